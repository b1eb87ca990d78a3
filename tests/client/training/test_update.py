"""A trainer's side of an update, in plain data: what it commits, and noticing it came late."""

import pytest
import torch

from client.routing import RouteHop
from client.sequence import TakenBackward
from client.training.ledger import Ledger
from client.training.stages import Member
from client.training.update import Update
from protocol import swarmlm_pb2 as pb
from protocol.errors import StaleEpochError


def member(pid: str, span=(0, 2)) -> Member:
    return Member(pid, span, "127.0.0.1:1", 5, pb.RoundStatus(epoch=5))


def update(ledger: Ledger, members) -> Update:
    async def redo(span, pid):
        ledger.fence(span, pid)

    return Update(
        None,
        run_id="r",
        prefix="m",
        epoch=5,
        trainer="T",
        trainers=["T", "U"],
        members={(0, 2): {m.peer_id: m for m in members}},
        ledger=ledger,
        redo=redo,
        round_timeout_s=1.0,
    )


def test_a_commit_names_every_member_and_what_each_holds_of_this_trainer():
    ledger = Ledger([(0, 2)])
    taken = TakenBackward(RouteHop("a", 0, 2, "x:1"), torch.zeros(1), torch.zeros(1))
    ledger.record((0, 2), "a", 0, 2, taken)
    ledger.record((0, 2), "a", 2, 1, taken)
    ledger.record((0, 2), "b", 1, 2, taken)
    request = update(ledger, [member("a"), member("b"), member("c")]).commit_request((0, 2), version=3)
    assert (request.epoch, request.version, request.trainer, list(request.trainers)) == (5, 3, "T", ["T", "U"])
    held = {h.peer_id: [(t.trainer, list(t.indices), t.samples) for t in h.held] for h in request.members}
    assert held == {"a": [("T", [0, 2], 3)], "b": [("T", [1], 2)], "c": []}  # c holds nothing, and takes part
    ledger.fence((0, 2), "b")
    request = update(ledger, [member("a"), member("b"), member("c")]).commit_request((0, 2), version=4)
    assert [h.peer_id for h in request.members] == ["a", "c"]  # a fenced member is left out


def test_a_round_without_this_trainer_means_it_came_late():
    u = update(Ledger([(0, 2)]), [member("a")])
    u._check_in(pb.RoundStatus(epoch=5, trainers=["T", "U"]))  # in it: fine
    u._check_in(pb.RoundStatus(epoch=5))  # no round yet: fine
    with pytest.raises(StaleEpochError, match="committed without this trainer"):
        u._check_in(pb.RoundStatus(epoch=5, trainers=["U"]))
