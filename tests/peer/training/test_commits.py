"""The commits of an update and the round they define: plain data."""

import pytest

from peer.training.commits import Commits
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError


def commit(trainer, trainers, members, version=1, epoch=3):
    return pb.CommitRequest(
        run_id="r",
        span=pb.Span(model="m", start=0, end=2),
        epoch=epoch,
        version=version,
        trainer=trainer,
        trainers=trainers,
        members=[
            pb.Holding(
                peer_id=peer,
                held=[pb.TrainerIndices(trainer=trainer, indices=ix, samples=2 * len(ix))] if ix else [],
            )
            for peer, ix in members.items()
        ],
    )


def test_one_trainer_one_round():
    commits = Commits(3)
    commits.add(commit("A", ["A"], {"p1": [0, 2], "p2": [1], "p3": []}))
    plan = commits.plan("p2")
    assert plan.members == ("p1", "p2", "p3") and plan.mine == {"A": [1]} and plan.samples == 6
    assert commits.plan("p3").mine == {"A": []} and commits.plan("p3").round_id == plan.round_id
    assert commits.plan("stranger") is None and commits.fenced("stranger") and not commits.fenced("p1")


def test_the_round_waits_for_every_trainer_named_and_changes_once_every_trainer_tried_again():
    commits = Commits(3)
    commits.add(commit("A", ["A", "B"], {"p1": [0], "p2": []}))
    assert commits.plan("p1") is None and not commits.fenced("p9")
    commits.add(commit("B", ["A", "B"], {"p1": [], "p2": [0, 1]}))
    first = commits.plan("p1")
    assert first.mine == {"A": [0], "B": []} and first.samples == 6 and first.version == 1
    # B alone tries again: A may be applying the first round already, which must stay
    commits.add(commit("B", ["A", "B"], {"p1": [0, 1]}, version=2))
    assert commits.plan("p1") == first and not commits.fenced("p2")
    commits.add(commit("A", ["A", "B"], {"p1": [0]}, version=2))
    second = commits.plan("p1")
    assert second.round_id != first.round_id and second.version == 2 and second.mine == {"A": [0], "B": [0, 1]}
    assert commits.fenced("p2")  # both trainers' commits of version 2 leave it out
    commits.add(commit("A", ["A", "B"], {"p1": [0], "p2": []}, version=3))  # A alone again: no change
    assert commits.plan("p1") == second
    commits.add(commit("B", ["A", "B"], {"p2": [0]}, version=1))  # an older version, again: nothing changes
    assert commits.plan("p1") == second


def test_a_trainer_that_drops_a_gone_one_follows_its_own_latest_commit():
    commits = Commits(3)
    commits.add(commit("A", ["A", "B"], {"p1": [0]}))
    commits.add(commit("B", ["A", "B"], {"p1": [1]}))
    commits.add(commit("A", ["A"], {"p1": [0]}, version=2))  # B died: A's micro-batches alone
    plan = commits.plan("p1")
    assert plan.trainers == ("A",) and plan.version == 2 and plan.samples == 2


def test_a_trainer_late_to_its_rendezvous_is_left_out_and_the_others_update():
    commits = Commits(3)
    commits.add(commit("C", ["A", "B", "C"], {"p1": [0]}))  # C saw A and B; they had gone on without it
    assert commits.plan("p1") is None  # A's and B's commits are not here yet
    commits.add(commit("A", ["A", "B"], {"p1": [0]}))
    commits.add(commit("B", ["A", "B"], {"p1": [1]}))
    plan = commits.plan("p1")
    assert plan.trainers == ("A", "B") and plan.mine == {"A": [0], "B": [1]}
    alone = Commits(3)
    alone.add(commit("A", ["A"], {"p1": [0]}))
    alone.add(commit("B", ["A", "B"], {"p1": [0]}))
    assert alone.plan("p1").trainers == ("A",)


def test_commits_that_name_different_trainers_are_split_once_every_trainer_named_has_committed():
    commits = Commits(3)
    commits.add(commit("A", ["A", "B"], {"p1": [0]}))  # A met B a moment before C announced the update
    commits.add(commit("B", ["A", "B", "C"], {"p1": [1]}))
    assert commits.plan("p1") is None and not commits.split()  # C may yet commit {A, B}
    commits.add(commit("C", ["A", "B", "C"], {"p1": [2]}))
    assert commits.plan("p1") is None and commits.split()  # and now no round can ever start
    commits.add(commit("A", ["A", "B", "C"], {"p1": [0]}, version=2))  # they agreed on who is in
    assert commits.plan("p1").trainers == ("A", "B", "C") and not commits.split()


@pytest.mark.parametrize(
    "request_, said",
    [
        (commit("A", ["B"], {"p1": [0]}), "among the trainers"),
        (
            pb.CommitRequest(trainer="A", trainers=["A"], members=[pb.Holding(peer_id="p"), pb.Holding(peer_id="p")]),
            "each member once",
        ),
    ],
)
def test_malformed_commits_are_refused(request_, said):
    with pytest.raises(BadRequestError, match=said):
        Commits(0).add(request_)
