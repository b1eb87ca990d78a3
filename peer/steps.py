"""One inference step of a session: checked against the session and its cache, then computed, together with other
sessions' one-token steps of the same blocks (peer/batching.py), or alone in chunks that let other sessions' steps run
between them (a long prefill).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

import torch

from peer import validation
from peer.batching import DecodeBatcher, Member, can_batch
from peer.blocks import BlockSpan, rewind_cache
from peer.compute import INFERENCE
from peer.config import ServingLimits
from peer.forwarding import check_next
from peer.inbox import InboxItem
from peer.served import ServedSpan
from peer.timings import StepClock
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, WrongSpanError


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
    inbox: asyncio.Queue[InboxItem] | None = None  # the session's work
    reclaimed: bool = False  # told to end, to make room for another session
    adapter: str = ""  # the named adapter it computes with (peer/adapters.py); "" for none


class SessionSteps:
    """Computes the steps of a peer's sessions on `served`."""

    def __init__(self, served: ServedSpan, limits: ServingLimits, batcher: DecodeBatcher):
        self.served, self.limits, self.batcher = served, limits, batcher

    async def compute(
        self,
        session: Session,
        step: pb.InferenceStep,
        payload: memoryview,
        clock: StepClock,
        *,
        alone: bool,
        can_push: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(the step's output, its mask, its positions); `alone`: no other session could share a batch with it,
        `can_push`: this peer pushes steps on to the next peer."""
        span = self._span_of(session)
        hidden, mask, positions = self._check(session, step, payload, can_push)
        clock.parsed()
        batch, new = hidden.shape[:2]
        with self.served.admission.admit(batch * new, hidden.nbytes):
            if mask is None and not alone and can_batch(span, new) and batch * new <= self.limits.max_batch_tokens:
                out = await self._decode_in_batch(session, span, step, hidden, positions, clock)
            else:
                out = await self._compute_in_chunks(session, span, step, hidden, mask, positions, clock)
        session.position = step.prefix_length + new
        session.last_used = time.monotonic()
        return out, mask, positions

    def _span_of(self, session: Session) -> BlockSpan:
        span = self.served.span
        if span is None or not span.start <= session.blocks[0] < session.blocks[1] <= span.end:
            raise WrongSpanError(
                f"this peer no longer serves blocks {session.blocks[0]}:{session.blocks[1]}; "
                f"continue the session on another peer"
            )
        return span

    def _check(self, session: Session, step: pb.InferenceStep, payload: memoryview, can_push: bool):
        """The step's (hidden states, mask, positions), checked against the session and its cache."""
        hidden, mask, positions = self.served.inputs(step, payload, step.prefix_length)
        if hidden.shape[0] != session.batch_size:
            raise BadRequestError(f"the session was opened for batch {session.batch_size}, got batch {hidden.shape[0]}")
        if step.prefix_length > session.position:
            raise BadRequestError(
                f"step builds on {step.prefix_length} tokens but the session's cache holds {session.position}; "
                f"replay the missing tokens first"
            )
        validation.check_length(step.prefix_length, hidden.shape[1], session.max_length)
        if step.next:
            if not can_push:
                raise BadRequestError("this peer does not push steps on to other peers; send each step yourself")
            check_next(step.next, blocks_left=self.served.num_blocks - session.blocks[1])
        return hidden, mask, positions

    async def _decode_in_batch(
        self, session: Session, span: BlockSpan, step: pb.InferenceStep, hidden, positions, clock: StepClock
    ) -> torch.Tensor:
        """A one-token step (or a few tokens: speculative decoding's verification), computed together with other
        sessions' steps of the same blocks (peer/batching.py)."""
        away = time.monotonic() - session.last_used
        session.away_s = away if session.away_s is None else 0.7 * session.away_s + 0.3 * away
        batch = hidden.shape[0]
        member = Member(
            session.session_id,
            session.cache,
            hidden,
            positions
            if positions is not None
            else (step.prefix_length + torch.arange(hidden.shape[1])).expand(batch, -1),
            step.prefix_length,
            session.position,
            asyncio.get_running_loop().create_future(),
            reset=lambda: forget_step(session, span, 0),
            adapter=session.adapter,
        )
        out = await self.batcher.step(session.blocks, member)
        clock.computed(member.forward_s, member.shared_by)
        return out

    async def _compute_in_chunks(
        self, session: Session, span: BlockSpan, step: pb.InferenceStep, hidden, mask, positions, clock: StepClock
    ) -> torch.Tensor:
        """The step alone, in chunks of at most max_batch_tokens: other sessions' decode steps run between them."""

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
                        between_layers=self.served.compute.checkpoint,
                        adapter=session.adapter,
                    )
            except Exception:
                forget_step(session, span, step.prefix_length)  # some layers may have grown
                raise

        batch, new = hidden.shape[:2]
        chunk = max(1, self.limits.max_batch_tokens // batch)
        parts = []
        for begin in range(0, new, chunk):
            end = min(new, begin + chunk)
            timed = clock.timed(functools.partial(run, begin, end))
            parts.append(await self.served.run(timed, batch * (end - begin), INFERENCE))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def forget_step(session: Session, span: BlockSpan, prefix_length: int) -> None:
    """Put the session's cache back to `prefix_length` tokens; where it cannot be (a sliding window), start the
    session afresh, so that no step builds on a bad cache."""
    try:
        rewind_cache(session.cache, prefix_length)
    except BadRequestError:
        session.cache, session.position = span.new_cache(), 0
