"""Peers that choose their own blocks cover the model, stay put when balanced, and re-cover a dead peer's blocks."""

from __future__ import annotations

import socket
import time

import pytest

from protocol.records import prefix_for_model
from tests.helpers.models import make_tiny_llama

NUM_LAYERS = 6
REBALANCE_S = 2.0  # --rebalance-period-s: each peer considers moving every 1 to 3 s (randomised)
POLL_S = 0.5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-placement", num_layers=NUM_LAYERS, seed=2)


def _online_spans(swarm, prefix):
    snapshot = swarm.snapshot(prefix, NUM_LAYERS)
    return snapshot, {pid: (i.start_block, i.end_block) for pid, i in snapshot.online().items()}


def _assert_unchanged(swarm, prefix, spans, duration_s):
    """Read the DHT every POLL_S for `duration_s` (the last read after it); each must show exactly `spans` ONLINE."""
    began = time.monotonic()
    while True:
        now = _online_spans(swarm, prefix)[1]
        elapsed = time.monotonic() - began
        assert now == spans, f"after {elapsed:.1f}s the ONLINE spans are {now}, not {spans}"
        if elapsed >= duration_s:
            return
        time.sleep(POLL_S)


def test_peers_cover_the_model_and_recover_a_dead_peers_blocks(swarm, model_path):
    prefix = prefix_for_model(str(model_path))
    swarm.start_bootstrap()
    options = ("--num-blocks", "2", "--rebalance-period-s", str(REBALANCE_S), "--update-period-s", "2")
    peers = []
    served = []
    for expected in [(0, 2), (2, 4), (4, 6), (0, 2)]:  # each newcomer takes the weakest blocks
        peers.append(swarm.start_peer(model_path, *options))
        served.append(expected)
        swarm.wait_for(
            lambda: sorted(_online_spans(swarm, prefix)[1].values()) == sorted(served),
            timeout_s=60,
            what=f"ONLINE spans {served}",
        )
    snapshot, spans = _online_spans(swarm, prefix)
    assert not snapshot.uncovered_blocks()

    # balanced: nobody moves (hysteresis). Every peer checks at least every 1.5 rebalance periods: watch the DHT
    # for three periods, and at every look each peer must still be ONLINE with the same blocks.
    _assert_unchanged(swarm, prefix, spans, duration_s=3 * REBALANCE_S)

    # the only peer of blocks 2:4 dies; one of the two peers of 0:2 moves there
    (lonely,) = [pid for pid, span in spans.items() if span == (2, 4)]
    victim = next(p for p in peers if p.stderr().find(lonely) >= 0)
    swarm.kill(victim)

    # one read for the whole condition: two reads could straddle the mover's announcements (seen in full suite
    # runs: 2:4 served in the first read, the mover's old 0:2 record in the second)
    def recovered() -> bool:
        snapshot, spans = _online_spans(swarm, prefix)
        return (
            not snapshot.uncovered_blocks()
            and lonely not in spans
            and sorted(spans.values()) == [(0, 2), (2, 4), (4, 6)]
        )

    swarm.wait_for(
        recovered,
        timeout_s=60,
        what="blocks 2:4 served again by one of the peers of 0:2",
        watch=[p for p in peers if p is not victim],
    )


def test_a_peer_places_itself_by_records_it_has_proven_not_by_made_up_ones(swarm, model_path):
    """Three strangers announce blocks 3:6 ONLINE at 1e7 tokens/s, signed with their own keys: one at an endpoint
    where nothing listens, one at the honest peer's endpoint, whose server cannot sign for the stranger's key, and one
    reached only through libp2p at its own DHT node, which serves no tunnel. A peer that places itself counts none of
    them (peer/placement_view.py) and takes 3:6, which nobody serves; counting them, it would take 0:3 beside the
    honest peer."""
    from protocol.records import ModelRecord, ServerInfo
    from protocol.vocab import Transport
    from swarm.dht.directory import announce
    from swarm.dht.node import start_dht, stop_dht

    prefix = prefix_for_model(str(model_path))
    swarm.start_bootstrap()
    swarm.start_peer(model_path, "--blocks", "0:3")
    honest = swarm.wait_online(prefix, [(0, 3)]).online()
    ((honest_id, info),) = honest.items()
    with socket.socket() as closed:  # a port that was free a moment ago, where nothing listens
        closed.bind(("127.0.0.1", 0))
        dead_endpoint = f"127.0.0.1:{closed.getsockname()[1]}"
    strangers = [start_dht(swarm.initial_peers) for _ in range(3)]
    try:
        for i, (stranger, endpoint) in enumerate(zip(strangers, [dead_endpoint, info.endpoint, dead_endpoint])):
            # the third is reached only through libp2p: asked at its own DHT node, which serves no tunnel
            transport = Transport.P2P.value if i == 2 else info.to_wire()["transport"]
            fake = ServerInfo.from_wire(
                {
                    **info.to_wire(),
                    "start_block": 3,
                    "end_block": 6,
                    "throughput": 1e7,
                    "endpoint": endpoint,
                    "transport": transport,
                }
            )
            assert not announce(
                stranger, prefix, fake, ModelRecord(num_blocks=NUM_LAYERS, repository="x"), expiration_s=120
            )
        ids = {stranger.peer_id.to_base58() for stranger in strangers}
        swarm.wait_for(lambda: ids <= set(swarm.snapshot(prefix, NUM_LAYERS).online()), 30, "the strangers' records")

        swarm.start_peer(model_path, "--num-blocks", "3")

        def placed():
            spans = _online_spans(swarm, prefix)[1]
            return sorted(span for pid, span in spans.items() if pid not in ids | {honest_id}) or None

        assert swarm.wait_for(placed, timeout_s=60, what="the second peer ONLINE") == [(3, 6)]
    finally:
        for stranger in strangers:
            stop_dht(stranger)
