"""The client's view of the swarm follows joins, clean departures and crashes within their bounds.

Bounds: a peer that announces ONLINE (or OFFLINE on a clean shutdown) is seen by a client within
`directory_refresh_s` of its announcement. A peer that crashes stops being announced: its records expire
`2 * update_period + 5` s after its last announcement (peer/server.py), and a client that has not sent it a
request stops routing to it within `directory_refresh_s` after that, without a failure. (A client that does
send it a request drops it at once: that is a failover, tested in test_failover.py.)

Every wait here polls against a deadline that is one of these bounds plus a little slack for one DHT read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model

T = TypeVar("T")

REFRESH_S = 2.0
SLACK_S = 1.0  # one DHT read and one poll interval, on a loaded machine
POLL_S = 0.2
CRASH_UPDATE_PERIOD_S = 1.0
CRASH_EXPIRY_S = 2 * CRASH_UPDATE_PERIOD_S + 5  # how long a record lives after its last announcement


def poll_until(probe: Callable[[], T], deadline: float, what: str) -> T:
    """Call `probe` every POLL_S until it returns something truthy; fail at `deadline` (time.monotonic()).

    Unlike `Swarm.wait_for`, an exception from `probe` (a wrong result) fails at once instead of being retried.
    """
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within the bound (last result {result!r})")
        time.sleep(POLL_S)


def routable(remote) -> set[str]:
    """The peers the client may route a forward through now (ONLINE in its view of the directory, not banned), read
    on its loop with no request sent. (Which of them a route takes is drawn: routes weigh each by its throughput,
    capped by what the client measured, client/speeds.py.)"""
    sequence = remote.sequence
    snapshot = remote._run(sequence.snapshot())
    return set(snapshot.online()) - sequence.bans.banned(snapshot.expirations)


def used_route(remote, ids, expected) -> set[str]:
    """Run a forward, check its logits, and return the peers it went through."""
    with torch.no_grad():
        torch.testing.assert_close(remote(ids).logits, expected, atol=1e-5, rtol=0)
    return {hop.peer_id for hop in remote.sequence.last_route}


def test_the_client_follows_joins_departures_and_crashes_within_the_bounds(swarm, tiny_llama_path):
    prefix = prefix_for_model(str(tiny_llama_path))
    swarm.start_bootstrap()
    slow = swarm.start_peer(tiny_llama_path, "--blocks", "0:4")
    swarm.wait_online(prefix, [(0, 4)])
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=swarm.initial_peers, directory_refresh_s=REFRESH_S
    )
    try:
        ids = torch.randint(3, 128, (1, 5))
        with torch.no_grad():
            expected = remote(ids).logits
        (slow_id,) = {hop.peer_id for hop in remote.sequence.last_route}

        # a faster peer joins: forward routes start to take it once the client has seen it
        fast = swarm.start_peer(tiny_llama_path, "--blocks", "0:4", "--throughput", "1000000")
        fast_id = wait_for_new_peer(swarm, prefix, known={slow_id})
        poll_until(
            lambda: fast_id in used_route(remote, ids, expected),
            time.monotonic() + REFRESH_S + SLACK_S,
            "the client routes through the new peer",
        )

        # it leaves cleanly: OFFLINE is announced before it exits, and the client stops routing to it without a
        # failure. Its view is read without sending requests: a forward through the stale view could reach the
        # departed peer and fail over, which is what this bound is about.
        assert swarm.terminate(fast) == 0
        poll_until(
            lambda: routable(remote) == {slow_id},
            time.monotonic() + REFRESH_S + SLACK_S,
            "the client's view leaves the departed peer",
        )
        for _ in range(3):
            assert used_route(remote, ids, expected) == {slow_id}
        assert remote.sequence.failovers == 0

        # another fast peer joins, re-announcing every second, and crashes before the client sent it anything:
        # no OFFLINE, its records just expire, and then the client routes around it without a failure
        doomed = swarm.start_peer(
            tiny_llama_path,
            "--blocks",
            "0:4",
            "--throughput",
            "1000000",
            "--update-period-s",
            str(CRASH_UPDATE_PERIOD_S),
        )
        doomed_id = wait_for_new_peer(swarm, prefix, known={slow_id, fast_id})
        poll_until(
            lambda: doomed_id in routable(remote),
            time.monotonic() + REFRESH_S + SLACK_S,
            "the client sees the new peer",
        )
        swarm.kill(doomed)  # SIGKILL to all its processes, as when its machine dies
        killed_at = time.monotonic()
        assert not doomed.wait_gone(10), doomed.logs()
        poll_until(
            lambda: doomed_id not in swarm.snapshot(prefix, 4).online(),
            killed_at + CRASH_EXPIRY_S + SLACK_S,
            "the crashed peer's records expire",
        )
        poll_until(
            lambda: routable(remote) == {slow_id},
            time.monotonic() + REFRESH_S + SLACK_S,
            "the client's view leaves the crashed peer",
        )
        assert used_route(remote, ids, expected) == {slow_id}
        assert remote.sequence.failovers == 0  # it never sent the crashed peer a request
        assert slow.alive()
    finally:
        remote.shutdown()


def wait_for_new_peer(swarm, prefix, known: set[str]) -> str:
    """Wait until a peer other than `known` is ONLINE; its id."""

    def new_peer():
        online = set(swarm.snapshot(prefix, 4).online()) - known
        return next(iter(online), None)

    return swarm.wait_for(new_peer, timeout_s=60, what="the new peer to be ONLINE")
