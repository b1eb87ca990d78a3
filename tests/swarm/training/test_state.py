"""swarm.training.state: which state a member that fell behind accepts (plain data), and a poisoned donor refused while
the honest one is used (real DHT nodes and averager processes on 127.0.0.1)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from protocol.errors import StateDownloadError
from protocol.records import TrainingProgress
from swarm.dht.node import dht_result, start_dht, stop_dht, visible_maddrs
from swarm.training.members import GroupProgress, progress_key
from swarm.training.rounds import RoundAverager, RoundSettings
from swarm.training.state import (
    applied_by_trainers,
    deciding,
    donor_order,
    load_verified_state,
    majority_claim,
    state_digest,
)

D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64


def progress(epoch: int, digest: str = "") -> TrainingProgress:
    return TrainingProgress(epoch=epoch, samples=0, param_digest=digest)


@pytest.mark.parametrize(
    ("members", "claim"),
    [
        ({}, None),
        ({"a": progress(3, D1)}, (3, D1)),
        ({"a": progress(3, D1), "b": progress(3, D1), "s": progress(99, D2)}, (3, D1)),
        ({"a": progress(3, D1), "s": progress(99, D2)}, None),  # a tie is no majority
        ({"a": progress(3, D1), "b": progress(4, D1), "c": progress(3, D2)}, None),  # epoch and digest both count
        ({"a": progress(3, D1), "j": progress(0), "k": progress(0)}, (3, D1)),  # joiners vouch for nothing
        ({"a": progress(3, D1), "b": progress(3, D1), "c": progress(3, D2), "d": progress(3, D3)}, None),
        ({"a": progress(3, D1), "b": progress(3, D1), "c": progress(3, D1), "d": progress(3, D3)}, (3, D1)),
    ],
)
def test_majority_claim(members, claim):
    assert majority_claim(members) == claim


@pytest.mark.parametrize(
    ("trainers", "applied"),
    [
        ({}, 0),
        ({"t": progress(4)}, 4),
        ({"t": progress(4), "u": progress(3)}, 3),  # one trainer ahead of the other is no majority
        ({"t": progress(4), "u": progress(4), "v": progress(2)}, 4),
        ({"t": progress(4), "s": TrainingProgress(epoch=99, samples=0, left=True)}, 4),  # one that left counts not
    ],
)
def test_the_update_the_trainers_applied_is_what_a_strict_majority_of_them_announce(trainers, applied):
    assert applied_by_trainers(trainers) == applied


def test_members_that_sat_out_one_update_copy_the_one_that_took_part_once_its_trainers_vouch_for_it():
    """Only "a" took update 1; the others agree with each other, so that by the records alone the group is at
    update 1 (or split), and none of them would ever catch up."""
    group = {"a": progress(2, D2), "b": progress(1, D1), "c": progress(1, D1)}
    assert majority_claim({pid: p for pid, p in group.items() if pid != "b"}) is None

    def claim(members, applied, comembers=("a", "b", "c", "d")):
        decided = deciding(members, "b", comembers=comembers, applied=applied)
        assert "b" not in members or "b" in decided  # its own record stays: it tells a whole read
        return majority_claim({pid: p for pid, p in decided.items() if pid != "b"})

    assert claim(group, applied=2) == (2, D2)
    assert claim({**group, "d": progress(1, D1)}, applied=2) == (2, D2)  # outnumbered by those behind
    assert claim(group, applied=0) is None  # no trainer's word: every record counts
    # a stranger took part in no round with "b": it counts for nothing while a member "b" averaged with is up to
    # date, however far ahead it claims to be
    assert claim({**group, "s": progress(2, D3)}, applied=2) == (2, D2)
    assert claim({**group, "s": progress(99, D3), "t": progress(99, D3)}, applied=2) == (2, D2)
    # none of them left up to date: every record counts, as before any update
    assert claim({"s": progress(2, D3), "c": progress(1, D1)}, applied=2) is None
    assert claim({"s": progress(2, D3), "e": progress(2, D3), "c": progress(1, D1)}, applied=2) == (2, D3)


def test_donors_are_those_that_announced_the_claim_starting_after_the_caller():
    members = {"a": progress(3, D1), "c": progress(3, D1), "e": progress(3, D1), "b": progress(3, D2)}
    assert donor_order(members, (3, D1), "b") == ["c", "e", "a"]
    assert donor_order(members, (3, D1), "f") == ["a", "c", "e"]
    assert donor_order(members, (4, D1), "b") == []


def test_state_digest_covers_values_dtypes_and_shapes():
    t = torch.arange(6, dtype=torch.float32)
    assert state_digest([t]) == state_digest([t.clone()])
    for other in ([t + 1], [t.reshape(2, 3)], [t.view(torch.int32)], [t[:3], t[3:]], [t, t]):
        assert state_digest(other) != state_digest([t])


SETTINGS = RoundSettings(sender_timeout_s=4.0)
GROUP = "test-model.train.run.0-2"
PREFIX = "test_state"
HONEST = [torch.full((4, 3), 1.5), torch.arange(5, dtype=torch.float32)]
POISONED = [torch.full((4, 3), 1e6), torch.arange(5, dtype=torch.float32)]


@pytest.fixture
def group():
    """Three members (their DHT node, averager and progress) started on demand; all stopped at the end."""
    dhts, averagers = [], []

    def start(state) -> tuple[RoundAverager, GroupProgress]:
        dhts.append(start_dht(visible_maddrs(dhts[0]) if dhts else ()))
        averager = RoundAverager(
            [torch.zeros(3)], dhts[-1], prefix=PREFIX, settings=SETTINGS, state=state, progress_key=progress_key(GROUP)
        )
        averagers.append(averager)
        return averager, GroupProgress(dhts[-1], GROUP, ttl_s=60)

    yield start
    for averager in averagers:
        averager.shutdown()
    for dht in dhts:
        stop_dht(dht)


class Served:
    """A member's state callable: epoch 7 and whichever tensors the test gives it."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __call__(self) -> tuple[int, list[torch.Tensor]]:
        return 7, self.tensors


def test_a_poisoned_donor_is_refused_and_the_honest_one_used(group, caplog):
    joiner, joiner_progress = group(None)
    donors = [(*group(served), served) for served in (Served(), Served())]
    # the joiner tries donors in peer id order after its own: the first it tries serves the poison
    order = donor_order({a.member_id: progress(7, D1) for a, _, _ in donors}, (7, D1), joiner.member_id)
    donors.sort(key=lambda donor: order.index(donor[0].member_id))
    (poisoner, poisoner_progress, poison), (honest, honest_progress, honesty) = donors
    poison.tensors, honesty.tensors = POISONED, HONEST
    claim = progress(7, state_digest(HONEST))
    for averager, member_progress in ((poisoner, poisoner_progress), (honest, honest_progress)):
        averager.serve_state()
        dht_result(averager.dht, member_progress.publish(claim), "publishing")  # the poisoner lies about its digest
    dht_result(joiner.dht, joiner_progress.publish(progress(0)), "publishing")
    deadline = time.monotonic() + 20
    while len(joiner_progress.members()) < 3:
        assert time.monotonic() < deadline, "the members' progress never showed up"
        time.sleep(0.2)

    like = [torch.zeros(4, 3), torch.zeros(5)]
    with caplog.at_level(logging.WARNING, logger="swarm.training.state"):
        state = load_verified_state(joiner, joiner_progress.members, like=like, timeout_s=20)
    assert state.donor == honest.member_id and state.epoch == 7
    assert all(torch.equal(a, b) for a, b in zip(state.tensors, HONEST))
    assert f"refused the state of {poisoner.member_id}" in caplog.text

    # without an honest donor, nothing is accepted, and the error says whom it tried
    honest.serve_state(False)
    began = time.monotonic()
    with pytest.raises(StateDownloadError, match="donors tried") as error:
        load_verified_state(joiner, joiner_progress.members, like=like, timeout_s=4)
    assert time.monotonic() - began < 4 + 5
    assert poisoner.member_id in str(error.value) and honest.member_id in str(error.value)


def test_a_member_whose_only_donor_died_gives_up_once_the_donor_record_lapses(group):
    """A trainer that fell behind the one other trainer, which then died (SIGKILL: no `left` record): it must not wait
    out the whole load-state timeout for a donor that is gone (its caller then goes on with its own state)."""
    behind, behind_progress = group(None)
    served = Served()
    served.tensors = HONEST
    donor, _ = group(served)
    donor.serve_state()
    lapsing = GroupProgress(donor.dht, GROUP, ttl_s=3)  # the donor's record, left to lapse
    dht_result(donor.dht, lapsing.publish(progress(7, state_digest(HONEST))), "publishing")
    dht_result(behind.dht, behind_progress.publish(progress(6, D1)), "publishing")
    deadline = time.monotonic() + 20
    while len(behind_progress.members()) < 2:
        assert time.monotonic() < deadline, "the members' progress never showed up"
        time.sleep(0.2)
    donor.serve_state(False)  # dead to downloads from now on, its record still fresh for a while

    began = time.monotonic()
    like = [torch.zeros(4, 3), torch.zeros(5)]
    with pytest.raises(StateDownloadError, match=r"no other member of group .* is left") as error:
        load_verified_state(behind, behind_progress.members, like=like, timeout_s=60)
    assert time.monotonic() - began < 20
    assert donor.member_id in str(error.value)  # the donor it tried while the record was fresh
