"""The bench's offload and moe scenarios, shortened, through the runner and the report: a tiny model's span
streamed under budgets of a quarter and half its blocks against resident, and a Mixtral-like model's expert cache
trained a few steps;
every output equals the resident one, the targets sit on the rows they judge, and the figures are drawn."""

from __future__ import annotations

import pytest

from bench.plan import Plan
from bench.report import write
from bench.runner import run_models


@pytest.mark.timeout(300)
def test_offload_and_moe_rows_reach_the_report(tmp_path):
    plan = Plan(
        configs=("tiny",),
        scenarios=("offload", "moe"),
        repeats=1,
        offload_fractions=(0.25, 0.5),
        moe_train_steps=2,
        moe_steps=4,
    )
    rows, errors, descriptions = run_models(
        plan, models_dir=tmp_path / "models", cache_dir=tmp_path / "cache", out_dir=tmp_path / "out"
    )
    assert not errors, errors
    offload = [r for r in rows if r.scenario == "offload"]
    assert sorted((r.variant.split(":")[0], r.metric) for r in offload) == sorted(
        (f"disk, {held} of the blocks held", metric)
        for held in ("25%", "50%")
        for metric in ("decode", "prefill 128", "RSS after load")
    )
    for row in offload:
        assert row.extra["output_difference"] == 0.0  # the same weights compute, wherever they waited
        assert row.ours.median > 0 and row.reference.median > 0
        assert row.extra["blocks_loaded"] > 0 and row.extra["budget_mib"] < row.extra["weights_mib"]
    (judged,) = [r for r in offload if r.target is not None]  # the target is at half the span
    assert judged.metric == "decode" and "50%" in judged.variant and judged.met is not None
    quarter, half = (r for r in offload if r.metric == "RSS after load")
    assert quarter.extra["budget_mib"] < half.extra["budget_mib"]

    moe = [r for r in rows if r.scenario == "moe"]
    assert len(moe) == 24  # 1, 2 and 4 experts a layer; host or disk; LRU alone and prefetch; hit rate and decode
    for row in moe:
        assert row.extra["output_difference"] < 1e-4
        assert (row.extra["prefetched"] > 0) == row.metric.endswith("prefetch")
        assert row.extra["waited_for_reads_s_a_step"] >= 0.0
    assert {r.variant.split(", ")[1] for r in moe} == {"the rest in host memory", "the rest on disk"}
    judged = [r for r in moe if r.target is not None]
    assert [r.metric for r in judged] == ["hit rate, prefetch"] * 6
    assert all(r.reference_name == "LRU alone" and r.met is not None for r in judged)
    assert set(descriptions) == {"tiny", "mixtral 4 layers x 8 experts"}

    header = {"started": "2026-12-07T00:00:00", "machine": {}, "summary": {}, "notes": [], "mode": "full"}
    paths = write(tmp_path / "out", rows, header)
    text = paths["markdown"].read_text()
    assert "Expert cache: hit rate" in text and "Blocks streamed under memory budgets" in text
    assert (
        "tiny, disk, 50% held: outputs differ from the resident span's by at most 0.0e+00" in text
    )  # what a GPU run shows
    assert "outputs against every expert resident: largest difference" in text
    assert (tmp_path / "out" / "offload.png").stat().st_size > 0 and (tmp_path / "out" / "moe.png").stat().st_size > 0


def test_the_moe_and_offload_settings_are_checked():
    with pytest.raises(ValueError, match="moe_steps"):
        Plan(configs=("tiny",), moe_steps=0)
    with pytest.raises(ValueError, match="moe_train_steps"):
        Plan(configs=("tiny",), moe_train_steps=-1)
    with pytest.raises(ValueError, match="offload_fractions"):
        Plan(configs=("tiny",), offload_fractions=(0.5, 1.0))
