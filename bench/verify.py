"""What checks cost on one swarm: spot checks on forward+backward, or (--inference) checks of generation.

Spot checks: forward+backward tokens/s with `verify_fraction` at 0, the default and 1.

Four peers on loopback serve the model's blocks in two halves, each half twice, so that every hop can be
recomputed on another peer. One client runs `model(ids, labels=ids).loss.backward()` with its blocks frozen as
in the train scenario. It takes turns between the fractions within each repeat, so that the machine's load
drifts alike for all of them. The figures are throughput ratios to fraction 0, each throughput being all the
tokens over all the time (not a median: at a small fraction most steps check nothing, and the median would
miss the ones that do). The expected ratio at fraction f is 1 / (1 + f x (1 / ratio(1) - 1)). The hops actually
checked are counted.

With --inference, the client generates `--new` tokens after a `--seq`-token prompt (greedy, batch 1), in turns
between the rates; a check runs beside the decoding on the other peers of a span (client/inference_checks.py), and
generate() waits for the last one before it returns. Figures: each rate's mean generation time against rate 0,
and the checks started and liars caught (none, on this honest swarm).

    python -m bench.verify [--model DIR] [--repeats 20] [--batch 2] [--seq 128] [--out DIR]
    python -m bench.verify --inference [--model DIR] [--repeats 8] [--seq 32] [--new 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.scenarios.decode import prompt_ids
from bench.scenarios.train import frozen_blocks, step
from client.config import ClientConfig
from client.demo.local_swarm import LocalSwarm
from client.model import AutoDistributedModelForCausalLM
from swarm.models.checkpoint import load_config
from swarm.models.default_model import resolve_default_model
from swarm.paths import default_cache_dir

PEER_ARGS = ("--num-threads", "1", "--throughput", "1000")


def measure(model: str, repeats: int, batch: int, seq: int, fractions: tuple[float, ...]) -> dict:
    config = load_config(Path(model))
    num_blocks = config.num_hidden_layers
    ids = prompt_ids(config.vocab_size, seq, seed=1, batch=batch)
    seconds: dict[float, list[float]] = {f: [] for f in fractions}
    checked: dict[float, int] = {}
    with _two_peers_per_half(model, num_blocks) as swarm:
        client = AutoDistributedModelForCausalLM.from_pretrained(
            model, initial_peers=swarm.initial_peers, verify_seed=0
        )
        checker = client.sequence.spot_checks
        try:
            _wait_for_peers(client, 4)
            with frozen_blocks(client):
                for fraction in fractions:  # warm-up: channels, kept activations, every peer's path
                    checker.fraction = fraction
                    step(client, ids)
                for _ in range(repeats):
                    for fraction in fractions:
                        checker.fraction = fraction
                        before = checker.stats.verified + checker.stats.unverifiable
                        began = time.perf_counter()
                        step(client, ids)
                        seconds[fraction].append(time.perf_counter() - began)
                        checked[fraction] = (
                            checked.get(fraction, 0) + checker.stats.verified + checker.stats.unverifiable - before
                        )
            stats = checker.stats
        finally:
            client.shutdown()
    tokens = batch * seq
    mean_s = {f: statistics.fmean(s) for f, s in seconds.items()}
    base = mean_s[0.0]
    full = base / mean_s[1.0] if 1.0 in mean_s else None
    return {
        "model": model,
        "blocks": num_blocks,
        "batch": batch,
        "seq": seq,
        "repeats": repeats,
        "hops_per_step": 4,  # two forward hops, two backward hops
        "tokens_per_s": {str(f): tokens / s for f, s in mean_s.items()},
        "ratio_to_unchecked": {str(f): base / s for f, s in mean_s.items()},
        "expected_ratio": {str(f): 1 / (1 + f * (1 / full - 1)) for f in fractions} if full else {},
        "hops_checked": {str(f): n for f, n in checked.items()},
        "mismatches": stats.mismatches,
        "unverifiable": stats.unverifiable,
        "caught": stats.caught,
        "outvoted": stats.outvoted,
        "seconds": {str(f): s for f, s in seconds.items()},
    }


def measure_inference(model: str, repeats: int, seq: int, new: int, rates: tuple[float, ...]) -> dict:
    config = load_config(Path(model))
    num_blocks = config.num_hidden_layers
    ids = prompt_ids(config.vocab_size, seq, seed=1, batch=1)
    seconds: dict[float, list[float]] = {r: [] for r in rates}
    started: dict[float, int] = dict.fromkeys(rates, 0)
    caught = 0
    with _two_peers_per_half(model, num_blocks) as swarm:
        client = AutoDistributedModelForCausalLM.from_pretrained(
            model, initial_peers=swarm.initial_peers, verify_seed=0, verify_fraction=0.0
        )
        sequence, base_config = client.sequence, client.sequence.config
        try:
            _wait_for_peers(client, 4)
            for attempt in range(repeats + 1):  # the first round warms channels and paths up
                for rate in rates:
                    sequence.config = dataclasses.replace(base_config, verify_inference=rate)
                    with client.inference_session(max_length=seq + new) as session:
                        began = time.perf_counter()
                        client.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
                        took = time.perf_counter() - began
                        if attempt:
                            seconds[rate].append(took)
                            started[rate] += session.remote.checks.started
                        caught += session.remote.checks.caught
        finally:
            client.shutdown()
    mean_s = {r: statistics.fmean(s) for r, s in seconds.items()}
    return {
        "model": model,
        "blocks": num_blocks,
        "prompt": seq,
        "new_tokens": new,
        "repeats": repeats,
        "seconds_per_generation": {str(r): s for r, s in mean_s.items()},
        "overhead": {str(r): mean_s[r] / mean_s[0.0] - 1 for r in rates},
        "checks_started": {str(r): n for r, n in started.items()},
        "caught": caught,
        "seconds": {str(r): s for r, s in seconds.items()},
    }


def markdown_inference(result: dict) -> str:
    rows = [
        "| verify_inference | s per generation | overhead vs 0 | checks started |",
        "|---|---|---|---|",
    ]
    for rate, took in result["seconds_per_generation"].items():
        rows.append(
            f"| {rate} | {took:.2f} | {100 * result['overhead'][rate]:+.1f}% | "
            f"{result['checks_started'][rate]} in {result['repeats']} generations |"
        )
    return "\n".join(rows)


@contextlib.contextmanager
def _two_peers_per_half(model: str, num_blocks: int) -> Iterator[LocalSwarm]:
    """A bootstrap and four peers on loopback, two on each half of the blocks: every hop has another peer to check
    it on."""
    half = num_blocks // 2
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        for i, (a, b) in enumerate([(0, half), (0, half), (half, num_blocks), (half, num_blocks)]):
            swarm.start_peer(f"p{i}", model, "--blocks", f"{a}:{b}", *PEER_ARGS)
        swarm.wait_online(model, num_blocks, [(0, half), (half, num_blocks)])
        yield swarm


def _wait_for_peers(client, count: int, timeout_s: float = 120.0) -> None:
    """Until the client's directory shows `count` ONLINE peers: a check needs a second peer on each half."""
    deadline = time.monotonic() + timeout_s
    while len(client._run(client.sequence.snapshot(refresh=True)).online()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} peers ONLINE within {timeout_s:.0f}s")
        time.sleep(0.5)


def markdown(result: dict) -> str:
    rows = [
        "| verify_fraction | tokens/s | ratio to 0 | expected from fraction 1 | hops checked |",
        "|---|---|---|---|---|",
    ]
    hops = result["repeats"] * result["hops_per_step"]
    for f, tps in result["tokens_per_s"].items():
        expected = result["expected_ratio"].get(f)
        rows.append(
            f"| {f} | {tps:.0f} | {result['ratio_to_unchecked'][f]:.3f} | "
            f"{'' if expected is None else f'{expected:.3f}'} | {result['hops_checked'][f]} of {hops} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.verify", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder (default: the built-in model)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, help="tokens per sequence (default 128), or of the prompt with --inference (32)")
    p.add_argument("--inference", action="store_true", help="measure verify_inference on generation instead")
    p.add_argument("--new", type=int, default=64, help="with --inference: tokens generated per repeat")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.seq = args.seq or (32 if args.inference else 128)
    if min(args.repeats, args.batch, args.seq, args.new) < 1:
        p.error("--repeats, --batch, --seq and --new must be >= 1")
    model = args.model or str(resolve_default_model(default_cache_dir()))
    if args.inference:
        default = ClientConfig.__dataclass_fields__["verify_inference"].default
        result = measure_inference(model, args.repeats, args.seq, args.new, (0.0, default, 1.0))
        print(markdown_inference(result))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "verify_inference.json").write_text(json.dumps(result, indent=1))
        return 0
    default = ClientConfig.__dataclass_fields__["verify_fraction"].default
    torch.manual_seed(0)
    result = measure(model, args.repeats, args.batch, args.seq, (0.0, default, 1.0))
    print(markdown(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "verify.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
