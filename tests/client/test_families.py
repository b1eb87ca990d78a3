"""Families whose causal LM does more around its blocks than a lookup and `lm_head(norm(hidden))` with an RMSNorm, on
an in-memory swarm (swarm/models/ends.py): Gemma 2 (scaled embeddings, capped attention scores and logits, sliding and
full layers), Gemma 3 (scaled embeddings, a rotary embedding per attention type, capped logits, a tied head), Granite
(embedding, residual, attention and logit multipliers), StableLM and StarCoder2 (a LayerNorm with a bias as final
norm; partial rotary, qk norms; a sliding window), OLMo (a LayerNorm without parameters, clipped qkv), Phi and
Persimmon (a final norm named `final_layernorm`; Phi's head has a bias), Cohere 1 and 2 (logits times `logit_scale`)
and MiniCPM3 (embeddings scaled in their module, logits divided, latent attention); and four mixture-of-experts
families: OLMoE, GraniteMoE, DeepSeek-V3 and GPT-OSS. A family whose blocks are laid out otherwise (GPT-NeoX) is
refused. Logits, greedy tokens and the gradient of the caller's
embeddings equal the local model's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from protocol.errors import ModelNotFoundError
from swarm.models.checkpoint import attention_for
from tests.helpers.fake_swarm import FakeSwarm
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, _common, save_random_model

ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
FAMILIES = {
    "gemma2": dict(
        head_dim=16,
        sliding_window=6,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,  # low caps, so that capping changes the results
        final_logit_softcapping=3.0,
        layer_types=ALTERNATING,
    ),
    "gemma3_text": dict(
        head_dim=16,
        sliding_window=6,
        query_pre_attn_scalar=16,
        final_logit_softcapping=3.0,
        layer_types=ALTERNATING,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
    "granite": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.1),
    # final norms other than an RMSNorm: a LayerNorm with a bias, and one without parameters
    "stablelm": dict(layer_norm_eps=1e-5, partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True),
    "starcoder2": dict(norm_epsilon=1e-5, sliding_window=6, use_bias=True),
    "olmo": dict(clip_qkv=4.0),
    # a final norm named otherwise, a head with a bias, parallel attention and MLP, partial rotary
    "phi": dict(layer_norm_eps=1e-5, partial_rotary_factor=0.5, qk_layernorm=True),
    "persimmon": dict(layer_norm_eps=1e-5, partial_rotary_factor=0.5, qk_layernorm=True),
    # logits scaled by logit_scale; Cohere 2 with sliding layers too
    "cohere": dict(logit_scale=0.25, use_qk_norm=True),
    "cohere2": dict(logit_scale=0.25, sliding_window=6, layer_types=ALTERNATING),
    # embeddings scaled by scale_emb in their module, the head's input divided by logits_scaling
    "minicpm3": dict(
        scale_emb=12.0,
        dim_model_base=8,  # logits_scaling = hidden_size / dim_model_base = 8
        scale_depth=1.4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    # mixture-of-experts families beyond tests/integration/test_moe.py's three: DeepSeek-V3 with a dense first
    # layer, a shared expert and latent attention; GPT-OSS with attention sinks, which sdpa refuses (eager)
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=4.0, logits_scaling=2.0),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=6, layer_types=ALTERNATING),
}


def _checkpoint(family: str, path) -> tuple:
    config = AutoConfig.for_model(family, **{**_common(4), **FAMILIES[family]})
    path = save_random_model(config, path / family)
    # transformers' sdpa refuses capped attention scores: the reference computes as the peers do (eager for Gemma 2)
    attention = attention_for(config)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).eval()
    return path, local


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_tokens_and_gradients_equal_the_local_model(family, tmp_path):
    path, local = _checkpoint(family, tmp_path)
    ids = torch.randint(3, VOCAB_SIZE, (2, 14), generator=torch.Generator().manual_seed(0))
    with FakeSwarm(path) as swarm:
        swarm.add_peer(0, 1)
        swarm.add_peer(1, 4)
        model = swarm.client()
        with torch.no_grad():  # 14 tokens: past the sliding window of 6
            torch.testing.assert_close(model(ids).logits, local(ids).logits, atol=1e-4, rtol=0)
        ours = generate_with_logits(model, ids[:1, :5], max_new_tokens=12, do_sample=False)
        theirs = generate_with_logits(local, ids[:1, :5], max_new_tokens=12, do_sample=False)
        assert_same_generation(ours, theirs)

        grads = []
        for lm in (model, local):
            embeds = local.get_input_embeddings()(ids).detach().requires_grad_(True)
            lm(inputs_embeds=embeds, labels=ids).loss.backward()
            grads.append(embeds.grad)
        torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_a_family_whose_blocks_are_laid_out_otherwise_is_refused(tmp_path):
    config = AutoConfig.for_model("gpt_neox", **_common(4))
    path = save_random_model(config, tmp_path / "gpt_neox")
    with FakeSwarm(path) as swarm, pytest.raises(ModelNotFoundError, match=r"not `model\.layers` between"):
        swarm.client()
