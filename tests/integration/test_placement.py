"""Peers that choose their own blocks cover the model, stay put when balanced, and re-cover a dead peer's blocks."""

from __future__ import annotations

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
