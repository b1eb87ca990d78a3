"""Block records against forgery, pinning and poisoning, on real hivemind DHT processes on 127.0.0.1.

An honest peer announces; a stranger started like every swarmlm node (our validators, its own key) and an
attacker started as a bare hivemind DHT (no validators: it stores and offers whatever it likes) try to write in
its name, to pin records far into the future, to erase a block's records with a plain value and to store values
that do not parse or are huge. A reader started like a client must see the honest peer's latest record, and nothing
forged.
"""

from __future__ import annotations

import logging
import math

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from protocol.records import (
    MAX_JOINING_S,
    MAX_RECORD_TTL_S,
    MODEL_INDEX_KEY,
    ModelRecord,
    ServerInfo,
    ServerState,
    block_key,
)
from swarm.dht.directory import announce, fetch_models, fetch_snapshot
from swarm.dht.node import dht_result, start_dht, start_plain_dht, stop_dht, visible_maddrs
from swarm.placement import choose_span
from tests.helpers.dht_store import Padding, store_in_node

NUM_BLOCKS = 4
HONEST_STORES = ("boot", "honest", "stranger")  # nodes with our validators that store records (not the reader)


@pytest.fixture(scope="module")
def nodes():
    started = []
    try:
        boot = start_dht()
        started.append(boot)
        maddrs = visible_maddrs(boot)
        for _name, start in [
            ("honest", lambda: start_dht(maddrs)),
            ("stranger", lambda: start_dht(maddrs)),
            ("attacker", lambda: start_plain_dht(maddrs)),
            ("reader", lambda: start_dht(maddrs, client_mode=True)),
        ]:
            started.append(start())
        yield dict(zip(["boot", "honest", "stranger", "attacker", "reader"], started))
    finally:
        for node in reversed(started):
            stop_dht(node)


def info(start: int = 0, end: int = NUM_BLOCKS, **changes) -> ServerInfo:
    fields = dict(
        state=ServerState.ONLINE,
        start_block=start,
        end_block=end,
        throughput=100.0,
        cache_tokens_left=1024,
        dtype="float32",
        version="1",
        endpoint="127.0.0.1:5000",
        joined_at=get_dht_time(),
    )
    return ServerInfo(**(fields | changes))


def announce_honestly(nodes, prefix: str, record: ServerInfo, expiration_s: float = 60.0) -> list[str]:
    return announce(
        nodes["honest"], prefix, record, ModelRecord(num_blocks=NUM_BLOCKS, repository="r"), expiration_s=expiration_s
    )


class _LocalEntries:
    """subkey -> (stored bytes, expiration) that a node keeps under `key` in its own storage."""

    def __init__(self, key):
        self.key = key

    async def __call__(self, dht, node) -> dict:
        item = node.protocol.storage.get(DHTID.generate(source=self.key))
        return {} if item is None else {subkey: tuple(entry) for subkey, entry in item.value.items()}


def store(node, key, subkey, value, expiration_s: float = 60.0) -> bool:
    """Whether some node took it (the attacker takes anything: see `refused` for the honest nodes)."""
    return store_in_node(node, key, subkey, value, expiration_s)


def local_entries(node, key) -> dict:
    return dht_result(node, node.run_coroutine(_LocalEntries(key), return_future=True), "reading local storage")


def honest_storage(nodes, key) -> list[dict]:
    return [local_entries(nodes[name], key) for name in HONEST_STORES]


def refused(nodes, node, key, subkey, value, expiration_s: float = 60.0) -> bool:
    """Store from `node`; whether no honest node (the stranger included) holds it then."""
    store(node, key, subkey, value, expiration_s)
    return all(subkey not in entries for entries in honest_storage(nodes, key))


def honest_view(nodes, prefix: str):
    snapshot = fetch_snapshot(nodes["reader"], prefix, NUM_BLOCKS)
    return snapshot, snapshot.servers.get(nodes["honest"].identity.peer_id)


def test_an_announcement_is_read_under_the_peers_id_with_its_key(nodes):
    honest = nodes["honest"]
    assert announce_honestly(nodes, "clean", info(throughput=123.0)) == []
    snapshot, seen = honest_view(nodes, "clean")
    assert list(snapshot.servers) == [honest.peer_id.to_base58()]  # the libp2p peer id clients dial
    assert seen.throughput == 123.0
    assert snapshot.verify(honest.peer_id.to_base58(), b"nonce", honest.identity.private_key.sign(b"nonce"))
    assert not snapshot.verify(
        honest.peer_id.to_base58(), b"nonce", nodes["stranger"].identity.private_key.sign(b"nonce")
    )


def test_a_stranger_cannot_write_in_an_honest_peers_name(nodes):
    honest, stranger = nodes["honest"], nodes["stranger"]
    announce_honestly(nodes, "name", info(throughput=100.0))
    key = block_key("name", 0)
    forged = info(throughput=9e6).to_wire()
    # (a) under the honest peer's owned subkey: it cannot sign for that key, so no honest node takes it
    before = honest_storage(nodes, key)
    assert all(honest.identity.record_subkey() in entries for entries in before)
    store(stranger, key, honest.identity.record_subkey(), forged, expiration_s=120)  # outliving the honest one
    assert honest_storage(nodes, key) == before
    # (b) under the honest peer id alone: anyone may write such a subkey, so readers ignore it
    store(stranger, key, honest.identity.peer_id, forged)
    # ... or under the honest peer id with the stranger's own key: the peer id is not that key's
    assert refused(
        nodes, stranger, key, f"{honest.identity.peer_id}[owner:{stranger.identity.public_key.decode()}]", forged
    )
    snapshot, seen = honest_view(nodes, "name")
    assert seen.throughput == 100.0
    assert list(snapshot.servers) == [honest.identity.peer_id]


def test_far_future_and_malformed_records_are_refused(nodes):
    stranger = nodes["stranger"]
    key, mine = block_key("limits", 1), stranger.identity.record_subkey()
    # (c) its own record, pinned far ahead: refused by every node, its own included
    assert refused(nodes, stranger, key, mine, info().to_wire(), expiration_s=10 * MAX_RECORD_TTL_S)
    # (d) values that are not a ServerInfo, or not a sane one
    for value in [
        b"junk",
        {"state": 2},
        info().to_wire() | {"throughput": math.inf},
        info().to_wire() | {"dtype": "int4"},
        info().to_wire() | {"next_pings": {"x": 1.0}},
    ]:
        assert refused(nodes, stranger, key, mine, value)
    assert fetch_snapshot(nodes["reader"], "limits", NUM_BLOCKS).servers == {}
    # the model index: an entry under its writer's signed subkey, well-formed
    entry = {"prefix": "limits", "num_blocks": NUM_BLOCKS, "repository": "r"}
    assert refused(nodes, stranger, MODEL_INDEX_KEY, mine, entry | {"num_blocks": -1})
    assert refused(nodes, stranger, MODEL_INDEX_KEY, mine, entry | {"prefix": "no/such prefix"})
    assert refused(nodes, stranger, MODEL_INDEX_KEY, mine, entry, expiration_s=10 * MAX_RECORD_TTL_S)
    assert refused(nodes, stranger, MODEL_INDEX_KEY, "limits", entry)  # unsigned, as the index once was
    # control: the same node can write its own well-formed records with an honest lifetime
    assert not refused(nodes, stranger, key, mine, info(1, 2).to_wire())
    assert not refused(nodes, stranger, MODEL_INDEX_KEY, mine, entry)
    assert list(fetch_snapshot(nodes["reader"], "limits", NUM_BLOCKS).servers) == [stranger.identity.peer_id]
    assert fetch_models(nodes["reader"])["limits"].num_blocks == NUM_BLOCKS


def test_the_model_index_says_what_most_of_its_writers_say(nodes):
    entry = {"prefix": "index", "num_blocks": NUM_BLOCKS, "repository": "honest/repo"}
    for name in ("boot", "honest"):
        store(nodes[name], MODEL_INDEX_KEY, nodes[name].identity.record_subkey(), entry)
    lie = entry | {"num_blocks": 2, "repository": "liar/repo"}
    liar = nodes["stranger"].identity.record_subkey()
    store(nodes["stranger"], MODEL_INDEX_KEY, liar, lie, 120)
    # (hivemind's store answers for its last replica only: what the honest nodes hold is what counts)
    assert any(b"liar/repo" in entries[liar][0] for entries in honest_storage(nodes, MODEL_INDEX_KEY))
    assert fetch_models(nodes["reader"])["index"] == ModelRecord(num_blocks=NUM_BLOCKS, repository="honest/repo")


def test_a_span_outside_the_model_or_a_record_under_a_block_it_does_not_claim_is_skipped(nodes):
    stranger = nodes["stranger"]
    mine = stranger.identity.record_subkey()
    assert store(stranger, block_key("spans", 3), mine, info(2, NUM_BLOCKS + 4).to_wire())  # past the model's end
    assert fetch_snapshot(nodes["reader"], "spans", NUM_BLOCKS).servers == {}
    assert store(stranger, block_key("spans", 3), mine, info(0, 2).to_wire())  # claims 0:2, stored under 3
    assert fetch_snapshot(nodes["reader"], "spans", NUM_BLOCKS).servers == {}
    assert store(stranger, block_key("spans", 1), mine, info(0, 2).to_wire())  # control: under a block it claims
    assert fetch_snapshot(nodes["reader"], "spans", NUM_BLOCKS).servers[stranger.identity.peer_id].end_block == 2


def test_a_bare_hivemind_attacker_can_neither_forge_nor_pin(nodes):
    honest, attacker = nodes["honest"], nodes["attacker"]
    announce_honestly(nodes, "pin", info(throughput=100.0))
    key = block_key("pin", 0)
    pinned = info(state=ServerState.OFFLINE, throughput=9e6).to_wire()
    # it writes into its own storage whatever it likes and offers it to readers; honest nodes refuse all of it
    store(attacker, key, honest.identity.record_subkey(), pinned, expiration_s=1e6)
    store(attacker, key, honest.identity.peer_id, pinned, expiration_s=1e6)
    store(attacker, key, "junk", b"junk", expiration_s=1e6)
    held = local_entries(attacker, key)
    assert held[honest.identity.record_subkey()][1] > get_dht_time() + 1e5 and "junk" in held
    for entries in honest_storage(nodes, key):
        assert list(entries) == [honest.identity.record_subkey()]
        assert entries[honest.identity.record_subkey()][1] < get_dht_time() + 60
    snapshot, seen = honest_view(nodes, "pin")
    assert list(snapshot.servers) == [honest.identity.peer_id]
    assert seen.state == ServerState.ONLINE and seen.throughput == 100.0
    # a later honest announcement is seen: nothing pinned hides it
    # (the attacker refuses it when it is among the key's replicas, which hivemind may report as not stored:
    # hivemind's result is the last replica's answer)
    announce_honestly(nodes, "pin", info(throughput=200.0))
    assert honest_view(nodes, "pin")[1].throughput == 200.0


def test_a_plain_value_under_every_block_key_erases_nothing(nodes):
    honest, attacker = nodes["honest"], nodes["attacker"]
    announce_honestly(nodes, "erase", info(throughput=100.0))
    # in hivemind's storage a plain value with a later expiry replaces a key's whole dictionary, and then refuses
    # every subkey stored under it: one store per block would hide the peer until 1e7 s from now
    for block in range(NUM_BLOCKS):
        store(attacker, block_key("erase", block), None, b"erased", expiration_s=1e7)
        assert honest.identity.record_subkey() in local_entries(nodes["boot"], block_key("erase", block))
    assert list(honest_view(nodes, "erase")[0].servers) == [honest.identity.peer_id]
    announce_honestly(nodes, "erase", info(throughput=200.0))  # and the next announcement is kept
    assert honest_view(nodes, "erase")[1].throughput == 200.0


def test_junk_and_megabyte_entries_are_refused_everywhere(nodes):
    stranger = nodes["stranger"]
    key, mine = block_key("junk", 0), stranger.identity.record_subkey()
    for subkey, value in [
        ("junk", b"junk"),  # a subkey that names no owner: anyone could write it, and nobody reads it
        (mine, Padding(1 << 20)),  # its own subkey, a megabyte of value
        ((mine, Padding(1 << 20, text=True)), info().to_wire()),  # a megabyte of subkey
    ]:
        assert refused(nodes, stranger, key, subkey, value)
    assert all(entries == {} for entries in honest_storage(nodes, key))


def test_a_joining_record_older_than_the_bound_does_not_hold_blocks(nodes):
    stranger = nodes["stranger"]
    mine = stranger.identity.record_subkey()
    stale = info(0, 2, state=ServerState.JOINING, joined_at=get_dht_time() - MAX_JOINING_S - 60)
    for block in (0, 1):  # re-announced as often as it likes, with the joined_at it signed
        assert store(stranger, block_key("joining", block), mine, stale.to_wire())
    snapshot = fetch_snapshot(nodes["reader"], "joining", NUM_BLOCKS)
    assert stranger.identity.peer_id in snapshot.servers and snapshot.live() == {}
    assert choose_span(snapshot, 2) == (0, 2)  # a newcomer takes the blocks it claims to be loading
    fresh = stale.model_copy(update={"joined_at": get_dht_time()})
    for block in (0, 1):
        assert store(stranger, block_key("joining", block), mine, fresh.to_wire())
    assert choose_span(fetch_snapshot(nodes["reader"], "joining", NUM_BLOCKS), 2) == (2, 4)  # control


def test_an_announcement_the_dht_refuses_is_reported(nodes, caplog):
    assert announce_honestly(nodes, "refused", info(), expiration_s=60) == []
    with caplog.at_level(logging.WARNING, logger="swarm.dht.directory"):
        # an earlier expiration than what the nodes hold for this subkey: hivemind keeps the later one
        failed = announce_honestly(nodes, "refused", info(), expiration_s=5)
    assert failed == [block_key("refused", block) for block in range(NUM_BLOCKS)] + [MODEL_INDEX_KEY]
    assert "the DHT did not store refused.0, refused.1" in caplog.text
