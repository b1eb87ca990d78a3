"""Tiny random-weight models built from a transformers config and saved as safetensors (nothing downloaded).

Each builder seeds torch, builds `AutoModelForCausalLM.from_config(config)` in float32 and saves it with
`save_pretrained(path)`; no tokenizer is written. The same seed gives the same weights, so a test can rebuild
the reference model locally and compare it with what the swarm computes.

The weights are drawn with a larger scale than transformers' default (INIT_SCALE): at the default 0.02 the
logits are nearly flat, greedy decoding repeats one token, and a client that sends wrong positions or keeps
too short a cache still produces the reference tokens. At 0.2 a 24-token greedy run has 13-24 distinct
tokens, a decode step at a wrong position moves the logits by several units, and the difference between
cached and uncached computation stays near 1e-5 (fp32), well under the tests' 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_HEADS = 4
NUM_KV_HEADS = 2  # grouped-query attention: 2 query heads per key/value head
VOCAB_SIZE = 128
MAX_POSITIONS = 256
INIT_SCALE = 0.2  # std of the random weights; see the module docstring


def _common(num_layers: int) -> dict:
    return dict(
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=INIT_SCALE,
    )


def llama_config(num_layers: int = 4) -> LlamaConfig:
    return LlamaConfig(**_common(num_layers), tie_word_embeddings=False)


def qwen3_config(num_layers: int = 4) -> Qwen3Config:
    return Qwen3Config(**_common(num_layers), head_dim=16, tie_word_embeddings=True)


def qwen2_config(num_layers: int = 4) -> Qwen2Config:
    return Qwen2Config(**_common(num_layers), tie_word_embeddings=True)


def mistral_config(num_layers: int = 4) -> MistralConfig:
    # a window shorter than the tests' sequences, so that sliding-window attention is exercised too
    return MistralConfig(**_common(num_layers), head_dim=16, sliding_window=16, tie_word_embeddings=False)


CONFIGS = {"llama": llama_config, "mistral": mistral_config, "qwen2": qwen2_config, "qwen3": qwen3_config}
"""Every family the peers are tested on: name -> config builder."""


def save_random_model(config: PretrainedConfig, path: str | Path, *, seed: int = 0) -> Path:
    """Build a random-weight causal LM from `config` (seeded) and save it to `path` as safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_llama(path: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """A Llama with GQA (4 heads, 2 kv heads), hidden 64, vocab 128, untied LM head."""
    return save_random_model(llama_config(num_layers), path, seed=seed)


def make_tiny_qwen3(path: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """A Qwen3 (q/k norms, head_dim 16) with GQA, hidden 64, vocab 128, tied LM head."""
    return save_random_model(qwen3_config(num_layers), path, seed=seed)


def make_tiny_qwen2(path: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """A Qwen2 (qkv biases) with GQA, hidden 64, vocab 128, tied LM head."""
    return save_random_model(qwen2_config(num_layers), path, seed=seed)


def make_tiny_mistral(path: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """A Mistral with GQA and a 16-token sliding window, hidden 64, vocab 128, untied LM head."""
    return save_random_model(mistral_config(num_layers), path, seed=seed)


def make_tiny(family: str, path: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """A tiny random model of `family` (a key of CONFIGS)."""
    return save_random_model(CONFIGS[family](num_layers), path, seed=seed)


def mixtral_config(num_layers: int = 4) -> MixtralConfig:
    return MixtralConfig(**_common(num_layers), num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)


def qwen2_moe_config(num_layers: int = 4) -> Qwen2MoeConfig:
    """Routed experts beside a gated shared expert, and one plain MLP layer (mlp_only_layers)."""
    return Qwen2MoeConfig(
        **_common(num_layers),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )


def qwen3_moe_config(num_layers: int = 4) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **_common(num_layers),
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


MOE_CONFIGS = {"mixtral": mixtral_config, "qwen2_moe": qwen2_moe_config, "qwen3_moe": qwen3_moe_config}
"""Mixture-of-experts families: name -> config builder (their checkpoints name experts otherwise than their modules)."""
