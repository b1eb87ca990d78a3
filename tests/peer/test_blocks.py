"""Spans of blocks loaded from a checkpoint compute exactly what the Hugging Face model computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MistralConfig

from peer.blocks import load_span, rewind_cache
from protocol.errors import BadRequestError, ModelNotFoundError
from swarm.models.checkpoint import load_config
from tests.helpers.models import MOE_CONFIGS, llama_config, qwen2_config, qwen3_config, save_random_model


def mistral_config(num_layers: int = 4) -> MistralConfig:
    return MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        sliding_window=4,
    )


def qwen3_sliding_config(num_layers: int = 4):
    config = qwen3_config(num_layers)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 3, 2
    config.layer_types = ["full_attention"] * 2 + ["sliding_attention"] * (num_layers - 2)
    return config


CONFIGS = {
    "llama": llama_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "qwen3-sliding": qwen3_sliding_config,
    "mistral-sliding": mistral_config,
    **MOE_CONFIGS,  # checkpoints whose experts transformers fuses on load
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = save_random_model(CONFIGS[request.param](4), tmp_path_factory.mktemp(request.param), seed=3)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Path(path), reference


def _spans(path: Path, bounds):
    return [
        load_span(path, load_config(path), a, b, dtype=torch.float32, device=torch.device("cpu")) for a, b in bounds
    ]


def _reference_hidden(reference, ids, mask, positions):
    """The last hidden state before the final norm, by running the reference's own layers."""
    captured = {}
    handle = reference.model.norm.register_forward_hook(lambda m, args, out: captured.setdefault("h", args[0]))
    with torch.no_grad():
        reference(ids, attention_mask=mask, position_ids=positions)
    handle.remove()
    return captured["h"]


def test_chained_spans_match_the_model_with_padding(checkpoint):
    path, reference = checkpoint
    ids = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    first, second = _spans(path, [(0, 1), (1, 4)])
    with torch.no_grad():
        hidden = reference.model.embed_tokens(ids)
        got = second(first(hidden, mask, positions), mask, positions)
    expected = _reference_hidden(reference, ids, mask, positions)
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=0)


def test_incremental_steps_with_cache_match_one_pass(checkpoint):
    path, _reference = checkpoint
    (span,) = _spans(path, [(0, 4)])
    hidden = torch.randn(1, 10, 64)
    with torch.no_grad():
        full = span(hidden)
        cache = span.new_cache()
        parts = [span(hidden[:, :6], cache=cache, prefix_length=0)]
        for t in range(6, 10):
            parts.append(span(hidden[:, t : t + 1], cache=cache, prefix_length=t))
    # attention over a cache sums in another order than one pass; with the test models' sharp attention
    # (tests/helpers/models.py) that differs by up to ~6e-5 in fp32, while a cache bug moves values by whole units
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-4, rtol=0)


def test_rewound_cache_continues_like_a_fresh_one(checkpoint):
    """Rewinding within every layer's window, then a different continuation: as if it had been sent first."""
    path, _ = checkpoint
    (span,) = _spans(path, [(0, 4)])
    generator = torch.Generator().manual_seed(0)
    hidden, branch = torch.randn(2, 1, 2, 64, generator=generator)  # shorter than the smallest window, 3
    with torch.no_grad():
        expected = span(torch.cat([hidden[:, :1], branch], dim=1))[:, 1:]
        cache = span.new_cache()
        span(hidden, cache=cache)
        rewind_cache(cache, 1)
        got = span(branch, cache=cache, prefix_length=1)
    assert cache.get_seq_length() == 3
    # cached attention sums in another order than one pass (see above); a rewind bug moves values by whole units
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def test_rewinding_past_a_sliding_window_is_a_typed_error(tmp_path):
    path = Path(save_random_model(mistral_config(2), tmp_path, seed=1))  # window of 4 tokens
    (span,) = _spans(path, [(0, 2)])
    cache = span.new_cache()
    with torch.no_grad():
        span(torch.randn(1, 9, 64), cache=cache)
    with pytest.raises(BadRequestError, match="keeps only its last 4 tokens; replay the sequence in a new session"):
        rewind_cache(cache, 2)


def test_sub_span_runs_only_its_blocks(checkpoint):
    path, _ = checkpoint
    (whole,) = _spans(path, [(0, 4)])
    first, second = _spans(path, [(0, 2), (2, 4)])
    hidden = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(whole(hidden, blocks=(0, 2)), first(hidden), atol=1e-6, rtol=0)
        torch.testing.assert_close(whole(hidden, blocks=(2, 4)), second(hidden), atol=1e-6, rtol=0)


def test_a_span_holds_only_its_own_weights(checkpoint):
    path, reference = checkpoint
    (span,) = _spans(path, [(1, 3)])
    own = sum(p.numel() for layer in reference.model.layers[1:3] for p in layer.parameters())
    assert sum(p.numel() for p in span.parameters()) == own
    assert not any(p.requires_grad for p in span.parameters())  # frozen


def test_blocks_outside_the_model_are_rejected(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="outside the model's 0:4"):
        load_span(path, load_config(path), 2, 5, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("family", "dropped", "said"),
    [
        ("llama", "model.layers.2.mlp.up_proj.weight", r"lacks tensors of block 2: \['mlp.up_proj.weight'\]"),
        ("mixtral", "model.layers.3.block_sparse_moe.gate.weight", r"lacks tensors of block 3: \['mlp.gate.weight'\]"),
        ("mixtral", "model.layers.2.block_sparse_moe.experts.1.w1.weight", "lacks tensors of block 2"),
    ],
)
def test_a_checkpoint_without_some_tensor_of_the_span_is_refused_by_name(tmp_path, family, dropped, said):
    path = save_random_model({**CONFIGS, **MOE_CONFIGS}[family](4), tmp_path, seed=0)
    (shard,) = path.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ModelNotFoundError, match=said):
        _spans(path, [(2, 4)])
    _spans(path, [(0, 2)])  # the other blocks are whole


def test_a_model_whose_ends_no_client_computes_is_refused_by_the_peer(tmp_path):
    """A peer would serve blocks no client can use (swarm/models/ends.py): it refuses at start, saying why."""
    from transformers import AutoConfig

    from tests.helpers.models import _common

    path = save_random_model(AutoConfig.for_model("gpt_neox", **_common(4)), tmp_path, seed=0)
    with pytest.raises(ModelNotFoundError, match=r"blocks are not `model\.layers` between"):
        _spans(path, [(0, 2)])
