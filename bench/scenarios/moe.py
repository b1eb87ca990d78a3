"""moe: the expert cache of a mixture-of-experts span (peer/experts.py, `swarmlm peer --expert-cache N
[--expert-prefetch]`), on bench/experts.py's small Mixtral (8 experts a layer, top-2) trained on the first third
of a Shakespeare play, decoding a passage from past that third, its span in this process.

Per experts kept a layer (1, 2 and 4 of 8) and where the others wait (host memory, or disk: `swarmlm peer
--expert-store disk`), LRU alone and with prefetch: the hit rate of the decode's picks, and decode tokens/s against
every expert resident. `extra` has the experts prefetched and the share of them then picked, the loads a step
(misses and guesses), the time a step waited for guesses still being read from disk, and the largest difference of
the outputs from the resident span's. Target (the MoE issue's): prefetch raises the hit rate by >= 20 points over
LRU alone. On a GPU guesses are copied beside the compute; on a CPU the device is host memory, so with the experts
there tokens/s say what the bookkeeping costs, and with them on disk what reading guesses beside the compute saves.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench import experts
from bench.plan import Plan
from bench.stats import Row, Summary, Target

PREFETCH_TARGET = Target("excess", ">=", 20.0, ">= +20 points over LRU alone")
CONFIG = f"mixtral {experts.LAYERS} layers x {experts.EXPERTS} experts"
DESCRIPTION = (
    f"a Mixtral-like model of {experts.LAYERS} layers with {experts.EXPERTS} experts each, top-{experts.TOP_K}, "
    "characters as tokens, trained on Shakespeare (bench/experts.py)"
)


def run(plan: Plan, work_dir: Path) -> list[Row]:
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moe-", dir=work_dir) as work:
        path, loss = experts.build_model(Path(work) / "mixtral", plan.moe_train_steps)
        results, resident_s = experts.measure(path, plan.moe_steps, device, dtype)
    return rows_from(results, resident_s, loss)


def rows_from(results: list[dict], resident_s: list[float], loss: float | None) -> list[Row]:
    """The rows of a run: `results` and `resident_s` as bench/experts.py's measure returns them."""
    resident = Summary.of([1 / s for s in resident_s])
    largest = max(r["difference"] for r in results)
    notes = [f"outputs against every expert resident: largest difference {largest:.1e} over every setting"]
    lru: dict[tuple[int, str], Summary] = {}
    rows = []
    for r in results:
        policy = "prefetch" if r["prefetch"] else "LRU alone"
        where = "on disk" if r["store"] == "disk" else "in host memory"
        variant = f"{r['capacity']} of {experts.EXPERTS} experts a layer, the rest {where}"
        setting = (r["capacity"], r["store"])
        extra = {
            "prefetched": r["prefetched"],
            "prefetch_used": r["used"],
            "loads_a_step": r["loads"],
            "waited_for_reads_s_a_step": r["waited_s"],
            "output_difference": r["difference"],
            "train_loss": loss,
            "notes": notes,
        }
        hit = Summary.of([100 * r["hit_rate"]])
        if not r["prefetch"]:
            lru[setting] = hit
        common = dict(scenario="moe", config=CONFIG, variant=variant, extra=extra)
        rows += [
            Row(
                metric=f"hit rate, {policy}",
                unit="%",
                ours=hit,
                reference=lru[setting] if r["prefetch"] else None,
                reference_name="LRU alone" if r["prefetch"] else "",
                target=PREFETCH_TARGET if r["prefetch"] else None,
                **common,
            ),
            Row(
                metric=f"decode, {policy}",
                unit="tokens/s",
                ours=Summary.of([1 / s for s in r["step_s"]]),
                reference=resident,
                reference_name="every expert resident",
                **common,
            ),
        ]
    return rows
