"""LoRA adapters on a span of blocks: add them, save and load them by name, export the span with them merged.

The adapters are peft's LoRA layers, injected in place into the span's decoder layers; the base weights are
frozen. Tensors are named as in the Hugging Face checkpoint, by absolute block index
(`model.layers.12.self_attn.q_proj.lora_A.weight`), so peers serving overlapping spans can average them by name.
This module does not train or average; it only gives the trainer and the exporter the tensors.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from peer.blocks import LAYER_PREFIX, BlockSpan
from swarm.training.adapters import ADAPTER as _ADAPTER
from swarm.training.adapters import LoraSettings, adapter_params, inject_lora, lora_modules


def add_lora(span: BlockSpan, settings: LoraSettings, *, seed: int = 0) -> list[nn.Parameter]:
    """Add LoRA adapters to the span in place, freeze its base weights, and return the adapter parameters, ordered by
    their names in `adapter_state` (swarm/training/adapters.py `inject_lora`: the same adapters for the same block on
    every peer, whatever its span).

    Raises:
        ValueError: the span already has adapters, or a target names no linear layer of the span.
    """
    return inject_lora(span.layers, span.start, settings, seed=seed)


def has_lora(span: BlockSpan) -> bool:
    """Whether `add_lora` has been called on the span."""
    return bool(_lora_modules(span))


def adapter_state(span: BlockSpan) -> dict[str, torch.Tensor]:
    """A copy of the adapter tensors, by checkpoint-style name (`model.layers.{i}.{layer}.lora_A.weight`)."""
    return {name: p.detach().clone() for name, p in _adapter_params(span).items()}


def load_adapter_state(span: BlockSpan, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (as `adapter_state` names it) into the span's adapters in place; optimizers keep their params.

    Raises:
        ValueError: the names or shapes differ from the span's adapters.
    """
    params = _adapter_params(span)
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(
            f"adapter state does not fit blocks {span.start}:{span.end}: "
            f"missing {missing[:3]} ({len(missing)}), unexpected {extra[:3]} ({len(extra)})"
        )
    for name, param in params.items():
        if state[name].shape != param.shape:
            raise ValueError(f"adapter {name} has shape {tuple(param.shape)}, got {tuple(state[name].shape)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


def layer_state(span: BlockSpan) -> dict[str, torch.Tensor]:
    """The tensors of a span without adapters, named as in the checkpoint; they share storage with the span.

    Raises:
        ValueError: the span has adapters; export it with `merged_layer_state`.
    """
    if has_lora(span):
        raise ValueError(
            f"blocks {span.start}:{span.end} have LoRA adapters, which layer_state would drop; "
            "use merged_layer_state to export them"
        )
    return _base_state(span)


def merged_layer_state(span: BlockSpan) -> dict[str, torch.Tensor]:
    """Every tensor of the span's layers, named as in the checkpoint, each adapted weight W as W + scale * B @ A.

    The span is left as it is. Merged weights are new tensors, summed in W's dtype or float32 if W is narrower and
    then cast back; the others share storage with the span. On a span without adapters this is `layer_state`.
    """
    state = _base_state(span)
    with torch.no_grad():
        for prefix, module in _lora_modules(span).items():
            a, b = module.lora_A[_ADAPTER].weight, module.lora_B[_ADAPTER].weight
            weight = state[f"{prefix}.weight"]
            dtype = torch.promote_types(weight.dtype, torch.float32)
            delta = (b.to(dtype) @ a.to(dtype)) * module.scaling[_ADAPTER]
            state[f"{prefix}.weight"] = (weight.to(dtype) + delta.to(weight.device)).to(weight.dtype)
    return state


def _lora_modules(span: BlockSpan) -> dict[str, LoraLayer]:
    return lora_modules(span.layers, span.start)


def _adapter_params(span: BlockSpan) -> dict[str, nn.Parameter]:
    return adapter_params(span.layers, span.start)


def _base_state(span: BlockSpan) -> dict[str, torch.Tensor]:
    """The layers' own tensors without the adapters, peft's `base_layer` level dropped from the names."""
    state = {}
    for j, layer in enumerate(span.layers):
        for name, tensor in layer.state_dict().items():
            if ".lora_" not in f".{name}":
                state[f"{LAYER_PREFIX}{span.start + j}.{name.replace('.base_layer.', '.')}"] = tensor
    return state
