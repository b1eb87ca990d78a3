"""The client's view of the swarm follows joins and clean departures within its refresh bound.

Bound: a peer that announces ONLINE (or OFFLINE on a clean shutdown) is seen by a client within
`directory_refresh_s` of its announcement; a peer that crashes is dropped at its first failed request.
"""

from __future__ import annotations

import time

import torch

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model

REFRESH_S = 2.0


def test_new_peers_are_used_and_departed_ones_dropped_within_the_bound(swarm, tiny_llama_path):
    prefix = prefix_for_model(str(tiny_llama_path))
    swarm.start_bootstrap()
    slow = swarm.start_peer(tiny_llama_path, "--blocks", "0:4")
    swarm.wait_online(prefix, [(0, 4)])
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=swarm.initial_peers, directory_refresh_s=REFRESH_S)
    try:
        ids = torch.randint(3, 128, (1, 5))
        with torch.no_grad():
            expected = remote(ids).logits
        (slow_id,) = {hop.peer_id for hop in remote.sequence.last_route}

        # a much faster peer joins: forward routing (by throughput) moves to it once the client has seen it
        fast = swarm.start_peer(tiny_llama_path, "--blocks", "0:4", "--throughput", "1000000")
        snapshot = swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == 2 and swarm.snapshot(prefix, 4),
                                  timeout_s=60, what="the second peer to be ONLINE")
        (fast_id,) = set(snapshot.online()) - {slow_id}
        seen_at = time.monotonic()
        used = set()
        while time.monotonic() - seen_at < REFRESH_S + 3 and fast_id not in used:
            with torch.no_grad():
                torch.testing.assert_close(remote(ids).logits, expected, atol=1e-5, rtol=0)
            used = {hop.peer_id for hop in remote.sequence.last_route}
            time.sleep(0.2)
        assert fast_id in used, f"the new peer was not used within {REFRESH_S + 3:.0f}s"

        # it leaves cleanly: OFFLINE is announced, and the client stops routing to it without a failure
        assert swarm.terminate(fast) == 0
        left_at = time.monotonic()
        while time.monotonic() - left_at < REFRESH_S + 1:
            time.sleep(0.2)
        for _ in range(5):
            with torch.no_grad():
                torch.testing.assert_close(remote(ids).logits, expected, atol=1e-5, rtol=0)
            assert {hop.peer_id for hop in remote.sequence.last_route} == {slow_id}
        assert remote.sequence.failovers == 0
        assert slow.alive()
    finally:
        remote.shutdown()
