"""`swarmlm monitor`: serve a live web page of a swarm (and `GET /api/state`) until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys

from client.monitor.config import MonitorConfig
from swarm.extras import require_extra
from swarm.status import check_initial_peers
from swarm.trust.swarmkey import SWARM_KEY_HELP, load_optional

logger = logging.getLogger(__name__)


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a live web page of a swarm: its models, which peers "
        "serve each block (gaps in red), each peer's state, throughput, cache, address and "
        "round-trip time, and training runs. The same data as JSON at /api/state.",
    )
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs to join through")
    p.add_argument("--host", default="127.0.0.1", help="address the page is served on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="TCP port of the page (default: 8080; 0: a free one)")
    p.add_argument(
        "--refresh-s",
        type=float,
        default=5.0,
        help="seconds between two reads of the swarm; the page refreshes as often (default: 5)",
    )
    p.add_argument(
        "--ping-timeout-s",
        type=float,
        default=2.0,
        help="how long a peer may take to answer a ping before it shows as 'no answer' (default: 2)",
    )
    p.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    return p


def config_from_args(args: argparse.Namespace) -> MonitorConfig:
    return MonitorConfig(host=args.host, port=args.port, refresh_s=args.refresh_s, ping_timeout_s=args.ping_timeout_s)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything slow, so that a taken port is said at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)  # browsers that come before the server does wait in the backlog
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"error: cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port "
            f"(0 for a free one) or --host"
        ) from None
    return sock


def run(args: argparse.Namespace) -> int:
    require_extra("api", "swarmlm monitor")  # the web stack: said before the swarm is joined
    try:
        config = config_from_args(args)
        swarm_key = load_optional(args.swarm_key)
        check_initial_peers(args.initial_peers)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    sock = bind(config.host, config.port)
    try:
        from swarm.runtime import run_until_signal

        return run_until_signal(lambda: _serve(args.initial_peers, config, swarm_key, sock))
    finally:
        sock.close()


async def _serve(initial_peers: list[str], config: MonitorConfig, swarm_key, sock: socket.socket) -> int:
    import uvicorn  # the web stack and hivemind: only once the flags are known good

    from client.monitor.app import create_app
    from client.monitor.watcher import Watcher
    from protocol.errors import SwarmError
    from swarm.dht.node import stop_dht
    from swarm.runtime import wait_for_signal
    from swarm.status import join_swarm

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield  # signals are ours (wait_for_signal below): uvicorn's would re-raise them once it stopped

    stop = asyncio.create_task(wait_for_signal())  # from now on: a signal while joining stops once joined
    joining = asyncio.create_task(asyncio.to_thread(join_swarm, initial_peers, swarm_key))
    await asyncio.wait({joining, stop}, return_when=asyncio.FIRST_COMPLETED)
    try:
        dht = await joining
    except SwarmError as exc:
        stop.cancel()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if stop.done():
            return 0
        app = create_app(lambda: Watcher(dht, config, swarm_key), config.refresh_s)
        server = Server(
            uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2)
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
        print(f"monitor: {url}  (JSON: {url}api/state); Ctrl+C to stop", flush=True)
        done, _ = await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        stop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stop
        await serving  # re-raises what stopped the server, if that was a failure
        if serving in done and not server.started:
            logger.error("the HTTP server did not start")
            return 1
        return 0
    finally:
        await asyncio.to_thread(stop_dht, dht)
