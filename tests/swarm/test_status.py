"""`swarmlm status` output: one line per peer, training state where a peer trains."""

from __future__ import annotations

from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot
from swarm.status import format_snapshot


def info(start: int, end: int, **changes) -> ServerInfo:
    fields = dict(
        state=ServerState.ONLINE,
        start_block=start,
        end_block=end,
        throughput=100.0,
        cache_tokens_left=64,
        dtype="float32",
        version="1",
        endpoint="127.0.0.1:5000",
    )
    return ServerInfo(**(fields | changes))


def test_status_shows_training_peers_and_gaps():
    snapshot = SwarmSnapshot(
        num_blocks=6, servers={"frozen": info(0, 2), "trainer": info(2, 4, run_id="shakespeare", epoch=12, samples=6)}
    )
    lines = format_snapshot("m", "repo", snapshot).splitlines()
    assert lines[0] == "model m (repo): 6 blocks"
    assert "training" not in lines[1] and "frozen" in lines[1]
    assert lines[2].endswith("training 'shakespeare': update 12, 6 samples")
    assert lines[3] == "  uncovered blocks: 4:6"


RELAY = "12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"


def test_status_shows_how_each_peer_is_reached():
    snapshot = SwarmSnapshot(
        num_blocks=4,
        servers={
            "direct": info(0, 1),
            "relaying": info(1, 2, relay=True),
            "home": info(2, 3, transport="p2p", relays=(RELAY,)),
            "p2p": info(3, 4, transport="p2p"),
        },
    )
    lines = format_snapshot("m", "repo", snapshot).splitlines()
    assert "direct 127.0.0.1:5000" in lines[1] and "relays" not in lines[1]
    assert "direct 127.0.0.1:5000  relays for others" in lines[2]
    assert f"behind NAT, via relay {RELAY[:16]}..." in lines[3] and "127.0.0.1:5000" not in lines[3]
    assert "libp2p only" in lines[4]
