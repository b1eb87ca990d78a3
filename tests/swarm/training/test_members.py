"""Signed progress records on real hivemind DHT nodes on 127.0.0.1: a member reads back only what each member signed,
so a stranger can neither announce progress in a member's name nor move what the group decides."""

from __future__ import annotations

import time

import pytest
from hivemind.utils import ValueWithExpiration, get_dht_time

from protocol.records import MAX_RECORD_TTL_S, TrainingProgress
from swarm.dht.node import dht_result, start_dht, stop_dht, visible_maddrs
from swarm.training.members import GroupProgress, OwnerCache, progress_key, verified_progress
from swarm.training.state import majority_claim

GROUP = "test-model.train.run.0-4"
DIGEST, OTHER = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def nodes():
    started = []
    try:
        names = ("first", "second", "reader", "stranger")
        for _ in names:
            started.append(start_dht(visible_maddrs(started[0]) if started else ()))
        yield dict(zip(names, started))
    finally:
        for node in reversed(started):
            stop_dht(node)


def store(node, subkey, value, expiration_s: float = 30.0) -> bool:
    future = node.store(progress_key(GROUP), value, get_dht_time() + expiration_s, subkey=subkey, return_future=True)
    return bool(dht_result(node, future, "store"))


def members_once(reader: GroupProgress, count: int, timeout_s: float = 20.0) -> dict[str, TrainingProgress]:
    """The reader's view once it holds `count` records (stores reach every node within moments)."""
    deadline = time.monotonic() + timeout_s
    while len(found := reader.members()) < count:
        assert time.monotonic() < deadline, f"only {sorted(found)} showed up"
        time.sleep(0.2)
    return found


def test_a_stranger_announcing_a_higher_epoch_changes_no_members_decision(nodes):
    first, second, reader, stranger = (GroupProgress(nodes[n], GROUP, ttl_s=60) for n in nodes)
    honest = TrainingProgress(epoch=3, samples=0, param_digest=DIGEST)
    for member in (first, second):
        dht_result(member.dht, member.publish(honest), "publishing")
    stranger_dht, first_id = nodes["stranger"], first.peer_id
    lie = TrainingProgress(epoch=99, samples=1 << 40, param_digest=OTHER).to_wire()
    # in a member's name: under its plain peer id (no node takes a plain subkey under our keys, and a reader
    # would skip it: test_a_plain_subkey_counts_for_nothing), and under its signed subkey (the stranger cannot
    # sign for that key, so no node takes it)
    assert not store(stranger_dht, first_id, lie)
    assert not store(stranger_dht, nodes["first"].identity.record_subkey(), lie, expiration_s=120)
    # malformed or pinned far ahead, under its own key: refused by the validators
    mine = stranger_dht.identity.record_subkey()
    for value in ({"epoch": -1, "samples": 0}, {"epoch": 1, "samples": 0, "param_digest": "x"}, b"junk"):
        assert not store(stranger_dht, mine, value)
    assert not store(stranger_dht, mine, lie, expiration_s=10 * MAX_RECORD_TTL_S)
    # and openly, under its own key: a record like any member's
    assert store(stranger_dht, mine, lie)

    found = members_once(reader, 3)
    assert found == {
        first_id: honest,
        second.peer_id: honest,
        stranger.peer_id: TrainingProgress.from_wire(lie),
    }
    # what a member decides: the state it would catch up to is still the honest majority's
    assert majority_claim(found) == (3, DIGEST)


def test_a_plain_subkey_counts_for_nothing(nodes):
    """What a reader keeps of a record, should a node have stored a plain subkey anyway: only signed entries."""
    signed = nodes["first"].identity.record_subkey()
    progress = TrainingProgress(epoch=3, samples=0, param_digest=DIGEST).to_wire()
    raw = {
        nodes["second"].peer_id.to_base58(): ValueWithExpiration(progress, get_dht_time() + 30),
        signed: ValueWithExpiration(progress, get_dht_time() + 30),
    }
    assert verified_progress(raw, OwnerCache()) == {
        nodes["first"].peer_id.to_base58(): TrainingProgress(epoch=3, samples=0, param_digest=DIGEST)
    }


def test_a_progress_record_outlives_no_ttl_and_the_ttl_is_bounded(nodes):
    reader = GroupProgress(nodes["reader"], GROUP + "-ttl", ttl_s=60)
    short = GroupProgress(nodes["first"], GROUP + "-ttl", ttl_s=2.0)
    dht_result(short.dht, short.publish(TrainingProgress(epoch=1, samples=2)), "publishing")
    assert short.peer_id in members_once(reader, 1)
    time.sleep(3.0)
    assert reader.members() == {}
    with pytest.raises(ValueError, match="ttl_s"):
        GroupProgress(nodes["first"], GROUP, ttl_s=MAX_RECORD_TTL_S)


def test_a_member_that_leaves_counts_for_nothing_at_once(nodes):
    """A clean stop marks the member's record as left: the next trainer of a run waits for no state it cannot get."""
    reader = GroupProgress(nodes["reader"], GROUP + "-leave", ttl_s=60)
    leaving = GroupProgress(nodes["first"], GROUP + "-leave", ttl_s=60)
    dht_result(leaving.dht, leaving.publish(TrainingProgress(epoch=4, samples=0, param_digest=DIGEST)), "publishing")
    assert majority_claim(members_once(reader, 1)) == (4, DIGEST)

    assert leaving.leave(timeout_s=10)
    # still there, saying where it stood, but it vouches for no state a joiner could copy
    assert reader.members() == {leaving.peer_id: TrainingProgress(epoch=4, samples=0, param_digest=DIGEST, left=True)}
    assert majority_claim(reader.members()) is None
    assert (
        not TrainingProgress(epoch=4, samples=0).left
        and TrainingProgress.from_wire({"epoch": 4, "samples": 0, "left": True}).left
    )
