"""`swarmlm status`: which models the swarm serves, who serves which blocks, and what is uncovered."""

from __future__ import annotations

import argparse
import sys

from protocol.errors import SwarmError
from protocol.records import ServerInfo, ServerState
from swarm.snapshot import SwarmSnapshot
from swarm.swarmkey import SWARM_KEY_HELP, load_optional


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Show the models of a swarm and who serves their blocks.")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs to join through")
    p.add_argument("--model", help="show only this DHT prefix")
    p.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    return p


def _ranges(blocks: list[int]) -> str:
    parts, i = [], 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
            j += 1
        parts.append(f"{blocks[i]}:{blocks[j] + 1}")
        i = j + 1
    return ", ".join(parts)


def describe_reach(info: ServerInfo) -> str:
    """How clients reach the peer of a record: its gRPC endpoint, or libp2p (through which relays)."""
    if info.transport == "direct":
        return f"direct {info.endpoint}" + ("  relays for others" if info.relay else "")
    if info.relays:
        return f"behind NAT, via relay {', '.join(relay[:16] + '...' for relay in info.relays)}"
    return "libp2p only"


def format_snapshot(prefix: str, repository: str, snapshot: SwarmSnapshot) -> str:
    lines = [f"model {prefix} ({repository}): {snapshot.num_blocks} blocks"]
    servers = sorted(snapshot.servers.items(), key=lambda item: (item[1].start_block, item[1].end_block, item[0]))
    for peer_id, info in servers:
        lines.append(
            f"  blocks {info.start_block:>3}:{info.end_block:<3}  {ServerState(info.state).name:<7}  {peer_id}  "
            f"{describe_reach(info)}  {info.throughput:8.1f} tok/s  {info.dtype}  cache left {info.cache_tokens_left}"
            + (f"  training {info.run_id!r}: update {info.epoch}, {info.samples} samples" if info.run_id else "")
        )
    uncovered = snapshot.uncovered_blocks()
    lines.append(f"  uncovered blocks: {_ranges(uncovered)}" if uncovered else "  all blocks covered")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        swarm_key = load_optional(args.swarm_key)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    from swarm.dht import start_dht  # hivemind: only once the flags are known good

    try:
        dht = start_dht(args.initial_peers, client_mode=True, swarm_key=swarm_key)
        return _show(dht, args)
    except SwarmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _show(dht, args: argparse.Namespace) -> int:
    from swarm.directory import fetch_models, fetch_snapshot

    try:
        models = fetch_models(dht)
        if args.model:
            models = {k: v for k, v in models.items() if k == args.model}
        if not models:
            print("no models announced in this swarm" + (f" under {args.model!r}" if args.model else ""))
            return 1
        for prefix, record in sorted(models.items()):
            print(format_snapshot(prefix, record.repository, fetch_snapshot(dht, prefix, record.num_blocks)))
        return 0
    finally:
        dht.shutdown()
