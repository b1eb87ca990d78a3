"""The inference stream of the Peer service: one session per stream, its steps, and the steps pushed into it.

A session's work comes through one queue, its inbox (peer/inbox.py): the client's requests, steps that the previous peer of the
route pushed into it (peer/forwarding.py), and reports of pushes of ours that failed. Each kind of item has its
own type and its own answer. The bytes of requests and pushed steps count as queued (peer/admission.py) from when
they enter the inbox: a push is refused when the peer's queue is full. Each step is computed by peer/steps.py:
one-token steps of concurrent sessions in one batch (peer/batching.py), a long prefill in chunks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from peer.batching import DecodeBatcher
from peer.cache import CacheBudget
from peer.config import ServingLimits
from peer.forwarding import Forwarder, failure_report
from peer.inbox import (
    ClientRequest,
    InboxItem,
    PushedStep,
    PushFailed,
    Reclaimed,
    StreamEnded,
    drain,
    held_bytes,
    read_into,
    size_of,
)
from peer.served import ServedSpan, as_swarm_error
from peer.steps import Session, SessionSteps
from peer.timings import StepClock, StepTimings
from protocol import swarmlm_pb2 as pb
from protocol.errors import (
    BadRequestError,
    OverloadedError,
    SessionExpiredError,
    SwarmError,
    UnknownSessionError,
    WrongSpanError,
)
from protocol.packing import Packer, Received
from swarm.runtime import in_background, within

logger = logging.getLogger(__name__)

MAX_CLIENT_REQUESTS_AHEAD = 2  # a session's client requests read before the ones ahead of them are done
MAX_PUSHED_WAITING = 4  # pushed steps a session holds before pushes are refused (one per step is normal)
MAX_PUSH_TOKEN_BYTES = 64
DECODING_S = 2.0  # a session that stepped within this long is decoding: a batch may wait a little for its step
RECLAIM_IDLE_S = 60.0
"""A session idle this long is closed when a new one waits for cache (SessionExpiredError: its client, idle since
at least the lifetime a client excuses, reopens and replays without blaming this peer)."""


@dataclass
class _Stream:
    """One inference stream: the work waiting for it, and its session once opened."""

    source: str  # the client's address: whose cache quota the session uses
    stack: contextlib.AsyncExitStack  # what the stream holds (its session, the reader), released when it ends
    inbox: asyncio.Queue[InboxItem] = field(default_factory=asyncio.Queue)
    # the client's requests are read ahead by at most this many: a client that sends without reading answers
    # meets gRPC's flow control, as it would without the queue
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_CLIENT_REQUESTS_AHEAD))
    session: Session | None = None


@dataclass(frozen=True)
class _Reply:
    """What one item of the inbox gets on the stream (None: nothing), and whether the stream ends after it."""

    response: bytes | pb.InferenceResponse | None = None
    last: bool = False


class InferenceStreams:
    """The inference sessions of a peer, one per stream, and the steps pushed into them."""

    def __init__(
        self, served: ServedSpan, budget: CacheBudget, limits: ServingLimits, forwarder: Forwarder | None = None
    ):
        self.served, self.budget, self.limits = served, budget, limits
        self.forwarder = forwarder  # pushes steps on to the next peer (None: this peer pushes nothing)
        self.sessions: dict[str, Session] = {}
        self._opening: set[str] = set()  # ids of sessions waiting for cache
        self._streams_of: collections.Counter[str] = collections.Counter()  # client address -> its streams
        self.batcher = DecodeBatcher(
            served.compute, lambda: served.span, limits.max_batch_tokens, expected=self._decoding
        )
        self.steps = SessionSteps(served, limits, self.batcher)
        self.step_timings = StepTimings()  # where inference steps spend their time (for Info and benchmarks)
        self.reclaimed = 0  # idle sessions closed to make room for others
        budget.reclaim = self._reclaim

    def _reclaim(self, tokens: int) -> int:
        """Close sessions idle for RECLAIM_IDLE_S, longest idle first, until `tokens` would fit in the budget."""
        now = time.monotonic()
        idle = sorted(
            (s for s in self.sessions.values() if not s.reclaimed and s.inbox and now - s.last_used >= RECLAIM_IDLE_S),
            key=lambda s: s.last_used,
        )
        room, closed = self.budget.tokens_left, 0
        for session in idle:
            if room >= tokens:
                break
            logger.info(
                "session %s idle for %.0fs, closing it to make room", session.session_id, now - session.last_used
            )
            session.reclaimed = True
            session.inbox.put_nowait(Reclaimed())
            room += session.max_length * session.batch_size
            closed += 1
        self.reclaimed += closed
        return closed

    def _decoding(self, blocks: tuple[int, int]) -> dict[str, float]:
        """When the next decode step of each session of `blocks` that is decoding is due (peer/batching.py)."""
        now = time.monotonic()
        return {
            s.session_id: s.last_used + s.away_s
            for s in self.sessions.values()
            if s.blocks == blocks and s.away_s is not None and now - s.last_used < DECODING_S
        }

    async def inference(self, requests: AsyncIterator[Received], context) -> None:
        """One session per stream: `open`, then `step`s, then `close` (or the stream ends, or it times out).

        Responses are written with a timeout: a client that stops reading would otherwise hold its session
        (and its cache) for as long as it keeps the connection open.
        """
        source = source_of(context)
        if self._streams_of[source] >= self.limits.max_streams_per_source:
            error = OverloadedError(
                f"this client address holds {self._streams_of[source]} inference streams to this peer, the most one "
                f"address may; end some, or use other peers"
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await within(context.write(_error(error)), self.limits.write_timeout_s)
            return
        self._streams_of[source] += 1
        responses = self._session(requests, source)
        try:
            async for response in responses:
                try:
                    await within(context.write(response), self.limits.write_timeout_s)
                except asyncio.TimeoutError:
                    logger.info(
                        "a client did not read its session's response within %.0fs; closing the stream",
                        self.limits.write_timeout_s,
                    )
                    return
        finally:
            await responses.aclose()  # frees the session's cache now, not when the generator is collected
            self._streams_of[source] -= 1
            if not self._streams_of[source]:
                del self._streams_of[source]

    async def _session(self, requests: AsyncIterator[Received], source: str) -> AsyncIterator:
        """The responses of one stream, until it closes or ends, or its session idles out or outlives its lifetime."""
        async with contextlib.AsyncExitStack() as stack:
            stream = _Stream(source, stack)
            # last out: the session is unlisted by then (no more pushes), and the reader stopped
            stack.callback(self._release_waiting, stream.inbox)
            hold = functools.partial(self.served.admission.hold, check=False)  # read ahead, bounded by the slots
            reader = asyncio.ensure_future(read_into(requests, stream.inbox, stream.slots, hold))
            stack.callback(reader.cancel)
            while True:
                reply = await self._next_reply(stream)
                if reply.response is not None:
                    yield reply.response
                if reply.last:
                    return

    async def _next_reply(self, stream: _Stream) -> _Reply:
        """Wait for the stream's next item of work (an idle session ends), and answer it."""
        opened = stream.session is not None
        try:
            item = await within(
                stream.inbox.get(), self.limits.session_timeout_s if opened else self.limits.open_timeout_s
            )
        except asyncio.TimeoutError:
            return self._idle(stream.session) if opened else self._never_opened()
        if isinstance(item, ClientRequest):
            stream.slots.release()
        self.served.admission.release(held_bytes(item))  # admitted again, as work, by the step that computes it
        return await self._answer(stream, item)

    def _release_waiting(self, inbox: asyncio.Queue[InboxItem]) -> None:
        """Release what the items left in a stream's inbox held: it ended before they were taken."""
        self.served.admission.release(drain(inbox))

    async def _answer(self, stream: _Stream, item: InboxItem) -> _Reply:
        """What one item of the stream's inbox gets."""
        if isinstance(item, StreamEnded):
            return _Reply(last=True)
        if isinstance(item, PushFailed):
            return _Reply(pb.InferenceResponse(forward_failed=item.report))
        if isinstance(item, Reclaimed):
            error = SessionExpiredError(
                f"session closed after {RECLAIM_IDLE_S:.0f}s or more without requests, to make room for another "
                f"session; open a new one"
            )
            return _Reply(_error(error), last=True)
        # past its lifetime, a session ends at its next request, whose answer says why (a stream closed
        # before would leave the client to guess), or at its idle timeout
        if stream.session is not None and self._past_lifetime(stream.session):
            return self._lifetime_reached(stream.session)
        if isinstance(item, PushedStep):
            return await _guarded(self._pushed(stream.session, item.received), "a pushed inference step failed")
        return await _guarded(self._request(stream, item.received), "inference request failed")

    def _idle(self, session: Session | None) -> _Reply:
        timeout_s = self.limits.session_timeout_s
        logger.info("session %s idle for %.0fs, closing it", session and session.session_id, timeout_s)
        error = UnknownSessionError(f"session timed out after {timeout_s:.0f}s without requests; open a new one")
        return _Reply(_error(error), last=True)

    def _never_opened(self) -> _Reply:
        timeout_s = self.limits.open_timeout_s
        logger.info("a stream opened no session within %.0fs, closing it", timeout_s)
        error = BadRequestError(f"no session opened within {timeout_s:g}s on this stream; send open first")
        return _Reply(_error(error), last=True)

    def _past_lifetime(self, session: Session) -> bool:
        return time.monotonic() > session.opened_at + self.limits.session_lifetime_s

    def _lifetime_reached(self, session: Session) -> _Reply:
        lifetime_s = self.limits.session_lifetime_s
        logger.info("session %s reached its lifetime of %.0fs, closing it", session.session_id, lifetime_s)
        error = SessionExpiredError(
            f"session reached this peer's session lifetime of {lifetime_s:.0f}s (--session-lifetime-s); open a new one"
        )
        return _Reply(_error(error), last=True)

    async def _pushed(self, session: Session, received: Received) -> _Reply:
        """A step pushed into the stream's session (only `push` puts one there, once the session is open)."""
        return _Reply(await self._step(session, received.message.step, received.payload))

    async def _request(self, stream: _Stream, received: Received) -> _Reply:
        """A client's request: open the stream's session, compute a step of it, or close it."""
        received.check()  # bytes that could not be read: this request fails, the stream goes on
        request: pb.InferenceRequest = received.message
        kind = request.WhichOneof("kind")
        if kind == "open":
            return _Reply(await self._open_on(stream, request.open))
        if kind == "step":
            return _Reply(await self._client_step(stream, request.step, received.payload))
        if kind == "close":
            return _Reply(last=True)
        raise BadRequestError("an inference request must be one of open, step or close")

    async def _open_on(self, stream: _Stream, request: pb.OpenSession) -> pb.InferenceResponse:
        if stream.session is not None:
            raise BadRequestError(f"session {stream.session.session_id} is already open on this stream")
        stream.session = session = await self._open(request, stream)
        return pb.InferenceResponse(
            opened=pb.SessionOpened(session_id=session.session_id, max_length=session.max_length)
        )

    async def _client_step(self, stream: _Stream, step: pb.InferenceStep, payload: memoryview) -> bytes:
        session = stream.session
        if session is None or step.session_id != session.session_id:
            raise UnknownSessionError(f"unknown session {step.session_id!r} on this stream; open it first")
        return await self._step(session, step, payload)

    def push(self, received: Received) -> pb.PushResponse:
        """A step pushed by the previous peer of a route, into a session whose push token it holds.

        Raises:
            UnknownSessionError: no session here takes pushed steps with that token.
            OverloadedError: the session already holds MAX_PUSHED_WAITING steps, or the peer's queue is full (the
                step's bytes wait counted as queued, peer/admission.py).
        """
        request: pb.PushRequest = received.message
        session = self.sessions.get(request.step.session_id)
        if session is None or not session.push_token or not hmac.compare_digest(request.push_token, session.push_token):
            raise UnknownSessionError(
                f"no session {request.step.session_id[:64]!r} here takes pushed steps with that token"
            )
        if session.inbox.qsize() >= MAX_PUSHED_WAITING:
            raise OverloadedError(f"session {session.session_id} has {MAX_PUSHED_WAITING} steps waiting")
        held = self.served.admission.hold(size_of(received))
        session.inbox.put_nowait(PushedStep(received, held))
        return pb.PushResponse()

    async def _push_on(self, session: Session, step: pb.InferenceStep, out, mask, positions) -> None:
        try:
            await self.forwarder.push(step.next, out, mask, positions, step)
        except Exception as exc:  # the client sends its steps itself then: it hears of it on this stream
            logger.info(
                "pushing step %d of session %s to %s failed: %s",
                step.step_id,
                session.session_id,
                step.next[0].endpoint,
                exc,
            )
            report = pb.ForwardFailed(step_id=step.step_id, endpoint=step.next[0].endpoint, message=failure_report(exc))
            session.inbox.put_nowait(PushFailed(report))

    def _check_open(self, request: pb.OpenSession) -> tuple[int, int]:
        """The blocks of a session to open; raises BadRequestError for what cannot be opened."""
        blocks = self.served.blocks(request.span)
        self.served.adapter(request.span)
        if len(request.push_token) > MAX_PUSH_TOKEN_BYTES:
            raise BadRequestError(f"a push token has at most {MAX_PUSH_TOKEN_BYTES} bytes")
        if not request.session_id:
            raise BadRequestError("session_id is empty")
        if request.session_id in self.sessions or request.session_id in self._opening:
            raise BadRequestError(
                f"session {request.session_id!r} is already open on this peer; open each session under a new id"
            )
        if request.max_length < 1 or request.batch_size < 1:
            raise BadRequestError(
                f"max_length and batch_size must be >= 1, got {request.max_length}, {request.batch_size}"
            )
        max_positions = self.served.max_positions
        if request.max_length > max_positions:
            raise BadRequestError(f"max_length {request.max_length} exceeds the model's {max_positions} positions")
        if not request.alloc_timeout_s >= 0:  # NaN too
            raise BadRequestError(
                f"alloc_timeout_s must be a number of seconds >= 0 (0: this peer's default, "
                f"{self.limits.alloc_timeout_s:g}s), got {request.alloc_timeout_s}"
            )
        return blocks

    async def _open(self, request: pb.OpenSession, stream: _Stream) -> Session:
        """Open a session on `stream`, once its cache is reserved; the stream's end frees both."""
        blocks = self._check_open(request)
        timeout = min(request.alloc_timeout_s or self.limits.alloc_timeout_s, self.limits.max_alloc_timeout_s)
        # the id is taken while the session waits for cache, so that a second open of it meanwhile is refused
        self._opening.add(request.session_id)
        try:
            async with contextlib.AsyncExitStack() as opening:  # undone unless the session opens
                await opening.enter_async_context(
                    self.budget.reserve(request.max_length * request.batch_size, timeout, stream.source)
                )
                if self.served.span is None:  # it started moving while this session waited for cache
                    raise WrongSpanError("this peer is moving to other blocks; use another peer")
                session = Session(
                    request.session_id,
                    blocks,
                    request.max_length,
                    request.batch_size,
                    self.served.span.new_cache(),
                    push_token=request.push_token,
                    inbox=stream.inbox,
                    adapter=self.served.adapter(request.span),
                )
                self.sessions[session.session_id] = session
                opening.callback(self.sessions.pop, session.session_id, None)
                await stream.stack.enter_async_context(opening.pop_all())  # the stream's now: freed when it ends
        finally:
            self._opening.discard(request.session_id)
        return session

    # --- steps ---

    async def _step(self, session: Session, step: pb.InferenceStep, payload: memoryview) -> bytes:
        """Compute one step of `session` (the client's, or pushed into it), push it on if asked, pack the answer."""
        clock = StepClock()
        out, mask, positions = await self.steps.compute(
            session, step, payload, clock, alone=len(self.sessions) <= 1, can_push=self.forwarder is not None
        )
        if step.next:  # on to the next peer now; our answer to the client goes out meanwhile
            in_background(self._push_on(session, step, out, mask, positions))
        clock.replying()
        packer = Packer()
        packed = packer.pack(
            pb.InferenceResponse(
                step=pb.StepResult(
                    hidden_states=packer.tensor(out, step.output_compression),
                    step_id=step.step_id,
                    position=session.position,
                )
            )
        )
        clock.replied()
        self.step_timings.add(clock)
        return packed


async def _guarded(answer: Awaitable[_Reply], what: str) -> _Reply:
    """`answer`, or the typed error it failed with: one request fails, the stream goes on."""
    try:
        return await answer
    except Exception as exc:
        return _Reply(_error(as_swarm_error(exc, what)))


def source_of(context) -> str:
    """The client's address without its port ("ipv4:1.2.3.4:5678" -> "ipv4:1.2.3.4"): whose cache quota it uses."""
    peer = context.peer() or ""
    return peer.rpartition(":")[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


def _error(exc: SwarmError) -> pb.InferenceResponse:
    return pb.InferenceResponse(error=pb.Error(code=exc.code, message=str(exc)))
