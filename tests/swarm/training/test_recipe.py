"""swarm.training.recipe: the run's recipe (validated, strict on the wire, its differences named) and the numerics it
fixes, checked against torch's and transformers' own schedule and clipping."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from protocol.errors import InvalidRecordError
from protocol.vocab import TrainMode
from swarm.training.recipe import (
    LRSchedule,
    RunRecipe,
    check_overrides,
    check_setting,
    clip_scale,
    global_norm,
    lr_at,
)

# --- the recipe ---


def test_text_becomes_the_vocabulary_and_ints_become_floats():
    recipe = RunRecipe(lr_schedule="cosine", total_steps=10, train_mode="lora", lr=1, max_grad_norm=2)
    assert recipe.lr_schedule is LRSchedule.COSINE and recipe.train_mode is TrainMode.LORA
    assert type(recipe.lr) is float and type(recipe.max_grad_norm) is float


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(optimizer="lion"), r"optimizer must be one of \('adamw', 'adam', 'sgd'\), got 'lion'"),
        (dict(lr=0.0), r"lr must be finite and > 0.0, got 0.0"),
        (dict(lr=math.nan), r"lr must be finite and > 0.0, got nan"),
        (dict(lr=math.inf), r"lr must be finite and > 0.0, got inf"),
        (dict(weight_decay=-0.1), r"weight_decay must be finite and >= 0.0, got -0.1"),
        (dict(warmup_steps=-1), r"warmup_steps must be >= 0 and <= \d+, got -1"),
        (dict(warmup_steps=1.5), r"warmup_steps must be an integer, got 1.5"),
        (dict(batch_size=True), r"batch_size must be an integer, got True"),
        (dict(batch_size=0), r"batch_size must be >= 1"),
        (dict(lr_schedule="linear"), r"lr_schedule must be one of \('constant', 'cosine'\), got 'linear'"),
        (dict(lr_schedule="cosine"), r"total_steps must exceed warmup_steps with lr_schedule cosine.*total_steps 0"),
        (dict(lr_schedule="cosine", total_steps=5, warmup_steps=5), r"got total_steps 5 and warmup_steps 5"),
        (dict(max_grad_norm=-1.0), r"max_grad_norm must be finite and >= 0.0, got -1.0"),
        (dict(train_mode="qlora"), r"train_mode must be one of \('full', 'lora'\)"),
        (dict(lora_rank=0), r"lora_rank must be >= 1"),
        (dict(master_dtype="bfloat16"), r"master_dtype must be one of \('float32',\), got 'bfloat16'"),
    ],
)
def test_bad_settings_are_named_with_their_values(changes, message):
    with pytest.raises(ValueError, match=message):
        RunRecipe(**changes)


def test_the_recipe_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        RunRecipe("adamw")
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunRecipe().lr = 1.0


def test_overrides_are_checked_alone_and_together_where_all_parts_are_given():
    assert check_overrides({"lr": 1, "lr_schedule": "cosine"}) == {"lr": 1.0, "lr_schedule": LRSchedule.COSINE}
    with pytest.raises(ValueError, match="total_steps must exceed warmup_steps"):
        check_overrides({"lr_schedule": "cosine", "total_steps": 10, "warmup_steps": 10})
    with pytest.raises(ValueError, match="'learning_rate' is not a recipe setting"):
        check_overrides({"learning_rate": 1e-3})
    with pytest.raises(ValueError, match=r"^target_batch_size must be >= 1"):
        check_setting("batch_size", 0, "target_batch_size")


SAMPLE = RunRecipe(
    optimizer="adam",
    lr=3e-4,
    weight_decay=0.1,
    warmup_steps=10,
    lr_schedule="cosine",
    total_steps=100,
    max_grad_norm=1.0,
    batch_size=32,
    train_mode="lora",
    lora_rank=4,
)


def test_the_wire_form_is_plain_and_round_trips():
    wire = SAMPLE.to_wire()
    assert wire["lr_schedule"] == "cosine" and type(wire["lr_schedule"]) is str and type(wire["train_mode"]) is str
    assert RunRecipe.from_wire(wire) == SAMPLE
    assert RunRecipe.from_wire(RunRecipe().to_wire()) == RunRecipe()


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda w: w.pop("lr"), "exactly the settings"),
        (lambda w: w.update(inner_steps=4), "exactly the settings"),  # a setting this version cannot honour
        (lambda w: w.update(lr=1), "lr must be a number, got 1"),  # the wire carries a float as a float
        (lambda w: w.update(batch_size=32.0), "batch_size must be an integer"),
        (lambda w: w.update(lr=-1.0), "lr must be finite and > 0.0"),
        (lambda w: w.update(total_steps=0), "total_steps must exceed warmup_steps"),
    ],
)
def test_the_wire_form_is_strict(change, words):
    wire = SAMPLE.to_wire()
    change(wire)
    with pytest.raises(InvalidRecordError, match=words):
        RunRecipe.from_wire(wire)
    with pytest.raises(InvalidRecordError, match="exactly the settings"):
        RunRecipe.from_wire([1, 2])


def test_equal_recipes_have_equal_digests_and_any_difference_changes_it():
    assert SAMPLE.digest() == RunRecipe.from_wire(SAMPLE.to_wire()).digest()
    assert len(SAMPLE.digest()) == 64
    others = dict(
        optimizer="sgd",
        lr=3.0001e-4,
        weight_decay=0.0,
        warmup_steps=11,
        lr_schedule="constant",
        total_steps=101,
        max_grad_norm=0.5,
        batch_size=31,
        train_mode="full",
        lora_rank=8,
        averaging_compression="float16",
        local_steps=8,
        outer_lr=0.5,
        outer_momentum=0.0,
        sync_overlap=1,
    )
    assert set(others) == {f.name for f in dataclasses.fields(RunRecipe)} - {"master_dtype"}  # only float32 exists
    for name, value in others.items():
        assert RunRecipe.from_wire(SAMPLE.to_wire() | {name: value, "local_steps": 8}).digest() != SAMPLE.digest(), name
    eight = SAMPLE.to_wire() | {"local_steps": 8}
    assert RunRecipe.from_wire(eight | {"sync_overlap": 1}).digest() != RunRecipe.from_wire(eight).digest()


def test_an_overlap_is_on_the_wire_only_where_set_and_below_the_local_steps():
    """A run without overlapped syncs has the wire form (and digest) it had before the setting existed, so peers
    of either version read each other's recipe; one with them names it, and an overlap as long as a sync's interval
    is refused: its outer step would land after the next sync began."""
    assert "sync_overlap" not in RunRecipe(local_steps=8).to_wire()
    assert RunRecipe.from_wire(RunRecipe(local_steps=8).to_wire() | {"sync_overlap": 0}) == RunRecipe(local_steps=8)
    overlapped = RunRecipe(local_steps=8, sync_overlap=3)
    assert overlapped.to_wire()["sync_overlap"] == 3 and RunRecipe.from_wire(overlapped.to_wire()) == overlapped
    assert "each overlapping 3 inner steps" in overlapped.describe()
    with pytest.raises(ValueError, match=r"sync_overlap must be below local_steps.*--local-steps H"):
        RunRecipe(local_steps=4, sync_overlap=4)
    with pytest.raises(ValueError, match="sync_overlap must be below local_steps"):
        RunRecipe(sync_overlap=1)  # no local steps: nothing to overlap
    with pytest.raises(ValueError, match="sync_overlap must be below local_steps"):
        check_overrides({"local_steps": 2, "sync_overlap": 2})
    with pytest.raises(InvalidRecordError, match="sync_overlap"):
        RunRecipe.from_wire(RunRecipe(local_steps=2).to_wire() | {"sync_overlap": 5})


def test_differences_name_each_setting_with_both_values():
    here = dataclasses.replace(SAMPLE, lr=1e-3, optimizer="sgd")
    assert here.differences(SAMPLE) == [
        "optimizer: 'sgd' here, 'adam' in the run's recipe",
        "lr: 0.001 here, 0.0003 in the run's recipe",
    ]
    assert SAMPLE.differences(SAMPLE) == []


# --- the schedule ---


def reference_lrs(recipe: RunRecipe, steps: int) -> list[float]:
    """The learning rate of each update as transformers' Trainer applies it: optimizer.step(), then scheduler.step()."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=recipe.lr)
    if recipe.lr_schedule == LRSchedule.COSINE:
        scheduler = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.total_steps)
    else:
        scheduler = get_constant_schedule_with_warmup(optimizer, recipe.warmup_steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    "recipe",
    [
        RunRecipe(lr=3e-4),
        RunRecipe(lr=3e-4, warmup_steps=7),
        RunRecipe(lr=3e-4, warmup_steps=1),
        RunRecipe(lr=1e-3, lr_schedule="cosine", total_steps=50),
        RunRecipe(lr=1e-3, lr_schedule="cosine", total_steps=50, warmup_steps=9),
        RunRecipe(lr=0.7, lr_schedule="cosine", total_steps=3, warmup_steps=2),
    ],
)
def test_the_schedule_equals_transformers_float_for_float(recipe):
    steps = recipe.total_steps + 1 if recipe.total_steps else 40
    assert [lr_at(recipe, step) for step in range(steps)] == reference_lrs(recipe, steps)


def test_a_warmup_starts_at_zero_and_cosine_ends_at_zero_and_stays_there():
    recipe = RunRecipe(lr=1e-3, lr_schedule="cosine", total_steps=20, warmup_steps=4)
    assert lr_at(recipe, 0) == 0.0 and lr_at(recipe, 4) == 1e-3
    assert lr_at(recipe, 20) == 0.0
    # transformers' cosine would climb again on a second half-cycle; a run past its planned end learns nothing
    assert reference_lrs(recipe, 30)[25] > 0 and lr_at(recipe, 25) == 0.0
    assert lr_at(RunRecipe(lr=1e-3), 10**9) == 1e-3
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        lr_at(recipe, -1)


# --- clipping ---


def test_the_global_norm_of_parts_is_the_norm_of_the_whole_in_any_order():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in [(5, 3), (7,), (2, 2, 2)]]
    parts = [float(g.pow(2).sum()) for g in grads]
    whole = float(torch.cat([g.flatten() for g in grads]).norm())
    assert global_norm(parts) == pytest.approx(whole, rel=1e-15)
    assert global_norm(parts) == global_norm(reversed(parts)) == global_norm(sorted(parts))
    assert global_norm([]) == 0.0
    # summed exactly: a float sum would drop the small parts after a large one, and differ by order
    parts = [1e16] + [1.0] * 1000
    assert global_norm(parts) == global_norm(reversed(parts)) == math.sqrt(1e16 + 1000)
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match=r"squared norm 1 of 2 must be finite and >= 0"):
            global_norm([1.0, bad])


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 3.0, 1e3])
def test_clipping_scales_like_torchs_clip_grad_norm(max_norm):
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=generator) for shape in [(8, 4), (4,), (3, 3)]]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    scale = clip_scale(global_norm(float(g.double().pow(2).sum()) for g in grads), max_norm)
    assert scale == pytest.approx(min(1.0, max_norm / (total + 1e-6)), rel=1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * scale, rtol=1e-6, atol=0)


def test_clip_scale_is_one_without_clipping_or_under_the_bound_and_refuses_what_is_not_a_norm():
    assert clip_scale(1e9, 0.0) == 1.0
    assert clip_scale(math.nan, 0.0) == 1.0  # no clipping asked: the norm is not looked at
    assert clip_scale(0.5, 1.0) == 1.0
    assert clip_scale(4.0, 1.0) == 1.0 / (4.0 + 1e-6)
    with pytest.raises(ValueError, match="total_norm must be finite and >= 0, got nan"):
        clip_scale(math.nan, 1.0)
    with pytest.raises(ValueError, match=r"max_norm must be finite and >= 0, got -1\.0"):
        clip_scale(1.0, -1.0)
