"""Optimizers that peers and trainers build the same way from the run's recipe, with their state created up front.

A group of peers moves its optimizer state along with parameters (to a joiner, after a fault), so the state must
exist before the first update (torch creates it lazily) and be listed in one fixed order on every member.

Weight decay spares what transformers' Trainer spares: norm weights, biases and embeddings (a tied head is the
embedding). That is decided by the type of the module that holds a parameter, not by its name, which differs
between architectures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from swarm.training.recipe import RunRecipe

_DTYPES = {"float32": torch.float32}


def no_decay(module: torch.nn.Module, name: str) -> bool:
    """Whether the parameter `name` held directly by `module` is spared weight decay."""
    return isinstance(module, torch.nn.Embedding) or type(module).__name__.endswith("Norm") or name.endswith("bias")


def param_groups(
    module: torch.nn.Module,
    weight_decay: float,
    params: Iterable[torch.nn.Parameter | tuple[str, torch.nn.Parameter]] | None = None,
) -> list[dict[str, Any]]:
    """torch param groups of the trained parameters of `module`: decayed ones, then the spared ones (weight decay 0).

    Args:
        module: what holds the parameters; the types of its submodules decide (nn.Embedding, any class whose name
            ends with "Norm", such as LlamaRMSNorm), and parameters named *bias are spared too.
        params: the trained tensors in the order every member lists them, each a parameter of `module`, or a
            (name, tensor) pair where the tensor stands for `module`'s parameter of that name (a float32 master of
            a bfloat16 weight); by default `module`'s parameters that require grad, each once, sorted by name.
            Each group keeps this order.

    Raises:
        ValueError: a tensor is neither a parameter of `module` nor named after one of its shape, or is listed twice.
    """
    spared: set[int] = set()
    held: set[int] = set()
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            held.add(id(p))
            if no_decay(sub, name):
                spared.add(id(p))  # a weight tied to an embedding is spared wherever else it appears
    if params is None:
        params = [(name, p) for name, p in sorted(module.named_parameters()) if p.requires_grad]
    decayed, kept = [], []
    for entry in params:
        name, p = entry if isinstance(entry, tuple) else (None, entry)
        (kept if id(_stands_for(module, held, name, p)) in spared else decayed).append(p)
    if len({id(p) for p in decayed + kept}) != len(decayed) + len(kept):
        raise ValueError("params lists a tensor twice (a tied weight belongs in it once)")
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def _stands_for(module: torch.nn.Module, held: set[int], name: str | None, p: torch.Tensor) -> torch.Tensor:
    """The parameter of `module` that `p` (named `name`, or None) is trained for."""
    if id(p) in held:
        return p
    try:
        own = module.get_parameter(name) if name is not None else None
    except AttributeError:
        own = None
    if own is None or own.shape != p.shape:
        raise ValueError(
            f"params holds a tensor of shape {tuple(p.shape)}{f' named {name!r}' if name else ''} that is not a "
            f"parameter of the {type(module).__name__} given, nor named after one of that shape"
        )
    return own


def make_optimizer(
    recipe: RunRecipe,
    source: torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    params: Iterable[torch.nn.Parameter | tuple[str, torch.nn.Parameter]] | None = None,
) -> torch.optim.Optimizer:
    """The recipe's optimizer (adamw, adam or plain sgd) over `source`, with its state already created.

    Args:
        source: a module, whose `params` (see `param_groups`) are grouped for weight decay; or param groups made
            by `param_groups`; or plain parameters, all decayed.

    Raises:
        ValueError: a parameter is not of the recipe's master dtype (float32): an update in a lower precision
            rounds small steps away; keep float32 master weights and cast the compute copy after each update.
    """
    if isinstance(source, torch.nn.Module):
        groups = param_groups(source, recipe.weight_decay, params)
    else:
        source = list(source)
        if params is not None:
            raise ValueError("params goes with a module; give param groups or parameters alone otherwise")
        if all(isinstance(group, dict) for group in source):
            groups = [dict(group) for group in source]
        else:
            groups = [{"params": source, "weight_decay": recipe.weight_decay}]
    dtype = _DTYPES[recipe.master_dtype]
    for group in groups:
        group["params"] = list(group["params"])
        for p in group["params"]:
            if p.dtype != dtype:
                raise ValueError(
                    f"a trained parameter of shape {tuple(p.shape)} is {p.dtype}, not the recipe's master dtype "
                    f"{recipe.master_dtype}: keep master weights in {recipe.master_dtype} and compute on a copy"
                )
    kwargs = dict(lr=recipe.lr, weight_decay=recipe.weight_decay)
    if recipe.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, **kwargs)
    elif recipe.optimizer == "adam":
        optimizer = torch.optim.Adam(groups, **kwargs)
    else:
        optimizer = torch.optim.SGD(groups, **kwargs)
    if recipe.optimizer in ("adamw", "adam"):
        for group in optimizer.param_groups:
            for p in group["params"]:
                # what torch's first step would create (not capturable, not fused)
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Use `lr` for the next step (the recipe's lr_at for that update), in every group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


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
