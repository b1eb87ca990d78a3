"""A mixture-of-experts model's load-balancing loss through the client's own forward and backward (RemoteBlocks), on
an in-memory swarm (tests/helpers/fake_swarm.py): `model(..., labels=ids)` gives transformers' loss and aux_loss, and
the gradient of the caller's embeddings equals transformers' (the router term reaches every hop), also with padding,
with a corrupter of forward or backward answers caught by spot checks, and with a peer whose answers lack the sums."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swarm.models.checkpoint import attention_for
from tests.helpers.fake_swarm import FakeSwarm, Fault
from tests.helpers.models import MOE_CONFIGS, VOCAB_SIZE, _common, save_random_model

AUX_COEF = 0.3


OTHER_FAMILIES = {  # besides MOE_CONFIGS: GPT-OSS computes with eager attention (its sinks), OLMoE plainly
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=6),
}


def _checkpoint(family: str, path):
    if family in MOE_CONFIGS:
        config = MOE_CONFIGS[family](4)
    else:
        config = AutoConfig.for_model(family, **_common(4), **OTHER_FAMILIES[family])
    config.output_router_logits, config.router_aux_loss_coef = True, AUX_COEF
    path = save_random_model(config, path / family)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention_for(config))
    return path, local.eval()


def _loss_and_grad(model, ids, embeds, mask, **kwargs):
    inputs = embeds.clone().requires_grad_(True)
    out = model(inputs_embeds=inputs, attention_mask=mask, labels=ids, **kwargs)
    out.loss.backward()
    return out, inputs.grad


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "gpt_oss"])
def test_loss_aux_loss_and_gradients_equal_transformers(family, tmp_path):
    path, local = _checkpoint(family, tmp_path)
    ids = torch.randint(3, VOCAB_SIZE, (2, 10), generator=torch.Generator().manual_seed(0))
    embeds = local.get_input_embeddings()(ids).detach()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: padded rows count for nothing in the loss's sums
    with FakeSwarm(path) as swarm:
        swarm.add_peer(0, 1)
        swarm.add_peer(1, 4)
        model = swarm.client()
        try:
            for attention_mask in (None, mask):
                ours, our_grad = _loss_and_grad(model, ids, embeds, attention_mask)
                theirs, their_grad = _loss_and_grad(local, ids, embeds, attention_mask)
                assert float(ours.aux_loss.detach()) == pytest.approx(float(theirs.aux_loss.detach()), rel=1e-5)
                assert float(ours.loss.detach()) == pytest.approx(float(theirs.loss.detach()), rel=1e-5)
                torch.testing.assert_close(our_grad, their_grad, atol=1e-5, rtol=1e-4)
                # without the term (as transformers with output_router_logits=False): another gradient
                _, plain_grad = _loss_and_grad(model, ids, embeds, attention_mask, output_router_logits=False)
                assert float((plain_grad - their_grad).abs().max()) > 1e-4
        finally:
            model.shutdown()


@pytest.mark.parametrize("method", ["forward", "backward"])
def test_a_corrupter_caught_by_spot_checks_leaves_the_loss_and_gradients_exact(method, tmp_path):
    path, local = _checkpoint("mixtral", tmp_path)
    with FakeSwarm(path) as swarm:
        for _ in range(3):
            swarm.add_peer(0, 4)
        corrupter = swarm.add_peer(0, 4, throughput=1e6, faults=[Fault("perturb", method=method)])
        model = swarm.client(verify_fraction=1.0, verify_seed=0)
        try:
            ids = torch.randint(3, VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(1))
            embeds = local.get_input_embeddings()(ids).detach()
            ours, our_grad = _loss_and_grad(model, ids, embeds, None)
            theirs, their_grad = _loss_and_grad(local, ids, embeds, None)
            assert model.sequence.spot_checks.stats.caught  # its answer was replaced by the honest majority's
            assert corrupter.peer_id in model.sequence.bans.banned()
            assert float(ours.loss.detach()) == pytest.approx(float(theirs.loss.detach()), rel=1e-5)
            torch.testing.assert_close(our_grad, their_grad, atol=1e-5, rtol=1e-4)
        finally:
            model.shutdown()


def test_a_peer_that_leaves_out_its_router_sums_is_left_out_and_the_loss_stays_exact(tmp_path):
    """As a peer that predates router sums answers: its hidden states are right, its sums missing."""
    path, local = _checkpoint("qwen2_moe", tmp_path)
    with FakeSwarm(path) as swarm:
        swarm.add_peer(0, 4)
        old = swarm.add_peer(0, 4, throughput=1e6, faults=[Fault("no_router", method="forward")])
        model = swarm.client()
        try:
            ids = torch.randint(3, VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(2))
            embeds = local.get_input_embeddings()(ids).detach()
            ours, our_grad = _loss_and_grad(model, ids, embeds, None)
            theirs, their_grad = _loss_and_grad(local, ids, embeds, None)
            assert old.peer_id in model.sequence.bans.banned() and model.sequence.failovers == 1
            assert float(ours.loss.detach()) == pytest.approx(float(theirs.loss.detach()), rel=1e-5)
            torch.testing.assert_close(our_grad, their_grad, atol=1e-5, rtol=1e-4)
        finally:
            model.shutdown()
