"""swarm/training/agreement.py's decisions on the members' records (the records here are plain values; the rounds and
records on real DHT nodes: tests/peer/training/test_sync_agreement.py and the trainers' tests)."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import TrainingFaultError
from protocol.records import TrainingProgress
from swarm.training import agreement

D1, D2 = "1" * 64, "2" * 64


class Records:
    """The group's records as the other members keep them: each member's outcome of the latest try it ran."""

    def __init__(self, **records: TrainingProgress):
        self.records = dict(records)

    async def read(self):
        return dict(self.records)


async def no_publish(attempt: int, digest: str) -> None:
    pass


def settle(records: Records, try_round, *, members, give_up_s: float, regroup=None):
    return asyncio.run(
        agreement.settle(
            try_round,
            no_publish,
            records.read,
            me="me",
            epoch=3,
            members=members,
            give_up_s=give_up_s,
            what="a round",
            regroup=regroup,
        )
    )


def outcome(attempt: int, digest: str, epoch: int = 3, left: bool = False) -> TrainingProgress:
    return TrainingProgress(epoch=epoch, samples=0, round=attempt, round_digest=digest, left=left)


def agree(records: Records, digest: str, attempt: int = 0, members=("me", "b")):
    return asyncio.run(
        asyncio.wait_for(
            agreement.agree(records.read, me="me", epoch=3, attempt=attempt, members=members, digest=digest), 10
        )
    )


def test_a_try_is_agreed_only_when_every_member_got_the_same():
    assert agree(Records(b=outcome(0, D1)), D1).agreed
    disagreed = agree(Records(b=outcome(0, D2)), D1)
    assert (disagreed.agreed, disagreed.attempt) == (False, 1)
    assert "ended with another average" in disagreed.why
    incomplete_there = agree(Records(b=outcome(0, "x")), D1)
    assert (incomplete_there.agreed, incomplete_there.attempt) == (False, 1)
    assert "incomplete at members" in incomplete_there.why
    # complete there, incomplete here: neither steps
    assert not agree(Records(b=outcome(0, D1)), "x").agreed


def test_a_member_ahead_in_tries_or_past_the_update_decides_the_outcome():
    ahead = agree(Records(b=outcome(4, "")), D1)
    assert (ahead.agreed, ahead.attempt) == (False, 4)
    # it moved on to the next update: it saw every member get the same, this one included unless it failed here
    assert agree(Records(b=outcome(0, "", epoch=4)), D1).agreed
    assert not agree(Records(b=outcome(0, "", epoch=4)), "x").agreed


def test_a_member_whose_record_is_gone_or_says_it_left_is_left_out():
    gone = agree(Records(c=outcome(0, D1)), D1, members=("me", "b", "c"))
    assert (gone.agreed, gone.members, gone.attempt) == (False, ("me", "c"), 1)
    # it left before it ended this try (an outcome it announced before leaving still counts)
    left = agree(Records(b=outcome(0, "", left=True), c=outcome(0, D1)), D1, members=("me", "b", "c"))
    assert left.members == ("me", "c")
    assert agree(Records(b=outcome(0, D1, left=True), c=outcome(0, D1)), D1, members=("me", "b", "c")).agreed


def test_settle_tries_again_until_all_agree_and_gives_up_after_its_time():
    records = Records(b=outcome(0, "x"))
    tries = []

    async def try_round(attempt, members):
        tries.append((attempt, members))
        if attempt == 0:
            return None, "x"
        records.records["b"] = outcome(attempt, D1)  # the other member's try after this one's
        return "average", D1

    settled = settle(records, try_round, members=["b", "me"], give_up_s=30)
    assert (settled.value, settled.attempt, settled.members) == ("average", 1, ("b", "me"))
    assert tries == [(0, ("b", "me")), (1, ("b", "me"))]

    async def always_failing(attempt, members):
        records.records["b"] = outcome(attempt, "x")
        return None, "x"

    with pytest.raises(TrainingFaultError, match="a round: the members could not agree"):
        settle(records, always_failing, members=["b", "me"], give_up_s=0.3)


def test_members_that_chose_other_members_regroup_from_the_records_and_meet():
    """This member met the others before c announced the update, so it chose {me, b}, where b and c chose all
    three: their rounds derive other ids and every try fails, until this one takes the members the records show."""
    records = Records(b=outcome(0, ""), c=outcome(0, ""))
    everyone = ("b", "c", "me")

    async def try_round(attempt, members):
        digest = D1 if members == everyone else "x"
        for other in ("b", "c"):
            records.records[other] = outcome(attempt, digest)
        return (members if digest == D1 else None), digest

    async def regroup():
        return ["me", "b", "c"]

    settled = settle(records, try_round, members=["me", "b"], give_up_s=0.5, regroup=regroup)
    assert (settled.value, settled.members, settled.attempt) == (everyone, everyone, 1)
    with pytest.raises(TrainingFaultError):  # without regrouping, every try fails until it gives up
        settle(records, try_round, members=["me", "b"], give_up_s=0.5)


def test_an_overlapped_sync_is_read_from_its_own_fields_while_members_move_on():
    """An overlapped sync of update 3 goes on while the members take updates 4 and 5: a member at update 5 whose sync
    fields still speak of update 3 has not agreed yet (it is waited for), one whose fields name the next sync did
    agree, and the update's own round fields beside them do not count."""

    def synced(epoch: int, attempt: int, digest: str, sync_update: int = 3) -> TrainingProgress:
        return TrainingProgress(
            epoch=epoch,
            samples=0,
            round=7,
            round_digest=D2,
            sync_update=sync_update,
            sync_round=attempt,
            sync_digest=digest,
        )

    def agree_sync(records: Records, digest: str, timeout_s: float = 10):
        return asyncio.run(
            asyncio.wait_for(
                agreement.agree(
                    records.read,
                    me="me",
                    epoch=3,
                    attempt=0,
                    members=("me", "b"),
                    digest=digest,
                    round_of=agreement.overlapped_sync,
                ),
                timeout_s,
            )
        )

    assert agree_sync(Records(b=synced(5, 0, D1)), D1).agreed
    disagreed = agree_sync(Records(b=synced(5, 0, D2)), D1)
    assert (disagreed.agreed, disagreed.attempt, "another average" in disagreed.why) == (False, 1, True)
    assert agree_sync(Records(b=synced(9, 0, "", sync_update=7)), D1).agreed  # it went on to the next sync
    with pytest.raises(TimeoutError):  # at update 5, its outcome of the sync not yet in: waited for
        agree_sync(Records(b=synced(5, 0, "")), D1, timeout_s=1)
    wire = synced(5, 0, D1).to_wire()
    assert (wire["sync_update"], wire["sync_round"], wire["sync_digest"]) == (3, 0, D1)
    assert "sync_update" not in outcome(0, D1).to_wire()  # records without one read as they did
