"""A trainer's side of an update, in plain data: what it commits, and noticing it came late."""

import asyncio

import pytest
import torch

from client.routing import RouteHop
from client.sequence import TakenBackward
from client.training.ledger import Ledger
from client.training.stages import Member
from client.training.update import Update
from peer.training.commits import Commits
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


def two_stages() -> Update:
    stages = {(0, 2): [member("a1"), member("a2")], (2, 4): [member("b1", (2, 4)), member("b2", (2, 4))]}
    u = update(Ledger(list(stages)), [])
    u.members = {span: {m.peer_id: m for m in ms} for span, ms in stages.items()}
    return u


def round_status(state, round_id, version=1) -> pb.RoundStatus:
    return pb.RoundStatus(
        epoch=5, state=state, round_id=round_id, grad_digest="g" + round_id, grad_sq_norm=2.0, samples=8,
        trainers=["T", "U"], version=version,
    )  # fmt: skip


def statuses(u: Update, answers: dict) -> dict:
    return {(span, pid): (m, answers[pid]) for span, ms in u.members.items() for pid, m in ms.items()}


AVERAGED, APPLIED = pb.RoundStatus.AVERAGED, pb.RoundStatus.APPLIED
GONE = OSError("connection refused")


def test_every_member_averaged_the_round_of_this_trainers_latest_commit():
    u = two_stages()
    u.version = 1
    averaged = {"a1": round_status(AVERAGED, "r1"), "a2": round_status(AVERAGED, "r1")}
    averaged |= {"b1": round_status(AVERAGED, "r2"), "b2": round_status(AVERAGED, "r2")}
    done = u._all_averaged(statuses(u, averaged))
    assert {span: (d.round_id, [m.peer_id for m in d.members]) for span, d in done.items()} == {
        (0, 2): ("r1", ["a1", "a2"]),
        (2, 4): ("r2", ["b1", "b2"]),
    }
    assert u._all_averaged(statuses(u, averaged | {"a2": GONE})) is None  # undecided: a member gone is a fault
    u.version = 2  # this trainer asked to replace those rounds: another trainer's retry may do it yet
    assert u._all_averaged(statuses(u, averaged)) is None


def test_once_a_member_applied_the_update_the_others_follow_it_without_those_gone():
    u = two_stages()
    u.version = 3  # this trainer saw a fault and tried again; another trainer had applied already
    answers = {"a1": round_status(APPLIED, "r1"), "a2": GONE}
    answers |= {"b1": round_status(AVERAGED, "r2"), "b2": round_status(AVERAGED, "r2")}
    done = u._all_averaged(statuses(u, answers))
    assert [m.peer_id for m in done[(0, 2)].members] == ["a1"] and done[(0, 2)].round_id == "r1"
    assert done[(0, 2)].trainers == ("T", "U")  # whose micro-batches it holds: the trainer's parts follow them
    assert [m.peer_id for m in done[(2, 4)].members] == ["b1", "b2"]
    # a member of another round (or one still averaging) keeps it from following, and is named
    answers["b2"] = round_status(pb.RoundStatus.AVERAGING, "r3")
    assert u._all_averaged(statuses(u, answers)) is None
    assert list(u._undecided(statuses(u, answers))) == [((2, 4), "b2")]
    # a stage none of whose members answers cannot be followed
    assert u._all_averaged(statuses(u, answers | {"b1": GONE, "b2": GONE})) is None


class Answers:
    """The part of Stages that a look at the rounds reads: each member's round status."""

    def __init__(self, answers: dict):
        self.answers, self.refused = answers, set()

    async def status(self, member, epoch):
        return self.answers[member.peer_id]


def test_stages_two_updates_ahead_mean_this_trainer_came_late():
    u = two_stages()
    later = pb.RoundStatus(epoch=33, state=pb.RoundStatus.IDLE)
    u.stages = Answers(dict.fromkeys(["a1", "a2", "b1", "b2"], later))
    with pytest.raises(StaleEpochError, match="at update 33"):
        asyncio.run(u._await_rounds(wait=False))


class Members:
    """Stage members that keep commits as a peer does (peer/training/commits.py) and, with local steps, have averaged
    once a round can start; the other trainers' commits are there already."""

    def __init__(self, peer_ids: list[str], others: list[pb.CommitRequest]):
        self.commits = {pid: Commits(5) for pid in peer_ids}
        for commits in self.commits.values():
            for request in others:
                commits.add(request)
        self.refused, self.sent = set(), []

    def answer(self, peer_id: str) -> pb.RoundStatus:
        commits = self.commits[peer_id]
        plan = commits.plan(peer_id)
        if plan is None:
            return pb.RoundStatus(epoch=5, state=pb.RoundStatus.WAITING, split=commits.split())
        return pb.RoundStatus(
            epoch=5, state=AVERAGED, round_id=plan.round_id, grad_digest="g", grad_sq_norm=1.0,
            samples=plan.samples, trainers=plan.trainers, version=plan.version,
        )  # fmt: skip

    async def call(self, member, method, request, timeout):
        assert method == "commit"
        self.sent.append((request.version, list(request.trainers)))
        self.commits[member.peer_id].add(request)
        return pb.CommitResponse(status=self.answer(member.peer_id))

    async def status(self, member, epoch):
        return self.answer(member.peer_id)

    async def lost(self, peer_id, exc=None):
        return False


def test_commits_that_name_different_trainers_make_the_trainers_agree_and_commit_again():
    """With local steps each trainer names the trainers it met at its rendezvous: T met only U, while U and V met
    all three. No stage can start a round then; T agrees on who is in and commits again with that."""
    others = [
        pb.CommitRequest(epoch=5, version=1, trainer=t, trainers=["T", "U", "V"], members=[pb.Holding(peer_id="a")])
        for t in ("U", "V")
    ]
    u = update(Ledger([(0, 2)]), [member("a")])
    u.stages = Members(["a"], others)
    u.local_steps = True
    agreed = []

    async def agree():  # U and V see the split too, agree, and commit again meanwhile
        agreed.append(True)
        for request in others:
            request.version = 2
            u.stages.commits["a"].add(request)
        return {"T": 4, "U": 4, "V": 4}

    u.agree = agree
    done = asyncio.run(u.average())
    assert agreed == [True] and u.agreed == {"T": 4, "U": 4, "V": 4}
    assert u.stages.sent == [(1, ["T", "U"]), (2, ["T", "U", "V"])]
    assert done[(0, 2)].trainers == ("T", "U", "V")
    assert any("named different trainers" in fault for fault in u.faults)
