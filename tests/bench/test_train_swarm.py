"""The train_swarm scenario's arithmetic on plain data: log parsing, final losses, rates and its targets."""

from __future__ import annotations

import json

import pytest

from bench import train_runs as tr
from bench.plan import QUICK_SCENARIOS, SCENARIOS, preset
from bench.scenarios.train_swarm import AVERAGING_TARGET, FIDELITY_TARGET, PIPELINING_TARGET
from bench.stats import Row, Summary

PEER_LOG = """\
07:01:02 INFO peer.server: ONLINE: serving blocks 0:2 of bench-train-two at 127.0.0.1:4242
07:01:05 INFO peer.training.span: update 0 of run 'two': averaged 16 samples (8 here) among 2 members in 1.49s
07:01:07 WARNING peer.training.span: update 1 of run 'two': the round failed: TimeoutError()
07:01:09 INFO peer.training.span: update 1 of run 'two': averaged 8 samples (8 here) among 1 members in 0.02s
07:01:11 INFO peer.training.span: update 2 of run 'two': averaged 16 samples (8 here) among 2 members in 1.31s, 4096 bytes sent
07:01:12 INFO peer.training.span: update 8 of run 'other': averaged 8 samples (8 here) among 1 members in 0.01s
"""


def test_rounds_and_updates_are_read_from_a_peer_log():
    assert tr.allreduce_rounds_s(PEER_LOG) == [1.49, 1.31]  # rounds with fewer than 2 members are not all-reduces
    assert tr.allreduce_rounds_s(PEER_LOG, min_members=1) == [1.49, 0.02, 1.31, 0.01]
    assert tr.updates_applied(PEER_LOG, "two") == 3
    assert tr.updates_applied(PEER_LOG, "other") == 9
    assert tr.updates_applied(PEER_LOG, "missing") == 0
    assert tr.allreduce_bytes(PEER_LOG) == 4096  # logs before the count was logged add nothing


def test_final_loss_curves_and_rates(tmp_path):
    losses = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0]
    assert tr.final_loss(losses) == pytest.approx(6.0)  # mean of the last 5
    assert tr.final_loss([3.0, 5.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no loss"):
        tr.final_loss([])
    assert tr.mean_curve([[1.0, 2.0, 3.0], [3.0, 4.0]]) == [2.0, 3.0]

    log = tmp_path / "steps.jsonl"
    log.write_text(
        "".join(
            json.dumps({"step": i + 1, "loss": 5.0, "samples": 8, "tokens_per_s": rate}) + "\n"
            for i, rate in enumerate([100.0, 200.0, 512.0, 256.0])
        )
    )
    steps = tr.read_steps(log)
    assert tr.steady_rates(steps) == [512.0, 256.0]
    assert tr.steady_rates(steps[:2]) == [100.0, 200.0]  # too short to skip a warm-up
    assert tr.step_seconds(steps, seq_len=64) == pytest.approx([5.12, 2.56, 1.0, 2.0])
    assert tr.summed_rates([steps, steps]) == [1024.0, 512.0]


def test_targets_of_the_scenario():
    def row(ours: float, reference: float, target) -> Row:
        return Row("train_swarm", "m", "v", "x", "u", Summary.of([ours]), Summary.of([reference]), target=target)

    assert row(5.05, 5.0, FIDELITY_TARGET).met is True
    assert row(5.2, 5.0, FIDELITY_TARGET).met is False
    assert row(4.8, 5.0, FIDELITY_TARGET).met is False  # a band: too low misses as well
    assert row(1.1, 1.0, AVERAGING_TARGET).met is True and row(1.3, 1.0, AVERAGING_TARGET).met is False
    assert row(2.1, 1.0, PIPELINING_TARGET).met is True and row(1.5, 1.0, PIPELINING_TARGET).met is False
    assert row(5.0, 5.0, FIDELITY_TARGET).to_json()["target"] == "0.98-1.02x local"


def test_train_swarm_is_a_scenario_but_not_a_quick_default():
    assert "train_swarm" in SCENARIOS and "train_swarm" not in QUICK_SCENARIOS
    assert preset(quick=True, device="cpu").scenarios == QUICK_SCENARIOS
    assert "train_swarm" in preset(quick=False, device="cpu").scenarios
    assert preset(quick=True, device="cpu").train_swarm_steps < preset(quick=False, device="cpu").train_swarm_steps
