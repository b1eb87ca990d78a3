"""Failover and churn on real processes: time to recover from a peer's death mid-generation, and tokens/s under churn.

Recovery: a session generates token by token through peers A (first half) and B, C (second half); at a
fixed step the second-half peer on the route is SIGKILLed. The recovery time is that step's latency minus
the median step latency (re-routing, opening a session, replaying the history).
Churn: back-to-back generations for a while without churn, then while a peer of a doubly served span is
killed and replaced every few seconds; tokens/s of both, and what churn cost.

    python -m bench.failover [--model DIR] [--trials 5] [--churn-s 30]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from client.demo.local_swarm import LocalSwarm
from client.model import AutoDistributedModelForCausalLM
from swarm.models.checkpoint import load_config
from swarm.models.default_model import resolve_default_model
from swarm.paths import default_cache_dir

PEER_ARGS = ("--num-threads", "1", "--throughput", "1000", "--update-period-s", "5")


def _peer_id(swarm: LocalSwarm, name: str) -> str | None:
    for line in swarm.log(name).read_text().splitlines():
        if "joined the DHT as " in line:
            return line.split("joined the DHT as ", 1)[1].split()[0]
    return None


def _name_of(swarm: LocalSwarm, peer_id: str) -> str:
    return next(name for name in swarm.children if _peer_id(swarm, name) == peer_id)


def measure_recovery(model: str, trials: int, tokens: int = 48, kill_at: int = 20) -> dict:
    num_blocks = load_config(Path(model)).num_hidden_layers
    half = num_blocks // 2
    recoveries, steps = [], []
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        swarm.start_peer("a", model, "--blocks", f"0:{half}", *PEER_ARGS)
        for name in ("b0", "c0"):
            swarm.start_peer(name, model, "--blocks", f"{half}:{num_blocks}", *PEER_ARGS)
        swarm.wait_online(model, num_blocks)
        remote = AutoDistributedModelForCausalLM.from_pretrained(model, initial_peers=swarm.initial_peers)
        try:
            for trial in range(trials):
                swarm.wait_online(model, num_blocks)
                ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(trial))
                latencies = []
                with remote.inference_session(max_length=8 + tokens) as session, torch.no_grad():
                    logits = remote(ids).logits
                    for step in range(tokens):
                        if step == kill_at:
                            (hop,) = [s.hop for s in session.remote.spans if s.hop.start == half]
                            victim = _name_of(swarm, hop.peer_id)
                            swarm.kill(victim)
                            swarm.start_peer(
                                f"{victim}-{trial}", model, "--blocks", f"{half}:{num_blocks}", *PEER_ARGS
                            )  # replacement for the next trial
                        began = time.perf_counter()
                        logits = remote(logits[:, -1:].argmax(-1)).logits
                        latencies.append(time.perf_counter() - began)
                    assert session.recoveries >= 1, "the kill was not noticed"
                normal = statistics.median(latencies[:kill_at] + latencies[kill_at + 1 :])
                recoveries.append(latencies[kill_at] - normal)
                steps.append(normal)
                time.sleep(6)  # let the replacement come ONLINE and the dead record expire from routes
        finally:
            remote.shutdown()
    return {
        "trials": trials,
        "recovery_s": {"median": statistics.median(recoveries), "max": max(recoveries), "all": recoveries},
        "normal_step_s": statistics.median(steps),
    }


def measure_churn(model: str, churn_s: float, kill_every_s: float, tokens: int = 32) -> dict:
    num_blocks = load_config(Path(model)).num_hidden_layers
    half = num_blocks // 2
    spans = [(0, half), (0, half), (half, num_blocks), (half, num_blocks)]
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        live = []
        for i, (a, b) in enumerate(spans):
            swarm.start_peer(f"p{i}", model, "--blocks", f"{a}:{b}", *PEER_ARGS)
            live.append((f"p{i}", (a, b)))
        swarm.wait_online(model, num_blocks)
        time.sleep(3)
        remote = AutoDistributedModelForCausalLM.from_pretrained(
            model, initial_peers=swarm.initial_peers, wait_for_peers_s=60
        )

        def generate_for(seconds: float) -> tuple[int, float]:
            produced, began = 0, time.monotonic()
            while time.monotonic() - began < seconds:
                ids = torch.randint(3, 1000, (1, 8))
                out = remote.generate(ids, max_new_tokens=tokens, do_sample=False)
                produced += out.shape[1] - ids.shape[1]
            return produced, time.monotonic() - began

        try:
            calm_tokens, calm_s = generate_for(churn_s)
            stop, kills, rng = threading.Event(), [0], random.Random(0)

            def churn():
                while not stop.wait(kill_every_s):
                    spare = [e for e in live if sum(span == e[1] for _, span in live) > 1]
                    name, span = rng.choice(spare)
                    live.remove((name, span))
                    swarm.kill(name)
                    kills[0] += 1
                    new = f"{name}-{kills[0]}"
                    swarm.start_peer(new, model, "--blocks", f"{span[0]}:{span[1]}", *PEER_ARGS)
                    live.append((new, span))

            failovers_before = remote.sequence.failovers
            killer = threading.Thread(target=churn, daemon=True)
            killer.start()
            churn_tokens, churned_s = generate_for(churn_s)
            stop.set()
            killer.join(30)
            failovers = remote.sequence.failovers - failovers_before
        finally:
            remote.shutdown()
    calm, churned = calm_tokens / calm_s, churn_tokens / churned_s
    return {
        "calm_tokens_per_s": calm,
        "churn_tokens_per_s": churned,
        "lost_fraction": 1 - churned / calm,
        "kills": kills[0],
        "failovers": failovers,
        "seconds_each": churn_s,
        "kill_every_s": kill_every_s,
    }


def markdown(recovery: dict, churn: dict) -> str:
    r = recovery["recovery_s"]
    return "\n".join(
        [
            "| metric | value |",
            "|---|---|",
            f"| recovery after SIGKILL mid-generation (median, max over {recovery['trials']}) "
            f"| {r['median'] * 1000:.0f} ms, {r['max'] * 1000:.0f} ms |",
            f"| normal decode step (median) | {recovery['normal_step_s'] * 1000:.1f} ms |",
            f"| tokens/s without churn | {churn['calm_tokens_per_s']:.1f} |",
            f"| tokens/s with churn (a kill every {churn['kill_every_s']:.0f} s; {churn['kills']} kills, "
            f"{churn['failovers']} failovers) | {churn['churn_tokens_per_s']:.1f} ({churn['lost_fraction'] * 100:.0f}% lost) |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder (default: the built-in model)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--churn-s", type=float, default=30.0)
    p.add_argument("--kill-every-s", type=float, default=5.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    model = args.model or str(resolve_default_model(default_cache_dir()))
    recovery = measure_recovery(model, args.trials)
    churn = measure_churn(model, args.churn_s, args.kill_every_s)
    print(markdown(recovery, churn))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "failover.json").write_text(json.dumps({"recovery": recovery, "churn": churn}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
