"""What a family's causal LM computes around its blocks: the token embedding before them, the logits after them.

The client holds these ends (client/model.py) and the peers the blocks. Most families embed with a plain lookup
and take logits as `lm_head(norm(hidden))`; a few do more, in their model's forward rather than in a module, so it
is repeated here as transformers computes it:
- Gemma 1-3 multiply the embeddings by sqrt(hidden_size), inside their `*TextScaledWordEmbedding`;
- Granite multiplies the embeddings by `embedding_multiplier` and divides the logits by `logits_scaling`;
- Gemma 2 and 3 cap the logits: `tanh(logits / cap) * cap` with `final_logit_softcapping`.
The final norm and the LM head are the family's own modules, built as its model builds them (`head_modules`): an
RMSNorm for most, a LayerNorm with a bias for StableLM and StarCoder2, one without parameters for OLMo, Phi's
`final_layernorm` and its head's bias. The ways known not to be repeated here (Cohere's logit scale, MiniCPM's
embedding scale, blocks outside `model.layers` as in GPT-NeoX) are refused (`check_ends`) rather than computed wrong; other families were checked against transformers by hand (Phi-3, OLMo 2
and 3, GLM, GLM-4, SmolLM3, Arcee, Apertus, EXAONE 4, ERNIE 4.5, Seed-OSS: the same logits).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from protocol.errors import ModelNotFoundError
from swarm.models.checkpoint import causal_lm_class, family_class

SQRT_SCALED = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})
"""Model types whose embeddings are scaled by sqrt(hidden_size) (their `{Family}TextScaledWordEmbedding`)."""

_UNSUPPORTED = {
    "logit_scale": "multiplies its logits by logit_scale (Cohere)",
    "scale_emb": "scales its embeddings by scale_emb (MiniCPM)",
}


FINAL_NORMS = ("norm", "final_layernorm")
"""What families name the norm after their blocks, under `model.` (Phi and Persimmon: final_layernorm)."""

LOCAL_PREFIXES = ("model.embed_tokens.", *(f"model.{name}." for name in FINAL_NORMS), "lm_head.")
"""Checkpoint names of the tensors a client holds (and a trainer trains) rather than the peers."""


def check_ends(config: PretrainedConfig) -> None:
    """Refuse a model whose ends a client cannot compute as its forward does: embeddings or logits scaled in a way
    this module does not repeat, or blocks not under `model.layers` with a final norm beside them (GPT-NeoX,
    Falcon). Peers refuse it too, at start: no client could use them.

    Raises:
        ModelNotFoundError: naming the setting.
    """
    for name, what in _UNSUPPORTED.items():
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ModelNotFoundError(f"model type {config.model_type!r} is not supported: it {what}")
    head_modules(config)


def head_modules(config: PretrainedConfig) -> tuple[str, nn.Module, nn.Linear]:
    """(its name, the final norm, the LM head) as the family's causal LM builds them, on the meta device: load their
    tensors by name (a norm may have none, a head may have a bias).

    Raises:
        ModelNotFoundError: the family's model keeps its blocks elsewhere than `model.layers`, or names its final
        norm otherwise than FINAL_NORMS.
    """
    # the whole causal LM, on the meta device: 0.07 s for 80 layers, and no family refuses its own config
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"  # it runs no attention: spare the families that refuse sdpa
    with torch.device("meta"):
        causal_lm = causal_lm_class(config)(config)
    base = causal_lm.base_model
    names = [name for name in FINAL_NORMS if isinstance(getattr(base, name, None), nn.Module)]
    head = causal_lm.get_output_embeddings()
    if causal_lm.base_model_prefix != "model" or not hasattr(base, "layers") or not names or head is None:
        raise ModelNotFoundError(
            f"model type {config.model_type!r} is not supported: its blocks are not `model.layers` followed by a "
            f"final norm named {' or '.join(FINAL_NORMS)}, the layout clients and peers compute"
        )
    return names[0], getattr(base, names[0]), head


def embedding(config: PretrainedConfig) -> nn.Embedding:
    """The family's token embedding module (on the current default device)."""
    if config.model_type in SQRT_SCALED:
        scaled = family_class(config, "TextScaledWordEmbedding")
        return scaled(config.vocab_size, config.hidden_size, config.pad_token_id, embed_scale=config.hidden_size**0.5)
    return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)


def restore_buffers(embed: nn.Module) -> None:
    """Make the scale of a scaled embedding again after it was built on the meta device (it is in no checkpoint)."""
    scale = getattr(embed, "scalar_embed_scale", None)
    if scale is not None:
        embed.embed_scale = torch.tensor(scale, device=embed.weight.device)


def scale_embeddings(config: PretrainedConfig, embeds: torch.Tensor) -> torch.Tensor:
    """What the model's forward does to the embeddings (token lookups or a caller's inputs_embeds) before block 0."""
    multiplier = getattr(config, "embedding_multiplier", None)
    return embeds if multiplier in (None, 1, 1.0) else embeds * multiplier


def finish_logits(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """What the causal LM's forward does to `lm_head`'s output."""
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        logits = logits / scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
