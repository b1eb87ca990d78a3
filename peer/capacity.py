"""How many blocks a peer can hold at each quantization, and `--quantize auto`: said before anything is loaded.

A block's bytes are read from the checkpoint's headers: its linear weights (the 2-D weights of a decoder layer) as
peer/quantize.py holds them (int8: a byte a weight and a float32 scale per row; nf4: half a byte a weight and a
float32 scale per 64), the rest (norms, biases, the fused experts of MoE families) in the compute dtype. The room
is `--memory-budget`, or else half the free memory of the device (the rest is left for the KV cache, activations
and the system), and every block needs its share of a least KV cache beside it.

`--quantize auto` takes the least rounding whose blocks fit: full precision when the blocks asked for
(`--blocks`, `--num-blocks`) fit as they are, or when no count was asked (the blocks are then chosen to fit), else
int8, else nf4. Default clients use only full-precision peers, so a peer rounds only what does not fit otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers import PretrainedConfig

from peer.offload import MIN_CACHE_TOKENS, format_size, kv_token_bytes
from peer.quantize import NF4_BLOCK
from protocol.vocab import Quantization
from swarm.models.checkpoint import tensor_shapes

MODES = (Quantization.NONE, Quantization.INT8, Quantization.NF4)  # from the least rounding


def held_bytes(path: Path, config: PretrainedConfig, block: int, dtype: torch.dtype, mode: Quantization) -> int:
    """Bytes block `block` holds at quantization `mode` (from the checkpoint's headers; nothing is loaded)."""
    size = torch.empty((), dtype=dtype).element_size()
    prefix = f"model.layers.{block}."
    total = 0
    for name, shape in tensor_shapes(path, lambda n: n.startswith(prefix)).items():
        numel = math.prod(shape)
        # experts stay as they are: transformers fuses a checkpoint's per-expert matrices into 3-d parameters
        linear = len(shape) == 2 and name.endswith(".weight") and ".experts." not in name
        if not linear or mode == Quantization.NONE:
            total += numel * size
        elif mode == Quantization.INT8:
            total += numel + 4 * shape[0]
        else:
            total += math.ceil(numel / NF4_BLOCK) * (NF4_BLOCK // 2 + 4)
    return total


def room(device: str, memory_budget: int | None) -> int:
    """Bytes for blocks and their least KV cache: the budget, or half the device's free memory."""
    if memory_budget is not None:
        return memory_budget
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0] // 2
    return psutil.virtual_memory().available // 2


@dataclass(frozen=True)
class Capacity:
    """Blocks that fit in `room` bytes at each quantization, each beside its share of a least KV cache."""

    room: int
    per_block: dict[Quantization, int]  # bytes of one block (the largest of those measured) and its least cache

    def blocks(self, mode: Quantization) -> int:
        return self.room // self.per_block[mode]

    def describe(self, num_layers: int) -> str:
        counts = ", ".join(f"{mode} {min(self.blocks(mode), num_layers)}" for mode in MODES)
        return f"blocks that fit in {format_size(self.room)}: {counts} (of {num_layers})"


def capacity(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, room_bytes: int, blocks: range | None = None
) -> Capacity:
    """What fits in `room_bytes`, measured on `blocks` (default: the first block; blocks of a model are alike)."""
    measured = blocks if blocks is not None else range(1)
    cache = MIN_CACHE_TOKENS * kv_token_bytes(config, 0, 1, dtype)
    per_block = {mode: max(held_bytes(path, config, i, dtype, mode) for i in measured) + cache for mode in MODES}
    return Capacity(room_bytes, per_block)


def choose_quantization(found: Capacity, wanted: int | None) -> Quantization:
    """`--quantize auto`: the least rounding at which `wanted` blocks fit (None: as many as fit, so none)."""
    if wanted is None:
        return Quantization.NONE
    for mode in MODES:
        if found.blocks(mode) >= wanted:
            return mode
    raise ValueError(
        f"{wanted} blocks do not fit even as nf4 (at most {found.blocks(Quantization.NF4)} in "
        f"{format_size(found.room)}): serve fewer blocks, raise --memory-budget, or stream them with --offload"
    )
