"""swarm.dht.node against a real hivemind DHT process: a start or a call into a node that stalls or dies fails in
bounded time."""

from __future__ import annotations

import asyncio
import socket
import time

import hivemind
import pytest

from protocol.errors import DHTUnavailableError
from swarm.dht.node import _start_forked, dht_result, start_dht, stop_dht
from swarm.trust.identity import fresh_identity


async def _stall(dht, node, seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


@pytest.fixture
def dht():
    node = start_dht()
    yield node
    stop_dht(node)


def test_a_call_that_answers_returns_its_result(dht):
    assert dht_result(dht, dht.run_coroutine(_Stall(0.1), return_future=True), "a short call") == "done"


def test_a_call_that_stalls_fails_after_its_timeout(dht):
    began = time.monotonic()
    with pytest.raises(DHTUnavailableError, match="did not answer within 1s"):
        dht_result(dht, dht.run_coroutine(_Stall(30), return_future=True), "a stalled call", timeout_s=1)
    assert time.monotonic() - began < 10


def test_a_call_whose_node_died_fails_at_once(dht):
    future = dht.run_coroutine(_Stall(600), return_future=True)
    dht.kill()  # as a crash would: hivemind's own wait for it never ends
    dht.join(10)
    began = time.monotonic()
    with pytest.raises(DHTUnavailableError, match="has stopped"):
        dht_result(dht, future, "a call to a dead node")
    assert time.monotonic() - began < 5


class _Stall:
    """A picklable coroutine function for run_coroutine (it runs in the DHT's process)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    async def __call__(self, dht, node) -> str:
        return await _stall(dht, node, self.seconds)


def test_a_node_whose_start_stalls_is_given_up_in_bounded_time():
    """A bootstrap peer that accepts connections and never speaks: the start is tried twice, each for its timeout,
    then fails with a typed error, where hivemind's own wait for readiness never ends."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]

        def make() -> hivemind.DHT:
            maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{fresh_identity().peer_id}"
            return hivemind.DHT(initial_peers=[maddr], start=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

        began = time.monotonic()
        with pytest.raises(DHTUnavailableError, match="did not start within 1s, twice"):
            _start_forked(make, 1)
        assert time.monotonic() - began < 20
