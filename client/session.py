"""Inference sessions: a server-side KV cache on each peer of a chain, with failover by replay.

A step goes to the first span of a chain and is pushed on from peer to peer where the peers can take it
(ClientConfig.forward_steps, peer/forwarding.py); every span still answers the client on its own stream.
Each span remembers every input it was sent. When its peer fails, the span is routed to other peers
(possibly several), the history is replayed to rebuild their caches at exactly the client's position,
and the step goes on; the outputs are the same as without the failure. A peer whose answer is wrong (kind,
shape, dtype, NaN/inf, position, step id: client/checks.py) has failed just as one that died. How many
failures a step survives, and the waits between its tries, are client/retry.py's rule. Each span also keeps its
answers, which a share of steps has other peers check (client/inference_checks.py): a peer they outvote is routed
around for the rest of the session (and banned where a fourth peer confirms the verdict), and the session rewinds
to what was verified.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field

import torch

from client import checks
from client.config import ForwardSteps
from client.inference_checks import InferenceChecks
from client.retry import Attempts, blame, describe
from client.routing import RouteHop
from client.sequence import RemoteSequence
from client.splitting import step_chunks
from client.transport import InferenceStream
from protocol import swarmlm_pb2 as pb
from protocol.errors import (
    BadRequestError,
    OutputRewoundError,
    PeerUnavailableError,
    SequenceTooLongError,
    SessionExpiredError,
)
from protocol.packing import Packer
from swarm.runtime import within

logger = logging.getLogger(__name__)


@dataclass
class SpanSession:
    """One hop's open session and everything it has been sent."""

    hop: RouteHop
    stream: InferenceStream
    session_id: str
    position: int = 0
    inputs: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)  # its answers, kept for the checks when they are on
    verified: int = 0  # its answers at positions before this one were checked (client/inference_checks.py)
    # (position, peers): a check by those peers' route confirmed its answers before that position
    confirmed: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)
    opened_at: float = field(default_factory=time.monotonic)
    push_token: bytes = b""  # what the previous peer shows to push a step into this session (peer/forwarding.py)
    stale: set[int] = field(default_factory=set)  # ids of steps given up on: their late answers are skipped


@dataclass
class HopTimings:
    """Client-side time of the inference steps one peer answered, summed (bench/hop_profile.py reads it).

    `pack_s` builds and packs the request (a chain's request counts for its first hop only); `rpc_s` runs from
    sending it until this hop's answer is received (a later hop of a chain counts from the chain's send);
    `check_s` checks the answer and casts its hidden states."""

    steps: int = 0
    pack_s: float = 0.0
    rpc_s: float = 0.0
    check_s: float = 0.0


class _HopFailed(Exception):
    """Span `index` of a chain of forwarded steps failed; `outputs` are those of the spans before it."""

    def __init__(self, index: int, error: BaseException, outputs: list[torch.Tensor]):
        super().__init__(str(error))
        self.index, self.error, self.outputs = index, error, outputs


class _PushNotTaken(Exception):
    """The previous span of a chain says it could not push a step on to the next (`error` says so): on its word
    alone, neither is at fault (a liar would get its honest successor banned), so the session sends the next span its
    steps itself from then on (pushes resume into a span that replaces it)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.error = PeerUnavailableError(message)


class InferenceSession:
    """Steps of new tokens through all blocks, each peer keeping its KV cache. Coroutines run on the client's loop."""

    def __init__(self, sequence: RemoteSequence, max_length: int, batch_size: int):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if sequence.max_positions is not None and max_length > sequence.max_positions:
            raise SequenceTooLongError(
                f"max_length {max_length} exceeds the model's {sequence.max_positions} "
                f"positions; open the session with a smaller max_length"
            )
        if batch_size < 1:
            raise BadRequestError(f"batch_size must be >= 1, got {batch_size}")
        self.sequence, self.max_length, self.batch_size = sequence, max_length, batch_size
        self._step_ids = itertools.count(1)  # each request's id, which its answer must echo
        self.spans: list[SpanSession] = []
        self.position = 0
        self.mask: torch.Tensor | None = None  # [batch, position], kept only once padding appears
        self.closed = False
        self.recoveries = 0
        # session ids of spans that a push into failed: the client sends their steps itself (not pushed into them)
        # until they are replaced
        self.unpushed: set[str] = set()
        self.recovery_s = 0.0  # time spent re-routing and replaying after failures
        self.hop_timings: dict[str, HopTimings] = {}  # peer id -> its answered steps' client-side time
        self.checks = InferenceChecks(sequence.config.verify_inference, sequence.spot_checks.rng)
        self.set_aside: set[str] = set()  # peers this session's checks outvoted: not routed to again, banned or not

    @property
    def cache_tokens(self) -> int:
        return self.max_length * self.batch_size

    async def _open(self, hop: RouteHop) -> SpanSession:
        stream = InferenceStream(self.sequence.pool, hop.endpoint)
        session_id, push_token = uuid.uuid4().hex, secrets.token_bytes(16)
        request = pb.InferenceRequest(
            open=pb.OpenSession(
                span=self.sequence.span(hop),
                session_id=session_id,
                max_length=self.max_length,
                batch_size=self.batch_size,
                alloc_timeout_s=self.sequence.config.connect_timeout_s,
                push_token=push_token,
            )
        )
        try:
            response = await stream.request(
                request, self.sequence.config.connect_timeout_s + self.sequence.config.request_timeout_s
            )
            checks.opened_answer(response, peer=describe(hop), session_id=session_id, max_length=self.max_length)
        except BaseException:
            await stream.close()
            raise
        return SpanSession(hop, stream, session_id, push_token=push_token)

    async def _open_route(self, start: int, end: int, refresh: bool) -> list[SpanSession]:
        route = await self.sequence.plan(
            start,
            end,
            inference=True,
            min_cache_tokens=self.cache_tokens,
            refresh=refresh,
            avoid=frozenset(self.set_aside),
        )
        opened: list[SpanSession] = []
        try:
            for hop in route:
                try:
                    opened.append(await self._open(hop))
                except Exception as exc:
                    raise await blame(exc, hop, self.sequence.report_failure) from exc
        except BaseException:
            for span in opened:
                await span.stream.close()
            raise
        return opened

    async def _open_first_route(self) -> list[SpanSession]:
        attempts = self.sequence.attempts()  # each try opens a whole route
        while True:
            try:
                return await self._open_route(0, self.sequence.num_blocks, refresh=attempts.count > 0)
            except Exception as exc:
                if await attempts.failed(exc) is not None:
                    raise
            await attempts.backoff()

    async def _send(self, span: SpanSession, hidden, mask, positions, prefix_length: int) -> torch.Tensor:
        return (await self._send_chain([span], hidden, mask, positions, prefix_length))[0]

    def _chain(self, index: int) -> list[SpanSession]:
        """Span `index` and the spans after it that its step can be pushed on to, peer to peer: all reached by
        direct gRPC, speaking protocol 2 or later, in one dtype (a pushed tensor is not cast on its way), each
        endpoint once."""
        first, config = self.spans[index], self.sequence.config
        chain = [first]
        if config.forward_steps == ForwardSteps.NEVER or not self.sequence.forwards(first.hop):
            return chain
        dtype = self.sequence.hop_dtype(first.hop)
        for span in self.spans[index + 1 :]:
            if not self.sequence.forwards(span.hop) or self.sequence.hop_dtype(span.hop) != dtype:
                break
            if span.session_id in self.unpushed:
                break  # the client sends it its steps itself
            if any(s.hop.endpoint == span.hop.endpoint for s in chain):
                break  # a peer takes a route that passes it once (peer/forwarding.py check_next)
            if (
                config.forward_steps == ForwardSteps.AUTO
                and self.sequence.dialer.rtts.get(span.hop.peer_id, 0.0) < config.forward_min_rtt_s
            ):
                break  # near this client: sending it the step directly is as fast, and costs the peers less
            chain.append(span)
        return chain

    async def _send_chain(self, chain: list[SpanSession], hidden, mask, positions, prefix_length: int) -> list:
        """Send a step to `chain[0]`, which pushes its output on to `chain[1]`, and so on; each span's answer comes
        back on its own stream. Returns the outputs; raises _HopFailed at the first span that failed."""
        config = self.sequence.config
        dtype = self.sequence.hop_dtype(chain[0].hop)
        ids = [next(self._step_ids) for _ in chain]
        began = time.perf_counter()
        packer = Packer()
        request = packer.pack(
            pb.InferenceRequest(
                step=pb.InferenceStep(
                    session_id=chain[0].session_id,
                    hidden_states=packer.tensor(hidden.to(dtype), self.sequence.compression),
                    attention_mask=packer.optional(mask),
                    position_ids=packer.optional(positions),
                    prefix_length=prefix_length,
                    step_id=ids[0],
                    output_compression=self.sequence.compression,
                    next=[
                        pb.NextHop(endpoint=s.hop.endpoint, session_id=s.session_id, push_token=s.push_token, step_id=i)
                        for s, i in zip(chain[1:], ids[1:])
                    ],
                )
            )
        )
        checks.check_size(request, config.max_message_bytes)
        outputs: list[torch.Tensor] = []
        sent = time.perf_counter()
        try:
            await within(chain[0].stream.send(request), config.request_timeout_s)
        except asyncio.TimeoutError:
            raise _HopFailed(
                0,
                PeerUnavailableError(
                    f"peer {describe(chain[0].hop)} did not take a step within {config.request_timeout_s:.1f}s"
                ),
                outputs,
            ) from None
        except Exception as exc:
            raise _HopFailed(0, exc, outputs) from exc
        position = prefix_length + hidden.shape[1]
        previous_answer = sent
        for k, span in enumerate(chain):
            try:
                response = await self._answer(span, ids[k], chain[k - 1] if k else None, ids[k - 1] if k else 0)
                answered = time.perf_counter()
                output = checks.step_answer(
                    response,
                    peer=describe(span.hop),
                    shape=hidden.shape,
                    dtype=dtype,
                    step_id=ids[k],
                    position=position,
                )
            except Exception as exc:
                for later, step_id in zip(chain[k:], ids[k:]):  # answers to them may still come: skip those
                    later.stale.add(step_id)
                raise _HopFailed(k, exc, outputs) from exc
            span.position = position
            # its answer came this long after the previous span's (or the send): a lower bound of its speed, which
            # caps what it announces for this client's routes as forward calls do (client/speeds.py)
            self.sequence.speeds.record(span.hop.peer_id, hidden.shape[0] * hidden.shape[1], answered - previous_answer)
            previous_answer = answered
            outputs.append(output.to(hidden.dtype))
            timings = self.hop_timings.setdefault(span.hop.peer_id, HopTimings())
            timings.steps += 1
            timings.pack_s += 0.0 if k else sent - began
            timings.rpc_s += answered - sent
            timings.check_s += time.perf_counter() - answered
        return outputs

    async def _answer(self, span: SpanSession, step_id: int, previous: SpanSession | None, previous_id: int):
        """The answer of `span` to step `step_id`, skipping late answers to steps given up on. While it waits,
        the previous span of a chain may report that it could not push the step on to `span` (_PushNotTaken)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.sequence.config.request_timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise PeerUnavailableError(f"peer {describe(span.hop)} did not answer step {step_id} in time")
            answer = asyncio.ensure_future(span.stream.receive(left))
            report = asyncio.ensure_future(previous.stream.receive(left)) if previous is not None else None
            try:
                await asyncio.wait([t for t in (answer, report) if t is not None], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (answer, report):
                    if task is not None and not task.done():
                        task.cancel()
                    elif task is not None and not task.cancelled():
                        # marked read: we may be leaving, cancelled, while it failed; and when both came at once,
                        # the answer is what counts
                        task.exception()
            if not answer.done() or answer.cancelled():
                try:
                    said = report.result().message
                except Exception:  # its stream ended after its answer: nothing more to hear from it
                    previous = None
                    continue
                if said.WhichOneof("kind") == "forward_failed" and said.forward_failed.step_id == previous_id:
                    raise _PushNotTaken(
                        f"peer {describe(previous.hop)} could not push the step on to "
                        f"{describe(span.hop)}: {said.forward_failed.message}"
                    )
                continue  # about an earlier step
            received = answer.result()
            message = received.message
            kind = message.WhichOneof("kind")
            if kind == "forward_failed" or (kind == "step" and message.step.step_id in span.stale):
                span.stale.discard(message.step.step_id if kind == "step" else -1)
                continue
            return received

    async def _replace(self, index: int) -> None:
        """Route span `index` to other peers and replay its history into them."""
        old = self.spans[index]
        await old.stream.close()
        replacements = await self._open_route(old.hop.start, old.hop.end, refresh=True)
        if old.inputs:
            history = torch.cat(old.inputs, dim=1)
            positions = torch.cat(old.positions, dim=1)
            mask = self.mask[:, : history.shape[1]] if self.mask is not None else None
            for span in replacements:
                span.inputs, span.positions = [history], [positions]
                try:
                    history = await self._send(span, history, mask, positions, prefix_length=0)
                    span.outputs = [history] if self.checks.rate > 0 else []
                except Exception as exc:
                    error = await blame(exc, span.hop, self.sequence.report_failure)
                    for opened in replacements:
                        await opened.stream.close()
                    raise error from exc
        self.spans[index : index + 1] = replacements
        self.recoveries += 1
        self.sequence.recoveries += 1
        logger.info(
            "span %d:%d now served by %s (replayed %d tokens)",
            old.hop.start,
            old.hop.end,
            ", ".join(s.hop.peer_id[-8:] for s in replacements),
            self.position,
        )

    async def _recover(self, index: int, attempts: Attempts) -> None:
        """Replace span `index`, retrying with back-off, out of the step's `attempts` (one granted already)."""
        began = time.perf_counter()
        try:
            while True:
                await attempts.backoff()
                try:
                    await self._replace(index)
                    return
                except Exception as exc:
                    if await attempts.failed(exc) is not None:
                        raise
        finally:
            self.recovery_s += time.perf_counter() - began
            self.sequence.recovery_s += time.perf_counter() - began

    async def step(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """Send `hidden` [batch, new, hidden] for tokens at `positions`; `mask` covers past + new tokens or is None.

        Raises:
            BadRequestError: the inputs are not what a peer accepts (nothing was sent); SequenceTooLongError
                past the session's max_length.
            SwarmError: peers kept failing (`max_retries` route changes), e.g. PeerFaultError.
        """
        if self.closed:
            raise BadRequestError("this inference session is closed; open a new one")
        liar = self.checks.liar()
        if liar is not None:
            await self.rewind(liar)
        if hidden.ndim != 3:
            raise BadRequestError(f"hidden_states must be [batch, new tokens, hidden], got shape {list(hidden.shape)}")
        batch, new = hidden.shape[:2]
        if batch != self.batch_size:
            raise BadRequestError(f"the session was opened for batch {self.batch_size}, got batch {batch}")
        if self.position + new > self.max_length:
            raise SequenceTooLongError(
                f"{self.position} tokens so far + {new} new exceed the session's max_length {self.max_length}; "
                f"open the session with a larger max_length"
            )
        self.sequence.check_inputs(hidden, mask, positions, prefix_length=self.position)
        if mask is not None and bool(mask.all()) and self.mask is None:
            mask = None  # no padding: the peers assume a full mask, and it need not travel
        elif mask is None and self.mask is not None:
            mask = torch.cat([self.mask, self.mask.new_ones(batch, new)], dim=1)
        if not self.spans:
            self.spans = await self._open_first_route()
        caps = self.sequence.caps(span.hop for span in self.spans)
        if batch * new > caps[0] or batch * new * (self.position + new) > caps[1]:  # in steps the peers take
            prefix, outputs = self.position, []
            for begin, end in step_chunks(batch, new, prefix, caps):
                piece_mask = mask[:, : prefix + end] if mask is not None else None
                outputs.append(await self.step(hidden[:, begin:end], piece_mask, positions[:, begin:end]))
            return torch.cat(outputs, dim=1)

        index, attempts = 0, self.sequence.attempts()  # a failed hop and a failed re-route each count
        while index < len(self.spans):
            chain = self._chain(index)
            for span in chain:
                if span.position != self.position:
                    raise RuntimeError(f"span at {span.position} tokens, session at {self.position}")
            try:
                outputs = await self._send_chain(chain, hidden, mask, positions, prefix_length=self.position)
                failed = None
            except _HopFailed as exc:
                outputs, failed = exc.outputs, exc
            for span, output in zip(chain, outputs):  # the spans that answered keep this step's input
                span.inputs.append(hidden)
                # kept [batch, new]: steps give [1, new] or [batch, new], and the history is joined along dim 1
                span.positions.append(positions.expand(batch, -1))
                if self.checks.rate > 0:
                    span.outputs.append(output)
                hidden = output
            index += len(outputs)
            if failed is None:
                continue
            span = self.spans[index]
            if isinstance(failed.error, _PushNotTaken):  # the step goes to `span` from here, the client's own
                logger.info("%s; this session sends that peer its steps itself from now on", failed.error)
                self.unpushed.add(span.session_id)
                error = await attempts.failed(failed.error.error, span.hop, report=False)
                if error is not None:
                    raise error
                continue
            # blame leaves a SessionExpiredError as it is: judged before it, the lifetime is judged the same
            expired = self._reached_lifetime(span, failed.error)
            error = await attempts.failed(failed.error, span.hop, report=not expired)
            if error is not None:
                raise error
            if expired:
                logger.info("peer %s ended its session at its lifetime; opening a new one", describe(span.hop))
            await self._recover(index, attempts)
        self.position += new
        if mask is not None:
            self.mask = mask.to(torch.int64)
        self.checks.after_step(self)
        return hidden

    def truncate(self, position: int) -> None:
        """Cut the session back to its first `position` tokens: each peer drops the rest of its cache at the next
        step, which builds on `position`."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot cut a session at {self.position} tokens back to {position}")
        for span in self.spans:
            for name in ("inputs", "positions", "outputs"):
                kept = getattr(span, name)
                if kept and position < self.position:
                    whole = torch.cat(kept, dim=1)[:, :position]
                    setattr(span, name, [whole] if position else [])
            span.position, span.verified = position, min(span.verified, position)
            span.confirmed = [(min(upto, position), peers) for upto, peers in span.confirmed]
        self.position = position
        if self.mask is not None:
            self.mask = self.mask[:, :position]

    async def rewind(self, liar: SpanSession) -> None:
        """`liar`'s peer was outvoted by other peers' results: cut the session back to the first position its answers
        were wrong at, route its span to other peers (never to it again, nor to a peer that confirmed its lie), and
        raise OutputRewoundError."""
        position = liar.verified
        self.set_aside.add(liar.hop.peer_id)
        self.set_aside |= self.checks.colluders
        self.truncate(position)
        if liar in self.spans:
            await self._recover(self.spans.index(liar), self.sequence.attempts(count=1))
        raise OutputRewoundError(
            f"peer {describe(liar.hop)} computed wrong results, outvoted by other peers computing its blocks, and this "
            f"session no longer uses it; it is rewound to position {position}: send the tokens from there on again",
            position=position,
        )

    async def settle(self) -> None:
        """Wait for the check that runs; raise OutputRewoundError (after the rewind) if it caught a liar."""
        liar = await self.checks.settle(self)
        if liar is not None:
            await self.rewind(liar)

    def _reached_lifetime(self, span: SpanSession, error: BaseException) -> bool:
        age = time.monotonic() - span.opened_at
        return isinstance(error, SessionExpiredError) and age >= self.sequence.config.min_session_lifetime_s

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.checks.close()
        for span in self.spans:
            await span.stream.close()
