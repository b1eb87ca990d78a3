"""Training over one slow, shared link: what a second trainer adds with a round every update, and with local steps.

Every process of the comparison (bootstrap, training peers, trainers) runs inside a Linux network namespace whose
loopback is rate-limited by `tc tbf`, so all their traffic shares one link of --rate-mbit: the rounds of the stage
groups and of the trainers, and the activations between stages. The model is train_swarm's small random Llama
(bench/train_runs.py), whose trainer parts (tied embeddings of a 49,152-token vocabulary) make the trainers' rounds
the largest traffic. Runs, each on fresh peers:

    1 trainer                 2 peers (one per stage); no round at all
    2 trainers                2 peers per stage, a round every update (float64)
    2 trainers, local steps   the same with --local-steps 4
    2 trainers, local + int8  the same with --local-steps 4 --averaging-compression int8

Reported: tokens/s of all trainers together (each trainer's tokens over its seconds after 2 warm-up steps, syncs
included, added up), the round bytes sent per trained sample, and the final loss. The processes share this machine's
cores, so a second trainer also halves the compute each one gets: what the link costs shows against one trainer's
figure, what a second machine would add does not.

    python -m bench.bandwidth [--rate-mbit 100] [--steps 8] [--out FILE]

Needs root and `ip netns` with `tc` (tbf); the namespace is removed also on failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import tempfile
from pathlib import Path

from bench.hop_profile import write_section
from bench.slow_link import SlowLinkError, run_inside, tbf

FIGURE = Path(__file__).resolve().parent / "figures" / "bandwidth.md"
HEAD = """# Training over one slow, shared link

`python -m bench.bandwidth`: one section per link rate, replaced when rerun. What each run is: the docstring of
bench/bandwidth.py.
"""
RUNS = {
    "1 trainer": (1, ()),
    "2 trainers": (2, ()),
    "2 trainers, --local-steps 4": (2, ("--local-steps", "4")),
    "2 trainers, --local-steps 4, int8 rounds": (2, ("--local-steps", "4", "--averaging-compression", "int8")),
}
SKIP = 2


def _inside(steps: int, out: Path) -> None:
    """Run every comparison here (inside the namespace) and write the figures to `out` as JSON."""
    from bench import train_runs as tr
    from bench.plan import preset
    from bench.scenarios.train_swarm import SPANS, TrainSwarm
    from swarm.paths import default_cache_dir

    plan = preset(quick=True, device="cpu").replace(train_swarm_steps=steps)
    cache = default_cache_dir()
    with (
        tempfile.TemporaryDirectory() as logs,
        TrainSwarm(plan, models_dir=cache / "bench-models", cache_dir=cache, out_dir=Path(logs)) as bench,
    ):
        # a round over the slow link takes far longer than on loopback: no round may time out for it
        bench.small = s = dataclasses.replace(bench.small, averaging_timeout_s=300.0)
        figures = {}
        for name, (trainers, extra) in RUNS.items():
            run_id = "bw" + str(len(figures))
            prefix = f"bench-bw-{len(figures)}"
            spans = SPANS if trainers == 1 else [SPANS[0], SPANS[0], SPANS[1], SPANS[1]]
            with bench._peers(bench.model, prefix, run_id, spans, trainers * s.batch_size, s, extra=extra) as names:
                runs = bench._train(
                    {
                        f"{run_id}-seed{seed}": [
                            *bench._remote(bench.model, prefix, run_id),
                            *s.args(seed=seed),
                            *extra,
                        ]
                        for seed in range(trainers)
                    },
                    s,
                )
                sent = bench._round_bytes_per_sample(runs, names)
            losses = tr.mean_curve([[r["loss"] for r in steps] for steps in runs.values()])
            # tokens over seconds after the warm-up, per trainer, added: a sync's slow step counts for its time
            figures[name] = {
                "tokens_per_s": sum(tr.tokens_per_second(steps[SKIP:], s.seq_len) for steps in runs.values()),
                "round_bytes_per_sample": sent,
                "final_loss": losses[-1],
                "losses": losses,
            }
    out.write_text(json.dumps(figures))


def _section(rate_mbit: float, steps: int, figures: dict) -> str:
    one = figures["1 trainer"]["tokens_per_s"]
    lines = [
        f"## A {rate_mbit:g} Mbit/s link ({datetime.datetime.now().isoformat(timespec='seconds')})",
        "",
        f"{steps} steps a run, batch 8x64 a trainer; tokens/s: each trainer's tokens over its seconds after {SKIP} "
        "warm-up steps, added over the trainers.",
        "",
        "| run | tokens/s | vs 1 trainer | round bytes sent per trained sample | final loss |",
        "|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        lines.append(
            f"| {name} | {f['tokens_per_s']:.1f} | {f['tokens_per_s'] / one:.2f}x | "
            f"{f['round_bytes_per_sample'] / 1e6:.2f} MB | {f['final_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--rate-mbit", type=float, default=100.0, help="the shared link's rate (default: 100)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default: 8)")
    p.add_argument("--out", type=Path, default=FIGURE, help="markdown file to put the table in")
    p.add_argument("--inside", type=Path, help=argparse.SUPPRESS)  # run the comparisons here, figures to this file
    args = p.parse_args(argv)
    if args.steps <= SKIP or args.rate_mbit <= 0:
        p.error(f"--steps must exceed {SKIP} and --rate-mbit must be positive")
    if args.inside is not None:
        _inside(args.steps, args.inside)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before the runs: minutes lost otherwise
    try:
        figures = run_inside(
            "bench.bandwidth", ["--steps", str(args.steps)], tbf(args.rate_mbit), timeout_s=600 * len(RUNS)
        )
    except SlowLinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    section = _section(args.rate_mbit, args.steps, figures)
    write_section(args.out, section, head=HEAD)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
