"""swarm.training.optim: optimizers built from the recipe, weight decay spared as transformers' Trainer spares it,
and state that exists before the first step and behaves exactly like torch's own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarm.training.optim import make_optimizer, param_groups, set_lr, set_step_count, state_tensors
from swarm.training.recipe import OPTIMIZERS, RunRecipe
from swarm.training.settings import AveragingSettings
from tests.helpers.models import llama_config, qwen2_config, qwen3_config

TORCH = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


class Block(torch.nn.Module):
    """Names that would fool a name pattern: a norm called "scale", a linear called "norm_proj"."""

    def __init__(self):
        super().__init__()
        self.norm_proj = torch.nn.Linear(3, 4)  # weight decayed, bias spared
        self.scale = torch.nn.LayerNorm(4)  # both spared
        self.table = torch.nn.Embedding(5, 3)  # spared


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(4, 3, generator=generator)),
        torch.nn.Parameter(torch.randn(5, generator=generator)),
    ]


def steps(optimizers, params_lists, count: int = 3) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        grads = [torch.randn(p.shape, generator=generator) for p in params_lists[0]]
        for ps in params_lists:
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_prebuilt_state_steps_like_torch(name):
    ours, theirs = params(), params()
    optimizer = make_optimizer(RunRecipe(optimizer=name, lr=1e-2, weight_decay=0.1), ours)
    steps([optimizer, TORCH[name](theirs, lr=1e-2, weight_decay=0.1)], [ours, theirs])
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_decay_is_spared_by_module_type_and_bias_not_by_name(name):
    torch.manual_seed(0)
    ours, theirs = Block(), Block()
    theirs.load_state_dict(ours.state_dict())
    optimizer = make_optimizer(RunRecipe(optimizer=name, lr=1e-2, weight_decay=0.5), ours)
    reference = TORCH[name](
        [
            {"params": [theirs.norm_proj.weight], "weight_decay": 0.5},
            {"params": [theirs.norm_proj.bias, theirs.scale.bias, theirs.scale.weight, theirs.table.weight]},
        ],
        lr=1e-2,
        weight_decay=0.0,
    )
    [decayed, spared] = optimizer.param_groups
    assert decayed["params"] == [ours.norm_proj.weight] and decayed["weight_decay"] == 0.5
    assert spared["weight_decay"] == 0.0 and len(spared["params"]) == 4
    named = lambda m: [p for _, p in sorted(m.named_parameters())]  # noqa: E731
    steps([optimizer, reference], [named(ours), named(theirs)])
    for (key, p), q in zip(sorted(ours.named_parameters()), named(theirs)):
        assert torch.equal(p, q), key


@pytest.mark.parametrize(
    "config, spared",
    [
        (llama_config(2), {"model.embed_tokens.weight", "model.norm.weight", "input_layernorm", "post_attention"}),
        (qwen3_config(2), {"model.embed_tokens.weight", "model.norm.weight", "layernorm", "q_norm", "k_norm"}),
        (qwen2_config(2), {"model.embed_tokens.weight", "model.norm.weight", "layernorm", ".bias"}),
    ],
)
def test_on_real_architectures_norms_biases_and_embeddings_are_spared(config, spared):
    model = AutoModelForCausalLM.from_config(config)
    named = sorted(model.named_parameters())
    groups = {group["weight_decay"]: group["params"] for group in param_groups(model, 0.1)}
    names = {id(p): name for name, p in named}
    no_decay = {names[id(p)] for p in groups[0.0]}
    assert no_decay and all(any(part in name for part in spared) for name in no_decay), no_decay
    assert all(not any(part in names[id(p)] for part in spared) for p in groups[0.1])
    assert len(groups[0.0]) + len(groups[0.1]) == len(named)  # each once; a tied head is the embedding
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in dict(named) and model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert id(model.lm_head.weight) in {id(p) for p in groups[0.1]}


def test_the_trained_parameters_keep_the_callers_order_and_must_belong_to_the_module():
    block = Block()
    chosen = [("scale.weight", block.scale.weight), ("norm_proj.weight", block.norm_proj.weight)]
    groups = param_groups(block, 0.1, chosen)
    assert [g["params"] for g in groups] == [[block.norm_proj.weight], [block.scale.weight]]
    assert param_groups(block, 0.1, [block.scale.bias, block.scale.weight])[0]["params"] == [
        block.scale.bias,
        block.scale.weight,
    ]
    frozen = Block()
    frozen.table.weight.requires_grad_(False)
    assert id(frozen.table.weight) not in {id(p) for g in param_groups(frozen, 0.1) for p in g["params"]}
    with pytest.raises(ValueError, match=r"of shape \(1,\) that is not a parameter of the Block given"):
        param_groups(block, 0.1, [torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match=r"of shape \(1,\) named 'scale.weight' that is not a parameter"):
        param_groups(block, 0.1, [("scale.weight", torch.nn.Parameter(torch.zeros(1)))])  # not of its shape
    with pytest.raises(ValueError, match="lists a tensor twice"):
        param_groups(block, 0.1, [block.scale.weight, block.scale.weight])


def test_float32_masters_of_low_precision_weights_are_grouped_by_the_weights_they_stand_for():
    model = AutoModelForCausalLM.from_config(qwen2_config(1)).to(torch.bfloat16)  # tied head, qkv biases
    named = sorted(model.named_parameters())
    masters = [(name, torch.nn.Parameter(p.detach().float())) for name, p in named]
    optimizer = make_optimizer(RunRecipe(weight_decay=0.1), model, masters)
    by_id = {id(m): name for name, m in masters}
    spared = {by_id[id(m)] for m in optimizer.param_groups[1]["params"]}
    assert spared == {name for name, _ in named if "norm" in name or name.endswith("bias") or "embed" in name}
    assert all(p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"])
    # the tied head stands for the embedding under either name
    head = torch.nn.Parameter(model.lm_head.weight.detach().float())
    assert param_groups(model, 0.1, [("lm_head.weight", head)]) == [{"params": [head], "weight_decay": 0.0}]
    # LoRA adapters are the module's own parameters, whatever name the caller gives them
    assert param_groups(model, 0.1, [("adapter.0", model.model.layers[0].mlp.up_proj.weight)])[0]["weight_decay"] == 0.1


def test_without_weight_decay_the_groups_step_bit_for_bit_like_one_group():
    # what `swarmlm train --local` computed before weight decay was spared: it must not move by a bit
    torch.manual_seed(0)
    ours, theirs = Block(), Block()
    theirs.load_state_dict(ours.state_dict())
    optimizer = make_optimizer(RunRecipe(lr=1e-3), ours)
    reference = torch.optim.AdamW([p for _, p in sorted(theirs.named_parameters())], lr=1e-3, weight_decay=0.0)
    steps([optimizer, reference], [[p for _, p in sorted(m.named_parameters())] for m in (ours, theirs)], count=5)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def test_master_weights_must_be_float32():
    with pytest.raises(ValueError, match=r"is torch.bfloat16, not the recipe's master dtype float32"):
        make_optimizer(RunRecipe(), [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])


def test_state_tensors_are_listed_before_the_first_step_in_group_order():
    block = Block()
    optimizer = make_optimizer(RunRecipe(weight_decay=0.1), block)
    listed = [p for group in optimizer.param_groups for p in group["params"]]
    assert [t.shape for t in state_tensors(optimizer)] == [p.shape for p in listed for _ in range(2)]
    assert all(not t.any() for t in state_tensors(optimizer))
    assert state_tensors(make_optimizer(RunRecipe(optimizer="sgd"), block)) == []


def test_step_count_and_lr_are_set_in_every_group():
    optimizer = make_optimizer(RunRecipe(optimizer="adam", weight_decay=0.1), Block())
    set_step_count(optimizer, 7)
    assert all(float(state["step"]) == 7.0 for state in optimizer.state.values())
    set_lr(optimizer, 0.25)
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 0.25]


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
