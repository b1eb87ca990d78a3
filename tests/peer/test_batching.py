"""Batched decode steps (peer/batching.py) against the same sessions computed alone, on real transformers layers:
sessions of different cache lengths, batch sizes and families (Mistral's sliding window included), the batcher's
grouping on a real compute thread, cancellation, the token budget, and a failing member."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from peer.batching import MAX_STEP_TOKENS, DecodeBatcher, Member, can_batch, forward_batch
from peer.blocks import load_span, rewind_cache
from peer.compute import INFERENCE, ComputeQueue
from swarm.models.checkpoint import load_config
from tests.helpers.models import HIDDEN_SIZE, make_tiny

RTOL = 1e-5  # of the largest |output|: batched and solo matmuls round differently, by ~1e-7 relative per layer


def _span(tmp_path_factory, family: str):
    path = make_tiny(family, tmp_path_factory.mktemp(family) / f"tiny-{family}", num_layers=4, seed=0)
    return load_span(Path(path), load_config(Path(path)), 0, 4, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _span(tmp_path_factory, "llama")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    worst, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert worst <= RTOL * scale, f"batched differs from solo by {worst:.2e} (outputs up to {scale:.1f})"


def _sessions(span, lengths, batches, seed=0):
    """Two identical caches per session (solo, batched), prefilled with the same random prompt."""
    g = torch.Generator().manual_seed(seed)
    solo, batched = [], []
    with torch.inference_mode():
        for length, batch in zip(lengths, batches):
            prompt = torch.randn(batch, length, HIDDEN_SIZE, generator=g)
            for caches in (solo, batched):
                cache = span.new_cache()
                span(prompt, None, None, cache, 0)
                caches.append(cache)
    return solo, batched


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_a_batch_of_sessions_of_different_lengths_computes_what_each_would_alone(tmp_path_factory, family):
    span = _span(tmp_path_factory, family)
    lengths, batches = [3, 20, 7, 1, 30], [1, 2, 1, 1, 3]  # Mistral's window is 16: two of them are past it
    solo, batched = _sessions(span, lengths, batches)
    positions = list(lengths)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for _ in range(20):  # past the window for all but the shortest
            hidden = [torch.randn(b, 1, HIDDEN_SIZE, generator=g) for b in batches]
            where = [torch.full((b, 1), p) for b, p in zip(batches, positions)]
            alone = [span(h, None, q, c, p) for h, q, c, p in zip(hidden, where, solo, positions)]
            together = forward_batch(span, hidden, where, batched, (0, 4))
            for a, t in zip(alone, together):
                _close(t, a)
            positions = [p + 1 for p in positions]
    for a, t in zip(solo, batched):  # the caches hold the same states too
        assert a.get_seq_length() == t.get_seq_length()
        _close(t.layers[-1].keys, a.layers[-1].keys)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_steps_of_several_tokens_and_branches_compute_what_each_would_alone(tmp_path_factory, family):
    """Speculative decoding's verification steps: sessions whose steps carry 1 to 9 tokens in one batch, some of
    them building on fewer tokens than their cache holds (the drafts refused last round are dropped first)."""
    span = _span(tmp_path_factory, family)
    assert can_batch(span, 9) and not can_batch(span, MAX_STEP_TOKENS + 1)
    lengths, batches = [3, 20, 7, 12], [1, 2, 1, 1]
    solo, batched = _sessions(span, lengths, batches)
    positions = list(lengths)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for round_ in range(6):
            new = [1 + (round_ + i) % 9 for i in range(len(lengths))]
            if round_ % 2:  # a branch: each drops its last two tokens before the step
                positions = [p - 2 for p in positions]
                for caches in (solo, batched):
                    for cache, p in zip(caches, positions):
                        rewind_cache(cache, p)
            hidden = [torch.randn(b, n, HIDDEN_SIZE, generator=g) for b, n in zip(batches, new)]
            where = [(p + torch.arange(n)).expand(b, -1) for b, n, p in zip(batches, new, positions)]
            alone = [span(h, None, q, c, p) for h, q, c, p in zip(hidden, where, solo, positions)]
            together = forward_batch(span, hidden, where, batched, (0, 4))
            for a, t in zip(alone, together):
                assert t.shape == a.shape
                _close(t, a)
            positions = [p + n for p, n in zip(positions, new)]
    for a, t in zip(solo, batched):
        assert a.get_seq_length() == t.get_seq_length()
        _close(t.layers[-1].keys, a.layers[-1].keys)


def test_a_sliding_window_batches_one_token_steps_only(tmp_path_factory):
    span = _span(tmp_path_factory, "mistral")
    assert can_batch(span, 1) and not can_batch(span, 2)


def test_a_batch_over_some_of_the_blocks(llama):
    solo, batched = _sessions(llama, [4, 9], [1, 1])
    hidden = [torch.randn(1, 1, HIDDEN_SIZE) for _ in range(2)]
    where = [torch.tensor([[4]]), torch.tensor([[9]])]
    with torch.inference_mode():
        alone = [llama(h, None, q, c, q.item(), blocks=(1, 3)) for h, q, c in zip(hidden, where, solo)]
        together = forward_batch(llama, hidden, where, batched, (1, 3))
    for a, t in zip(alone, together):
        _close(t, a)


class Blocked:
    """Keeps the compute thread busy until released, so that the steps submitted meanwhile form one batch."""

    def __init__(self, compute: ComputeQueue):
        self.release = threading.Event()
        self.task = asyncio.ensure_future(compute.run(lambda: self.release.wait(30), INFERENCE))


def _member(cache, hidden, position, loop) -> Member:
    return Member(
        f"session-{id(cache)}",
        cache,
        hidden,
        torch.full((hidden.shape[0], 1), position),
        position,
        position,
        loop.create_future(),
    )


def test_the_batcher_batches_what_waits_skips_the_cancelled_and_keeps_to_its_budget(llama):
    lengths = [5, 11, 2, 8]
    solo, batched = _sessions(llama, lengths, [1, 1, 1, 1])
    hidden = [torch.randn(1, 1, HIDDEN_SIZE) for _ in lengths]
    compute = ComputeQueue()
    batcher = DecodeBatcher(compute, lambda: llama, max_batch_tokens=2)

    async def main():
        loop = asyncio.get_running_loop()
        blocked = Blocked(compute)
        await asyncio.sleep(0.05)
        members = [_member(c, h, p, loop) for c, h, p in zip(batched, hidden, lengths)]
        steps = [asyncio.ensure_future(batcher.step((0, 4), m)) for m in members]
        await asyncio.sleep(0.05)
        steps[1].cancel()  # its client went away before the batch began
        blocked.release.set()
        await blocked.task
        return await asyncio.gather(*steps, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        compute.close()
    assert isinstance(results[1], asyncio.CancelledError)
    assert batched[1].get_seq_length() == lengths[1], "a cancelled step was computed"
    # three steps, two rows a batch at most: two batches
    assert (batcher.batches, batcher.batched_steps) == (2, 3)
    with torch.inference_mode():
        for i in (0, 2, 3):
            _close(results[i], llama(hidden[i], None, torch.tensor([[lengths[i]]]), solo[i], lengths[i]))


def _waiting_together(span, caches, hidden, prefixes, held):
    """Steps `hidden[i]` of sessions whose caches hold `held[i]` tokens and that build on `prefixes[i]`, submitted
    while the compute thread is busy, so that they wait together: (the batcher, each step's output)."""
    compute = ComputeQueue()
    batcher = DecodeBatcher(compute, lambda: span, max_batch_tokens=64)

    async def main():
        loop = asyncio.get_running_loop()
        blocked = Blocked(compute)
        await asyncio.sleep(0.05)
        members = [
            Member(f"s{i}", c, h, (p + torch.arange(h.shape[1]))[None], p, length, loop.create_future())
            for i, (c, h, p, length) in enumerate(zip(caches, hidden, prefixes, held))
        ]
        steps = [asyncio.ensure_future(batcher.step((0, 4), m)) for m in members]
        await asyncio.sleep(0.05)
        blocked.release.set()
        await blocked.task
        return await asyncio.gather(*steps)

    try:
        return batcher, asyncio.run(main())
    finally:
        compute.close()


def test_the_batcher_batches_steps_of_several_tokens_and_a_branch(llama):
    """Verification steps of 3, 1 and 5 tokens wait together and go as one batch; the second builds on 9 of its 11
    tokens (the drafts its client refused), so its cache is cut back first, as a step computed alone would be."""
    lengths, prefixes, new = [5, 11, 8], [5, 9, 8], [3, 1, 5]
    solo, batched = _sessions(llama, lengths, [1, 1, 1])
    hidden = [torch.randn(1, n, HIDDEN_SIZE) for n in new]
    batcher, results = _waiting_together(llama, batched, hidden, prefixes, lengths)
    assert (batcher.batches, batcher.batched_steps) == (1, 3)  # 9 tokens, padded to 15: within twice
    with torch.inference_mode():
        for i, (h, p) in enumerate(zip(hidden, prefixes)):
            rewind_cache(solo[i], p)
            _close(results[i], llama(h, None, (p + torch.arange(h.shape[1]))[None], solo[i], p))
            assert batched[i].get_seq_length() == p + h.shape[1]


def test_a_long_step_waits_rather_than_padding_short_ones_to_its_length(llama):
    """Eight one-token steps, then a step of 16 tokens: padding the eight to 16 positions would compute 144 for 24,
    so the long step goes in a batch of its own."""
    lengths = [4, 6, 3, 5, 7, 2, 8, 9, 5]
    _, batched = _sessions(llama, lengths, [1] * 9)
    hidden = [torch.randn(1, 1, HIDDEN_SIZE) for _ in range(8)] + [torch.randn(1, 16, HIDDEN_SIZE)]
    batcher, results = _waiting_together(llama, batched, hidden, lengths, lengths)
    assert (batcher.batches, batcher.batched_steps) == (2, 9)
    assert [r.shape[1] for r in results] == [1] * 8 + [16]


def test_a_member_that_breaks_the_batch_fails_alone(llama):
    solo, batched = _sessions(llama, [6, 3], [1, 1])
    good = torch.randn(1, 1, HIDDEN_SIZE)
    compute = ComputeQueue()
    batcher = DecodeBatcher(compute, lambda: llama, max_batch_tokens=64)

    async def main():
        loop = asyncio.get_running_loop()
        blocked = Blocked(compute)
        await asyncio.sleep(0.05)
        members = [
            _member(batched[0], good, 6, loop),
            _member(batched[1], torch.randn(1, 1, HIDDEN_SIZE + 1), 3, loop),
        ]  # not this model's width
        steps = [asyncio.ensure_future(batcher.step((0, 4), m)) for m in members]
        await asyncio.sleep(0.05)
        blocked.release.set()
        await blocked.task
        return await asyncio.gather(*steps, return_exceptions=True)

    try:
        out, error = asyncio.run(main())
    finally:
        compute.close()
    assert isinstance(error, RuntimeError)
    assert batched[1].get_seq_length() == 3, "the failed member's cache was not put back"
    with torch.inference_mode():
        _close(out, llama(good, None, torch.tensor([[6]]), solo[0], 6))
