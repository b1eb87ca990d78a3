"""Inference sessions: a server-side KV cache on each peer of a chain, with failover by replay.

Each span remembers every input it was sent. When its peer fails, the span is routed to other peers
(possibly several), the history is replayed to rebuild their caches at exactly the client's position,
and the step goes on; the outputs are the same as without the failure.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadRequestError
from protocol.packing import Packer
from client.routing import RouteHop
from client.sequence import RemoteSequence, is_retriable
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


class InferenceSession:
    """Steps of new tokens through all blocks, each peer keeping its KV cache. Coroutines run on the client's loop."""

    def __init__(self, sequence: RemoteSequence, max_length: int, batch_size: int):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.sequence, self.max_length, self.batch_size = sequence, max_length, batch_size
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
            await stream.request(request, self.sequence.config.connect_timeout_s + self.sequence.config.request_timeout_s)
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
                    if is_retriable(exc):
                        await self.sequence.report_failure(hop, exc)
                    raise
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
        packer = Packer()
        request = packer.pack(pb.InferenceRequest(step=pb.InferenceStep(
            session_id=span.session_id, hidden_states=packer.tensor(hidden.to(self.sequence.hop_dtype(span.hop))),
            attention_mask=packer.optional(mask), position_ids=packer.optional(positions),
            prefix_length=prefix_length)))
        response = await span.stream.request(request, self.sequence.config.request_timeout_s)
        step = response.message.step
        span.position = step.position
        return decode_tensor(step.hidden_states, "hidden_states", response.payload).to(hidden.dtype)

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
                    if is_retriable(exc):
                        await self.sequence.report_failure(span.hop, exc)
                    for opened in replacements:
                        await opened.stream.close()
                    raise
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
        """Send `hidden` [batch, new, hidden] for tokens at `positions`; `mask` covers past + new tokens or is None."""
        if self.closed:
            raise BadRequestError("this inference session is closed; open a new one")
        batch, new = hidden.shape[:2]
        if batch != self.batch_size:
            raise BadRequestError(f"the session was opened for batch {self.batch_size}, got batch {batch}")
        if self.position + new > self.max_length:
            raise BadRequestError(
                f"{self.position} tokens so far + {new} new exceed the session's max_length {self.max_length}; "
                f"open the session with a larger max_length")
        if mask is not None and mask.shape != (batch, self.position + new):
            raise BadRequestError(f"attention_mask must have shape [{batch}, {self.position + new}], got {list(mask.shape)}")
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
                if not is_retriable(exc) or attempt >= self.sequence.config.max_retries:
                    raise
                await self.sequence.report_failure(span.hop, exc)
                attempt = await self._recover(index, attempt)
                continue
            span.inputs.append(hidden)
            span.positions.append(positions)
            hidden, index = output, index + 1
        self.position += new
        if mask is not None:
            self.mask = mask.to(torch.int64)
        return hidden

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for span in self.spans:
            await span.stream.close()
