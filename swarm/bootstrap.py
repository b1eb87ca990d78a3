"""`swarmlm bootstrap`: a DHT-only node with a stable identity that other peers join through.

It also answers reachability probes (swarm/reachability.py) and, unless `--no-relay`, relays streams to peers
behind NAT (swarm/relay.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from swarm.dht import start_dht, visible_maddrs
from swarm.reachability import ProbeService
from swarm.relay import RelayService
from swarm.runtime import run_until_signal, wait_for_signal

logger = logging.getLogger(__name__)


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run a DHT bootstrap node and print how to join it.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    parser.add_argument(
        "--identity", metavar="FILE", help="private key file; created if missing, keeps the peer id across restarts"
    )
    parser.add_argument("--no-relay", action="store_true",
                        help="do not forward streams to peers behind NAT (by default the bootstrap node relays)")
    return parser


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be in 0..65535, got {args.port}")

    async def main() -> int:
        dht = await asyncio.to_thread(start_dht, (), host=args.host, port=args.port, identity_path=args.identity)
        services = []
        try:
            p2p = await dht.replicate_p2p()
            services = [ProbeService(p2p)] + ([] if args.no_relay else [RelayService(p2p)])
            for service in services:
                await service.start()
            maddrs = visible_maddrs(dht)
            for maddr in maddrs:
                print(maddr)
            print(f"--initial-peers {' '.join(maddrs)}", flush=True)
            logger.info("bootstrap node ready%s; Ctrl+C to stop", "" if args.no_relay else ", relaying for peers behind NAT")
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
