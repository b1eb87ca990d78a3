"""swarm.training.optim: optimizers whose state exists before the first step behave exactly like torch's own."""

from __future__ import annotations

import pytest
import torch

from swarm.training.optim import make_optimizer, set_step_count, state_tensors
from swarm.training.settings import OPTIMIZERS, AveragingSettings


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(4, 3, generator=generator)),
        torch.nn.Parameter(torch.randn(5, generator=generator)),
    ]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_prebuilt_state_steps_like_torch(name):
    ours, theirs = params(), params()
    optimizer = make_optimizer(name, ours, lr=1e-2, weight_decay=0.1)
    reference = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name](
        theirs, lr=1e-2, weight_decay=0.1
    )
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator) for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_state_tensors_are_listed_before_the_first_step_in_parameter_order():
    ps = params()
    optimizer = make_optimizer("adamw", ps, lr=1e-3, weight_decay=0.0)
    tensors = state_tensors(optimizer)
    assert [t.shape for t in tensors] == [ps[0].shape, ps[0].shape, ps[1].shape, ps[1].shape]
    assert all(not t.any() for t in tensors)
    assert state_tensors(make_optimizer("sgd", ps, lr=1e-3, weight_decay=0.0)) == []


def test_step_count_sets_adams_bias_correction():
    ps = params()
    optimizer = make_optimizer("adam", ps, lr=1e-3, weight_decay=0.0)
    set_step_count(optimizer, 7)
    assert all(float(state["step"]) == 7.0 for state in optimizer.state.values())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(name="lion"), "optimizer"),
        (dict(lr=0.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(weight_decay=-1.0), "weight_decay"),
    ],
)
def test_bad_settings_are_named(kwargs, field):
    args = dict(name="adamw", lr=1e-3, weight_decay=0.0) | kwargs
    with pytest.raises(ValueError, match=field):
        make_optimizer(args.pop("name"), params(), **args)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(matchmaking_time_s=0), "matchmaking_time_s"),
        (dict(averaging_timeout_s=-1), "averaging_timeout_s"),
        (dict(matchmaking_time_s=10, averaging_timeout_s=5), "averaging_timeout_s"),
        (dict(load_state_timeout_s=float("nan")), "load_state_timeout_s"),
    ],
)
def test_averaging_settings_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AveragingSettings(**kwargs)
