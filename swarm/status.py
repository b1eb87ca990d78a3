"""`swarmlm status`: which models the swarm serves, who serves which blocks, what is uncovered, and the recipe of
each training run.

`--json` prints the document of swarm/dht/state.py instead (the one `swarmlm monitor` serves), without pinging the
peers: its "rtt_measured" is false and every "rtt_s" null.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence

from protocol.errors import SwarmError
from protocol.records import ServerState
from swarm.dht.snapshot import SwarmSnapshot
from swarm.dht.state import block_ranges, build_state, describe_reach, training_runs
from swarm.training.recipe import RunRecipe, recipes_of_runs, recipes_on_wire
from swarm.trust.swarmkey import SWARM_KEY_HELP, SwarmKey, load_optional


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Show the models of a swarm and who serves their blocks.")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs to join through")
    p.add_argument("--model", help="show only this DHT prefix")
    p.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    p.add_argument(
        "--json",
        action="store_true",
        help="print the swarm's state as one JSON document (described in docs/monitor.md) instead of text",
    )
    return p


def _ranges(blocks: list[int]) -> str:
    return ", ".join(f"{start}:{end}" for start, end in block_ranges(blocks))


def format_snapshot(
    prefix: str, repository: str, snapshot: SwarmSnapshot, recipes: Mapping[str, Sequence[RunRecipe]] | None = None
) -> str:
    """The text of one model; `recipes`: run id -> the different RunRecipes published for it, the one that counts
    first (None: not read)."""
    lines = [f"model {prefix} ({repository}): {snapshot.num_blocks} blocks"]
    servers = sorted(snapshot.servers.items(), key=lambda item: (item[1].start_block, item[1].end_block, item[0]))
    for peer_id, info in servers:
        lines.append(
            f"  blocks {info.start_block:>3}:{info.end_block:<3}  {ServerState(info.state).name:<7}  {peer_id}  "
            f"{describe_reach(info)}  {info.throughput:8.1f} tok/s  {info.dtype}"
            + (f" {info.quantization}" if info.quantization != "none" else "")
            + f"  cache left {info.cache_tokens_left}"
            + (f"  training {info.run_id!r}: update {info.epoch}, {info.samples} samples" if info.run_id else "")
            + (f"  adapters {', '.join(a.name for a in info.adapters)}" if info.adapters else "")
        )
    uncovered = snapshot.uncovered_blocks()
    lines.append(f"  uncovered blocks: {_ranges(uncovered)}" if uncovered else "  all blocks covered")
    for run_id in training_runs(snapshot.online()) if recipes is not None else ():
        published = recipes.get(run_id) or []
        recipe = published[0].describe() if published else "no recipe published"
        others = f" ({len(published) - 1} other recipes published; the first published counts)"
        lines.append(f"  run {run_id!r}: {recipe}" + (others if len(published) > 1 else ""))
    return "\n".join(lines)


def check_initial_peers(initial_peers: Sequence[str]) -> list[str]:
    """The multiaddrs, each checked to name a peer (".../p2p/ID"), before anything slow starts.

    Raises:
        ValueError: one does not; the message shows the form `swarmlm bootstrap` prints.
    """
    for maddr in initial_peers:
        if not (maddr.startswith("/") and "/p2p/" in maddr and not maddr.endswith("/p2p/")):
            raise ValueError(
                f"--initial-peers {maddr!r} is not a multiaddr of a peer: use one that `swarmlm "
                f"bootstrap` prints, such as /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW..."
            )
    return list(initial_peers)


def run(args: argparse.Namespace) -> int:
    try:
        swarm_key = load_optional(args.swarm_key)
        check_initial_peers(args.initial_peers)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        dht = join_swarm(args.initial_peers, swarm_key)
        return _show(dht, args)
    except SwarmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def join_swarm(initial_peers: Sequence[str], swarm_key: SwarmKey | None, startup_timeout_s: float = 60.0):
    """A client-mode DHT node joined through `initial_peers`, to read the swarm's records.

    Raises:
        DHTUnavailableError: no initial peer could be reached (the message names them).
        UnauthorizedError: they refused this node's swarm key (or its lack of one).
    """
    from hivemind.p2p import P2PDaemonError  # hivemind: only once the flags are known good

    from protocol.errors import DHTUnavailableError
    from swarm.dht.node import start_dht

    try:
        return start_dht(initial_peers, client_mode=True, swarm_key=swarm_key, startup_timeout_s=startup_timeout_s)
    except (P2PDaemonError, TimeoutError) as exc:
        raise DHTUnavailableError(
            f"could not join the swarm through --initial-peers {' '.join(initial_peers)}: "
            f"{exc}; check that these are the multiaddrs a bootstrap node or peer printed, "
            f"and that it is running and reachable from here"
        ) from None


def _show(dht, args: argparse.Namespace) -> int:
    from swarm.dht.state import MAX_BLOCKS_READ, read_state

    try:
        models, snapshots = read_state(dht, args.model)
        recipes = recipes_of_runs(dht, snapshots)
        if args.json:
            print(json.dumps(build_state(models, snapshots, recipes=recipes_on_wire(recipes)), indent=2))
        if not models:
            if not args.json:
                print("no models announced in this swarm" + (f" under {args.model!r}" if args.model else ""))
            return 1
        if not args.json:
            for prefix in sorted(snapshots):
                print(format_snapshot(prefix, models[prefix].repository, snapshots[prefix], recipes.get(prefix, {})))
            if len(snapshots) < len(models):
                print(
                    f"{len(models) - len(snapshots)} more models in the index were not read: their peers are "
                    f"fewer and their blocks over the {MAX_BLOCKS_READ} read at once (ask for one with --model)"
                )
        return 0
    finally:
        dht.shutdown()
