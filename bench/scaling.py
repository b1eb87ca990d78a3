"""More trainers over a slow network: tokens/s of 1, 2 and 4 trainers, with a round every update and with local steps.

Every process (bootstrap, the training peers, the trainers) runs inside a Linux network namespace whose loopback
carries --rate-mbit in all (tc tbf), so the rounds and everything else share one link. Each peer's gRPC port is
behind bench/proxy.py's DelayProxy, which the peer announces: --delay-ms each way and --peer-mbit for each peer, so
each hop of a micro-batch pays a wide-area round trip. (This kernel has no netem: the DHT's lookups and the rounds'
libp2p streams are rate-limited but not delayed.) The model is a tiny random Llama (hidden 64, 4 layers, tied
embeddings): its compute is small against the delays, so the runs measure the protocol (round trips, waiting,
rounds' bytes) rather than this machine's 2 cores. Its vocabulary (--vocab) is the tests' 128 characters, so the
trainers' rounds carry next to nothing, or the built-in model's 49,152 tokens ("smollm2"), so that each round
carries 3.1 million parameters of embeddings. Runs, each on fresh peers, every trainer with its own batch of 4x64
in one micro-batch (an update takes one batch from each):

    1 trainer                   no round at all
    N trainers                  the trainers average their parts' gradients every update (float64)
    N trainers, local steps     --local-steps 8 --averaging-compression int8: a sync of 8-bit pseudo-gradients
                                every 8 updates
    2 trainers, 2 peers per     two peers serve each stage (each behind its own proxy), a round every update
      stage                     (", local steps": with the local steps' flags above, on peers and trainers)
    N trainers, local steps,    the same with --sync-overlap 1: each sync's round runs during the next update,
      overlapped                nobody waits for it (Streaming DiLoCo)

Reported: tokens/s of all trainers together (each trainer's tokens over its seconds after 2 warm-up steps, syncs
included, added up), the part of those seconds a trainer waited on others (for the update to open, rounds, the
stages' apply, syncs; the rest is its micro-batches: compute and the wire), the round bytes sent per trained sample,
and the final loss.

    python -m bench.scaling [--delay-ms 25] [--peer-mbit 50] [--rate-mbit 200] [--vocab char|smollm2] [--steps 18]
                            [--out FILE]

Needs root and `ip netns` with `tc` (tbf); the namespace is removed also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import sys
import tempfile
from pathlib import Path

from bench.hop_profile import write_section
from bench.scaling_plot import draw
from bench.slow_link import SlowLinkError, run_inside, tbf

FIGURE = Path(__file__).resolve().parent / "figures" / "scaling.md"
HEAD = """# More trainers over a slow network

`python -m bench.scaling`: one section per delay and rate, replaced when rerun. What each run is: the docstring of
bench/scaling.py.
"""
VOCABULARIES = {"char": "128-character vocabulary", "smollm2": "49,152-token vocabulary"}
TINY_SPEC = {
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
}
LOCAL = ("--local-steps", "8", "--averaging-compression", "int8")
OVERLAPPED = (*LOCAL, "--sync-overlap", "1")
RUNS = {  # name -> (trainers, peers per stage, flags of peers and trainers)
    "1 trainer": (1, 1, ()),
    "2 trainers": (2, 1, ()),
    "4 trainers": (4, 1, ()),
    "2 trainers, local steps": (2, 1, LOCAL),
    "4 trainers, local steps": (4, 1, LOCAL),
    "2 trainers, 2 peers per stage": (2, 2, ()),
    "2 trainers, 2 peers per stage, local steps": (2, 2, LOCAL),
    "2 trainers, local steps, overlapped": (2, 1, OVERLAPPED),
    "4 trainers, local steps, overlapped": (4, 1, OVERLAPPED),
}
BATCH = 4
"""Sequences of 64 tokens in each trainer's batch, sent as one micro-batch: little compute per round trip."""
SKIP = 2
WAITING = ("ready", "rounds", "decide", "apply", "sync")
"""The phases of a trainer's step (client/training/trainer.py StepResult.phases) spent waiting on others."""


def _inside(steps: int, delay_s: float, peer_bytes_s: float, vocab: str, out: Path, only: list[str]) -> None:
    """Run every comparison here (inside the namespace) and write the figures to `out` as JSON."""
    from bench import train_runs as tr
    from bench.plan import preset
    from bench.proxy import DelayProxy
    from bench.scenarios.train_swarm import SPANS, TrainSwarm
    from swarm.paths import default_cache_dir

    plan = preset(quick=True, device="cpu").replace(train_swarm_steps=steps)
    cache = default_cache_dir()
    with (
        tempfile.TemporaryDirectory() as logs,
        TrainSwarm(plan, models_dir=cache / "bench-models", cache_dir=cache, out_dir=Path(logs)) as bench,
    ):
        char = vocab == "char"
        model_name = "train-tiny" if char else "train-tiny-smollm2"
        model = tr.build_train_model(
            cache / "bench-models", cache, name=model_name, config=TINY_SPEC, char_tokenizer=char
        )
        # every round trip is slow here: gathering waits longer, and no round may time out for the link
        s = dataclasses.replace(
            bench.small, batch_size=BATCH, micro_batch_size=BATCH, matchmaking_time_s=2.0, averaging_timeout_s=300.0
        )
        figures = {}
        for name, (trainers, per_stage, extra) in RUNS.items():
            if name not in only:
                continue
            spans = [span for span in SPANS for _ in range(per_stage)]
            run_id = "sc" + str(len(figures))
            prefix = f"bench-sc-{len(figures)}"
            with contextlib.ExitStack() as proxies:
                ports = []
                for _ in spans:
                    port = tr.free_port()
                    proxy = DelayProxy(f"127.0.0.1:{port}", delay_s, bandwidth_bps=peer_bytes_s)
                    ports.append((port, proxies.enter_context(proxy).endpoint))
                names = proxies.enter_context(
                    bench._peers(model, prefix, run_id, spans, trainers * s.batch_size, s, ports=ports, extra=extra)
                )
                runs = bench._train(
                    {
                        f"{run_id}-seed{seed}": [*bench._remote(model, prefix, run_id), *s.args(seed=seed), *extra]
                        for seed in range(trainers)
                    },
                    s,
                )
                sent = bench._round_bytes_per_sample(runs, names)
            losses = tr.mean_curve([[r["loss"] for r in steps] for steps in runs.values()])
            measured = [steps[SKIP:] for steps in runs.values()]
            figures[name] = {
                "tokens_per_s": sum(tr.tokens_per_second(steps, s.seq_len) for steps in measured),
                "waiting": _waiting([r for steps in measured for r in steps]),
                "phases": _mean_phases([r for steps in measured for r in steps]),
                "round_bytes_per_sample": sent,
                "final_loss": losses[-1],
                "losses": losses,
            }
    out.write_text(json.dumps(figures))


def _waiting(steps: list[dict]) -> float:
    """The part of `steps`' seconds spent waiting on others."""
    return sum(r["phases"].get(p, 0.0) for r in steps for p in WAITING) / sum(sum(r["phases"].values()) for r in steps)


def _mean_phases(steps: list[dict]) -> dict[str, float]:
    """Mean seconds of each phase over `steps`."""
    names = sorted({p for r in steps for p in r["phases"]})
    return {p: sum(r["phases"].get(p, 0.0) for r in steps) / len(steps) for p in names}


def _title(delay_ms: float, peer_mbit: float, rate_mbit: float, vocab: str) -> str:
    return (
        f"{delay_ms:g} ms each way and {peer_mbit:g} Mbit/s to each peer, {rate_mbit:g} Mbit/s in all, "
        f"{VOCABULARIES[vocab]}"
    )


def _section(
    delay_ms: float, peer_mbit: float, rate_mbit: float, vocab: str, steps: int, figures: dict, when: str = ""
) -> str:
    one = figures["1 trainer"]["tokens_per_s"]
    when = when or datetime.datetime.now().isoformat(timespec="seconds")
    lines = [
        f"## {_title(delay_ms, peer_mbit, rate_mbit, vocab)} ({when})",
        "",
        f"{steps} steps a run, batch {BATCH}x64 a trainer; tokens/s: each trainer's tokens over its seconds after {SKIP} "
        "warm-up steps, added over the trainers.",
        "",
        "| run | tokens/s | vs 1 trainer | waiting | mean step: micro-batches / ready / rounds / decide / apply / sync (s) "
        "| round bytes sent per trained sample | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        phases = " / ".join(f"{f['phases'].get(p, 0.0):.2f}" for p in ("micro_batches", *WAITING))
        lines.append(
            f"| {name} | {f['tokens_per_s']:.1f} | {f['tokens_per_s'] / one:.2f}x | {f['waiting']:.0%} | {phases} | "
            f"{f['round_bytes_per_sample'] / 1e3:.1f} kB | {f['final_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay to and from each peer (default: 25)")
    p.add_argument("--peer-mbit", type=float, default=50.0, help="each peer's rate, each way (default: 50)")
    p.add_argument("--rate-mbit", type=float, default=200.0, help="the link all traffic shares (default: 200)")
    p.add_argument("--vocab", choices=VOCABULARIES, default="char", help="the model's vocabulary (default: char)")
    p.add_argument("--steps", type=int, default=18, help="optimizer steps per run (default: 18)")
    p.add_argument("--out", type=Path, default=FIGURE, help="markdown file to put the table in")
    p.add_argument(
        "--runs", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN", help="the runs (default: all)"
    )
    p.add_argument("--inside", type=Path, help=argparse.SUPPRESS)  # run the comparisons here, figures to this file
    args = p.parse_args(argv)
    if args.steps <= SKIP or min(args.rate_mbit, args.peer_mbit) <= 0 or args.delay_ms < 0:
        p.error(f"--steps must exceed {SKIP}, the rates must be positive and --delay-ms not negative")
    if "1 trainer" not in args.runs:
        p.error("--runs must include '1 trainer': the others are measured against it")
    if args.inside is not None:
        _inside(args.steps, args.delay_ms / 1000, args.peer_mbit * 1e6 / 8, args.vocab, args.inside, args.runs)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before the runs: minutes lost otherwise
    try:
        figures = run_inside(
            "bench.scaling",
            [
                *("--steps", str(args.steps), "--vocab", args.vocab),
                *("--delay-ms", f"{args.delay_ms:g}", "--peer-mbit", f"{args.peer_mbit:g}"),
                "--runs",
                *args.runs,
            ],
            tbf(args.rate_mbit),
            timeout_s=600 * len(args.runs),
        )
    except SlowLinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    when = datetime.datetime.now().isoformat(timespec="seconds")
    section = _section(args.delay_ms, args.peer_mbit, args.rate_mbit, args.vocab, args.steps, figures, when)
    write_section(args.out, section, head=HEAD)
    if set(args.runs) != set(RUNS):  # a partial run: no plot of it beside the full runs
        print(section)
        return 0
    # the figures beside the table, for the plot of every vocabulary run (bench/scaling_plot.py)
    title = _title(args.delay_ms, args.peer_mbit, args.rate_mbit, args.vocab)
    kept = {"title": title, "when": when, "steps": args.steps, "figures": figures}
    args.out.with_name(f"scaling-{args.vocab}.json").write_text(json.dumps(kept, indent=1) + "\n")
    plot = draw(args.out.parent, args.out.with_suffix(".png"))
    print(section + (f"\nplot: {plot}" if plot else "\nno plot drawn (needs matplotlib: the bench extra)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
