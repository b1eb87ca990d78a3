"""Decode steps of concurrent sessions, computed as one batched forward over the span, exact per session.

A step of a few tokens (speculative decoding's verification: the last token and its drafts) is batched too, where
every layer attends to the whole cache: the batch's steps are padded on the right to the longest, each row's
queries see its own cache and its own tokens before them, and only each step's real keys and values are stored.

A decode step (one new token per row) of a session waits in its group (sessions of the same blocks) while the
compute thread is busy; the thread then takes the whole group, up to `max_batch_tokens` rows, and runs it as one
forward. Batching pays because a decode step's cost is reading the weights, which one batched matmul reads once.

Each session keeps its own KV cache (peer/inference.py Session.cache, a transformers DynamicCache). In the batched
forward, `BatchCache` stands for all of them: each layer's new keys and values are appended to each session's
own cache, and attention reads their states padded on the right to the longest, with a per-row mask that hides
the padding. Rotary positions are per row. Nothing else differs from the session computed alone, so outputs
agree with it to rounding (fp32: ~1e-7).

If a batch fails as a whole, every member's cache is put back and each is computed alone, so that one bad
member costs only itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from peer.blocks import BlockSpan, rewind_cache
from peer.compute import INFERENCE, ComputeQueue

logger = logging.getLogger(__name__)

BATCHED_ATTENTION = ("sdpa", "eager")  # attention implementations that take the per-row padding mask below
DUE_SLACK_S = 0.003  # a session's step may come this much later than due and still be waited for


MAX_STEP_TOKENS = 16
"""Steps of up to this many new tokens per row are batched (a speculative verification step is the last token and
its drafts); longer ones are prefills, computed alone in chunks."""


def can_batch(span: BlockSpan, new: int = 1) -> bool:
    """Whether steps of `new` tokens a row over `span` can be batched: one token always where the attention takes
    a padding mask; several only where every layer attends to the whole cache (no sliding window)."""
    if getattr(span.config, "_attn_implementation", None) not in BATCHED_ATTENTION:
        return False
    return new == 1 or (new <= MAX_STEP_TOKENS and set(span.types) == {"full_attention"})


def stored_tokens(cache: DynamicCache, layer_idx: int) -> int:
    """Tokens whose keys and values the layer `layer_idx` of `cache` holds (a sliding window holds its last)."""
    layer = cache.layers[layer_idx]
    return layer.keys.shape[-2] if getattr(layer, "is_initialized", False) else 0


class BatchCache:
    """The caches of a batch's sessions, as one cache to the decoder layers: `rows[i]` rows belong to `caches[i]`,
    whose step has `new[i]` tokens (the batch's states are padded on the right to the longest step)."""

    def __init__(self, caches: list[DynamicCache], rows: list[int], new: list[int]):
        self.caches, self.rows, self.new = caches, rows, new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = [], []
        parts = zip(self.caches, self.new, key_states.split(self.rows), value_states.split(self.rows))
        for cache, new, k, v in parts:
            k, v = cache.update(k[:, :, :new], v[:, :, :new], layer_idx)
            keys.append(k)
            values.append(v)
        length = max(k.shape[-2] for k in keys)
        return _pad_cat(keys, length), _pad_cat(values, length)


def _pad_cat(states: list[torch.Tensor], length: int) -> torch.Tensor:
    """[b_i, heads, len_i, dim] each -> [sum b_i, heads, length, dim], zeros on the right."""
    return torch.cat([F.pad(s, (0, 0, 0, length - s.shape[-2])) for s in states])


def padding_mask(lengths: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor | None:
    """Row r attends to its first `lengths[r]` states: [rows, 1, 1, max length], or None when all are full."""
    longest = int(lengths.max())
    if bool((lengths == longest).all()):
        return None
    allowed = (torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=lengths.device).masked_fill(~allowed, torch.finfo(dtype).min)


def step_mask(held: torch.Tensor, new: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """Row r's query j attends to its first held[r] + j + 1 states (causal within its `new[r]` tokens; queries
    past them are padding, whose outputs are dropped): [rows, 1, longest step, longest cache]."""
    steps, longest = int(new.max()), int((held + new).max())
    query = torch.minimum(torch.arange(steps, device=held.device)[None, :], new[:, None] - 1)
    allowed = (torch.arange(longest, device=held.device)[None, None, :] <= (held[:, None] + query)[:, :, None])[:, None]
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=held.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _pad_steps(tensors: list[torch.Tensor], steps: int) -> torch.Tensor:
    """[b_i, n_i, ...] each -> [sum b_i, steps, ...]: each step padded on the right by repeating its last entry."""
    padded = [torch.cat([t, t[:, -1:].expand(-1, steps - t.shape[1], *t.shape[2:])], dim=1) for t in tensors]
    return torch.cat(padded)


def forward_batch(
    span: BlockSpan,
    hidden: list[torch.Tensor],
    positions: list[torch.Tensor],
    caches: list[DynamicCache],
    blocks: tuple[int, int],
    adapters: list[str] | None = None,
) -> list[torch.Tensor]:
    """One step of several sessions over `blocks`: hidden[i] is [b_i, n_i, hidden], positions[i] [b_i, n_i]; n_i is
    1 (a decode step), or more where can_batch(span, n_i) (a verification step of speculative decoding).
    adapters[i]: the named adapter of session i ("": none; peer/adapters.py), each row through its own."""
    start, end = blocks
    types = span.types[start - span.start : end - span.start]
    device = span.device
    rows, new = [h.shape[0] for h in hidden], [h.shape[1] for h in hidden]
    steps = max(new)
    states = _pad_steps(hidden, steps).to(device)
    position_ids = _pad_steps(positions, steps).to(device)
    masks = {}
    for kind in set(types):
        first = start + types.index(kind)  # every layer of a kind holds as many tokens as the first
        held = [stored_tokens(c, first) for c in caches]
        if steps == 1:
            lengths = torch.tensor([h + 1 for h, r in zip(held, rows) for _ in range(r)], device=device)
            masks[kind] = padding_mask(lengths, span.config._attn_implementation, states.dtype)
        else:
            held_rows = torch.tensor([h for h, r in zip(held, rows) for _ in range(r)], device=device)
            new_rows = torch.tensor([n for n, r in zip(new, rows) for _ in range(r)], device=device)
            masks[kind] = step_mask(held_rows, new_rows, span.config._attn_implementation, states.dtype)
    view = BatchCache(caches, rows, new)
    position_embeddings = span.position_embeddings(states, position_ids, types)
    per_row = [name for name, r in zip(adapters, rows) for _ in range(r)] if adapters and any(adapters) else None
    with span.adapter_rows(per_row, sum(rows)):
        for index, kind in enumerate(types):
            if span.expert_caches is not None:
                span.expert_caches.before(start + index, states)
            states = span.layer(start + index)(
                states,
                attention_mask=masks[kind],
                position_ids=position_ids,
                cache=view,
                use_cache=True,
                position_embeddings=position_embeddings[kind],
            )
    return [out[:, :n] for out, n in zip(states.split(rows), new)]


@dataclass
class Member:
    """One session's decode step waiting for its batch."""

    key: str  # the session's id
    cache: DynamicCache
    hidden: torch.Tensor  # [batch, 1, hidden]
    positions: torch.Tensor  # [batch, 1]
    prefix_length: int
    position: int  # tokens the session's cache holds now (more than prefix_length: a retried step)
    future: asyncio.Future
    reset: Callable[[], None] = field(default=lambda: None)  # when the cache cannot be put back: start afresh
    output: Any = None
    error: BaseException | None = None
    forward_s: float = 0.0  # how long the forward that computed this step took (peer/timings.py)
    shared_by: int = 1  # steps computed in that forward
    adapter: str = ""  # the session's named adapter (peer/adapters.py); "" for none

    @property
    def rows(self) -> int:
        """Tokens of the step (rows times new tokens a row): what the batch's token budget counts."""
        return self.hidden.shape[0] * self.hidden.shape[1]


class DecodeBatcher:
    """Collects decode steps by blocks and runs each group as one batch on the compute thread."""

    def __init__(
        self,
        compute: ComputeQueue,
        span: Callable[[], BlockSpan | None],
        max_batch_tokens: int,
        *,
        expected: Callable[[tuple[int, int]], dict[str, float]] = lambda blocks: {},
        max_wait_s: float = 0.1,
    ):
        """`expected(blocks)`: session id -> when (time.monotonic()) its next decode step on `blocks` is due."""
        self.compute, self.span, self.max_batch_tokens = compute, span, max_batch_tokens
        self.expected, self.max_wait_s = expected, max_wait_s
        self._waiting: dict[tuple[int, int], list[Member]] = {}
        self._lock = threading.Lock()  # _waiting: appended on the event loop, taken on the compute thread
        self._runners: dict[tuple[int, int], asyncio.Task] = {}
        self._arrived = asyncio.Event()
        self._last_batch_s = 0.0  # how long the latest batch took to compute
        self.batches = 0  # batched forwards run, and the steps in them (for Info and benchmarks)
        self.batched_steps = 0

    async def step(self, blocks: tuple[int, int], member: Member) -> torch.Tensor:
        with self._lock:
            self._waiting.setdefault(blocks, []).append(member)
        self._arrived.set()
        if blocks not in self._runners:
            self._runners[blocks] = asyncio.ensure_future(self._run(blocks))
        return await member.future  # cancelled (the client went away): skipped unless its batch already began

    async def _gather(self, blocks: tuple[int, int]) -> None:
        """Wait a little for the steps of other sessions of the same blocks that are due now. Without it, sessions
        that reach the peer a few ms apart split into a batch of one and a batch of the rest, at every hop, and
        stay split. `expected(blocks)` says when each decoding session's next step is due (its latest step's end
        plus its usual time away); the wait ends when those due within the bound are in, and is at most twice
        the latest batch's compute time (and `max_wait_s`)."""
        bound = time.monotonic() + min(self.max_wait_s, 4 * self._last_batch_s)
        while True:
            with self._lock:
                waiting = self._waiting.get(blocks, [])
                keys, rows = {m.key for m in waiting}, sum(m.rows for m in waiting)
            due = [at for key, at in self.expected(blocks).items() if key not in keys and at <= bound]
            now = time.monotonic()
            until = min(bound, max(due, default=now) + DUE_SLACK_S)
            if not due or rows >= self.max_batch_tokens or now >= until:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), until - now)
            except asyncio.TimeoutError:
                return

    async def _run(self, blocks: tuple[int, int]) -> None:
        try:
            while True:
                with self._lock:
                    if not self._waiting.get(blocks):
                        self._waiting.pop(blocks, None)
                        return
                await self._gather(blocks)
                try:
                    members = await self.compute.run(lambda: self._compute(blocks), INFERENCE)
                except BaseException as exc:  # the compute thread stopped: fail those still waiting
                    with self._lock:
                        left = self._waiting.pop(blocks, [])
                    for member in left:
                        if not member.future.done():
                            member.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))
                    raise
                for member in members:
                    if member.future.done():  # cancelled meanwhile
                        continue
                    if member.error is not None:
                        member.future.set_exception(member.error)
                    else:
                        member.future.set_result(member.output)
        finally:
            self._runners.pop(blocks, None)

    def _take(self, blocks: tuple[int, int]) -> list[Member]:
        """The waiting members of `blocks` that fit in one batch, oldest first (the rest wait for the next): at most
        `max_batch_tokens` tokens, and padded to the longest step at most twice their own tokens, so that a
        prompt of 16 tokens does not make eight one-token steps compute 16 positions each."""
        with self._lock:
            waiting = [m for m in self._waiting.get(blocks, []) if not m.future.cancelled()]
            taken, tokens, rows, widest = [], 0, 0, 0
            for member in waiting:
                batch, new = member.hidden.shape[:2]
                padded = (rows + batch) * max(widest, new)
                if taken and (tokens + member.rows > self.max_batch_tokens or padded > 2 * (tokens + member.rows)):
                    break
                taken.append(member)
                tokens, rows, widest = tokens + member.rows, rows + batch, max(widest, new)
            self._waiting[blocks] = waiting[len(taken) :]
        return taken

    def _compute(self, blocks: tuple[int, int]) -> list[Member]:
        taken, members = self._take(blocks), []
        span = self.span()
        for member in taken:  # a retried step: forget what follows it, as the solo path does
            try:
                if member.prefix_length < member.position:
                    rewind_cache(member.cache, member.prefix_length)
                members.append(member)
            except Exception as exc:  # a sliding window past the step: this member only fails
                member.error = exc
                member.reset()
        if not members:
            return taken
        began = time.perf_counter()
        with torch.inference_mode():
            try:
                if span is None:
                    raise RuntimeError("this peer is moving to other blocks")
                outputs = forward_batch(
                    span,
                    [m.hidden for m in members],
                    [m.positions for m in members],
                    [m.cache for m in members],
                    blocks,
                    [m.adapter for m in members],
                )
            except Exception as exc:
                logger.warning("a batch of %d decode steps failed (%r); computing each alone", len(members), exc)
                for member in members:
                    alone = time.perf_counter()
                    self._alone(span, member, blocks)
                    member.forward_s = time.perf_counter() - alone
                return taken
        self._last_batch_s = time.perf_counter() - began
        for member, output in zip(members, outputs):
            member.output, member.forward_s, member.shared_by = output, self._last_batch_s, len(members)
        self.batches += 1
        self.batched_steps += len(members)
        return taken

    @staticmethod
    def _alone(span: BlockSpan | None, member: Member, blocks: tuple[int, int]) -> None:
        try:
            rewind_cache(member.cache, member.prefix_length)  # some layers of the failed batch may have grown
            if span is None:
                raise RuntimeError("this peer is moving to other blocks")
            member.output = span(
                member.hidden,
                None,
                member.positions,
                member.cache,
                member.prefix_length,
                blocks=blocks,
                adapter=member.adapter,
            )
        except Exception as exc:
            member.error = exc
            try:
                rewind_cache(member.cache, member.prefix_length)
            except Exception:  # cannot: the session starts afresh, so no step builds on a bad cache
                member.reset()
