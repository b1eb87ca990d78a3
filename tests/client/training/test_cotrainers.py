"""The run's trainers agreeing on who is in an update of a run with local steps, on real hivemind DHT nodes (and the
averager processes a trainers' group starts): trainers that chose different trainers at their rendezvous end with
one set, which the stages' commits then accept (with the sets as chosen, no stage would ever start the update)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from client.config import TrainConfig
from client.training.cotrainers import CoTrainers
from peer.training.commits import Commits
from protocol import swarmlm_pb2 as pb
from protocol.records import TrainingProgress
from swarm.dht.node import start_dht, stop_dht, visible_maddrs
from swarm.training.settings import AveragingSettings

AVERAGING = AveragingSettings(
    matchmaking_time_s=1.0, averaging_timeout_s=6.0, load_state_timeout_s=6.0, progress_period_s=0.2
)
EPOCH, SAMPLES = 4, 8
PARAMS = [torch.zeros(3)]


@pytest.fixture
def trainers():
    """Three trainers of one run, each on its own DHT node, every record at update EPOCH with its samples (as their
    rendezvous leaves them); stopped at the end, also on failure."""
    dhts, members = [], []
    try:
        for _ in range(3):
            dhts.append(start_dht(visible_maddrs(dhts[0]) if dhts else ()))
            member = CoTrainers(
                dhts[-1],
                "model",
                TrainConfig(run_id="agree", averaging=AVERAGING),
                params=PARAMS,
                state=lambda: (EPOCH, PARAMS),
                stages_epoch=lambda: EPOCH,
            )
            members.append(member)
            member.start(TrainingProgress(epoch=EPOCH, samples=SAMPLES))
        yield members
    finally:
        for member in members:
            with contextlib.suppress(Exception):
                member.close()
        for dht in dhts:
            stop_dht(dht)


def commit(trainer: str, trainers: list[str]) -> pb.CommitRequest:
    held = [pb.TrainerIndices(trainer=trainer, indices=[0], samples=SAMPLES)]
    return pb.CommitRequest(
        epoch=EPOCH, version=1, trainer=trainer, trainers=trainers, members=[pb.Holding(peer_id="member", held=held)]
    )


def plan_of(sets: dict[str, list[str]]):
    commits = Commits(EPOCH)
    for trainer, named in sets.items():
        commits.add(commit(trainer, named))
    return commits.plan("member")


def test_trainers_that_met_different_trainers_agree_on_one_set(trainers):
    a, b, c = (t.trainer_id for t in trainers)
    # a met b a moment before c announced the update; b and c saw everyone
    chosen = {a: [a, b], b: [a, b, c], c: [a, b, c]}
    assert plan_of(chosen) is None  # as chosen, no stage ever starts the update

    async def agree():
        return await asyncio.wait_for(
            asyncio.gather(
                *(t.agree_on(EPOCH, SAMPLES, dict.fromkeys(chosen[t.trainer_id], SAMPLES)) for t in trainers)
            ),
            60,
        )

    agreed = asyncio.run(agree())
    assert [sorted(s) for s in agreed] == [sorted([a, b, c])] * 3
    assert all(s == dict.fromkeys(s, SAMPLES) for s in agreed)
    plan = plan_of({t.trainer_id: sorted(s) for t, s in zip(trainers, agreed)})
    assert plan is not None and plan.trainers == tuple(sorted([a, b, c])) and plan.samples == 3 * SAMPLES
    # the sync that follows starts past every try of the agreement, at the same try everywhere
    assert len({t.first_try(EPOCH) for t in trainers}) == 1 and trainers[0].first_try(EPOCH) >= 2


def test_a_decision_is_in_the_trainers_record_once_stored_and_too_many_stages_are_refused_not_raised(trainers, caplog):
    """What a stage member reads (its trainers' records) holds the decision, and the rest of the record as before;
    a decision no record can hold is left out with a warning, and the step applies anyway."""
    first, second, _ = trainers
    rounds = ["ab" * 32, "cd" * 32]
    assert first.decide(EPOCH, rounds, 0.25)
    record = second.group.members()[first.trainer_id]
    assert (record.epoch, record.samples, record.decided, record.clip_scale) == (
        EPOCH, SAMPLES, ("abababababababab", "cdcdcdcdcdcdcdcd"), 0.25
    )  # fmt: skip
    assert not first.decide(EPOCH + 1, [f"{i:016x}" + "0" * 48 for i in range(300)], 0.5)
    assert "could not store this trainer's decision" in caplog.text
    assert first.progress.decided == ("abababababababab", "cdcdcdcdcdcdcdcd")  # the last one stored stands


def test_a_late_trainer_reads_when_the_others_overlapped_sync_lands(trainers):
    """With --sync-overlap 1, a trainer whose co-trainers took the sync of update EPOCH-1 (their records say so,
    beside every later record of theirs) joins past update EPOCH, after which the sync lands: before, they serve no
    state, and waiting for it at EPOCH would hold them all. Without an overlap, nothing lands later."""
    first, _, third = trainers
    first._sync = {"sync_update": EPOCH - 1, "sync_round": 0, "sync_digest": "a" * 64}
    first.publish(TrainingProgress(epoch=EPOCH, samples=SAMPLES))
    assert first.progress.sync_update == EPOCH - 1  # kept in the update's own records
    deadline = time.monotonic() + 10
    while third.last_landing(1) != EPOCH and time.monotonic() < deadline:
        time.sleep(0.1)
    assert third.last_landing(1) == EPOCH and third.last_landing(2) == EPOCH + 1
    assert third.last_landing(0) == -1 and first.last_landing(1) == -1  # its own sync is not the others'
