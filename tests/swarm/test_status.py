"""`swarmlm status` output: one line per peer, training state where a peer trains."""

from __future__ import annotations

from protocol.records import ServerInfo, ServerState
from swarm.snapshot import SwarmSnapshot
from swarm.status import format_snapshot


def info(start: int, end: int, **changes) -> ServerInfo:
    fields = dict(state=ServerState.ONLINE, start_block=start, end_block=end, throughput=100.0, cache_tokens_left=64,
                  dtype="float32", version="1", endpoint="127.0.0.1:5000")
    return ServerInfo(**(fields | changes))


def test_status_shows_training_peers_and_gaps():
    snapshot = SwarmSnapshot(num_blocks=6, servers={
        "frozen": info(0, 2), "trainer": info(2, 4, run_id="shakespeare", epoch=12, samples=6)})
    lines = format_snapshot("m", "repo", snapshot).splitlines()
    assert lines[0] == "model m (repo): 6 blocks"
    assert "training" not in lines[1] and "frozen" in lines[1]
    assert lines[2].endswith("training 'shakespeare': update 12, 6 samples")
    assert lines[3] == "  uncovered blocks: 4:6"
