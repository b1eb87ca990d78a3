"""The inference stream without gRPC: each kind of work in a session's inbox (the client's requests, steps pushed
by the previous peer, failed pushes of ours) gets its answer on the stream, and one failure never ends it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from peer.admission import WorkLimits
from peer.cache import CacheBudget
from peer.config import ServingLimits
from peer.inference import RECLAIM_IDLE_S, InferenceStreams
from peer.served import ServedSpan
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    OverloadedError,
    SessionExpiredError,
    UnknownSessionError,
)
from protocol.packing import Packer, unpack

HIDDEN = 8
NUM_BLOCKS = 4  # of the model; sessions open blocks 0:2
PREFIX = "test-model"


class _Cache:
    layers: tuple = ()  # nothing to rewind


class DoublingSpan:
    """Stands in for a BlockSpan: the output is twice the input; `fail` makes the next call raise."""

    dtype, start, end = torch.float32, 0, 2
    adapters = None

    def __init__(self):
        self.fail = False
        self.calls = 0

    def new_cache(self) -> _Cache:
        return _Cache()

    def __call__(self, hidden, mask, positions, cache, prefix_length, blocks, between_layers, adapter=None):
        self.calls += 1
        if self.fail:
            self.fail = False
            raise RuntimeError("a bug")
        return hidden * 2


class FailingForwarder:
    async def push(self, hops, out, mask, positions, step) -> None:
        raise ConnectionError("the next peer is down")


class Context:
    """What the stream needs of gRPC's: the client's address, and a place to write its responses."""

    def __init__(self, address: str = "ipv4:127.0.0.1:5555"):
        self.address = address
        self.written: asyncio.Queue = asyncio.Queue()
        self.writable = asyncio.Event()  # cleared: the client does not read, and the stream waits in write()
        self.writable.set()

    def peer(self) -> str:
        return self.address

    async def write(self, response) -> None:
        await self.writable.wait()
        self.written.put_nowait(response)


def _step(session_id: str, value: float, prefix_length: int, step_id: int, packer: Packer, **fields):
    return pb.InferenceStep(
        session_id=session_id,
        hidden_states=packer.tensor(torch.full((1, 1, HIDDEN), value)),
        prefix_length=prefix_length,
        step_id=step_id,
        **fields,
    )


def _pushed(session_id: str, token: bytes, value: float, prefix_length: int, step_id: int):
    """A PushRequest as the peer receives it."""
    packer = Packer()
    request = pb.PushRequest(push_token=token, step=_step(session_id, value, prefix_length, step_id, packer))
    return unpack(pb.PushRequest, packer.pack(request).SerializeToString())


class Client:
    """One stream of `streams`: requests in, responses out, as the peer receives and sends them."""

    def __init__(self, streams: InferenceStreams, address: str = "ipv4:127.0.0.1:5555"):
        self.context, self._requests = Context(address), asyncio.Queue()
        self.task = asyncio.ensure_future(streams.inference(self._stream(), self.context))

    async def _stream(self):
        while (request := await self._requests.get()) is not None:
            yield request

    def _send(self, packed) -> None:
        self._requests.put_nowait(unpack(pb.InferenceRequest, packed.SerializeToString()))

    def open(self, session_id: str, push_token: bytes = b"") -> None:
        span = pb.Span(model=PREFIX, start=0, end=2)
        opening = pb.OpenSession(span=span, session_id=session_id, max_length=8, batch_size=1, push_token=push_token)
        self._send(pb.InferenceRequest(open=opening))

    def step(self, session_id: str, value: float, prefix_length: int, step_id: int, **fields) -> None:
        packer = Packer()
        step = _step(session_id, value, prefix_length, step_id, packer, **fields)
        self._send(packer.pack(pb.InferenceRequest(step=step)))

    def close(self, session_id: str) -> None:
        self._send(pb.InferenceRequest(close=pb.CloseSession(session_id=session_id)))

    def end(self) -> None:
        """End the stream without closing its session."""
        self._requests.put_nowait(None)

    async def answer(self) -> pb.InferenceResponse:
        return (await self._next()).message

    async def output(self) -> tuple[float, int, int]:
        """(the output's first value, step id, position) of the next answer, which must be a step result."""
        received = await self._next()
        assert received.message.WhichOneof("kind") == "step", received.message
        step = received.message.step
        out = decode_tensor(step.hidden_states, "hidden_states", received.payload)
        return float(out.flatten()[0]), step.step_id, step.position

    async def _next(self):
        response = await asyncio.wait_for(self.context.written.get(), 5)
        return unpack(pb.InferenceResponse, response.SerializeToString())

    async def ended(self) -> None:
        await asyncio.wait_for(self.task, 5)


def _run(
    test,
    span: DoublingSpan | None = None,
    forwarder=None,
    cache_tokens: int = 1024,
    work: WorkLimits | None = None,
    **limits,
):
    """`await test(streams)` with streams over `span` (by default a DoublingSpan)."""

    async def go():
        config = SimpleNamespace(hidden_size=HIDDEN, max_position_embeddings=64, num_hidden_layers=NUM_BLOCKS)
        served = ServedSpan(config, PREFIX, work or WorkLimits())
        served.span = span or DoublingSpan()
        streams = InferenceStreams(served, CacheBudget(cache_tokens), ServingLimits(**limits), forwarder)
        try:
            await test(streams)
        finally:
            streams.served.close()

    asyncio.run(go())


def test_a_session_answers_its_clients_steps_and_the_steps_pushed_into_it():
    async def test(streams: InferenceStreams):
        client = Client(streams)
        client.open("s", push_token=b"token")
        assert (await client.answer()).opened.session_id == "s"
        client.step("s", 1.0, prefix_length=0, step_id=1)
        assert await client.output() == (2.0, 1, 1)

        with pytest.raises(UnknownSessionError, match="takes pushed steps with that token"):
            streams.push(_pushed("s", b"not the token", 5.0, 1, 2))
        with pytest.raises(UnknownSessionError):
            streams.push(_pushed("another", b"token", 5.0, 1, 2))
        assert streams.push(_pushed("s", b"token", 3.0, 1, 2)) == pb.PushResponse()
        assert await client.output() == (6.0, 2, 2)  # answered on the client's stream

        client.close("s")
        await client.ended()
        assert streams.sessions == {} and streams.budget.tokens_left == 1024

    _run(test)


def test_pushes_beyond_what_a_session_may_hold_are_refused():
    async def test(streams: InferenceStreams):
        client = Client(streams)
        client.open("s", push_token=b"token")
        await client.answer()
        # the stream is busy with nothing: fill the inbox faster than the stream drains it, on this loop
        for step_id in range(4):
            streams.push(_pushed("s", b"token", 1.0, 0, step_id))
        with pytest.raises(OverloadedError, match="4 steps waiting"):
            streams.push(_pushed("s", b"token", 1.0, 0, 9))
        client.end()
        await client.ended()

    _run(test)


def test_a_bug_fails_one_request_as_an_internal_error_and_the_stream_goes_on():
    span = DoublingSpan()

    async def test(streams: InferenceStreams):
        client = Client(streams)
        client.open("s")
        await client.answer()
        span.fail = True
        client.step("s", 1.0, prefix_length=0, step_id=1)
        error = (await client.answer()).error
        assert error.message == "internal error on the peer: RuntimeError: a bug"
        client.step("s", 1.0, prefix_length=0, step_id=2)
        assert await client.output() == (2.0, 2, 1)
        client.step("other", 1.0, prefix_length=0, step_id=3)
        assert "unknown session 'other'" in (await client.answer()).error.message
        client.end()
        await client.ended()

    _run(test, span)


def test_a_push_of_ours_that_fails_is_reported_on_the_stream():
    async def test(streams: InferenceStreams):
        client = Client(streams)
        client.open("s")
        await client.answer()
        hop = pb.NextHop(endpoint="127.0.0.1:1", session_id="next", push_token=b"t", step_id=7)
        client.step("s", 1.0, prefix_length=0, step_id=1, next=[hop])
        assert await client.output() == (2.0, 1, 1)  # the client's answer first, the push meanwhile
        failed = (await client.answer()).forward_failed
        assert (failed.step_id, failed.endpoint) == (1, "127.0.0.1:1")
        # not the transport's words, which would tell a closed port from a filtered one
        assert failed.message == "the next peer could not be reached"
        client.end()
        await client.ended()

    _run(test, forwarder=FailingForwarder())


def test_more_hops_than_blocks_left_or_a_hop_twice_is_refused_before_any_compute():
    span = DoublingSpan()

    async def test(streams: InferenceStreams):
        client = Client(streams)
        client.open("s")  # blocks 0:2 of 4: two blocks left, so two hops at most
        await client.answer()

        def hop(port: int) -> pb.NextHop:
            return pb.NextHop(endpoint=f"127.0.0.1:{port}", session_id="next", push_token=b"t", step_id=7)

        for hops, said in [
            ([hop(1), hop(2), hop(3)], "at most 2 next hops"),
            ([hop(1), hop(1)], "endpoint twice"),
        ]:
            client.step("s", 1.0, prefix_length=0, step_id=1, next=hops)
            error = (await client.answer()).error
            assert error.code == BadRequestError.code and said in error.message, error.message
        assert span.calls == 0
        client.step("s", 1.0, prefix_length=0, step_id=2, next=[hop(1), hop(2)])  # control: a whole route
        assert await client.output() == (2.0, 2, 1)
        client.end()
        await client.ended()

    _run(test, span, forwarder=FailingForwarder())


def test_an_idle_session_ends_with_a_typed_error():
    async def test(streams: InferenceStreams):
        client = Client(streams)
        client.open("s")
        await client.answer()
        error = (await client.answer()).error
        assert error.code == UnknownSessionError.code and "timed out after 0s without requests" in error.message
        await client.ended()
        assert streams.sessions == {}

    _run(test, session_timeout_s=0.2)


def test_a_stream_that_opens_no_session_is_closed_at_the_open_timeout():
    """A stream that sends nothing holds one of the peer's concurrent calls: it gets the open timeout, not the idle
    session's (300 s by default), and then a typed error."""

    async def test(streams: InferenceStreams):
        silent = Client(streams)
        error = (await silent.answer()).error
        assert error.code == BadRequestError.code and "no session opened within 0.2s" in error.message
        await silent.ended()
        opened = Client(streams)  # an opened session idles on the session timeout
        opened.open("s")
        assert (await opened.answer()).WhichOneof("kind") == "opened"
        await asyncio.sleep(0.4)
        assert "s" in streams.sessions
        opened.close("s")
        await opened.ended()

    _run(test, open_timeout_s=0.2, session_timeout_s=30)


def test_one_address_holds_a_bounded_number_of_streams_and_others_still_get_theirs():
    async def test(streams: InferenceStreams):
        held = [Client(streams, f"ipv4:10.0.0.1:{port}") for port in range(3)]
        for i, client in enumerate(held):
            client.open(f"h{i}")
            assert (await client.answer()).WhichOneof("kind") == "opened"
        refused = Client(streams, "ipv4:10.0.0.1:9999")  # another port of the same address
        error = (await refused.answer()).error
        assert error.code == OverloadedError.code and "3 inference streams" in error.message
        await refused.ended()
        other = Client(streams, "ipv4:10.0.0.2:1")  # another address is served
        other.open("o")
        assert (await other.answer()).WhichOneof("kind") == "opened"
        held[0].close("h0")
        await held[0].ended()
        again = Client(streams, "ipv4:10.0.0.1:7")  # a stream that ended frees its place
        again.open("a")
        assert (await again.answer()).WhichOneof("kind") == "opened"
        for client, session in [(held[1], "h1"), (held[2], "h2"), (other, "o"), (again, "a")]:
            client.close(session)
            await client.ended()

    _run(test, max_streams_per_source=3)


def test_a_session_idle_on_its_cache_is_closed_when_another_waits_for_room():
    """The cache holds one session. One that stepped lately keeps it (the newcomer gets CacheFullError); one idle for
    RECLAIM_IDLE_S is closed with SessionExpiredError (its client reopens elsewhere without blaming this peer)."""

    async def test(streams: InferenceStreams):
        squatter = Client(streams)
        squatter.open("squatter")
        await squatter.answer()
        newcomer = Client(streams)
        newcomer.open("newcomer")
        assert (await newcomer.answer()).error.code == CacheFullError.code, "a busy session was closed"
        newcomer.end()
        await newcomer.ended()

        streams.sessions["squatter"].last_used -= RECLAIM_IDLE_S  # idle since long enough
        newcomer = Client(streams)
        newcomer.open("newcomer")
        error = (await squatter.answer()).error
        assert error.code == SessionExpiredError.code and "to make room for another session" in error.message
        assert (await newcomer.answer()).opened.session_id == "newcomer"
        assert set(streams.sessions) == {"newcomer"} and streams.reclaimed == 1
        await squatter.ended()
        newcomer.end()
        await newcomer.ended()

    _run(test, cache_tokens=8, alloc_timeout_s=0.2)


def test_a_session_past_its_lifetime_ends_at_its_next_request():
    async def test(streams: InferenceStreams):
        client = Client(streams)
        client.open("s")
        await client.answer()
        streams.sessions["s"].opened_at -= 101  # opened longer ago than its lifetime
        client.step("s", 1.0, prefix_length=0, step_id=1)
        error = (await client.answer()).error
        assert "session lifetime of 100s (--session-lifetime-s)" in error.message
        await client.ended()
        assert streams.sessions == {}

    _run(test, session_lifetime_s=100)


def test_pushed_steps_and_requests_read_ahead_count_as_queued_bytes_until_taken():
    """A step waiting in an inbox holds memory as a step being computed does: its bytes count in the peer's queue
    (peer/admission.py) from when it arrives, a push the queue has no room for is refused, and what a stream that
    ended left in its inbox is given back."""
    first, second = (_pushed("s", b"token", 1.0, prefix, prefix + 1) for prefix in (0, 1))
    two_steps = first.message.ByteSize() + second.message.ByteSize()  # one float32 token each, inline, and the rest

    async def test(streams: InferenceStreams):
        admission = streams.served.admission
        client = Client(streams)
        client.open("s", push_token=b"token")
        await client.answer()
        assert admission.queued_bytes == 0
        streams.push(first)
        streams.push(second)
        assert admission.queued_bytes == two_steps  # not taken yet: this loop has not let the stream run
        with pytest.raises(OverloadedError, match="MiB are queued"):
            streams.push(_pushed("s", b"token", 1.0, 2, 3))  # a third would pass --max-queued-bytes
        assert await client.output() == (2.0, 1, 1)
        assert await client.output() == (2.0, 2, 2)
        assert admission.queued_bytes == 0

        # the stream ends before it takes a pushed step (its client closed the session first): the step's bytes are
        # given back
        client.context.writable.clear()
        client.step("s", 1.0, prefix_length=2, step_id=5)
        client.close("s")
        await asyncio.sleep(0.1)  # the step's answer waits to be written; the close is read ahead behind it
        streams.push(_pushed("s", b"token", 1.0, 3, 6))
        assert admission.queued_bytes > 0
        client.context.writable.set()
        assert await client.output() == (2.0, 5, 3)
        await client.ended()
        assert admission.queued_bytes == 0 and streams.sessions == {} and span.calls == 3

    span = DoublingSpan()
    _run(test, span, work=WorkLimits(max_queued_bytes=two_steps))
