"""Optimizers that peers and trainers build the same way, with their state created up front.

A group of peers averages its optimizer state along with gradients and parameters, so the state must
exist before the first update (torch creates it lazily) and be listed in one fixed order on every member.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.training.settings import OPTIMIZERS


def make_optimizer(
    name: str, params: Sequence[torch.nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """An optimizer over `params` (adamw, adam or plain sgd) whose state already exists."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    params = list(params)
    if name == "adamw":
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    elif name == "adam":
        optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    else:
        optimizer = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    for p in params:
        if name in ("adamw", "adam"):
            # what torch's first step would create (not capturable, not fused)
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
    return optimizer


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter statistics, in parameter order (step counters excluded: they are epochs)."""
    tensors = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            tensors += [state[key] for key in sorted(state) if key != "step" and isinstance(state[key], torch.Tensor)]
    return tensors


def set_step_count(optimizer: torch.optim.Optimizer, count: int) -> None:
    """Set Adam's update counter (its bias correction), e.g. after copying another member's state."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(float(count))
