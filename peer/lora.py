"""LoRA adapters on a span of blocks: add them, save and load them by name, export the span with them merged.

The adapters are peft's LoRA layers, injected in place into the span's decoder layers; the base weights are
frozen. Tensors are named as in the Hugging Face checkpoint, by absolute block index
(`model.layers.12.self_attn.q_proj.lora_A.weight`), so peers serving overlapping spans can average them by name.
This module does not train or average; it only gives the trainer and the exporter the tensors.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

from peer.blocks import LAYER_PREFIX, BlockSpan

_ADAPTER = "default"  # peft's name for the one adapter a span has; it never appears in our tensor names


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The shape of the LoRA adapters added to every decoder layer of a span."""

    rank: int = 8
    """Inner dimension r of each adapter pair B @ A."""
    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank) * B @ A to its layer's weight."""
    dropout: float = 0.0
    """Dropout probability on an adapter's input, in training mode only."""
    target: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the linear layers, inside each decoder layer, that get an adapter."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSettings.rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraSettings.alpha must be a positive finite number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraSettings.dropout must be in [0, 1), got {self.dropout!r}")
        if (
            not isinstance(self.target, tuple)
            or not self.target
            or not all(isinstance(name, str) and name for name in self.target)
        ):
            raise ValueError(f"LoraSettings.target must be a non-empty tuple of layer names, got {self.target!r}")


def add_lora(span: BlockSpan, settings: LoraSettings, *, seed: int = 0) -> list[nn.Parameter]:
    """Add LoRA adapters to the span in place, freeze its base weights, and return the adapter parameters.

    B starts at zero, so the span computes exactly what it did before. A is drawn from `seed`, the block index
    and the layer name only: the same block gets the same adapters on every peer and device, whatever its span.
    Adapters are at least float32, also on a half-precision span (peft casts around them): they train and average
    well there.

    Returns:
        The trainable tensors, ordered by their names in `adapter_state`.
    Raises:
        ValueError: the span already has adapters, or a target names no linear layer of the span.
    """
    if has_lora(span):
        raise ValueError(f"blocks {span.start}:{span.end} already have LoRA adapters; load a fresh span instead")
    present = {name.rsplit(".", 1)[-1] for name, m in span.layers.named_modules() if isinstance(m, nn.Linear)}
    missing = sorted(set(settings.target) - present)
    if missing:
        raise ValueError(
            f"LoraSettings.target names {missing}, which are not linear layers of "
            f"{type(span.layers[0]).__name__}; it has {sorted(present)}"
        )
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):  # peft draws an init we replace below; leave the caller's RNG alone
        inject_adapter_in_model(config, span.layers, adapter_name=_ADAPTER)
    span.requires_grad_(False)
    with torch.no_grad():
        for prefix, module in _lora_modules(span).items():
            a, b = module.lora_A[_ADAPTER], module.lora_B[_ADAPTER]
            if a.weight.dtype.itemsize < 4:
                a.float(), b.float()
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{prefix}".encode()))
            init = torch.empty(a.weight.shape)  # on the CPU, so that the draw does not depend on the device
            nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)  # peft's default for A
            a.weight.copy_(init)
            b.weight.zero_()
    params = list(_adapter_params(span).values())
    for param in params:
        param.requires_grad_(True)
    return params


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
    """Checkpoint name of each adapted linear layer (`model.layers.3.self_attn.q_proj`) -> its peft layer."""
    return {
        f"{LAYER_PREFIX}{span.start + j}.{name}": module
        for j, layer in enumerate(span.layers)
        for name, module in layer.named_modules()
        if isinstance(module, LoraLayer)
    }


def _adapter_params(span: BlockSpan) -> dict[str, nn.Parameter]:
    params = {}
    for prefix, module in _lora_modules(span).items():
        params[f"{prefix}.lora_A.weight"] = module.lora_A[_ADAPTER].weight
        params[f"{prefix}.lora_B.weight"] = module.lora_B[_ADAPTER].weight
    return dict(sorted(params.items()))


def _base_state(span: BlockSpan) -> dict[str, torch.Tensor]:
    """The layers' own tensors without the adapters, peft's `base_layer` level dropped from the names."""
    state = {}
    for j, layer in enumerate(span.layers):
        for name, tensor in layer.state_dict().items():
            if ".lora_" not in f".{name}":
                state[f"{LAYER_PREFIX}{span.start + j}.{name.replace('.base_layer.', '.')}"] = tensor
    return state
