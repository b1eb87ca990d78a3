"""Whether a tensor holds only finite values: the check both sides make on every tensor they receive."""

from __future__ import annotations

import numpy
import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor holds no NaN or inf, checked by numpy on one thread.

    torch would spread this over its thread pool; waking the pool's sleeping threads costs more than the
    check itself, on every request. bfloat16 (unknown to numpy): no value has all exponent bits set.
    Integer and bool tensors are always finite.
    """
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    if tensor.dtype == torch.bfloat16:
        bits = tensor.contiguous().view(torch.int16).numpy()
        return not bool(((bits & 0x7F80) == 0x7F80).any())
    return bool(numpy.isfinite(tensor.contiguous().numpy()).all())
