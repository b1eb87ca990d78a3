"""gRPC handlers of the Peer service: decode, validate, compute on the span, encode.

Every failure of one request becomes a typed error for that request only; the peer and its other sessions
go on. Compute runs on one worker thread so the event loop stays free for the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import torch

from peer import validation
from peer.activations import ActivationStore, Kept
from peer.admission import Admission, WorkLimits
from peer.batching import DecodeBatcher, Member, can_batch
from peer.blocks import BlockSpan, rewind_cache
from peer.cache import CacheBudget
from peer.compute import INFERENCE, TRAINING, ComputeQueue
from peer.forwarding import check_next
from peer.timings import StepClock, StepTimings
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_optional, decode_tensor
from protocol.errors import (
    BadRequestError,
    OverloadedError,
    SessionExpiredError,
    SwarmError,
    UnknownSessionError,
    WrongSpanError,
)
from protocol.packing import Packer, Received
from protocol.service import ERROR_CODE_KEY, status_for
from swarm.runtime import in_background, within
from swarm.trust.identity import MAX_NONCE_BYTES

logger = logging.getLogger(__name__)

MAX_CLIENT_REQUESTS_AHEAD = 2  # a session's client requests read before the ones ahead of them are done
MAX_PUSHED_WAITING = 4  # pushed steps a session holds before pushes are refused (one per step is normal)
MAX_PUSH_TOKEN_BYTES = 64
DECODING_S = 2.0  # a session that stepped within this long is decoding: a batch may wait a little for its step
INLINE_COMPUTE_TOKENS = 4  # steps up to this many tokens (batch x length) compute on the event loop
STATE_PIECE_BYTES = 16 * 1024 * 1024  # weights travel in pieces of at most this size (messages stop at 64 MiB)


@dataclass
class Session:
    session_id: str
    blocks: tuple[int, int]
    max_length: int
    batch_size: int
    cache: object
    position: int = 0
    last_used: float = field(default_factory=time.monotonic)
    opened_at: float = field(default_factory=time.monotonic)
    away_s: float | None = None  # usual time from the end of a decode step to the next one's arrival
    push_token: bytes = b""  # what the previous peer of the route shows to push steps into it (empty: none may)
    inbox: asyncio.Queue | None = None  # the session's work: client requests, pushed steps (peer/forwarding.py)


@dataclass(frozen=True)
class HandlerLimits:
    """Limits the handler enforces per request."""

    session_timeout_s: float
    """An inference session idle this long is closed and its cache freed."""
    alloc_timeout_s: float
    """Default wait for cache space when a session asks for none."""
    max_alloc_timeout_s: float = 60.0
    """Longest wait for cache space a client may ask for."""
    activation_bytes: int = 0
    """Memory for forward activations kept for their backward (0: backward always recomputes)."""
    activation_ttl_s: float = 60.0
    """How long kept activations wait for their backward."""
    session_lifetime_s: float = 3600.0
    """An inference session is closed this long after it opened, however busy: no one keeps cache forever."""
    write_timeout_s: float = 30.0
    """A stream whose client does not take a response within this long is closed."""
    max_batch_tokens: int = 2048
    """Tokens of one inference forward at most: decode steps of concurrent sessions are batched up to it, and a
    longer prefill is computed in chunks of it, with other sessions' decode steps between them."""
    work: WorkLimits = field(default_factory=WorkLimits)


class PeerServicer:
    """Implements forward, backward, inference and info over one BlockSpan."""

    def __init__(
        self,
        model_config,
        prefix: str,
        budget: CacheBudget,
        limits: HandlerLimits,
        info: Callable[[], pb.InfoResponse],
    ):
        self.prefix, self.budget, self.limits, self._info = prefix, budget, limits, info
        self.prove: Callable[[bytes], bytes] | None = None  # signs identity nonces with the peer's key
        self.span: BlockSpan | None = None  # None while the peer loads or moves its blocks
        self.training = None  # a peer.training.SpanTraining when the peer trains its blocks
        self.hidden_size = model_config.hidden_size
        self.max_positions = model_config.max_position_embeddings
        self.sessions: dict[str, Session] = {}
        self._opening: set[str] = set()  # ids of sessions waiting for cache
        self.activations = ActivationStore(limits.activation_bytes, limits.activation_ttl_s)
        self.admission = Admission(limits.work, self.max_positions)
        self._busy = 0  # computations queued for or running on the compute thread
        self.compute = ComputeQueue()
        self.forwarder = None  # a peer.forwarding.Forwarder once the server has its credentials
        self.batcher = DecodeBatcher(self.compute, lambda: self.span, limits.max_batch_tokens, expected=self._decoding)
        self.step_timings = StepTimings()  # where inference steps spend their time (for Info and benchmarks)

    def _decoding(self, blocks: tuple[int, int]) -> dict[str, float]:
        """When the next decode step of each session of `blocks` that is decoding is due (peer/batching.py)."""
        now = time.monotonic()
        return {
            s.session_id: s.last_used + s.away_s
            for s in self.sessions.values()
            if s.blocks == blocks and s.away_s is not None and now - s.last_used < DECODING_S
        }

    def set_span(self, span: BlockSpan | None) -> None:
        """Serve `span` from now on (None: serve nothing); sessions of other blocks fail over on their next step."""
        self.span = span
        self.activations.clear()  # they belong to the blocks served so far

    def close(self) -> None:
        self.compute.close()

    async def _compute(self, fn, tokens: int, priority: int = TRAINING):
        """Run `fn` on the compute thread (peer/compute.py); a step of a few tokens runs right here instead.

        A decode step takes milliseconds, and the two thread switches around it cost a good share of
        that on a busy machine; a longer computation goes to the thread so the network is served meanwhile.
        """
        if tokens <= INLINE_COMPUTE_TOKENS and not self._busy:
            return fn()
        self._busy += 1
        try:
            return await self.compute.run(fn, priority)
        finally:
            self._busy -= 1

    # --- checks shared by all requests ---

    def _blocks(self, span: pb.Span) -> tuple[int, int]:
        if span.model != self.prefix:
            raise WrongSpanError(f"this peer serves model {self.prefix!r}, not {span.model!r}")
        if self.span is None:
            raise WrongSpanError("this peer is loading its blocks; use another peer or try again shortly")
        if not self.span.start <= span.start < span.end <= self.span.end:
            raise WrongSpanError(
                f"this peer serves blocks {self.span.start}:{self.span.end}, not {span.start}:{span.end}"
            )
        return span.start, span.end

    def _inputs(self, message, payload: memoryview, prefix_length: int = 0):
        hidden = decode_optional(message, "hidden_states", payload)
        if hidden is None:
            raise BadRequestError("hidden_states is missing")
        validation.check_hidden(hidden, hidden_size=self.hidden_size, dtype=self.span.dtype)
        batch, seq, _ = hidden.shape
        self.admission.check(batch, seq, prefix_length)
        mask = validation.check_mask(
            decode_optional(message, "attention_mask", payload), batch=batch, length=prefix_length + seq
        )
        positions = validation.check_positions(
            decode_optional(message, "position_ids", payload), batch=batch, seq=seq, max_positions=self.max_positions
        )
        return hidden, mask, positions

    # --- unary methods ---

    async def _unary(self, context: grpc.aio.ServicerContext, work):
        try:
            return await work()
        except SwarmError as exc:
            error = exc
        except Exception as exc:  # a bug of ours: report it, keep serving
            logger.exception("request failed")
            error = SwarmError(f"internal error on the peer: {type(exc).__name__}: {exc}")
        await context.abort(status_for(error), str(error), trailing_metadata=((ERROR_CODE_KEY, error.code),))

    async def forward(self, received: Received, context):
        request: pb.ForwardRequest = received.message

        async def work():
            blocks = self._blocks(request.span)
            hidden, mask, positions = self._inputs(request, received.payload)

            span, keep_id = self.span, request.backward_id

            def run():
                if keep_id and self.activations.enabled:
                    return self._forward_keeping(keep_id, span, blocks, hidden, mask, positions)
                with torch.inference_mode():
                    return span(hidden, mask, positions, blocks=blocks, between_layers=self.compute.checkpoint)

            tokens = hidden.shape[0] * hidden.shape[1]
            with self.admission.admit(tokens, hidden.nbytes):
                out = await self._compute(run, tokens)
            packer = Packer()
            return packer.pack(pb.ForwardResponse(hidden_states=packer.tensor(out, request.output_compression)))

        return await self._unary(context, work)

    async def backward(self, received: Received, context):
        request: pb.BackwardRequest = received.message

        async def work():
            blocks = self._blocks(request.span)
            hidden, mask, positions = self._inputs(request, received.payload)
            if not request.HasField("grad_outputs"):
                raise BadRequestError("grad_outputs is missing")
            grad = decode_tensor(request.grad_outputs, "grad_outputs", received.payload)
            validation.check_grad(grad, hidden)

            span, training = self.span, None
            if request.run_id:
                training = self.training
                if training is None:
                    raise BadRequestError(
                        f"this peer does not train (run {request.run_id!r}); route training "
                        f"steps to peers started with --train --run-id {request.run_id}"
                    )
                training.check(request.run_id, blocks, request.epoch)

            def run():
                kept = self.activations.pop(request.backward_id) if request.backward_id else None
                if kept is None or not kept.matches(blocks, hidden, mask, positions):
                    # recompute the forward: the kept one expired, was evicted, or was kept by another peer
                    kept = self._forward_graph(span, blocks, hidden, mask, positions)
                if training is not None:
                    return training.backward(
                        kept.outputs,
                        kept.inputs,
                        grad.to(span.device),
                        run_id=request.run_id,
                        blocks=blocks,
                        epoch=request.epoch,
                    )
                with torch.enable_grad():
                    (grad_inputs,) = torch.autograd.grad(kept.outputs, kept.inputs, grad.to(span.device))
                return grad_inputs

            tokens = hidden.shape[0] * hidden.shape[1]
            with self.admission.admit(tokens, hidden.nbytes + grad.nbytes):
                grad_inputs = await self._compute(run, tokens * 3)
            packer = Packer()
            return packer.pack(pb.BackwardResponse(grad_inputs=packer.tensor(grad_inputs, request.output_compression)))

        return await self._unary(context, work)

    def _forward_graph(self, span: BlockSpan, blocks, hidden, mask, positions) -> Kept:
        inputs = hidden.to(span.device).requires_grad_(True)
        with torch.enable_grad():
            outputs = span(inputs, mask, positions, blocks=blocks, between_layers=self.compute.checkpoint)
        return Kept(blocks, inputs, outputs, mask, positions, nbytes=0)

    def _forward_keeping(self, keep_id: str, span: BlockSpan, blocks, hidden, mask, positions) -> torch.Tensor:
        """Forward with autograd, keeping the graph for the backward with `keep_id` if it fits."""
        with ActivationStore.counting(span) as saved:  # only what is kept needs its size
            kept = self._forward_graph(span, blocks, hidden, mask, positions)
        kept.nbytes = saved.bytes
        self.activations.put(keep_id, kept)
        return kept.outputs.detach()

    async def info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        async def work():
            response = self._info()
            if request.nonce:  # a client checks that who answers at this address holds the announced key
                if self.prove is None:
                    raise WrongSpanError("this peer is starting; try again shortly")
                if len(request.nonce) > MAX_NONCE_BYTES:
                    raise BadRequestError(f"a nonce has at most {MAX_NONCE_BYTES} bytes, got {len(request.nonce)}")
                response.identity_proof = self.prove(request.nonce)
            training = self.training
            if training is not None:
                response.run_id, response.epoch, response.samples = training.run_id, training.epoch, training.samples
                response.train_mode, response.updating = training.config.mode, training.group.closing
                if request.param_digest:
                    response.param_digest = await self._compute(training.digest, tokens=1 << 20)
            return response

        return await self._unary(context, work)

    async def state(self, request: pb.StateRequest, context) -> AsyncIterator:
        """Stream the span's current weights, each tensor cut along its first dimension into pieces."""
        try:
            blocks = self._blocks(request.span)
            span = self.span
            if blocks != (span.start, span.end):
                raise BadRequestError(
                    f"ask for this peer's whole span {span.start}:{span.end}, not {blocks[0]}:{blocks[1]}"
                )
            from peer import lora  # peft loads only when weights are asked for

            weights_of = self.training.weights if self.training is not None else (lambda: lora.layer_state(span))
            weights = await self._compute(
                lambda: {k: v.detach().cpu().clone() for k, v in weights_of().items()}, tokens=1 << 20
            )
        except SwarmError as exc:
            await context.abort(status_for(exc), str(exc), trailing_metadata=((ERROR_CODE_KEY, exc.code),))
            return
        for name, tensor in weights.items():
            for piece, last in _pieces(tensor, STATE_PIECE_BYTES):
                packer = Packer()
                yield packer.pack(pb.StatePart(name=name, tensor=packer.tensor(piece), last=last))

    # --- inference stream ---

    async def inference(self, requests: AsyncIterator[Received], context) -> None:
        """One session per stream: `open`, then `step`s, then `close` (or the stream ends, or it times out).

        Responses are written with a timeout: a client that stops reading would otherwise hold its session
        (and its cache) for as long as it keeps the connection open.
        """
        responses = self._session(requests, _source_of(context))
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

    async def _session(self, requests: AsyncIterator[Received], source: str) -> AsyncIterator:
        """The session of one stream. Its work comes in one queue: the client's requests, steps that the previous
        peer of the route pushed into it (peer/forwarding.py), and reports of pushes of ours that failed."""
        session: Session | None = None
        limits = self.limits
        inbox: asyncio.Queue = asyncio.Queue()
        # the client's requests are read ahead by at most this many: a client that sends without reading answers
        # meets gRPC's flow control, as it would without the queue
        slots = asyncio.Semaphore(MAX_CLIENT_REQUESTS_AHEAD)
        async with contextlib.AsyncExitStack() as stack:
            reader = asyncio.ensure_future(_read_into(requests, inbox, slots))
            stack.callback(reader.cancel)
            while True:
                try:
                    kind, received = await within(inbox.get(), limits.session_timeout_s)
                    if kind == "client":
                        slots.release()
                except asyncio.TimeoutError:
                    logger.info(
                        "session %s idle for %.0fs, closing it",
                        session and session.session_id,
                        limits.session_timeout_s,
                    )
                    yield _error(
                        UnknownSessionError(
                            f"session timed out after {limits.session_timeout_s:.0f}s without requests; open a new one"
                        )
                    )
                    return
                if kind == "end":
                    return
                if kind == "forward_failed":
                    yield pb.InferenceResponse(forward_failed=received)
                    continue
                # past its lifetime, a session ends at its next request, whose answer says why (a stream closed
                # before would leave the client to guess), or at its idle timeout
                if session is not None and time.monotonic() > session.opened_at + limits.session_lifetime_s:
                    logger.info(
                        "session %s reached its lifetime of %.0fs, closing it",
                        session.session_id,
                        limits.session_lifetime_s,
                    )
                    yield _error(
                        SessionExpiredError(
                            f"session reached this peer's session lifetime of {limits.session_lifetime_s:.0f}s "
                            f"(--session-lifetime-s); open a new one"
                        )
                    )
                    return
                if kind == "pushed":  # checked by push(): a step of this session
                    try:
                        yield await self._step(session, received.message.step, received.payload)
                    except SwarmError as exc:
                        yield _error(exc)
                    except Exception as exc:
                        logger.exception("a pushed inference step failed")
                        yield _error(SwarmError(f"internal error on the peer: {type(exc).__name__}: {exc}"))
                    continue
                request: pb.InferenceRequest = received.message
                kind = request.WhichOneof("kind")
                try:
                    received.check()  # bytes that could not be read: this request fails, the stream goes on
                    if kind == "open":
                        if session is not None:
                            raise BadRequestError(f"session {session.session_id} is already open on this stream")
                        session = await self._open(request.open, stack, source, inbox)
                        yield pb.InferenceResponse(
                            opened=pb.SessionOpened(session_id=session.session_id, max_length=session.max_length)
                        )
                    elif kind == "step":
                        if session is None or request.step.session_id != session.session_id:
                            raise UnknownSessionError(
                                f"unknown session {request.step.session_id!r} on this stream; open it first"
                            )
                        yield await self._step(session, request.step, received.payload)
                    elif kind == "close":
                        return
                    else:
                        raise BadRequestError("an inference request must be one of open, step or close")
                except SwarmError as exc:
                    yield _error(exc)
                except Exception as exc:
                    logger.exception("inference request failed")
                    yield _error(SwarmError(f"internal error on the peer: {type(exc).__name__}: {exc}"))

    async def push(self, received: Received, context) -> pb.PushResponse:
        """A step pushed by the previous peer of a route, into a session whose push token it holds."""

        async def work():
            request: pb.PushRequest = received.message
            session = self.sessions.get(request.step.session_id)
            if (
                session is None
                or not session.push_token
                or not hmac.compare_digest(request.push_token, session.push_token)
            ):
                raise UnknownSessionError(
                    f"no session {request.step.session_id[:64]!r} here takes pushed steps with that token"
                )
            if session.inbox.qsize() >= MAX_PUSHED_WAITING:
                raise OverloadedError(f"session {session.session_id} has {MAX_PUSHED_WAITING} steps waiting")
            session.inbox.put_nowait(("pushed", received))
            return pb.PushResponse()

        return await self._unary(context, work)

    async def _push_on(self, session: Session, step: pb.InferenceStep, out, mask, positions) -> None:
        try:
            await self.forwarder.push(step.next, out, mask, positions, step)
        except Exception as exc:  # the client repairs the route: it hears of it on this session's stream
            logger.info(
                "pushing step %d of session %s to %s failed: %s",
                step.step_id,
                session.session_id,
                step.next[0].endpoint,
                exc,
            )
            session.inbox.put_nowait(
                (
                    "forward_failed",
                    pb.ForwardFailed(step_id=step.step_id, endpoint=step.next[0].endpoint, message=str(exc)[:500]),
                )
            )

    async def _open(
        self, request: pb.OpenSession, stack: contextlib.AsyncExitStack, source: str, inbox: asyncio.Queue
    ) -> Session:
        blocks = self._blocks(request.span)
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
        if request.max_length > self.max_positions:
            raise BadRequestError(f"max_length {request.max_length} exceeds the model's {self.max_positions} positions")
        if not request.alloc_timeout_s >= 0:  # NaN too
            raise BadRequestError(
                f"alloc_timeout_s must be a number of seconds >= 0 (0: this peer's default, "
                f"{self.limits.alloc_timeout_s:g}s), got {request.alloc_timeout_s}"
            )
        timeout = min(request.alloc_timeout_s or self.limits.alloc_timeout_s, self.limits.max_alloc_timeout_s)
        # the id is taken while the session waits for cache, so that a second open of it meanwhile is refused
        self._opening.add(request.session_id)
        try:
            async with contextlib.AsyncExitStack() as opening:  # undone unless the session opens
                await opening.enter_async_context(
                    self.budget.reserve(request.max_length * request.batch_size, timeout, source)
                )
                if self.span is None:  # it started moving while this session waited for cache
                    raise WrongSpanError("this peer is moving to other blocks; use another peer")
                session = Session(
                    request.session_id,
                    blocks,
                    request.max_length,
                    request.batch_size,
                    self.span.new_cache(),
                    push_token=request.push_token,
                    inbox=inbox,
                )
                self.sessions[session.session_id] = session
                opening.callback(self.sessions.pop, session.session_id, None)
                await stack.enter_async_context(opening.pop_all())  # the stream's now: freed when it ends
        finally:
            self._opening.discard(request.session_id)
        return session

    async def _step(self, session: Session, step: pb.InferenceStep, payload: memoryview):
        clock = StepClock()
        span = self.span
        if span is None or not span.start <= session.blocks[0] < session.blocks[1] <= span.end:
            raise WrongSpanError(
                f"this peer no longer serves blocks {session.blocks[0]}:{session.blocks[1]}; "
                f"continue the session on another peer"
            )
        hidden, mask, positions = self._inputs(step, payload, step.prefix_length)
        if hidden.shape[0] != session.batch_size:
            raise BadRequestError(f"the session was opened for batch {session.batch_size}, got batch {hidden.shape[0]}")
        if step.prefix_length > session.position:
            raise BadRequestError(
                f"step builds on {step.prefix_length} tokens but the session's cache holds {session.position}; "
                f"replay the missing tokens first"
            )
        validation.check_length(step.prefix_length, hidden.shape[1], session.max_length)
        if step.next:
            if self.forwarder is None:
                raise BadRequestError("this peer does not push steps on to other peers; send each step yourself")
            check_next(step.next)
        clock.parsed()

        def run(begin: int, end: int):
            """Tokens [begin, end) of the step (a chunk of a long prefill, or all of it)."""
            if begin == 0 and step.prefix_length < session.position:  # a retried step, or a branch
                rewind_cache(session.cache, step.prefix_length)
                session.position = step.prefix_length
            try:
                with torch.inference_mode():
                    return span(
                        hidden[:, begin:end],
                        mask[:, : step.prefix_length + end] if mask is not None else None,
                        positions[:, begin:end] if positions is not None else None,
                        session.cache,
                        step.prefix_length + begin,
                        blocks=session.blocks,
                        between_layers=self.compute.checkpoint,
                    )
            except Exception:
                _forget_step(session, span, step.prefix_length)  # some layers may have grown
                raise

        batch, new = hidden.shape[:2]
        tokens = batch * new
        with self.admission.admit(tokens, hidden.nbytes):
            if (
                new == 1
                and mask is None
                and len(self.sessions) > 1
                and can_batch(span)
                and batch <= self.limits.max_batch_tokens
            ):
                away = time.monotonic() - session.last_used
                session.away_s = away if session.away_s is None else 0.7 * session.away_s + 0.3 * away
                member = Member(
                    session.session_id,
                    session.cache,
                    hidden,
                    positions if positions is not None else torch.full((batch, 1), step.prefix_length),
                    step.prefix_length,
                    session.position,
                    asyncio.get_running_loop().create_future(),
                    reset=lambda: _forget_step(session, span, 0),
                )
                out = await self.batcher.step(session.blocks, member)
                clock.computed(member.forward_s, member.shared_by)
            else:
                chunk = max(1, self.limits.max_batch_tokens // batch)
                parts = []
                for begin in range(0, new, chunk):  # other sessions' decode steps run between the chunks
                    end = min(new, begin + chunk)
                    parts.append(
                        await self._compute(
                            clock.timed(functools.partial(run, begin, end)), batch * (end - begin), INFERENCE
                        )
                    )
                out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        session.position = step.prefix_length + hidden.shape[1]
        session.last_used = time.monotonic()
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


async def _read_into(requests: AsyncIterator[Received], inbox: asyncio.Queue, slots: asyncio.Semaphore) -> None:
    """The client's requests into the session's queue, each once a slot is free, then ("end", None) when its
    stream ends."""
    iterator = requests.__aiter__()
    try:
        while True:
            await slots.acquire()
            try:
                received = await iterator.__anext__()
            except StopAsyncIteration:
                return
            inbox.put_nowait(("client", received))
    except (grpc.RpcError, asyncio.CancelledError):
        pass
    finally:
        inbox.put_nowait(("end", None))


def _forget_step(session: Session, span: BlockSpan, prefix_length: int) -> None:
    """Put the session's cache back to `prefix_length` tokens; where it cannot be (a sliding window), start the
    session afresh, so that no step builds on a bad cache."""
    try:
        rewind_cache(session.cache, prefix_length)
    except BadRequestError:
        session.cache, session.position = span.new_cache(), 0


def _pieces(tensor: torch.Tensor, max_bytes: int):
    """(piece, is_last) along the first dimension, each under `max_bytes` unless one row is larger."""
    if tensor.dim() == 0 or tensor.numel() * tensor.element_size() <= max_bytes:
        yield tensor.contiguous(), True
        return
    row_bytes = max(1, tensor[0].numel() * tensor.element_size())
    rows = max(1, max_bytes // row_bytes)
    for start in range(0, tensor.shape[0], rows):
        yield tensor[start : start + rows].contiguous(), start + rows >= tensor.shape[0]


def _source_of(context) -> str:
    """The client's address without its port ("ipv4:1.2.3.4:5678" -> "ipv4:1.2.3.4"): whose cache quota it uses."""
    peer = context.peer() or ""
    return peer.rpartition(":")[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


def _error(exc: SwarmError) -> pb.InferenceResponse:
    return pb.InferenceResponse(error=pb.Error(code=exc.code, message=str(exc)))
