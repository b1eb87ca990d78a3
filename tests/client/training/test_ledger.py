"""Where a step's micro-batches went: each held once per stage, a fenced member's share handed back."""

import pytest
import torch

from client.routing import RouteHop
from client.sequence import TakenBackward
from client.training.ledger import Ledger

S1, S2 = (0, 2), (2, 4)


def taken(peer: str) -> TakenBackward:
    return TakenBackward(RouteHop(peer, 0, 2, "127.0.0.1:1"), torch.zeros(1), torch.zeros(1))


def test_holdings_and_completeness():
    ledger = Ledger([S1, S2])
    assert ledger.record(S1, "a", 0, 2, taken("a")) and ledger.record(S1, "b", 1, 2, taken("b"))
    assert ledger.record(S1, "a", 2, 1, taken("a"))
    assert ledger.holdings(S1) == {"a": [0, 2], "b": [1]} and ledger.samples_of(S1, [0, 2]) == 3
    assert ledger.complete(S1, 3) and not ledger.complete(S1, 4) and not ledger.complete(S2, 3)


def test_a_fenced_member_hands_back_its_micro_batches_and_a_late_answer_from_it_does_not_count():
    ledger = Ledger([S1])
    ledger.record(S1, "a", 0, 2, taken("a"))
    ledger.record(S1, "a", 1, 2, taken("a"))
    moved = ledger.fence(S1, "a")
    assert [index for index, _ in moved] == [0, 1] and ledger.holdings(S1) == {} and ledger.fenced() == {"a"}
    assert ledger.fence(S1, "a") == []  # a second fence moves nothing again
    assert ledger.record(S1, "a", 2, 2, taken("a")) is False  # answered after it was fenced: send it elsewhere
    assert ledger.record(S1, "b", 0, 2, taken("b"))


def test_one_micro_batch_at_two_members_is_a_bug_caught_at_once():
    ledger = Ledger([S1])
    ledger.record(S1, "a", 0, 2, taken("a"))
    with pytest.raises(AssertionError, match="held by a and b"):
        ledger.record(S1, "b", 0, 2, taken("b"))
