"""Faults under local steps, against the same run without them: the final loss of each.

Two runs of the same trainers on fresh peers: a tiny random Llama (hidden 64, 4 layers, the tests' 128-character
vocabulary), two peers per stage, two trainers (seeds 0 and 1, a batch of 8x64 each in micro-batches of 2),
`--local-steps 4 --outer-momentum 0.5` (a sync after every 4th update) on every peer and trainer. (DiLoCo's momentum
0.9 is made for hundreds of inner steps: with 4, the tiny model's last block output grows without bound, 80x in 56
updates in the one-process reference, until the peers refuse its gradients as outliers; with 0.5 it stays bounded.)

    fault-free      nothing happens
    with faults     once trainer 0 has logged --kill-at steps (between two syncs) one member of the second stage is
                    SIGKILLed; once it has logged --join-at steps a third trainer (seed 2) joins for the rest

What a killed member learnt since the last sync is lost with it, and the joiner's batches add to the updates it
takes part in. Reported: the loss of trainers 0 and 1 (the same batches in both runs), the mean over their last 5
steps, and the faulty run's against the fault-free one's (the issue's target: within 2%). Every process runs on this
machine's loopback.

With `--sync-overlap N` every peer and trainer overlaps its syncs with the next N updates (Streaming DiLoCo).

    python -m bench.local_faults [--steps 32] [--kill-at 9] [--join-at 16] [--sync-overlap 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.hop_profile import write_section
from bench.scaling import TINY_SPEC

FIGURE = Path(__file__).resolve().parent / "figures" / "local_faults.md"
HEAD = """# Faults under local steps

`python -m bench.local_faults`: one section per setting, replaced when rerun. What the runs are: the docstring of
bench/local_faults.py.
"""
LOCAL_STEPS = 4
OUTER_MOMENTUM = 0.5
TRAINERS = 2
STAGE_SPANS = [(0, 2), (0, 2), (2, 4), (2, 4)]
KILLED = 2
"""The index in STAGE_SPANS of the member that is killed: one of the second stage's two."""
TARGET = 0.02
POLL_S = 0.2
MAX_KINDS = 4
"""Kinds of faults listed per run."""


def _run(
    bench, model: Path, settings, name: str, *, kill_at: int | None, join_at: int | None, overlap: int
) -> dict[str, list]:
    """One run on fresh peers; run name -> its --log-json steps. Faults happen when `kill_at`/`join_at` are set."""
    from bench import train_runs as tr

    swarm, extra = bench.swarm, recipe_flags(overlap)
    prefix, run_id = f"bench-lf-{name}", f"lf-{name}"
    trainers = {f"{run_id}-seed{seed}": seed for seed in range(TRAINERS)}
    logs = {run: swarm.log_dir / f"{run}.jsonl" for run in [*trainers, f"{run_id}-seed{TRAINERS}"]}

    def start(run: str, seed: int, steps: int) -> None:
        logs[run].unlink(missing_ok=True)
        args = [*bench._remote(model, prefix, run_id), *dataclasses.replace(settings, steps=steps).args(seed=seed)]
        swarm.start(run, "train", *args, *extra, "--log-json", str(logs[run]))

    target = TRAINERS * settings.batch_size
    with bench._peers(model, prefix, run_id, STAGE_SPANS, target, settings, extra=extra) as peers:
        try:
            for run, seed in trainers.items():
                start(run, seed, settings.steps)
            first = next(iter(trainers))
            deadline = time.monotonic() + bench._timeout_s(settings)
            killed = joined = False
            while any(swarm.children[run].poll() is None for run in trainers):
                done = len(tr.read_steps(logs[first])) if logs[first].exists() else 0
                if kill_at is not None and not killed and done >= kill_at:
                    swarm.kill(peers[KILLED])
                    killed = True
                if join_at is not None and not joined and done >= join_at:
                    joiner = f"{run_id}-seed{TRAINERS}"
                    start(joiner, TRAINERS, settings.steps - join_at)
                    trainers[joiner] = TRAINERS
                    joined = True
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: trainers not done in time: {swarm.tail(first)}")
                time.sleep(POLL_S)
            for run in trainers:
                code = swarm.children[run].wait(max(1.0, deadline - time.monotonic()))
                if code != 0:
                    raise RuntimeError(f"{run} exited with code {code} (logs in {swarm.log_dir}): {swarm.tail(run)}")
            if (kill_at is not None and not killed) or (join_at is not None and not joined):
                raise RuntimeError(f"{name}: the run ended before its faults (--kill-at/--join-at past --steps?)")
        finally:
            for run in trainers:
                if run in swarm.children:
                    swarm.stop_child(run)
    return {run: tr.read_steps(logs[run]) for run in trainers}


def recipe_flags(overlap: int) -> tuple[str, ...]:
    """The local steps' flags of every peer and trainer (with `overlap`: --sync-overlap)."""
    flags = ("--local-steps", str(LOCAL_STEPS), "--outer-momentum", str(OUTER_MOMENTUM))
    return (*flags, "--sync-overlap", str(overlap)) if overlap else flags


def measure(steps: int, kill_at: int, join_at: int, overlap: int = 0) -> dict:
    """Both runs, here; the figures of each."""
    from bench import train_runs as tr
    from bench.plan import preset
    from bench.scenarios.train_swarm import TrainSwarm
    from swarm.paths import default_cache_dir

    plan = preset(quick=True, device="cpu").replace(train_swarm_steps=steps)
    cache = default_cache_dir()
    figures = {}
    logs = Path(tempfile.mkdtemp(prefix="swarmlm-local-faults-"))
    with TrainSwarm(plan, models_dir=cache / "bench-models", cache_dir=cache, out_dir=logs) as bench:
        model = tr.build_train_model(
            cache / "bench-models", cache, name="train-tiny", config=TINY_SPEC, char_tokenizer=True
        )
        for name, faults in {"fault-free": (None, None), "with faults": (kill_at, join_at)}.items():
            runs = _run(
                bench, model, bench.small, name.replace(" ", "-"), kill_at=faults[0], join_at=faults[1], overlap=overlap
            )
            joined = {run: run.endswith(f"seed{TRAINERS}") for run in runs}
            joiner = [steps for run, steps in runs.items() if joined[run]]
            curve = tr.mean_curve([[r["loss"] for r in steps] for run, steps in runs.items() if not joined[run]])
            figures[name] = {
                "final_loss": tr.final_loss(curve),
                "curve": curve,
                "faults": sum(len(r.get("faults", [])) for steps in runs.values() for r in steps),
                "kinds": fault_kinds(f for steps in runs.values() for r in steps for f in r.get("faults", [])),
                "joiner_steps": sum(map(len, joiner)),
            }
    shutil.rmtree(logs, ignore_errors=True)  # kept when a run failed: its error names them
    return figures


def fault_kinds(faults) -> list[tuple[str, int]]:
    """The trainers' fault lines, told apart by what happened (peer ids, updates and counts left out), most common
    first: (kind, how many)."""
    kinds = Counter(
        re.sub(
            r"\d+(\.\d+)?",
            "N",
            re.sub(r"\b(peers?|trainers?) [1-9A-HJ-NP-Za-km-z]{8,}(, [1-9A-HJ-NP-Za-km-z]{8,})*", r"\1 X", f),
        )
        for f in faults
    )
    return kinds.most_common()


def _section(steps: int, kill_at: int, join_at: int, figures: dict, when: str, overlap: int = 0) -> str:
    clean, faulty = figures["fault-free"], figures["with faults"]
    change = faulty["final_loss"] / clean["final_loss"] - 1
    met = "met" if abs(change) <= TARGET else "missed"
    return "\n".join(
        [
            f"## {steps} steps, a member killed after step {kill_at}, a trainer joining after step {join_at}"
            + (f", syncs overlapping {overlap} update{'s' * (overlap > 1)}" if overlap else "")
            + f" ({when})",
            "",
            f"`{' '.join(recipe_flags(overlap))}`, two peers per stage, trainers of a batch of 8x64; final loss: the "
            "mean over the last 5 steps of trainers 0 and 1.",
            "",
            "| run | final loss | faults the trainers logged | joiner's steps |",
            "|---|---|---|---|",
            *(
                f"| {name} | {f['final_loss']:.4f} | {f['faults']} | {f['joiner_steps']} |"
                for name, f in figures.items()
            ),
            "",
            f"With faults against fault-free: {change:+.2%} (target within {TARGET:.0%}: {met}).",
            "",
            *(
                f"- {name}: {count} x `{kind}`"
                for name, f in figures.items()
                for kind, count in f.get("kinds", [])[:MAX_KINDS]
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.local_faults",
        description="Faults under local steps (a member killed between syncs, a trainer joining) against the same "
        "run without them.",
    )
    p.add_argument("--steps", type=int, default=32, help="steps of trainers 0 and 1 (default: %(default)s)")
    p.add_argument("--kill-at", type=int, default=9, help="kill a member after this step (default: %(default)s)")
    p.add_argument(
        "--join-at", type=int, default=16, help="a third trainer joins after this step (default: %(default)s)"
    )
    p.add_argument(
        "--sync-overlap",
        type=int,
        default=0,
        metavar="N",
        help="every peer and trainer overlaps its syncs with N updates (below 4; default: %(default)s)",
    )
    p.add_argument("--out", type=Path, default=FIGURE, help="markdown file to put the table in")
    args = p.parse_args(argv)
    if not 0 <= args.sync_overlap < LOCAL_STEPS:
        p.error(f"--sync-overlap must be 0 to {LOCAL_STEPS - 1}: below the run's --local-steps {LOCAL_STEPS}")
    if not 0 < args.kill_at < args.steps or not 0 < args.join_at < args.steps - 5:
        p.error("--kill-at must be within --steps, and --join-at at least 5 steps before its end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figures = measure(args.steps, args.kill_at, args.join_at, args.sync_overlap)
    when = datetime.datetime.now().isoformat(timespec="seconds")
    section = _section(args.steps, args.kill_at, args.join_at, figures, when, args.sync_overlap)
    write_section(args.out, section, head=HEAD)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
