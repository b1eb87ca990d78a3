"""A stage peer's gradient sums: each micro-batch once, one sum per trainer, a commit's listing checked."""

import pytest
import torch

from peer.training.accumulators import Accumulators, HeldMismatch
from protocol.errors import BadRequestError


def grads(value: float) -> list[torch.Tensor]:
    return [torch.full((2, 3), value, dtype=torch.bfloat16), torch.full((4,), value, dtype=torch.bfloat16)]


def test_a_micro_batch_is_added_once_and_sums_are_float32():
    acc = Accumulators([torch.zeros(2, 3), torch.zeros(4)])
    assert acc.add("t1", 0, 2, grads(1.0)) is True
    assert acc.add("t1", 0, 2, grads(100.0)) is False  # the same id again: ignored
    assert acc.add("t1", 1, 3, grads(2.0)) is True
    assert acc.holds("t1", 1) and not acc.holds("t1", 2) and not acc.holds("t2", 0)
    assert acc.held() == {"t1": ([0, 1], 5)}
    total, samples = acc.total({"t1": [0, 1]})
    assert samples == 5 and total[0].dtype == torch.float64
    assert torch.equal(total[0], torch.full((2, 3), 1.0 * 2 + 2.0 * 3, dtype=torch.float64))


def test_a_trainer_left_out_of_the_listing_is_dropped_and_a_mismatch_is_refused():
    acc = Accumulators([torch.zeros(3)])
    acc.add("t1", 0, 1, [torch.ones(3)])
    acc.add("dead", 0, 1, [torch.full((3,), 50.0)])
    total, samples = acc.total({"t1": [0]})  # the dead trainer's share is not in the update
    assert samples == 1 and torch.equal(total[0], torch.ones(3, dtype=torch.float64))
    with pytest.raises(HeldMismatch, match=r"lists \[0, 1\], this peer holds \[0\]"):
        acc.total({"t1": [0, 1]})
    with pytest.raises(HeldMismatch, match="lists"):
        acc.total({"t1": []})  # holding more than committed is a mismatch too
    assert acc.total({"t3": []})[1] == 0


@pytest.mark.parametrize("trainer, index, samples", [("", 0, 1), ("t", -1, 1), ("t", 1 << 21, 1), ("t", 0, 0)])
def test_malformed_ids_are_refused(trainer, index, samples):
    with pytest.raises(BadRequestError, match="micro-batch needs"):
        Accumulators([torch.zeros(1)]).add(trainer, index, samples, [torch.zeros(1)])


def test_clear_forgets_everything():
    acc = Accumulators([torch.zeros(1)])
    acc.add("t", 0, 1, [torch.ones(1)])
    acc.clear()
    assert acc.held() == {} and not acc.holds("t", 0)


def test_drop_forgets_only_the_trainers_named():
    acc = Accumulators([torch.zeros(1)])
    acc.add("dead", 0, 2, [torch.ones(1)])
    acc.add("dead", 1, 3, [torch.ones(1)])
    acc.add("live", 0, 1, [torch.ones(1)])
    assert acc.drop(["dead", "never-sent"]) == 5
    assert acc.held() == {"live": ([0], 1)} and not acc.holds("dead", 0)
