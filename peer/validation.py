"""Checks on every tensor a request carries, so bad input becomes a BadRequestError naming the problem."""

from __future__ import annotations

import torch

from protocol.errors import BadRequestError, SequenceTooLongError
from protocol.finite import all_finite


def check_hidden_layout(
    shape: tuple[int, ...], declared: torch.dtype, *, hidden_size: int, dtype: torch.dtype, name: str = "hidden_states"
) -> None:
    """The checks of `check_hidden` that need no data: a tensor's shape and dtype as its message declares them."""
    if len(shape) != 3:
        raise BadRequestError(f"{name} must be [batch, seq, hidden], got shape {list(shape)}")
    batch, seq, size = shape
    if size != hidden_size:
        raise BadRequestError(f"{name} has hidden size {size}, this model's is {hidden_size}")
    if batch < 1 or seq < 1:
        raise BadRequestError(f"{name} must have at least one sequence and one token, got shape {list(shape)}")
    if declared != dtype:
        raise BadRequestError(f"{name} has dtype {declared}, this peer computes in {dtype}; send {dtype}")


def check_hidden(hidden: torch.Tensor, *, hidden_size: int, dtype: torch.dtype, name: str = "hidden_states") -> None:
    check_hidden_layout(tuple(hidden.shape), hidden.dtype, hidden_size=hidden_size, dtype=dtype, name=name)
    if not all_finite(hidden):
        raise BadRequestError(f"{name} contains NaN or inf")


def check_mask_shape(shape: tuple[int, ...], *, batch: int, length: int) -> None:
    if tuple(shape) != (batch, length):
        raise BadRequestError(f"attention_mask must have shape [{batch}, {length}], got {list(shape)}")


def check_positions_shape(shape: tuple[int, ...], *, batch: int, seq: int) -> None:
    if len(shape) != 2 or shape[0] not in (1, batch) or shape[1] != seq:
        raise BadRequestError(f"position_ids must have shape [{batch} or 1, {seq}], got {list(shape)}")


def check_mask(mask: torch.Tensor | None, *, batch: int, length: int) -> torch.Tensor | None:
    """`mask` must be [batch, length] of 0/1; returned as int64 (what transformers' mask builders expect)."""
    if mask is None:
        return None
    check_mask_shape(tuple(mask.shape), batch=batch, length=length)
    if mask.is_floating_point() or mask.is_complex():
        raise BadRequestError(f"attention_mask must be an integer or bool tensor, got {mask.dtype}")
    mask = mask.to(torch.int64)
    if ((mask != 0) & (mask != 1)).any():
        raise BadRequestError("attention_mask values must be 0 or 1")
    return mask


def check_positions(positions: torch.Tensor | None, *, batch: int, seq: int, max_positions: int) -> torch.Tensor | None:
    if positions is None:
        return None
    check_positions_shape(tuple(positions.shape), batch=batch, seq=seq)
    if positions.is_floating_point() or positions.dtype == torch.bool:
        raise BadRequestError(f"position_ids must be integers, got {positions.dtype}")
    positions = positions.to(torch.int64)
    if positions.numel() and (positions.min() < 0 or positions.max() >= max_positions):
        raise BadRequestError(
            f"position_ids must lie in [0, {max_positions}), got {positions.min()}..{positions.max()}"
        )
    return positions


def check_grad(grad: torch.Tensor, hidden: torch.Tensor) -> None:
    if grad.shape != hidden.shape:
        raise BadRequestError(f"grad_outputs has shape {list(grad.shape)}, hidden_states {list(hidden.shape)}")
    if grad.dtype != hidden.dtype:
        raise BadRequestError(f"grad_outputs has dtype {grad.dtype}, hidden_states {hidden.dtype}")
    if not all_finite(grad):
        raise BadRequestError("grad_outputs contains NaN or inf")


def check_length(prefix_length: int, new_tokens: int, max_length: int) -> None:
    if prefix_length + new_tokens > max_length:
        raise SequenceTooLongError(
            f"{prefix_length} cached + {new_tokens} new tokens exceed the session's max_length {max_length}; "
            f"open the session with a larger max_length"
        )
