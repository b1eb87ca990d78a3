"""What a peer's placement counts (peer/placement_view.py): records proven by their endpoints, JOINING ones for a
bounded time from first sight. Real keys sign the pings' nonces; the endpoints are scripted (the real Info call is
exercised by tests/integration/test_placement.py, whose peers place themselves through this view)."""

from __future__ import annotations

import asyncio

from peer.placement_view import VERIFIED_S, PlacementView
from protocol.errors import PeerUnavailableError
from protocol.records import MAX_JOINING_S, ServerInfo, ServerState
from protocol.vocab import Transport
from swarm.dht.snapshot import SwarmSnapshot
from swarm.net.tunnel import tunnel_address
from swarm.placement import should_move
from swarm.trust.identity import fresh_identity, prove_identity

NUM_BLOCKS = 8


class Endpoints:
    """Servers by endpoint: each signs nonces with an identity, or does not answer (absent)."""

    def __init__(self):
        self.servers = {}
        self.pings: list[str] = []

    async def ping(self, endpoint: str, nonce: bytes, timeout_s: float) -> bytes:
        self.pings.append(endpoint)
        if endpoint not in self.servers:
            raise PeerUnavailableError(f"nothing answers at {endpoint}")
        return prove_identity(self.servers[endpoint], nonce)


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(start, end, throughput, endpoint, state=ServerState.ONLINE, joined_at=0.0, transport=Transport.DIRECT):
    return ServerInfo(
        state=state,
        start_block=start,
        end_block=end,
        throughput=throughput,
        cache_tokens_left=4096,
        dtype="float32",
        version="1",
        endpoint=endpoint,
        joined_at=joined_at,
        transport=transport,
    )


def snapshot(identities, records, taken_at) -> SwarmSnapshot:
    return SwarmSnapshot(
        num_blocks=NUM_BLOCKS,
        servers={identities[name].peer_id: info for name, info in records.items()},
        public_keys={identity.peer_id: identity.public_key for identity in identities.values()},
        taken_at=taken_at,
    )


def test_only_records_whose_endpoint_proves_them_count_and_a_dead_fast_record_no_longer_holds_a_peer_back():
    ids = {name: fresh_identity() for name in ("me", "first", "dead", "impostor", "victim", "relayed", "ghost")}
    endpoints, clock = Endpoints(), Clock()
    endpoints.servers = {
        "first:1": ids["first"],
        "impostor:1": ids["victim"],
        "victim:1": ids["victim"],
        tunnel_address(ids["relayed"].peer_id): ids["relayed"],
    }
    records = {
        "me": record(0, 4, 10.0, "me:1"),
        "first": record(0, 4, 10.0, "first:1"),
        # a made-up record of a fast peer for 4:8, where nobody answers: honest peers would leave 4:8 to it
        "dead": record(4, 8, 1e6, "dead:1"),
        # a record pointing at another peer's server: that server signs with its own key, not the record's
        "impostor": record(4, 8, 1e6, "impostor:1"),
        # reached through libp2p: asked through a tunnel like any other (one that nobody answers counts for nothing)
        "relayed": record(0, 2, 1.0, "relayed:1", transport=Transport.P2P),
        "ghost": record(4, 8, 1e6, "ghost:1", transport=Transport.P2P),
    }
    taken = snapshot(ids, records, clock.now)
    me = ids["me"].peer_id
    assert should_move(taken, me) is None  # as the directory says, 4:8 is served a million times over

    view = PlacementView(me, endpoints.ping, clock)
    trusted = asyncio.run(view.trusted(taken))
    assert set(trusted.servers) == {me, ids["first"].peer_id, ids["relayed"].peer_id}
    assert should_move(trusted, me) == (4, 8)  # 4:8 is served by nobody who can show it
    ghost, relayed = tunnel_address(ids["ghost"].peer_id), tunnel_address(ids["relayed"].peer_id)
    assert sorted(endpoints.pings) == sorted(["dead:1", "first:1", ghost, "impostor:1", relayed])  # not its own

    # a verified record is not asked again until VERIFIED_S have passed; the others are asked every time
    endpoints.pings.clear()
    clock.now += VERIFIED_S / 2
    asyncio.run(view.trusted(snapshot(ids, records, clock.now)))
    assert sorted(endpoints.pings) == sorted(["dead:1", ghost, "impostor:1"])
    endpoints.pings.clear()
    del endpoints.servers["first:1"]  # it went away without leaving
    clock.now += VERIFIED_S
    trusted = asyncio.run(view.trusted(snapshot(ids, records, clock.now)))
    assert "first:1" in endpoints.pings and ids["first"].peer_id not in trusted.servers


def test_a_joining_record_counts_for_a_bounded_time_from_first_sight_however_often_it_is_renewed():
    ids = {name: fresh_identity() for name in ("me", "squatter", "honest")}
    endpoints, clock = Endpoints(), Clock()
    endpoints.servers = {"squatter:1": ids["squatter"], "honest:1": ids["honest"]}
    view = PlacementView(ids["me"].peer_id, endpoints.ping, clock)
    first_seen = clock.now

    def decide(squatter_joined_at: float) -> SwarmSnapshot:
        records = {
            "me": record(0, 4, 10.0, "me:1"),
            # JOINING 4:8 for ever: each announcement claims it began a moment ago
            "squatter": record(4, 8, 50.0, "squatter:1", ServerState.JOINING, joined_at=squatter_joined_at),
            "honest": record(0, 4, 10.0, "honest:1", ServerState.JOINING, joined_at=first_seen),
        }
        return asyncio.run(view.trusted(snapshot(ids, records, clock.now)))

    trusted = decide(clock.now)
    assert trusted.live().keys() == {ids[name].peer_id for name in ("me", "squatter", "honest")}
    clock.now += MAX_JOINING_S / 2
    assert ids["squatter"].peer_id in decide(clock.now).live()  # still within its time
    clock.now += MAX_JOINING_S / 2 + 1
    trusted = decide(clock.now - 1)
    # dated at first sight, it no longer counts, and its blocks are uncovered again; the honest joiner, whose
    # joined_at was first sight too, has run out of time alike (it should be ONLINE by now)
    assert trusted.servers[ids["squatter"].peer_id].joined_at == first_seen
    assert ids["squatter"].peer_id not in trusted.live() and ids["honest"].peer_id not in trusted.live()
    assert trusted.uncovered_blocks(online_only=False) == [4, 5, 6, 7]

    # the same peer announcing another span is seen anew there
    records = {"me": record(0, 4, 10.0, "me:1"), "squatter": record(0, 2, 5.0, "squatter:1", ServerState.JOINING)}
    records["squatter"] = records["squatter"].model_copy(update={"joined_at": clock.now})
    trusted = asyncio.run(view.trusted(snapshot(ids, records, clock.now)))
    assert ids["squatter"].peer_id in trusted.live()
