"""LoRA adapters added to a model's decoder layers, the same on every member: a stage peer's span (peer/lora.py) and
the local reference's whole model (client/training/local.py) get bit-identical adapters for the same block.

The adapters are peft's LoRA layers, injected in place, named as in the Hugging Face checkpoint by absolute block
index (`model.layers.12.self_attn.q_proj.lora_A.weight`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

ADAPTER = "default"  # peft's name for the one adapter a layer has; it never appears in our tensor names
LAYER_PREFIX = "model.layers."


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


def inject_lora(layers: nn.ModuleList, first: int, settings: LoraSettings, *, seed: int = 0) -> list[nn.Parameter]:
    """Add LoRA adapters to `layers` (blocks first, first + 1, ...) in place, freeze their base weights, and return
    the adapter parameters.

    B starts at zero, so the layers compute exactly what they did before. A is drawn from `seed`, the block index
    and the layer name only: the same block gets the same adapters on every member and device, whatever its span.
    Adapters are at least float32, also on half-precision layers (peft casts around them): they train and average
    well there.

    Returns:
        The trainable tensors, ordered by their names (`adapter_params`).
    Raises:
        ValueError: the layers already have adapters, or a target names no linear layer of theirs.
    """
    if lora_modules(layers, first):
        raise ValueError(f"blocks {first}:{first + len(layers)} already have LoRA adapters; load fresh ones instead")
    present = {name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if isinstance(m, nn.Linear)}
    missing = sorted(set(settings.target) - present)
    if missing:
        raise ValueError(
            f"LoraSettings.target names {missing}, which are not linear layers of "
            f"{type(layers[0]).__name__}; it has {sorted(present)}"
        )
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):  # peft draws an init we replace below; leave the caller's RNG alone
        inject_adapter_in_model(config, layers, adapter_name=ADAPTER)
    layers.requires_grad_(False)
    with torch.no_grad():
        for prefix, module in lora_modules(layers, first).items():
            a, b = module.lora_A[ADAPTER], module.lora_B[ADAPTER]
            if a.weight.dtype.itemsize < 4:
                a.float(), b.float()
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{prefix}".encode()))
            init = torch.empty(a.weight.shape)  # on the CPU, so that the draw does not depend on the device
            nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)  # peft's default for A
            a.weight.copy_(init)
            b.weight.zero_()
    params = list(adapter_params(layers, first).values())
    for param in params:
        param.requires_grad_(True)
    return params


def lora_modules(layers: nn.ModuleList, first: int) -> dict[str, LoraLayer]:
    """Checkpoint name of each adapted linear layer (`model.layers.3.self_attn.q_proj`) -> its peft layer."""
    return {
        f"{LAYER_PREFIX}{first + j}.{name}": module
        for j, layer in enumerate(layers)
        for name, module in layer.named_modules()
        if isinstance(module, LoraLayer)
    }


def adapter_params(layers: nn.ModuleList, first: int) -> dict[str, nn.Parameter]:
    """The adapter tensors by checkpoint-style name (`model.layers.{i}.{layer}.lora_A.weight`), sorted by name."""
    params = {}
    for prefix, module in lora_modules(layers, first).items():
        params[f"{prefix}.lora_A.weight"] = module.lora_A[ADAPTER].weight
        params[f"{prefix}.lora_B.weight"] = module.lora_B[ADAPTER].weight
    return dict(sorted(params.items()))
