"""The monitor's watcher without a network: what a ping finds, and a failed refresh keeping the last document."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from client.monitor import watcher as watcher_module
from client.monitor.config import MonitorConfig
from client.monitor.watcher import Watcher
from protocol import swarmlm_pb2 as pb
from protocol.errors import DHTUnavailableError, PeerUnavailableError
from protocol.records import ModelRecord, ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot
from swarm.net.tunnel import tunnel_address

PEER = "12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"


def info(**changes) -> ServerInfo:
    fields = dict(
        state=ServerState.ONLINE,
        start_block=0,
        end_block=2,
        throughput=100.0,
        cache_tokens_left=64,
        dtype="float32",
        version="1",
        endpoint="127.0.0.1:5000",
    )
    return ServerInfo(**(fields | changes))


@dataclass(frozen=True)
class Signed(SwarmSnapshot):
    """A snapshot whose signature check accepts exactly the proof b"good"."""

    def verify(self, peer_id: str, data: bytes, signature: bytes) -> bool:
        return signature == b"good"


class FakePool:
    """Answers Info calls per address: a proof, or an error; records the addresses called and dropped."""

    def __init__(self, answers: dict[str, bytes | Exception]):
        self.answers, self.called, self.dropped = answers, [], []

    async def unary(self, address, method, request, timeout_s):
        assert method == "info" and isinstance(request, pb.InfoRequest) and len(request.nonce) == 16
        self.called.append(address)
        answer = self.answers[address]
        if isinstance(answer, Exception):
            raise answer
        return pb.InfoResponse(identity_proof=answer)

    async def drop(self, address):
        self.dropped.append(address)

    async def close(self):
        pass


def ping(answers) -> tuple:
    watcher = Watcher(dht=None, config=MonitorConfig())
    watcher.pool = FakePool(answers)
    snapshot = Signed(num_blocks=2, servers={PEER: info()})
    return asyncio.run(watcher.ping(PEER, info(), snapshot)), watcher.pool


def test_a_ping_counts_only_an_answer_that_proves_the_key_and_tries_the_next_address():
    direct, tunnel = "127.0.0.1:5000", tunnel_address(PEER)
    result, pool = ping({direct: b"good", tunnel: b"good"})
    assert result.outcome == "answered" and result.rtt_s > 0 and pool.called == [direct]
    result, pool = ping({direct: PeerUnavailableError("refused"), tunnel: b"good"})
    assert result.outcome == "answered" and pool.called == [direct, tunnel] and pool.dropped == [direct]
    result, pool = ping({direct: b"forged", tunnel: PeerUnavailableError("no route")})
    assert (result.outcome, result.rtt_s) == ("wrong key", None)
    result, pool = ping({direct: PeerUnavailableError("refused"), tunnel: PeerUnavailableError("no route")})
    assert (result.outcome, result.rtt_s) == ("no answer", None) and pool.dropped == [direct, tunnel]


def test_a_failed_refresh_keeps_the_last_document_and_says_why(monkeypatch):
    models = {"m": ModelRecord(num_blocks=2, repository="r")}
    reads = [
        (models, {"m": Signed(num_blocks=2, servers={PEER: info()})}),
        DHTUnavailableError("DHT gone"),
        RuntimeError("surprise"),
    ]

    def read_state(dht):
        result = reads.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(watcher_module, "read_state", read_state)
    watcher = Watcher(dht=None, config=MonitorConfig())
    watcher.pool = FakePool({"127.0.0.1:5000": b"good"})

    async def three_refreshes():
        states = []
        for _ in range(3):
            await watcher.refresh()
            states.append(watcher.state)
        return states

    good, gone, surprise = asyncio.run(three_refreshes())
    assert good["error"] is None and good["models"][0]["answering"] == [1, 1]
    assert gone["error"] == "DHT gone" and gone["models"] == good["models"] and gone["taken_at"] == good["taken_at"]
    assert surprise["error"] == "RuntimeError: surprise" and surprise["models"] == good["models"]
    assert watcher.refreshes == 3
