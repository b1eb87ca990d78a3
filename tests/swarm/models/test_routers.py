"""The load-balancing loss added up from stages equals transformers' own, value and gradient, on every MoE family."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from client.training.microbatches import lm_loss
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError
from swarm.models.routers import (
    RouterStats,
    RouterTotals,
    aux_coefficient,
    check_prob_grad,
    check_stats,
    moe_shape,
    recording,
)
from tests.helpers.models import MOE_CONFIGS, VOCAB_SIZE, llama_config

STAGES = [(0, 1), (1, 4)]  # qwen2_moe's layer 1 is a plain MLP: the second stage holds a dense layer too


def _model(family: str):
    config = MOE_CONFIGS[family](4)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.05
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
@pytest.mark.parametrize("masked", [False, True])
def test_stages_add_up_to_transformers_loss_and_gradient(family, masked):
    model = _model(family)
    config = model.config
    experts, top_k = moe_shape(config)
    coef = aux_coefficient(config)
    assert coef == 0.05
    ids = torch.randint(0, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if masked:
        mask[1, :4] = 0  # left padding

    # transformers: LM loss + coef * aux, and its gradients
    out = model(input_ids=ids, attention_mask=mask if masked else None, labels=ids)
    reference = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)

    # the pipeline's way: each stage records its own layers' sums in the same forward
    weights = mask.reshape(-1).float() if masked else None
    stages = [RouterStats(experts, top_k, weights) for _ in STAGES]
    with contextlib.ExitStack() as stack:
        for stats, (start, end) in zip(stages, STAGES):
            for layer in model.model.layers[start:end]:
                stack.enter_context(recording(layer, stats, config))
        logits = model(input_ids=ids, attention_mask=mask if masked else None, use_cache=False).logits
    messages = [check_stats(s.to_message(), experts, top_k, "p") for s in stages]
    totals = RouterTotals.add(messages, experts)
    assert totals.loss() == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)

    grad = torch.tensor(totals.prob_grad(coef), dtype=torch.float32)
    lm = lm_loss(logits, ids, VOCAB_SIZE)
    assert float(lm.detach()) + coef * totals.loss() == pytest.approx(float(out.loss.detach()), rel=1e-6)
    surrogate = lm + sum((grad * s.probs).sum() for s in stages if s.probs is not None)
    params = list(model.parameters())
    mine = torch.autograd.grad(surrogate, params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), mine, reference):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    # the aux term really reaches the routers: without it their gradients differ
    plain = model(input_ids=ids, attention_mask=mask if masked else None, use_cache=False).logits
    without = torch.autograd.grad(lm_loss(plain, ids, VOCAB_SIZE), params, allow_unused=True)
    routers = [i for i, (name, _) in enumerate(model.named_parameters()) if name.endswith("mlp.gate.weight")]
    routers_moved = max(float((mine[i] - without[i]).abs().max()) for i in routers)
    assert routers_moved > 1e-5  # the aux term really reaches the routers


def test_the_weight_is_transformers_unless_given_and_a_dense_model_has_none():
    assert moe_shape(llama_config(2)) is None and aux_coefficient(llama_config(2)) == 0.0
    with pytest.raises(ValueError, match="no load-balancing loss"):
        aux_coefficient(llama_config(2), 0.01)
    config = MOE_CONFIGS["mixtral"](2)
    assert moe_shape(config) == (4, 2) and aux_coefficient(config) == 0.0  # output_router_logits is off by default
    assert aux_coefficient(config, 0.02) == 0.02
    config.output_router_logits = True
    assert aux_coefficient(config) == config.router_aux_loss_coef and aux_coefficient(config, 0.0) == 0.0
    assert RouterTotals.add([([], [], 0.0)], 4).prob_grad(0.05) == []
    # DeepSeek's experts are balanced without this loss in transformers: no term, and none to ask for
    deepseek = AutoConfig.for_model("deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, output_router_logits=True)
    assert moe_shape(deepseek) is None and aux_coefficient(deepseek) == 0.0
    with pytest.raises(ValueError, match="no load-balancing loss"):
        aux_coefficient(deepseek, 0.01)


def test_stats_no_forward_gives_are_refused():
    good = pb.RouterStats(counts=[3, 1, 0, 0], probs=[0.9, 0.6, 0.3, 0.2], rows=2)
    assert check_stats(good, 4, 2, "p")[2] == 2.0
    assert check_stats(pb.RouterStats(), 4, 2, "p") == ([], [], 0.0)  # a span with no routed layer
    for bad in [
        pb.RouterStats(counts=[3, 1, 0], probs=[0.9, 0.6, 0.5], rows=2),  # experts
        pb.RouterStats(counts=[5, -1, 0, 0], probs=[0.9, 0.6, 0.3, 0.2], rows=2),  # negative
        pb.RouterStats(counts=[3, 1, 0, 0], probs=[float("nan"), 0.6, 0.3, 0.2], rows=2),  # not finite
        pb.RouterStats(counts=[30, 1, 0, 0], probs=[0.9, 0.6, 0.3, 0.2], rows=2),  # more picks than rows give
        pb.RouterStats(counts=[3, 1, 0, 0], probs=[9, 0.6, 0.3, 0.2], rows=2),  # probabilities over 1 a row
    ]:
        with pytest.raises(ValueError):
            check_stats(bad, 4, 2, "p")


def test_a_router_gradient_is_one_finite_value_per_expert():
    assert check_prob_grad([], 4) is None
    assert check_prob_grad([0.1, 0.2, 0.3, 0.4], 4).shape == (4,)
    for bad in ([0.1, 0.2], [0.1, float("inf"), 0.3, 0.4]):
        with pytest.raises(BadRequestError):
            check_prob_grad(bad, 4)
