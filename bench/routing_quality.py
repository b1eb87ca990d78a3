"""Routing quality on simulated swarms: how good is the inference route the client picks, and how fast is it picked?

Each trial builds a swarm of random spans, throughputs and client RTTs. The planner sees RTTs measured with
noise (as a client's one-off pings are); the chosen route is then costed with the true values and compared
with the best route under the true values, and with a greedy baseline (always take the span reaching furthest).

    python -m bench.routing_quality [--peers 100 200] [--blocks 80] [--trials 50]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from client.routing import RouteHop, plan_inference_route
from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot


def random_swarm(rng: random.Random, peers: int, blocks: int) -> tuple[SwarmSnapshot, dict[str, float]]:
    servers, rtts = {}, {}
    for i in range(peers):
        length = rng.randint(max(1, blocks // 16), max(2, blocks // 3))
        start = rng.randrange(0, blocks - length + 1)
        servers[f"peer{i:04d}"] = ServerInfo(
            state=ServerState.ONLINE,
            start_block=start,
            end_block=start + length,
            throughput=rng.lognormvariate(6.0, 1.0),  # tokens/s through the whole span; median ~400
            cache_tokens_left=8192,
            dtype="float32",
            version="1",
            endpoint=f"10.0.{i // 250}.{i % 250}:5000",
        )
        rtts[f"peer{i:04d}"] = rng.uniform(0.002, 0.150)  # 2 ms (same rack) to 150 ms (other continent)
    # make sure every block is served, as in a usable swarm
    for block in range(blocks):
        if not any(s.start_block <= block < s.end_block for s in servers.values()):
            pid = f"filler{block:04d}"
            servers[pid] = ServerInfo(
                state=ServerState.ONLINE,
                start_block=block,
                end_block=block + 1,
                throughput=100.0,
                cache_tokens_left=8192,
                dtype="float32",
                version="1",
                endpoint=f"10.1.0.{block % 250}:5000",
            )
            rtts[pid] = rng.uniform(0.002, 0.150)
    return SwarmSnapshot(num_blocks=blocks, servers=servers), rtts


def route_latency(route: list[RouteHop], snapshot: SwarmSnapshot, rtts: dict[str, float]) -> float:
    """Seconds per token along the route under the cost model the planner optimises, with true values."""
    total = 0.0
    for hop in route:
        info = snapshot.servers[hop.peer_id]
        span = info.end_block - info.start_block
        total += rtts[hop.peer_id] + (hop.end - hop.start) / (span * info.throughput)
    return total


def greedy_route(snapshot: SwarmSnapshot) -> list[RouteHop]:
    """Baseline: from each block take the server whose span reaches furthest."""
    route, block = [], 0
    while block < snapshot.num_blocks:
        pid, info = max(snapshot.servers_of_block(block).items(), key=lambda item: item[1].end_block)
        route.append(RouteHop(pid, block, info.end_block, info.endpoint))
        block = info.end_block
    return route


def trial(rng: random.Random, peers: int, blocks: int, noise: float) -> dict[str, float]:
    snapshot, true_rtts = random_swarm(rng, peers, blocks)
    measured = {pid: rtt * rng.uniform(1 - noise, 1 + noise) for pid, rtt in true_rtts.items()}
    began = time.perf_counter()
    chosen = plan_inference_route(snapshot, 0, blocks, client_rtt_s=measured)
    planning_s = time.perf_counter() - began
    best = plan_inference_route(snapshot, 0, blocks, client_rtt_s=true_rtts)
    best_s = route_latency(best, snapshot, true_rtts)
    return {
        "chosen_over_best": route_latency(chosen, snapshot, true_rtts) / best_s,
        "greedy_over_best": route_latency(greedy_route(snapshot), snapshot, true_rtts) / best_s,
        "planning_ms": planning_s * 1000,
        "hops": len(chosen),
    }


def run_all(peer_counts: list[int], blocks: int, trials: int, noise: float, seed: int = 0) -> list[dict]:
    rows = []
    for peers in peer_counts:
        rng = random.Random(seed + peers)
        results = [trial(rng, peers, blocks, noise) for _ in range(trials)]
        row = {"peers": peers, "blocks": blocks, "trials": trials, "rtt_noise": noise}
        for key in results[0]:
            values = sorted(r[key] for r in results)
            row[key] = {"median": statistics.median(values), "max": values[-1]}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| peers | blocks | chosen / best latency (median, max) | greedy / best (median) | planning ms (median, max) | hops |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['peers']} | {r['blocks']} | {r['chosen_over_best']['median']:.3f}, {r['chosen_over_best']['max']:.3f} "
            f"| {r['greedy_over_best']['median']:.2f} | {r['planning_ms']['median']:.1f}, {r['planning_ms']['max']:.1f} "
            f"| {r['hops']['median']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing_quality", description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, nargs="+", default=[100, 250, 500])
    p.add_argument("--blocks", type=int, default=80)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--rtt-noise", type=float, default=0.2, help="relative error of measured RTTs (default 0.2)")
    p.add_argument("--out", type=Path, help="write routing_quality.json here")
    args = p.parse_args(argv)
    rows = run_all(args.peers, args.blocks, args.trials, args.rtt_noise)
    print(markdown(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "routing_quality.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
