"""How the outer step's momentum behaves with few inner steps: the one-process DiLoCo reference, several settings.

For each setting, `swarmlm train --local`'s trainer (client/training/local.py: what a swarm with one peer per stage
and one trainer computes, to float32 rounding) trains the bench's tiny random Llama (hidden 64, 4 layers, the
tests' 128-character vocabulary) on the same batches of Shakespeare (8 sequences of 64 characters a step).
Reported every 8 steps: the norm of the last block's output on the first two sequences of the step (the residual
stream before the final norm, which hides its growth from the loss); and the mean loss of the last 5 steps.

    python -m bench.outer_momentum [--steps 56] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from bench.hop_profile import write_section

FIGURE = Path(__file__).resolve().parent / "figures" / "outer_momentum.md"
HEAD = """# The outer step's momentum with few inner steps

`python -m bench.outer_momentum`: one section per run length, replaced when rerun. What it runs: the docstring of
bench/outer_momentum.py.
"""
SETTINGS = {  # name -> (local steps, outer lr, outer momentum)
    "a round every update": (1, 0.0, 0.0),
    "--local-steps 4, momentum 0.9 (DiLoCo's)": (4, 0.7, 0.9),
    "--local-steps 4, momentum 0.5": (4, 0.7, 0.5),
    "--local-steps 4, momentum 0.3": (4, 0.7, 0.3),
    "--local-steps 4, momentum 0": (4, 0.7, 0.0),
    "--local-steps 8, momentum 0.9": (8, 0.7, 0.9),
}
BATCH, SEQ, EVERY = 8, 64, 8


def measure(steps: int) -> dict[str, dict]:
    """Every setting's output norms (every EVERY steps) and final loss."""
    import torch
    from transformers import AutoTokenizer

    from bench import train_runs as tr
    from bench.scaling import TINY_SPEC
    from client.config import TrainConfig
    from client.training.data import default_corpus, tokenize_files
    from client.training.local import LocalTrainer
    from swarm.paths import default_cache_dir

    cache = default_cache_dir()
    model = tr.build_train_model(
        cache / "bench-models", cache, name="train-tiny", config=TINY_SPEC, char_tokenizer=True
    )
    ids = tokenize_files(AutoTokenizer.from_pretrained(model), default_corpus())[: steps * BATCH * SEQ].long()
    if ids.numel() < steps * BATCH * SEQ:
        raise ValueError(f"the corpus holds {ids.numel()} tokens, fewer than {steps} steps take")
    figures = {}
    for name, (local_steps, lr, momentum) in SETTINGS.items():
        outer = dict(local_steps=local_steps, outer_lr=lr, outer_momentum=momentum) if local_steps > 1 else {}
        trainer = LocalTrainer(model, TrainConfig(batch_size=BATCH, micro_batch_size=2, lr=1e-3, **outer))
        seen: dict[str, torch.Tensor] = {}

        def keep(module, args, output, seen=seen):
            seen["out"] = output[0] if isinstance(output, tuple) else output

        trainer.model.model.layers[-1].register_forward_hook(keep)
        norms, losses = [], []
        for step in range(steps):
            batch = ids[step * BATCH * SEQ : (step + 1) * BATCH * SEQ].view(BATCH, SEQ)
            losses.append(trainer.step(batch).loss)
            if step % EVERY == EVERY - 1:
                with torch.no_grad():
                    trainer.model(batch[:2])
                norms.append(float(seen["out"].norm()))
        trainer.close()
        figures[name] = {"norms": norms, "final_loss": tr.final_loss(losses)}
    return figures


def _section(steps: int, figures: dict[str, dict], when: str) -> str:
    marks = ", ".join(str(s) for s in range(EVERY, steps + 1, EVERY))
    return "\n".join(
        [
            f"## {steps} steps ({when})",
            "",
            f"Last block's output norm after steps {marks}; loss: mean of the last 5 steps.",
            "",
            "| setting | output norm | loss |",
            "|---|---|---|",
            *(
                f"| {name} | {' / '.join(f'{n:.0f}' for n in f['norms'])} | {f['final_loss']:.3f} |"
                for name, f in figures.items()
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.outer_momentum", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=56, help="steps of each setting (default: %(default)s)")
    p.add_argument("--out", type=Path, default=FIGURE, help="markdown file to put the table in")
    args = p.parse_args(argv)
    if args.steps < EVERY:
        p.error(f"--steps must be at least {EVERY}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    section = _section(args.steps, measure(args.steps), datetime.datetime.now().isoformat(timespec="seconds"))
    write_section(args.out, section, head=HEAD)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
