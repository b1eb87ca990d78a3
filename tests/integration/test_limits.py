"""Bounded work on a live peer: hard caps per request, a bounded queue, KV-cache quotas, streams per address, session
lifetime and write timeouts. Each attack runs against a real peer process next to an honest "witness" session that must
stay exact, and the peer must be left with the witness alone.

The witness reaches the peer through libp2p (swarm/net/tunnel.py), so that the peer sees it come from another
address than the attacker's direct gRPC connection: each address has its own cache quota. How a client reopens a
session that reached its lifetime is tested on in-memory peers (tests/client/test_failover.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import torch

from client.transport import ChannelPool, InferenceStream
from peer.blocks import load_span
from protocol import swarmlm_pb2 as pb
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    MessageTooLargeError,
    OverloadedError,
    SequenceTooLongError,
    UnknownSessionError,
)
from protocol.records import prefix_for_model
from protocol.service import PeerStub
from swarm.models.checkpoint import load_config
from swarm.net.tunnel import TunnelPool, tunnel_address
from tests.helpers import requests
from tests.helpers.models import HIDDEN_SIZE, MAX_POSITIONS
from tests.helpers.requests import end_stream, forward_request, open_request
from tests.helpers.requests import hidden as _hidden
from tests.helpers.requests import step_request as _step

NUM_LAYERS = 2
CACHE_TOKENS = 96  # per address at most half: 48
WITNESS_LENGTH = 16
MAX_REQUEST_TOKENS = 320  # > MAX_POSITIONS, so that a too-long sequence meets the positions check first
MAX_ATTENTION_COST = 200 * 200
MAX_QUEUED_TOKENS = 400
SESSION_LIFETIME_S = 6.0
WRITE_TIMEOUT_S = 2.0
MAX_STREAMS = 4  # inference streams one address may hold
OPEN_TIMEOUT_S = 2.0
TIMEOUT_S = 30.0
ATOL = 1e-5


def _witness(stream: InferenceStream, prefix: str, span, lifetime_s: float | None = None) -> requests.Witness:
    return requests.Witness(
        stream, prefix, span, length=WITNESS_LENGTH, timeout_s=TIMEOUT_S, atol=ATOL, lifetime_s=lifetime_s
    )


def _open(prefix: str, session_id: str, max_length: int) -> pb.InferenceRequest:
    return open_request(prefix, NUM_LAYERS, session_id, max_length)


def _forward(prefix: str, batch: int, length: int) -> pb.ForwardRequest:
    return forward_request(prefix, NUM_LAYERS, _hidden(batch, length, HIDDEN_SIZE, seed=length))


async def _end(stream: InferenceStream) -> None:
    await end_stream(stream, TIMEOUT_S)


@pytest.fixture(scope="module")
def peer(tmp_path_factory, tiny_llama_path):
    from tests.helpers.processes import Swarm

    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        process = swarm.start_peer(
            tiny_llama_path,
            "--blocks",
            f"0:{NUM_LAYERS}",
            "--cache-tokens",
            str(CACHE_TOKENS),
            "--alloc-timeout-s",
            "0.5",
            "--max-request-tokens",
            str(MAX_REQUEST_TOKENS),
            "--max-attention-cost",
            str(MAX_ATTENTION_COST),
            "--max-queued-tokens",
            str(MAX_QUEUED_TOKENS),
            "--session-lifetime-s",
            str(SESSION_LIFETIME_S),
            "--write-timeout-s",
            str(WRITE_TIMEOUT_S),
            "--max-streams-per-source",
            str(MAX_STREAMS),
            "--open-timeout-s",
            str(OPEN_TIMEOUT_S),
        )
        prefix = prefix_for_model(str(tiny_llama_path))
        ((peer_id, info),) = swarm.wait_online(prefix, [(0, NUM_LAYERS)]).online().items()
        span = load_span(
            Path(tiny_llama_path),
            load_config(Path(tiny_llama_path)),
            0,
            NUM_LAYERS,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        yield {
            "process": process,
            "prefix": prefix,
            "endpoint": info.endpoint,
            "p2p": tunnel_address(peer_id),
            "dht": swarm.dht,
            "initial_peers": swarm.initial_peers,
            "span": span,
        }


@pytest.fixture
def attack(peer):
    """Run a test coroutine `fn(prefix, pool, endpoint, witness)` next to the witness; then check what is left."""

    def run(fn, timeout_s: float = 120.0, outlives_witness: bool = False):
        async def main():
            pool = ChannelPool(1 << 26)  # the attacker: direct gRPC
            witness_pool = ChannelPool(1 << 26, TunnelPool(peer["dht"].replicate_p2p))
            # an attack that happens to take longer than the lifetime on a slow machine: the witness opens anew
            lifetime_s = None if outlives_witness else SESSION_LIFETIME_S
            stream = InferenceStream(witness_pool, peer["p2p"])
            witness = await _witness(stream, peer["prefix"], peer["span"], lifetime_s).open()
            try:
                await witness.step()
                await fn(peer["prefix"], pool, peer["endpoint"], witness)
                if outlives_witness:  # the witness reached its lifetime too: a new one must be exact
                    with pytest.raises(UnknownSessionError, match="--session-lifetime-s"):
                        await witness.step()
                    await _end(witness.stream)
                    witness = await _witness(
                        InferenceStream(witness_pool, peer["p2p"]), peer["prefix"], peer["span"]
                    ).open()
                await witness.step()
                assert peer["process"].alive(), f"the peer exited with {peer['process'].returncode}"
                deadline = time.monotonic() + 10.0  # streams the test gave up on end on the peer a little later
                while True:
                    info = await pool.unary(peer["endpoint"], "info", pb.InfoRequest(), TIMEOUT_S)
                    state = (info.open_sessions, info.cache_tokens_left)
                    if state == (1, CACHE_TOKENS - WITNESS_LENGTH) or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                assert state == (1, CACHE_TOKENS - WITNESS_LENGTH), f"(sessions, cache left) afterwards: {state}"
            finally:
                await _end(witness.stream)
                await pool.close()
                await witness_pool.close()
                await (await peer["dht"].replicate_p2p()).shutdown()  # the replica's tasks live on this loop

        asyncio.run(asyncio.wait_for(main(), timeout_s))

    return run


def test_requests_over_the_hard_caps_are_refused_before_any_compute(attack):
    async def fn(prefix, pool, endpoint, witness):
        cases = [
            ((1, MAX_POSITIONS + 1), SequenceTooLongError, f"model's {MAX_POSITIONS} positions"),
            ((2, 200), MessageTooLargeError, "--max-request-tokens"),
            ((1, 201), MessageTooLargeError, "--max-attention-cost"),
        ]
        for (batch, length), error, words in cases:
            for method in ("forward", "backward"):
                request = _forward(prefix, batch, length)
                if method == "backward":
                    request = pb.BackwardRequest(
                        span=request.span, hidden_states=request.hidden_states, grad_outputs=request.hidden_states
                    )
                with pytest.raises(error, match=words.replace("-", r"\-")):
                    await pool.unary(endpoint, method, request, TIMEOUT_S)
                await witness.step()
        # within the caps: served
        response = await pool.unary(endpoint, "forward", _forward(prefix, 1, 200), TIMEOUT_S)
        assert list(response.message.hidden_states.shape) == [1, 200, HIDDEN_SIZE]

    attack(fn)


def test_a_full_queue_answers_overloaded_at_once(attack):
    async def fn(prefix, pool, endpoint, witness):
        # waves of 16 requests of 190 tokens at once: the queue takes two (380 <= 400 tokens) and refuses what comes
        # on top. A loaded machine can drain each request before the next one arrives, so a wave may pass whole;
        # one of up to 6 must meet a full queue.
        for _ in range(6):
            calls = [pool.unary(endpoint, "forward", _forward(prefix, 1, 190), TIMEOUT_S) for _ in range(16)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            refused = [r for r in results if isinstance(r, BaseException)]
            if refused:
                break
        assert refused and all(isinstance(r, OverloadedError) for r in refused), results
        assert "--max-queued-tokens" not in str(refused[0]) and "use another peer" in str(refused[0])
        assert len(refused) < len(results)
        await witness.step()
        await pool.unary(endpoint, "forward", _forward(prefix, 1, 190), TIMEOUT_S)  # the queue drained

    attack(fn)


def test_one_client_address_cannot_take_the_whole_cache(attack, peer):
    async def fn(prefix, pool, endpoint, witness):
        streams = [InferenceStream(pool, endpoint) for _ in range(3)]
        try:
            await streams[0].request(_open(prefix, "squat-1", CACHE_TOKENS // 2), TIMEOUT_S)  # its whole quota
            with pytest.raises(CacheFullError, match=f"your address holds {CACHE_TOKENS // 2} of its quota"):
                await streams[1].request(_open(prefix, "squat-2", 8), TIMEOUT_S)
            # the rest stays for others: the witness's address opens a second session in it
            other = InferenceStream(ChannelPool(1 << 26, TunnelPool(peer["dht"].replicate_p2p)), peer["p2p"])
            left = CACHE_TOKENS - CACHE_TOKENS // 2 - WITNESS_LENGTH
            await other.request(_open(prefix, "other", left), TIMEOUT_S)
            await _end(other)
            await other.pool.close()
            await witness.step()
        finally:
            for stream in streams:
                await _end(stream)

    attack(fn)


def test_a_second_libp2p_identity_gets_no_second_quota(attack, peer):
    """A squatter tunnels in through a libp2p identity of its own, next to the witness's: each identity comes from
    a loopback address of its own, but identities are free, so tunneled clients share one quota (the witness
    holds 16 of its 48). A client at another address still gets its own."""
    from swarm.dht.node import start_dht, stop_dht

    squatter = start_dht(peer["initial_peers"], client_mode=True)

    async def fn(prefix, pool, endpoint, witness):
        tunneled = ChannelPool(1 << 26, TunnelPool(squatter.replicate_p2p))
        streams = [InferenceStream(tunneled, peer["p2p"]) for _ in range(2)]
        direct = InferenceStream(pool, endpoint)
        shared = CACHE_TOKENS // 2
        try:
            await streams[0].request(_open(prefix, "squat-1", shared - WITNESS_LENGTH), TIMEOUT_S)
            with pytest.raises(CacheFullError, match=f"tunneled through libp2p hold {shared} of the quota {shared}"):
                await streams[1].request(_open(prefix, "squat-2", 8), TIMEOUT_S)
            await direct.request(_open(prefix, "direct", shared), TIMEOUT_S)  # the rest is for other addresses
            await witness.step()
        finally:
            for stream in [*streams, direct]:
                await _end(stream)
            await tunneled.close()
            await (await squatter.replicate_p2p()).shutdown()

    try:
        attack(fn)
    finally:
        stop_dht(squatter)


def test_silent_streams_of_one_address_are_capped_and_end_at_the_open_timeout(attack):
    """Inference streams that send nothing each hold one of the peer's concurrent calls: one address holds at most
    --max-streams-per-source of them (the rest are refused at once), each ends at --open-timeout-s, and the witness,
    at another address, is served throughout."""

    async def fn(prefix, pool, endpoint, witness):
        channel = grpc.aio.insecure_channel(endpoint)
        try:
            calls = [PeerStub(channel).inference() for _ in range(MAX_STREAMS + 3)]
            began = time.monotonic()
            first = asyncio.gather(*(asyncio.wait_for(call.read(), TIMEOUT_S) for call in calls))
            await asyncio.sleep(0.5)
            await witness.step()  # while the attacker's streams are held
            answers = [getattr(answer, "message", answer).error for answer in await first]
            waited_s = time.monotonic() - began
            codes = sorted(error.code for error in answers)
            assert codes == sorted([OverloadedError.code] * 3 + [BadRequestError.code] * MAX_STREAMS), answers
            assert all("no session opened within" in e.message for e in answers if e.code == BadRequestError.code)
            assert waited_s >= OPEN_TIMEOUT_S - 0.5
            # the held streams are ended: the address may open as many again
            again = [InferenceStream(pool, endpoint) for _ in range(MAX_STREAMS)]
            try:
                for i, stream in enumerate(again):
                    await stream.request(_open(prefix, f"again-{i}", 4), TIMEOUT_S)
            finally:
                for stream in again:
                    await _end(stream)
            await witness.step()
        finally:
            await channel.close(grace=None)

    attack(fn)


def test_a_session_ends_at_its_lifetime_however_busy(attack):
    async def fn(prefix, pool, endpoint, witness):
        stream = InferenceStream(pool, endpoint)
        try:
            await stream.request(_open(prefix, "forever", 8), TIMEOUT_S)
            started, ended = time.monotonic(), None
            # steps back to back, which would keep it open forever without the lifetime (and the answer to the
            # step in flight when it runs out says why)
            while time.monotonic() < started + 3 * SESSION_LIFETIME_S:
                try:
                    await stream.request(_step("forever", _hidden(1, 1, HIDDEN_SIZE), 0), TIMEOUT_S)
                except UnknownSessionError as exc:
                    assert "--session-lifetime-s" in str(exc)
                    ended = time.monotonic() - started
                    break
            assert ended is not None, "the session outlived its lifetime"
            assert ended >= SESSION_LIFETIME_S - 1.0
        finally:
            await _end(stream)

    attack(fn, outlives_witness=True)


def test_a_client_that_stops_reading_loses_its_session(attack, peer):
    async def fn(prefix, pool, endpoint, witness):
        channel = grpc.aio.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", 1 << 26)])
        try:
            call = PeerStub(channel).inference()
            await call.write(_open(prefix, "no-reader", 40))
            # prefill steps of 200 tokens: 50 KiB answers that the client never reads, until flow control stops
            # the peer's writes; the peer must then close the stream and free the cache
            prefill = _step("no-reader", _hidden(1, 40, HIDDEN_SIZE), 0)
            freed = False
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline and not freed:
                try:
                    await asyncio.wait_for(call.write(prefill), 1.0)
                except (asyncio.TimeoutError, asyncio.InvalidStateError, grpc.aio.AioRpcError, grpc.aio.UsageError):
                    pass
                info = await pool.unary(endpoint, "info", pb.InfoRequest(), TIMEOUT_S)
                freed = info.cache_tokens_left == CACHE_TOKENS - WITNESS_LENGTH and info.open_sessions == 1
            assert freed, "the peer kept the session of a client that stopped reading"
            await witness.step()
        finally:
            await channel.close(grace=None)

    attack(fn, timeout_s=180.0)
