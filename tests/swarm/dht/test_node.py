"""swarm.dht.node against a real hivemind DHT process: a call into a node that stalls or dies fails in bounded time."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol.errors import DHTUnavailableError
from swarm.dht.node import dht_result, start_dht, stop_dht


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
