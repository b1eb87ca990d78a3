"""Blocks beyond memory (peer/offload.py): the budget's split, and a span that streams blocks in computing exactly
what the same span computes with every block resident, within the bytes its plan allows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peer.batching import forward_batch
from peer.blocks import load_span
from peer.offload import (
    MIN_CACHE_TOKENS,
    STREAM_SLOTS,
    DiskStore,
    HostStore,
    block_bytes,
    kv_token_bytes,
    parse_size,
    plan_memory,
)
from protocol.vocab import Offload, Quantization
from swarm.models.checkpoint import load_config
from tests.helpers.models import MOE_CONFIGS, llama_config, mistral_config, save_random_model

CPU = torch.device("cpu")
LAYERS = 6
RESIDENT = 2
CONFIGS = {"llama": llama_config, "mistral-sliding": mistral_config, "qwen2-moe": MOE_CONFIGS["qwen2_moe"]}


@pytest.mark.parametrize(
    ("text", "size"),
    [("3MB", 3_000_000), ("512MiB", 512 * 2**20), ("8GB", 8 * 10**9), ("1.5gb", 1_500_000_000), ("4096", 4096)],
)
def test_sizes_read_as_a_user_writes_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "3XB", "-1GB", "0MB", "1e9"])
def test_a_size_that_is_not_one_says_how_to_write_it(text):
    with pytest.raises(ValueError, match=r"512MB|positive"):
        parse_size(text)


def test_the_budget_holds_every_block_when_it_can_and_streams_the_rest_when_it_cannot():
    blocks, token = [100] * 10, 1
    everything = plan_memory(blocks, token, 8192, 1000 + MIN_CACHE_TOKENS, Offload.DISK)
    assert (everything.resident, everything.streamed, everything.cache_tokens) == (10, 0, MIN_CACHE_TOKENS)
    # two slots (200), the cache up to its 300 tokens, then 3 blocks resident; the 50 bytes left hold no block
    plan = plan_memory(blocks, token, 300, 850, Offload.DISK)
    assert (plan.resident, plan.streamed, plan.cache_tokens, plan.resident_bytes) == (3, 7, 300, 500)
    assert plan.resident_bytes + plan.cache_tokens * token <= plan.budget_bytes
    # never more resident than leaves two blocks to stream
    assert plan_memory(blocks, token, 1, 1000 + MIN_CACHE_TOKENS - 1, Offload.HOST).resident == 8


def test_a_budget_too_small_says_the_least_it_must_be_or_what_to_change():
    with pytest.raises(ValueError, match=f"at least {MIN_CACHE_TOKENS} tokens.*--offload"):
        plan_memory([100] * 10, 1, 8192, 900, Offload.NONE)
    with pytest.raises(ValueError, match=r"give --memory-budget at least 456 B"):
        plan_memory([100] * 10, 1, 8192, 300, Offload.DISK)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    return save_random_model(CONFIGS[request.param](LAYERS), tmp_path_factory.mktemp(request.param), seed=5)


def _spans(path: Path, store, quantization=Quantization.NONE):
    config = load_config(path)
    load = dict(dtype=torch.float32, device=CPU, quantization=quantization)
    return load_span(path, config, 0, LAYERS, **load), load_span(
        path, config, 0, LAYERS, **load, stream=(RESIDENT, store)
    )


@pytest.mark.parametrize("store_kind", ["disk", "host"])
def test_a_streaming_span_computes_what_a_resident_one_does(checkpoint, store_kind, tmp_path):
    store = DiskStore(CPU, tmp_path) if store_kind == "disk" else HostStore(CPU)
    full, streaming = _spans(checkpoint, store)
    try:
        largest = max(block_bytes(checkpoint, full.config, 0, LAYERS, torch.float32))
        assert streaming.streamer is not None and streaming.streamer.streamed_bytes == 0  # nothing loaded yet
        torch.manual_seed(0)
        prompt = torch.randn(2, 7, full.config.hidden_size)
        with torch.inference_mode():
            caches = [full.new_cache(), streaming.new_cache()]
            outputs = [span(prompt, cache=cache) for span, cache in zip((full, streaming), caches)]
            torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
            for position in range(7, 10):  # decode steps, each a pass over the span
                step = torch.randn(2, 1, full.config.hidden_size)
                ids = torch.tensor([[position]]).expand(2, 1)
                outputs = [
                    s(step, position_ids=ids, cache=c, prefix_length=position)
                    for s, c in zip((full, streaming), caches)
                ]
                torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
            # a request for part of the span, and a batch of sessions: the same layers, streamed or not
            middle = torch.randn(1, 3, full.config.hidden_size)
            torch.testing.assert_close(streaming(middle, blocks=(1, 5)), full(middle, blocks=(1, 5)), rtol=0, atol=0)
            step = [torch.randn(2, 1, full.config.hidden_size)]
            ids = [torch.full((2, 1), 10)]
            batched = [forward_batch(s, step, ids, [c], (0, LAYERS))[0] for s, c in zip((full, streaming), caches)]
            torch.testing.assert_close(batched[1], batched[0], rtol=0, atol=0)
        streamer = streaming.streamer
        assert streamer.peak_streamed_bytes <= STREAM_SLOTS * largest
        assert streamer.loads >= 6 * (LAYERS - RESIDENT)  # each pass loads every streamed block again
        # from disk, into the slots' buffers, reused from block to block (a pass without grad holds none back)
        assert streamer.buffers_made == (STREAM_SLOTS if store_kind == "disk" else 0)
        resident = sum(p.numel() * p.element_size() for p in streaming.parameters() if not p.is_meta)
        assert resident <= RESIDENT * largest + STREAM_SLOTS * largest + _rotary_bytes(streaming)
    finally:
        streaming.close()
    if store_kind == "disk":
        assert not store.folder.exists()


def test_a_backward_through_streamed_blocks_uses_the_weights_its_forward_used(checkpoint, tmp_path):
    """Taking a block's weights out never changes them in place: autograd's saved tensors stay valid, also when an
    inference pass between layers (peer/compute.py) streams other blocks in and out meanwhile."""
    full, streaming = _spans(checkpoint, DiskStore(CPU, tmp_path))
    try:
        torch.manual_seed(1)
        hidden = torch.randn(1, 5, full.config.hidden_size)
        grads = []
        for span in (full, streaming):

            def interrupt(span=span):
                with torch.inference_mode():
                    span(torch.randn(1, 2, full.config.hidden_size))

            inputs = hidden.clone().requires_grad_(True)
            output = span(inputs, between_layers=interrupt)
            (output * output).sum().backward()
            grads.append((output.detach(), inputs.grad))
        torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)
    finally:
        streaming.close()


def test_quantized_blocks_stream_as_quantized(tmp_path):
    path = save_random_model(llama_config(LAYERS), tmp_path / "llama", seed=2)
    full, streaming = _spans(path, DiskStore(CPU, tmp_path / "store"), Quantization.INT8)
    try:
        hidden = torch.randn(1, 4, full.config.hidden_size)
        with torch.inference_mode():
            torch.testing.assert_close(streaming(hidden), full(hidden), rtol=0, atol=0)
        stored = sum(f.stat().st_size for f in (tmp_path / "store").rglob("block-*.weights"))
        full_precision = sum(block_bytes(path, full.config, RESIDENT, LAYERS, torch.float32))
        assert stored < full_precision / 2  # int8 codes, not the float32 weights
    finally:
        streaming.close()


def test_kv_bytes_count_every_kv_head_of_every_block():
    config = llama_config(4)  # 2 kv heads of 16
    assert kv_token_bytes(config, 1, 4, torch.float32) == 2 * 2 * 16 * 4 * 3
    assert kv_token_bytes(config, 0, 1, torch.bfloat16) == 2 * 2 * 16 * 2


def _rotary_bytes(span) -> int:
    return sum(t.numel() * t.element_size() for t in span.rotary.parameters())
