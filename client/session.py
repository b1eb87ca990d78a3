"""Inference sessions: a server-side KV cache on each peer of a chain, with failover by replay.

Each span remembers every input it was sent. When its peer fails, the span is routed to other peers
(possibly several), the history is replayed to rebuild their caches at exactly the client's position,
and the step goes on; the outputs are the same as without the failure. A peer whose answer is wrong (kind,
shape, dtype, NaN/inf, position, step id: client/checks.py) has failed just as one that died.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, SequenceTooLongError, SessionExpiredError
from protocol.packing import Packer
from client import checks
from client.routing import RouteHop
from client.sequence import RemoteSequence, describe, is_retriable
from client.transport import InferenceStream

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
    opened_at: float = field(default_factory=time.monotonic)


class InferenceSession:
    """Steps of new tokens through all blocks, each peer keeping its KV cache. Coroutines run on the client's loop."""

    def __init__(self, sequence: RemoteSequence, max_length: int, batch_size: int):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if sequence.max_positions is not None and max_length > sequence.max_positions:
            raise SequenceTooLongError(f"max_length {max_length} exceeds the model's {sequence.max_positions} "
                                       f"positions; open the session with a smaller max_length")
        if batch_size < 1:
            raise BadRequestError(f"batch_size must be >= 1, got {batch_size}")
        self.sequence, self.max_length, self.batch_size = sequence, max_length, batch_size
        self._step_ids = itertools.count(1)  # each request's id, which its answer must echo
        self.spans: list[SpanSession] = []
        self.position = 0
        self.mask: torch.Tensor | None = None  # [batch, position], kept only once padding appears
        self.closed = False
        self.recoveries = 0
        self.recovery_s = 0.0  # time spent re-routing and replaying after failures

    @property
    def cache_tokens(self) -> int:
        return self.max_length * self.batch_size

    async def _open(self, hop: RouteHop) -> SpanSession:
        stream = InferenceStream(self.sequence.pool, hop.endpoint)
        session_id = uuid.uuid4().hex
        request = pb.InferenceRequest(open=pb.OpenSession(
            span=pb.Span(model=self.sequence.prefix, start=hop.start, end=hop.end), session_id=session_id,
            max_length=self.max_length, batch_size=self.batch_size,
            alloc_timeout_s=self.sequence.config.connect_timeout_s))
        try:
            response = await stream.request(
                request, self.sequence.config.connect_timeout_s + self.sequence.config.request_timeout_s)
            checks.opened_answer(response, peer=describe(hop), session_id=session_id, max_length=self.max_length)
        except BaseException:
            await stream.close()
            raise
        return SpanSession(hop, stream, session_id)

    async def _open_route(self, start: int, end: int, refresh: bool) -> list[SpanSession]:
        route = await self.sequence.plan(start, end, inference=True, min_cache_tokens=self.cache_tokens,
                                         refresh=refresh)
        opened: list[SpanSession] = []
        try:
            for hop in route:
                try:
                    opened.append(await self._open(hop))
                except Exception as exc:
                    error = checks.blame(exc, describe(hop))
                    if is_retriable(error):
                        await self.sequence.report_failure(hop, error)
                    raise error
        except BaseException:
            for span in opened:
                await span.stream.close()
            raise
        return opened

    async def _open_first_route(self) -> list[SpanSession]:
        attempt = 0
        while True:
            try:
                return await self._open_route(0, self.sequence.num_blocks, refresh=attempt > 0)
            except Exception as exc:
                if not is_retriable(exc) or attempt >= self.sequence.config.max_retries:
                    raise
            await self.sequence.backoff(attempt)
            attempt += 1

    async def _send(self, span: SpanSession, hidden, mask, positions, prefix_length: int) -> torch.Tensor:
        dtype, step_id = self.sequence.hop_dtype(span.hop), next(self._step_ids)
        packer = Packer()
        request = packer.pack(pb.InferenceRequest(step=pb.InferenceStep(
            session_id=span.session_id, hidden_states=packer.tensor(hidden.to(dtype)),
            attention_mask=packer.optional(mask), position_ids=packer.optional(positions),
            prefix_length=prefix_length, step_id=step_id)))
        checks.check_size(request, self.sequence.config.max_message_bytes)
        response = await span.stream.request(request, self.sequence.config.request_timeout_s)
        position = prefix_length + hidden.shape[1]
        output = checks.step_answer(response, peer=describe(span.hop), shape=hidden.shape, dtype=dtype,
                                    step_id=step_id, position=position)
        span.position = position
        return output.to(hidden.dtype)

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
                except Exception as exc:
                    error = checks.blame(exc, describe(span.hop))
                    if is_retriable(error):
                        await self.sequence.report_failure(span.hop, error)
                    for opened in replacements:
                        await opened.stream.close()
                    raise error
        self.spans[index : index + 1] = replacements
        self.recoveries += 1
        self.sequence.recoveries += 1
        logger.info("span %d:%d now served by %s (replayed %d tokens)", old.hop.start, old.hop.end,
                    ", ".join(s.hop.peer_id[-8:] for s in replacements), self.position)

    async def _recover(self, index: int, attempt: int) -> int:
        """Replace span `index`, retrying with back-off; returns the attempts used so far."""
        began = time.perf_counter()
        try:
            while True:
                await self.sequence.backoff(attempt)
                attempt += 1
                try:
                    await self._replace(index)
                    return attempt
                except Exception as exc:
                    if not is_retriable(exc) or attempt >= self.sequence.config.max_retries:
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
        if hidden.ndim != 3:
            raise BadRequestError(f"hidden_states must be [batch, new tokens, hidden], got shape {list(hidden.shape)}")
        batch, new = hidden.shape[:2]
        if batch != self.batch_size:
            raise BadRequestError(f"the session was opened for batch {self.batch_size}, got batch {batch}")
        if self.position + new > self.max_length:
            raise SequenceTooLongError(
                f"{self.position} tokens so far + {new} new exceed the session's max_length {self.max_length}; "
                f"open the session with a larger max_length")
        self.sequence.check_inputs(hidden, mask, positions, prefix_length=self.position)
        if mask is not None and bool(mask.all()) and self.mask is None:
            mask = None  # no padding: the peers assume a full mask, and it need not travel
        elif mask is None and self.mask is not None:
            mask = torch.cat([self.mask, self.mask.new_ones(batch, new)], dim=1)
        if not self.spans:
            self.spans = await self._open_first_route()

        index, attempt = 0, 0
        while index < len(self.spans):
            span = self.spans[index]
            try:
                if span.position != self.position:
                    raise RuntimeError(f"span at {span.position} tokens, session at {self.position}")
                output = await self._send(span, hidden, mask, positions, prefix_length=self.position)
            except Exception as exc:
                error = checks.blame(exc, describe(span.hop))
                if not is_retriable(error) or attempt >= self.sequence.config.max_retries:
                    raise error
                if self._reached_lifetime(span, error):
                    logger.info("peer %s ended its session at its lifetime; opening a new one", describe(span.hop))
                else:
                    await self.sequence.report_failure(span.hop, error)
                attempt = await self._recover(index, attempt)
                continue
            span.inputs.append(hidden)
            span.positions.append(positions)
            hidden, index = output, index + 1
        self.position += new
        if mask is not None:
            self.mask = mask.to(torch.int64)
        return hidden

    def _reached_lifetime(self, span: SpanSession, error: BaseException) -> bool:
        age = time.monotonic() - span.opened_at
        return isinstance(error, SessionExpiredError) and age >= self.sequence.config.min_session_lifetime_s

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for span in self.spans:
            await span.stream.close()
