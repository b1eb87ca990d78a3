"""HeadBatcher: the heads of concurrent generations' steps as one batch per round, with threads as generations."""

from __future__ import annotations

import threading

import pytest
import torch

from client.heads import HeadBatcher

HIDDEN, VOCAB = 16, 40


@pytest.fixture
def head():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False))


def _members(
    batcher: HeadBatcher,
    inputs: list[list[torch.Tensor]],
    results: dict,
    errors: list,
    leave_after: dict[int, int] | None = None,
):
    """One thread per member, each handing in its inputs one round after the other, once all are members."""
    joined = threading.Barrier(len(inputs))

    def run(i: int):
        try:
            with batcher.member():
                joined.wait(20)
                for r, hidden in enumerate(inputs[i]):
                    if leave_after and leave_after.get(i) == r:
                        return
                    results[i, r] = batcher.logits(hidden)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    return threads


def _join(threads, timeout_s: float = 20.0):
    for thread in threads:
        thread.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a member is still waiting for its round"


def test_every_round_is_one_batch_of_all_members_and_each_row_is_its_own(head):
    batcher = HeadBatcher(head, max_wait_s=30.0)  # rounds are complete long before: all members hand in
    inputs = [[torch.randn(1 + i % 2, HIDDEN) for _ in range(5)] for i in range(4)]
    results, errors = {}, []
    _join(_members(batcher, inputs, results, errors))
    assert not errors
    assert (batcher.rounds, batcher.rows) == (5, 5 * 6)
    with torch.no_grad():
        for (i, r), logits in results.items():
            torch.testing.assert_close(logits, head(inputs[i][r]), rtol=1e-5, atol=1e-6)


def test_a_member_that_leaves_does_not_hold_up_the_others(head):
    batcher = HeadBatcher(head, max_wait_s=60.0)  # a round waiting for the one that left would hang the test
    inputs = [[torch.randn(1, HIDDEN) for _ in range(4)] for _ in range(3)]
    results, errors = {}, []
    _join(_members(batcher, inputs, results, errors, leave_after={0: 1}))
    assert not errors
    assert len(results) == 1 + 4 + 4
    assert batcher.rounds == 4


def test_a_member_that_is_late_delays_a_round_by_at_most_the_wait(head):
    batcher = HeadBatcher(head, max_wait_s=0.05)
    release = threading.Event()

    def late():
        with batcher.member():
            release.wait(20)

    thread = threading.Thread(target=late)
    thread.start()
    try:
        with batcher.member():
            for _ in range(3):
                batcher.logits(torch.randn(1, HIDDEN))
    finally:
        release.set()
        thread.join(20)
    assert (batcher.rounds, batcher.rows) == (3, 3)


def test_a_failing_head_fails_its_round_for_every_member_and_the_next_round_works(head):
    calls = []

    def flaky(hidden):
        calls.append(hidden.shape[0])
        if len(calls) == 1:
            raise RuntimeError("out of memory, say")
        return head(hidden)

    batcher = HeadBatcher(flaky, max_wait_s=30.0)
    inputs = [[torch.randn(1, HIDDEN)] for _ in range(3)]
    results, errors = {}, []
    _join(_members(batcher, inputs, results, errors))
    assert len(errors) == 3 and all("out of memory" in str(e) for e in errors)
    assert batcher.logits(torch.randn(2, HIDDEN)).shape == (2, VOCAB)


def test_max_wait_must_be_a_non_negative_number(head):
    with pytest.raises(ValueError, match="max_wait_s"):
        HeadBatcher(head, max_wait_s=float("nan"))


def test_without_a_wait_rows_that_come_during_a_round_make_the_next_one(head):
    started, release = threading.Event(), threading.Event()
    sizes = []

    def slow(hidden):
        sizes.append(hidden.shape[0])
        if len(sizes) == 1:
            started.set()
            release.wait(20)
        return head(hidden)

    batcher = HeadBatcher(slow)  # the default: a round never waits for anyone
    results, errors = {}, []
    with batcher.member():  # a member that never hands anything in holds nobody up
        first = _members(batcher, [[torch.randn(1, HIDDEN)]], results, errors)
        assert started.wait(20)
        others = _members(batcher, [[torch.randn(1, HIDDEN)] for _ in range(3)], {}, errors)
        for _ in range(2000):  # the three wait for the round being computed
            if len(batcher._pending) == 3 or errors:
                break
            threading.Event().wait(0.01)
        release.set()
        _join(first + others)
    assert not errors
    assert sizes == [1, 3]
