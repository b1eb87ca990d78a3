"""`swarmlm export --adapter-only` (client/training/adapters.py): the shapes a peer's adapters are held to, and the
check that every block came with the same adapted layers. The export itself, against peft loading it, is in
tests/integration/test_training.py (test_lora_training_exports_what_the_swarm_serves)."""

from __future__ import annotations

import pytest
import torch

from client.training.adapters import _targets, adapter_shapes
from protocol.errors import NoPeersError, PeerFaultError

SHAPES = {
    "model.embed_tokens.weight": (100, 16),
    "model.layers.0.self_attn.q_proj.weight": (16, 16),
    "model.layers.0.mlp.down_proj.weight": (16, 32),
    "model.layers.0.input_layernorm.weight": (16,),
    "model.layers.1.self_attn.q_proj.weight": (16, 16),
    "model.layers.1.mlp.down_proj.weight": (16, 32),
}


def test_each_linear_layer_of_a_block_may_carry_a_by_in_and_b_by_out_of_the_runs_rank():
    expected = adapter_shapes(SHAPES, rank=4)
    assert expected["model.layers.0.mlp.down_proj.lora_A.weight"] == (4, 32)
    assert expected["model.layers.0.mlp.down_proj.lora_B.weight"] == (16, 4)
    assert len(expected) == 8  # 2 blocks x 2 linear layers x (A, B): no norm, no embeddings
    assert not any("layernorm" in name or "embed" in name for name in expected)


def _adapters(layers_by_block: dict[int, list[str]]) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{block}.{layer}.lora_{ab}.weight": torch.zeros(1)
        for block, layers in layers_by_block.items()
        for layer in layers
        for ab in "AB"
    }


def test_every_block_must_bring_the_same_adapted_layers_each_with_a_and_b():
    layers = ["self_attn.q_proj", "mlp.down_proj"]
    assert _targets(_adapters({0: layers, 1: layers}), num_blocks=2) == ["down_proj", "q_proj"]
    with pytest.raises(NoPeersError, match=r"blocks \[1\]"):
        _targets(_adapters({0: layers}), num_blocks=2)
    with pytest.raises(PeerFaultError, match="block 1"):
        _targets(_adapters({0: layers, 1: layers[:1]}), num_blocks=2)
    lacking_b = _adapters({0: layers, 1: layers})
    del lacking_b["model.layers.1.mlp.down_proj.lora_B.weight"]
    with pytest.raises(PeerFaultError, match="lack A or B"):
        _targets(lacking_b, num_blocks=2)
