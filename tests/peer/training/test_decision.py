"""peer/training/decision.py: which trainer's record decides a member's averaged round."""

from __future__ import annotations

from peer.training.decision import Decision, decision_for
from protocol import swarmlm_pb2 as pb
from protocol.records import TrainingProgress, round_tag

ROUND = "ab" * 32
OTHER = "cd" * 32


def averaged(epoch: int = 5, round_id: str = ROUND, trainers=("QmT1", "QmT2")) -> pb.RoundStatus:
    return pb.RoundStatus(epoch=epoch, state=pb.RoundStatus.AVERAGED, round_id=round_id, trainers=list(trainers))


def decided(epoch: int = 5, rounds=(ROUND, OTHER), clip_scale: float = 0.5) -> TrainingProgress:
    return TrainingProgress(
        epoch=epoch, samples=8, decided=tuple(sorted(round_tag(r) for r in rounds)), clip_scale=clip_scale
    )


def test_a_trainer_of_the_round_that_named_it_at_this_update_decides_it():
    assert decision_for({"QmT2": decided()}, averaged()) == Decision("QmT2", 5, ROUND, 0.5)
    # with several trainers, each decided the same: one stands, whichever the reader finds first
    assert decision_for({"QmT2": decided(), "QmT1": decided(clip_scale=0.5)}, averaged()).trainer == "QmT1"


def test_no_decision_from_strangers_other_updates_other_rounds_or_plain_records():
    assert decision_for({"QmStranger": decided()}, averaged()) is None  # not a trainer of the round
    assert decision_for({"QmT1": decided(epoch=4)}, averaged()) is None
    assert decision_for({"QmT1": decided(rounds=(OTHER,))}, averaged()) is None
    assert decision_for({"QmT1": TrainingProgress(epoch=5, samples=8)}, averaged()) is None
    assert decision_for({}, averaged()) is None


def test_only_an_averaged_round_is_decided():
    for state in (pb.RoundStatus.IDLE, pb.RoundStatus.AVERAGING, pb.RoundStatus.FAILED, pb.RoundStatus.APPLIED):
        status = averaged()
        status.state = state
        assert decision_for({"QmT1": decided()}, status) is None
