"""What a family's causal LM computes around its blocks: the token embedding before them, the logits after them.

The client holds these ends (client/model.py) and the peers the blocks. The embedding, the final norm and the LM
head are the family's own modules, built as its causal LM builds them (`family_ends`): Gemma's and MiniCPM3's
embeddings scale their lookups, most final norms are RMSNorms, StableLM's and StarCoder2's LayerNorms have a bias,
OLMo's has no parameters, Phi and Persimmon name theirs `final_layernorm`, Phi's head has a bias. What a few do in
their model's forward rather than in a module is repeated here as transformers computes it:
- Granite multiplies the embeddings by `embedding_multiplier` and divides the logits by `logits_scaling` (MiniCPM3
  divides its head's input by it, which is the same);
- Cohere multiplies the logits by `logit_scale`;
- Gemma 2 and 3 cap the logits: `tanh(logits / cap) * cap` with `final_logit_softcapping`.
Families whose blocks are not `model.layers` (GPT-NeoX, Falcon) are refused (`check_ends`) rather than computed
wrong; other families were checked against transformers by hand (Phi-3, OLMo 2 and 3, GLM, GLM-4, SmolLM3, Arcee,
Apertus, EXAONE 4, ERNIE 4.5, Seed-OSS: the same logits).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from protocol.errors import ModelNotFoundError
from swarm.models.checkpoint import meta_causal_lm

FINAL_NORMS = ("norm", "final_layernorm")
"""What families name the norm after their blocks, under `model.` (Phi and Persimmon: final_layernorm)."""

LOCAL_PREFIXES = ("model.embed_tokens.", *(f"model.{name}." for name in FINAL_NORMS), "lm_head.")
"""Checkpoint names of the tensors a client holds (and a trainer trains) rather than the peers."""


def check_ends(config: PretrainedConfig) -> None:
    """Refuse a model whose ends a client cannot compute as its forward does: blocks not under `model.layers`, with
    `model.embed_tokens` before them and a final norm after them (GPT-NeoX, Falcon). Peers refuse it too, at start:
    no client could use them.

    Raises:
        ModelNotFoundError: naming what differs.
    """
    family_ends(config)


def family_ends(config: PretrainedConfig) -> tuple[nn.Module, str, nn.Module, nn.Module]:
    """(the token embedding, the final norm's name, the final norm, the LM head) as the family's causal LM builds
    them, on the meta device: load their tensors by name (a norm may have none, a head may have a bias), then
    `restore_buffers` of the embedding.

    Raises:
        ModelNotFoundError: the family's model keeps its blocks elsewhere than `model.layers`, or names its
        embedding or final norm otherwise.
    """
    causal_lm = meta_causal_lm(config)
    base = causal_lm.base_model
    names = [name for name in FINAL_NORMS if isinstance(getattr(base, name, None), nn.Module)]
    embed, head = getattr(base, "embed_tokens", None), causal_lm.get_output_embeddings()
    if causal_lm.base_model_prefix != "model" or not hasattr(base, "layers") or not names or None in (embed, head):
        raise ModelNotFoundError(
            f"model type {config.model_type!r} is not supported: its blocks are not `model.layers` between "
            f"`model.embed_tokens` and a final norm named {' or '.join(FINAL_NORMS)}, the layout clients and peers "
            f"compute"
        )
    return embed, names[0], getattr(base, names[0]), head


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
    scaling = getattr(config, "logits_scaling", None)  # Granite; MiniCPM3 divides its head's input alike
    if scaling not in (None, 1, 1.0):
        logits = logits / scaling
    scale = getattr(config, "logit_scale", None)  # Cohere
    if scale not in (None, 1, 1.0):
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
