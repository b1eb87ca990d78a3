"""Weight-only quantization of a span's linear layers: int8 per output row, or nf4 in blocks of 64 (QLoRA's 4-bit
NormalFloat), in plain torch, so that a peer holds those weights in a quarter or about a seventh of float32's bytes.

A QuantizedLinear keeps only the codes and their scales; each forward widens them back into the compute dtype
(`dequantize`) and multiplies as nn.Linear does. So a quantized peer computes exactly what a full-precision model
holding the dequantized weights computes: that is the reference its outputs are checked against, and what clients
of a quantized swarm opt into (client/config.py `quantization`). Norms, biases and fused expert tensors (MoE
families in transformers 5 keep experts as 3-d parameters, not nn.Linear) stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from protocol.vocab import Quantization

NF4_BLOCK = 64
# the 16 values of QLoRA's NormalFloat4: quantiles of a standard normal, scaled to [-1, 1], with an exact zero
NF4_CODES = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
)  # fmt: skip
_NF4_EDGES = (NF4_CODES[1:] + NF4_CODES[:-1]) / 2  # nearest code by bucketing between midpoints


@dataclass(frozen=True)
class Quantized:
    """A weight as codes and scales: int8 codes with a float32 scale per row, or nf4 codes two to a byte with a
    float32 absmax per block of 64 (the weight's elements in row-major order, the last block zero-padded)."""

    mode: Quantization
    shape: torch.Size
    codes: torch.Tensor
    scales: torch.Tensor


def quantize(weight: torch.Tensor, mode: Quantization) -> Quantized:
    """`weight` (2-d, any float dtype) as codes of `mode` (int8 or nf4)."""
    w = weight.detach().to(torch.float32)
    if mode == Quantization.INT8:
        scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return Quantized(mode, weight.shape, codes, scales)
    if mode == Quantization.NF4:
        flat = w.reshape(-1)
        flat = F.pad(flat, (0, -flat.numel() % NF4_BLOCK))
        blocks = flat.view(-1, NF4_BLOCK)
        scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        index = torch.bucketize(blocks / scales[:, None], _NF4_EDGES.to(w.device)).to(torch.uint8).view(-1)
        return Quantized(mode, weight.shape, (index[0::2] << 4) | index[1::2], scales)
    raise ValueError(f"no quantization {mode!r}: use one of int8, nf4")


def dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The weight `q` stands for, in `dtype` (computed in float32, then cast)."""
    if q.mode == Quantization.INT8:
        w = q.codes.to(torch.float32) * q.scales[:, None]
    else:
        index = torch.stack([q.codes >> 4, q.codes & 0xF], dim=1).view(-1).long()
        values = NF4_CODES.to(q.scales.device)[index].view(-1, NF4_BLOCK) * q.scales[:, None]
        w = values.view(-1)[: q.shape.numel()].view(q.shape)
    return w.to(dtype)


class QuantizedLinear(nn.Module):
    """nn.Linear with its weight held as `Quantized` codes (buffers), widened into the input's dtype per call.

    Made after the span is on its device in its dtype: casting the module later would round the float32 scales.
    """

    def __init__(self, linear: nn.Linear, mode: Quantization):
        super().__init__()
        self.in_features, self.out_features, self.mode = linear.in_features, linear.out_features, mode
        self.weight_dtype = linear.weight.dtype
        q = quantize(linear.weight, mode)
        self.shape = q.shape
        self.register_buffer("codes", q.codes)
        self.register_buffer("scales", q.scales)
        self.bias = linear.bias

    def quantized(self) -> Quantized:
        return Quantized(self.mode, self.shape, self.codes, self.scales)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for code that reads a linear's weight, such as its dtype or device)."""
        return dequantize(self.quantized(), self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.quantized(), x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def quantize_linears(module: nn.Module, mode: Quantization) -> None:
    """Replace every nn.Linear inside `module` by a QuantizedLinear of `mode`."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, QuantizedLinear(child, mode))


def dequantized_copy_(module: nn.Module, mode: Quantization) -> None:
    """Round every nn.Linear weight inside `module` through `mode` in place: a full-precision model computing what
    a peer quantized with `mode` computes (the reference of tests and of bench)."""
    with torch.no_grad():
        for child in module.modules():
            if type(child) is nn.Linear:
                child.weight.copy_(dequantize(quantize(child.weight, mode), child.weight.dtype))
