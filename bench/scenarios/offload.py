"""offload: a model's whole span streamed under memory budgets that hold a quarter, half and three quarters of its
blocks (`Plan.offload_fractions`; peer/offload.py, `swarmlm peer --memory-budget SIZE --offload disk|host`),
against the same span held resident, each in a fresh process (bench/offload.py measures; its docstring says how).

Per variant and share held: prefill (128 tokens) and decode tokens/s against the resident span's, and the
process's RSS after loading against the resident one's (the budget in `extra`). Host offload runs on a GPU only: on a CPU, host memory
is the device. The outputs must equal the resident span's; the largest difference is in `extra`.
Target (the offload issue's): decode at a budget of half the span >= 0.5x the resident span's tokens/s.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.models import BenchModel
from bench.offload import PROMPT, run_variant, variants
from bench.plan import Plan
from bench.stats import Row, Summary, Target

HALF_SPAN_TARGET = Target("ratio", ">=", 0.5, ">= 0.5x resident")
MIB = 2**20


def run(plan: Plan, model: BenchModel, work_dir: Path) -> list[Row]:
    blocks = model.config.num_hidden_layers
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="offload-", dir=work_dir) as work:
        resident, *streamed_variants = variants(plan.device)
        results = [run_variant(model, resident, _args(plan, 0), Path(work))]
        for fraction in plan.offload_fractions:
            # the budget holds this share of the blocks in all, the two streaming slots among them
            held = max(2, round(blocks * fraction))
            for variant in streamed_variants:
                result = run_variant(model, variant, _args(plan, held - 2), Path(work))
                results.append(result | {"fraction": fraction})
    return rows_from(model.name, results)


def _args(plan: Plan, resident_blocks: int) -> argparse.Namespace:
    return argparse.Namespace(
        device=plan.device, dtype=plan.dtype, rounds=plan.repeats, resident_blocks=resident_blocks
    )


def rows_from(config: str, results: list[dict]) -> list[Row]:
    """The rows of a run: `results` as bench/offload.py's run_variant returns them, the resident one first, each
    streamed one with the share of the blocks its budget holds ("fraction")."""
    resident, *streamed = results
    prefill = Summary.of([PROMPT / s for s in resident["prefill_s"]])
    decode = Summary.of([1 / s for s in resident["decode_s"]])
    rows = []
    for r in streamed:
        difference = float((r["output"].float() - resident["output"].float()).abs().max())
        extra = {
            "budget_mib": r["budget"] / MIB,
            "split": r["split"],
            "weights_mib": r["weights"] / MIB,
            "blocks_loaded": r["loads"],
            "waited_s": r["waited_s"],
            "output_difference": difference,
            "notes": [
                f"{config}, {r['variant']}, {r['fraction']:.0%} held: outputs differ from the resident span's by at "
                f"most {difference:.1e}"
            ],
        }
        held = f"{r['fraction']:.0%} of the blocks held"
        common = dict(
            scenario="offload",
            config=config,
            variant=f"{r['variant']}, {held}: {r['split']}",
            reference_name="every block resident",
            extra=extra,
        )
        rows += [
            Row(
                metric="decode",
                unit="tokens/s",
                ours=Summary.of([1 / s for s in r["decode_s"]]),
                reference=decode,
                target=HALF_SPAN_TARGET if r["fraction"] == 0.5 else None,
                **common,
            ),
            Row(
                metric=f"prefill {PROMPT}",
                unit="tokens/s",
                ours=Summary.of([PROMPT / s for s in r["prefill_s"]]),
                reference=prefill,
                **common,
            ),
            Row(
                metric="RSS after load",
                unit="MiB",
                ours=Summary.of([r["rss_load"] / MIB]),
                reference=Summary.of([resident["rss_load"] / MIB]),
                **common,
            ),
        ]
    return rows
