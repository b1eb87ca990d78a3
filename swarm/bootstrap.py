"""`swarmlm bootstrap`: a DHT-only node with a stable identity that other peers join through.

It also answers reachability probes (swarm/net/reachability.py) and, unless `--no-relay`, relays streams to peers
behind NAT (swarm/net/relay.py). With `--swarm-key FILE` (or `--new-swarm-key FILE`, which creates that file first) it
starts a private swarm: only holders of the key can use its DHT and call its peers (swarm/trust/dhtauth.py,
swarm/trust/rpcauth.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from swarm.runtime import run_until_signal, wait_for_signal
from swarm.trust.swarmkey import SWARM_KEY_HELP, create_key_file, load_optional

logger = logging.getLogger(__name__)


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run a DHT bootstrap node and print how to join it.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    parser.add_argument(
        "--announce-host",
        metavar="HOST",
        help="the public IP or DNS name others reach this node at, printed and announced instead of the addresses "
        "it listens on (with --host 0.0.0.0, or behind 1:1 NAT); needs --port",
    )
    parser.add_argument(
        "--identity", metavar="FILE", help="private key file; created if missing, keeps the peer id across restarts"
    )
    parser.add_argument(
        "--no-relay",
        action="store_true",
        help="do not forward streams to peers behind NAT (by default the bootstrap node relays)",
    )
    private = parser.add_mutually_exclusive_group()
    private.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    private.add_argument(
        "--new-swarm-key",
        metavar="FILE",
        help="create a new swarm key in FILE (mode 0600; an existing file is never overwritten), "
        "print how members use it, and run a private swarm with it",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be in 0..65535, got {args.port}")
    if args.announce_host is not None:
        from swarm.dht.addresses import announce_maddr

        try:
            announce_maddr(args.announce_host, args.port)
        except ValueError as exc:
            raise SystemExit(f"error: --announce-host: {exc}") from None
    try:
        if args.new_swarm_key is not None:
            swarm_key = create_key_file(args.new_swarm_key)
            print(
                f"created {swarm_key.describe()}: copy it (privately) to every member of this swarm, and pass "
                f"--swarm-key {args.new_swarm_key} to swarmlm bootstrap, peer, status and train, or "
                f"ClientConfig(swarm_key=SwarmKey.load(...)) to a client",
                flush=True,
            )
        else:
            swarm_key = load_optional(args.swarm_key)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None

    from swarm.dht.node import start_dht, visible_maddrs  # hivemind: only once the flags are known good
    from swarm.net.reachability import ProbeService
    from swarm.net.relay import RelayService
    from swarm.trust.rpcauth import RpcAuth

    auth = RpcAuth(swarm_key) if swarm_key is not None else None

    async def main() -> int:
        dht = await asyncio.to_thread(
            start_dht,
            (),
            host=args.host,
            port=args.port,
            identity_path=args.identity,
            swarm_key=swarm_key,
            announce_host=args.announce_host,
        )
        services = []
        try:
            p2p = await dht.replicate_p2p()
            services = [ProbeService(p2p, auth=auth)] + ([] if args.no_relay else [RelayService(p2p)])
            for service in services:
                await service.start()
            maddrs = visible_maddrs(dht)
            for maddr in maddrs:
                print(maddr)
            print(f"--initial-peers {' '.join(maddrs)}", flush=True)
            logger.info(
                "bootstrap node ready%s%s; Ctrl+C to stop",
                "" if args.no_relay else ", relaying for peers behind NAT",
                f", private swarm ({swarm_key.describe()})" if swarm_key else "",
            )
            await wait_for_signal()
        finally:
            for service in services:
                await service.stop()
            if services:
                await p2p.shutdown()  # the replica's tasks live on this loop
            await asyncio.to_thread(dht.shutdown)
        return 0

    return run_until_signal(main)


if __name__ == "__main__":
    sys.exit(run(build_parser("swarmlm bootstrap").parse_args()))
