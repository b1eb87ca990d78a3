"""Inference and forward routing, on hand-built snapshots."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from client.routing import RouteHop, dial_candidates, plan_forward_route, plan_inference_route
from protocol.errors import NoPeersError
from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot


def server(
    start: int,
    end: int,
    throughput: float = 100.0,
    *,
    state: ServerState = ServerState.ONLINE,
    cache: int = 4096,
    port: int = 5000,
) -> ServerInfo:
    return ServerInfo(
        state=state,
        start_block=start,
        end_block=end,
        throughput=throughput,
        cache_tokens_left=cache,
        dtype="float32",
        version="1",
        endpoint=f"127.0.0.1:{port}",
    )


def swarm(num_blocks: int, **servers: ServerInfo) -> SwarmSnapshot:
    return SwarmSnapshot(num_blocks=num_blocks, servers=dict(servers))


def spans(route: list[RouteHop]) -> list[tuple[str, int, int]]:
    return [(hop.peer_id, hop.start, hop.end) for hop in route]


def long_and_three_short(long_throughput: float = 100.0, **long_kwargs: object) -> SwarmSnapshot:
    return swarm(
        12,
        long=server(0, 12, long_throughput, port=5000, **long_kwargs),  # type: ignore[arg-type]
        s1=server(0, 4, port=5001),
        s2=server(4, 8, port=5002),
        s3=server(8, 12, port=5003),
    )


THREE_SHORT = [("s1", 0, 4), ("s2", 4, 8), ("s3", 8, 12)]


# plan_inference_route


def test_prefers_one_long_span_over_three_short_ones() -> None:
    route = plan_inference_route(long_and_three_short(), 0, 12)
    assert route == [RouteHop("long", 0, 12, "127.0.0.1:5000")]


def test_prefers_three_fast_spans_over_one_very_slow_one() -> None:
    assert spans(plan_inference_route(long_and_three_short(long_throughput=1.0), 0, 12)) == THREE_SHORT


def test_avoids_a_distant_peer() -> None:
    route = plan_inference_route(long_and_three_short(), 0, 12, client_rtt_s={"long": 0.5})
    assert spans(route) == THREE_SHORT


def test_default_rtt_applies_to_unmeasured_peers() -> None:
    # The shorts are measured close; the long one is unmeasured and assumed far away.
    rtts = {"s1": 0.001, "s2": 0.001, "s3": 0.001}
    assert spans(plan_inference_route(long_and_three_short(), 0, 12, client_rtt_s=rtts)) == [("long", 0, 12)]
    route = plan_inference_route(long_and_three_short(), 0, 12, client_rtt_s=rtts, default_rtt_s=1.0)
    assert spans(route) == THREE_SHORT


def test_avoids_a_peer_without_cache_left() -> None:
    snap = long_and_three_short(cache=10)
    assert spans(plan_inference_route(snap, 0, 12, min_cache_tokens=128)) == THREE_SHORT
    assert spans(plan_inference_route(snap, 0, 12, min_cache_tokens=10)) == [("long", 0, 12)]


def test_avoids_banned_peers() -> None:
    assert spans(plan_inference_route(long_and_three_short(), 0, 12, banned={"long"})) == THREE_SHORT


@pytest.mark.parametrize("state", [ServerState.OFFLINE, ServerState.JOINING])
def test_only_online_servers_are_used(state: ServerState) -> None:
    assert spans(plan_inference_route(long_and_three_short(state=state), 0, 12)) == THREE_SHORT


def test_part_of_a_span() -> None:
    snap = long_and_three_short()
    assert plan_inference_route(snap, 4, 8) == [RouteHop("long", 4, 8, "127.0.0.1:5000")]
    assert spans(plan_inference_route(snap, 5, 6, banned={"long"})) == [("s2", 5, 6)]


def test_overlapping_spans_switch_where_compute_is_cheaper() -> None:
    # a: 1/(8*100) s per block, b: 1/(6*100) s per block, so a is used as far as it goes.
    snap = swarm(12, a=server(0, 8, port=5001), b=server(6, 12, port=5002))
    assert spans(plan_inference_route(snap, 0, 12)) == [("a", 0, 8), ("b", 8, 12)]
    # Now b is faster per block, so the client switches to it as early as it can.
    snap = swarm(12, a=server(0, 8, 10.0, port=5001), b=server(6, 12, 1000.0, port=5002))
    assert spans(plan_inference_route(snap, 0, 12)) == [("a", 0, 6), ("b", 6, 12)]


def test_zero_rtt_does_not_split_a_span() -> None:
    # With no RTT, float rounding makes 0->1->6 on one peer a hair cheaper than 0->6 at this throughput.
    snap = swarm(6, a=server(0, 6, 0.1))
    assert spans(plan_inference_route(snap, 0, 6, default_rtt_s=0.0)) == [("a", 0, 6)]


def test_zero_throughput_peer_is_a_last_resort() -> None:
    snap = swarm(4, a=server(0, 4, 0.0), b=server(0, 2), c=server(2, 4))
    assert spans(plan_inference_route(snap, 0, 4)) == [("b", 0, 2), ("c", 2, 4)]
    assert spans(plan_inference_route(snap, 0, 4, banned={"c"})) == [("b", 0, 2), ("a", 2, 4)]


def test_route_does_not_depend_on_record_order() -> None:
    forward = swarm(4, a=server(0, 4, port=5001), b=server(0, 4, port=5002))
    backward = swarm(4, b=server(0, 4, port=5002), a=server(0, 4, port=5001))
    assert plan_inference_route(forward, 0, 4) == plan_inference_route(backward, 0, 4)


def test_missing_blocks_raise_with_range_and_command() -> None:
    snap = swarm(24, a=server(0, 12), b=server(16, 24))
    with pytest.raises(NoPeersError) as info:
        plan_inference_route(snap, 0, 24, model_name="llama-tiny")
    message = str(info.value)
    assert "no peer serves blocks 12-15 of model llama-tiny" in message
    assert "swarmlm peer llama-tiny --blocks 12:16" in message


def test_first_of_several_gaps_is_named() -> None:
    snap = swarm(10, a=server(1, 3), b=server(5, 10))
    with pytest.raises(NoPeersError, match=r"no peer serves block 0 of model MODEL.*--blocks 0:1"):
        plan_inference_route(snap, 0, 10)
    with pytest.raises(NoPeersError, match=r"blocks 3-4 .*--blocks 3:5"):
        plan_inference_route(snap, 1, 10)


def test_no_peers_error_says_why_existing_peers_were_skipped() -> None:
    snap = swarm(
        4,
        a=server(0, 2),
        b=server(2, 4, state=ServerState.JOINING),
        c=server(2, 4),
        d=server(2, 4, cache=5),
    )
    with pytest.raises(NoPeersError) as info:
        plan_inference_route(snap, 0, 4, banned={"c"}, min_cache_tokens=64)
    message = str(info.value)
    assert "blocks 2-3" in message
    assert "b (JOINING)" in message
    assert "c (banned)" in message
    assert "d (cache 5 < 64 tokens)" in message
    assert "a (" not in message


def test_empty_swarm_raises_no_peers() -> None:
    with pytest.raises(NoPeersError, match="blocks 0-7"):
        plan_inference_route(swarm(8), 0, 8)


@pytest.mark.parametrize(("start", "end"), [(-1, 4), (3, 3), (4, 2), (0, 13)])
def test_bad_range_is_rejected(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="block range"):
        plan_inference_route(long_and_three_short(), start, end)
    with pytest.raises(ValueError, match="block range"):
        plan_forward_route(long_and_three_short(), start, end)


def test_negative_rtt_is_rejected() -> None:
    with pytest.raises(ValueError, match="RTT"):
        plan_inference_route(long_and_three_short(), 0, 12, client_rtt_s={"s1": -0.1})


# plan_forward_route


def test_forward_takes_each_server_as_far_as_it_goes() -> None:
    snap = swarm(8, a=server(0, 4, port=5001), b=server(4, 8, port=5002))
    route = plan_forward_route(snap, 0, 8, rng=random.Random(0))
    assert route == [RouteHop("a", 0, 4, "127.0.0.1:5001"), RouteHop("b", 4, 8, "127.0.0.1:5002")]
    assert spans(plan_forward_route(snap, 1, 6, rng=random.Random(0))) == [("a", 1, 4), ("b", 4, 6)]


def test_forward_load_is_proportional_to_throughput() -> None:
    snap = swarm(4, a=server(0, 4, 300.0), b=server(0, 4, 100.0), c=server(0, 4, 0.0))
    rng = random.Random(1234)
    counts = Counter(plan_forward_route(snap, 0, 4, rng=rng)[0].peer_id for _ in range(4000))
    # Expected 3000 / 1000 / 0; the std of a's count is ~27, so these bounds are > 7 sigma wide.
    assert 2800 <= counts["a"] <= 3200
    assert 800 <= counts["b"] <= 1200
    assert counts["c"] == 0


def test_a_checks_route_is_drawn_uniformly_whatever_throughput_is_announced() -> None:
    """A liar announcing a huge figure would otherwise be drawn to check itself, or its accomplice (client/verify.py)."""
    snap = swarm(4, liar=server(0, 4, 1e7), a=server(0, 4, 1.0), b=server(0, 4, 0.0))
    rng = random.Random(99)
    counts = Counter(plan_forward_route(snap, 0, 4, rng=rng, uniform=True)[0].peer_id for _ in range(3000))
    # Expected 1000 each; the std of a count is ~26, so these bounds are > 7 sigma wide.
    assert all(800 <= counts[peer] <= 1200 for peer in ("liar", "a", "b")), counts


def test_forward_spreads_over_overlapping_chains() -> None:
    # Either the long server alone, or the two short ones; equal throughput -> about half each.
    snap = swarm(8, long=server(0, 8), s1=server(0, 4), s2=server(4, 8, 1000.0))
    rng = random.Random(7)
    routes = Counter(tuple(spans(plan_forward_route(snap, 0, 8, rng=rng))) for _ in range(2000))
    assert set(routes) == {
        (("long", 0, 8),),
        (("s1", 0, 4), ("s2", 4, 8)),
        (("s1", 0, 4), ("long", 4, 8)),
    }
    assert 800 <= routes[(("long", 0, 8),)] <= 1200
    # After s1, block 4 is served by long (100) and s2 (1000): s2 about 10 times out of 11.
    after_s1 = routes[(("s1", 0, 4), ("s2", 4, 8))] + routes[(("s1", 0, 4), ("long", 4, 8))]
    assert routes[(("s1", 0, 4), ("s2", 4, 8))] >= 0.8 * after_s1


def test_forward_with_only_zero_throughput_servers_still_routes() -> None:
    snap = swarm(4, a=server(0, 4, 0.0), b=server(0, 4, 0.0))
    rng = random.Random(3)
    seen = {plan_forward_route(snap, 0, 4, rng=rng)[0].peer_id for _ in range(200)}
    assert seen == {"a", "b"}


@pytest.mark.parametrize("state", [ServerState.OFFLINE, ServerState.JOINING])
def test_forward_uses_only_online_servers(state: ServerState) -> None:
    snap = swarm(4, a=server(0, 4, 1e6, state=state), b=server(0, 4, 1.0))
    rng = random.Random(0)
    assert {plan_forward_route(snap, 0, 4, rng=rng)[0].peer_id for _ in range(100)} == {"b"}


def test_forward_avoids_banned_peers() -> None:
    snap = swarm(4, a=server(0, 4, 1e6), b=server(0, 4, 1.0))
    rng = random.Random(0)
    assert {plan_forward_route(snap, 0, 4, banned=["a"], rng=rng)[0].peer_id for _ in range(100)} == {"b"}


def test_forward_is_reproducible_with_a_seed() -> None:
    snap = swarm(8, a=server(0, 8), b=server(0, 4), c=server(4, 8))
    first = [plan_forward_route(snap, 0, 8, rng=random.Random(42)) for _ in range(3)]
    assert first[0] == first[1] == first[2]


def test_forward_missing_blocks_raise_with_range_and_command() -> None:
    snap = swarm(24, a=server(0, 12), b=server(16, 24), c=server(12, 16, state=ServerState.OFFLINE))
    with pytest.raises(NoPeersError) as info:
        plan_forward_route(snap, 0, 24, model_name="X")
    message = str(info.value)
    assert "no peer serves blocks 12-15 of model X" in message
    assert "c (OFFLINE)" in message
    assert "swarmlm peer X --blocks 12:16" in message
    with pytest.raises(NoPeersError, match=r"blocks 0-15 .*a \(banned\).*--blocks 0:16"):
        plan_forward_route(snap, 0, 24, banned={"a"})


# --- how each peer is reached ---

PEER, RELAY_A, RELAY_B = (
    "12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG",
    "12D3KooWT241nwFhv13PBe9xCSj7sSKjYiy6BSPNBWa2UJFijRdw",
    "12D3KooWQdEtvjX6SGNMXWFXTEFBjRD4Ru13eUg3efSEcALscQkZ",
)


def test_a_direct_peer_is_tried_on_its_endpoint_then_over_libp2p() -> None:
    assert dial_candidates(PEER, server(0, 1, port=6001)) == ["127.0.0.1:6001", f"p2p:{PEER}"]


def test_a_peer_behind_nat_is_tried_through_each_of_its_relays_in_order() -> None:
    info = server(0, 1).model_copy(update={"transport": "p2p", "relays": (RELAY_A, RELAY_B)})
    assert dial_candidates(PEER, info) == [f"p2p:{PEER}@{RELAY_A}", f"p2p:{PEER}@{RELAY_B}"]


def test_a_libp2p_peer_without_relays_is_dialed_by_its_id() -> None:
    info = server(0, 1).model_copy(update={"transport": "p2p"})
    assert dial_candidates(PEER, info) == [f"p2p:{PEER}"]
