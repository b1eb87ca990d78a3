"""client.training.local: the reference applies the run's recipe as torch and transformers would, and with the
defaults still computes, bit for bit, what it computed before the recipe had a schedule, clipping and spared decay."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

from client.config import TrainConfig
from client.training.local import LocalTrainer
from client.training.microbatches import lm_loss
from client.training.trainer import local_parameters
from swarm.training.recipe import RunRecipe, lr_at

BATCH, MICRO, SEQ = 4, 2, 8


def batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (BATCH, SEQ), generator=generator) for _ in range(count)]


def mean_grads(model, params, batch) -> list[torch.Tensor]:
    """The step's mean gradients, micro-batch by micro-batch, as the swarm adds them."""
    sums = [torch.zeros_like(p) for p in params]
    for ids in batch.split(MICRO):
        loss = lm_loss(model(input_ids=ids, use_cache=False).logits, ids, model.config.vocab_size)
        for acc, grad in zip(sums, torch.autograd.grad(loss, params, allow_unused=True)):
            if grad is not None:
                acc.add_(grad, alpha=ids.shape[0])
    return [acc / batch.shape[0] for acc in sums]


def reference(path, steps, *, make_optimizer, schedule=None, max_grad_norm: float = 0.0):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    params = local_parameters(model)
    optimizer = make_optimizer(model, params)
    scheduler = schedule(optimizer) if schedule else None
    for batch in batches(steps):
        grads = mean_grads(model, params, batch)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_norm=max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if scheduler:
            scheduler.step()
    return model


def trained(path, steps, **config) -> LocalTrainer:
    trainer = LocalTrainer(path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, **config))
    for batch in batches(steps):
        trainer.step(batch)
    return trainer


def test_with_the_default_recipe_it_computes_exactly_what_it_did_before(tiny_llama_path):
    ours = trained(tiny_llama_path, 3, lr=1e-2)
    # before: one AdamW group over every parameter, a flat learning rate, no clipping, no decay
    before = reference(tiny_llama_path, 3, make_optimizer=lambda m, ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0))
    for (name, p), q in zip(sorted(ours.model.named_parameters()), local_parameters(before)):
        assert torch.equal(p, q), name


def test_schedule_clipping_and_spared_decay_are_torchs_and_transformers(tiny_llama_path):
    recipe = dict(lr=1e-2, weight_decay=0.1, warmup_steps=2, lr_schedule="cosine", total_steps=5, max_grad_norm=0.5)
    ours = trained(tiny_llama_path, 5, **recipe)

    def by_hand(model, params):
        spared = {id(p) for name, p in model.named_parameters() if "norm" in name or "embed" in name}
        return torch.optim.AdamW(
            [
                {"params": [p for p in params if id(p) not in spared], "weight_decay": 0.1},
                {"params": [p for p in params if id(p) in spared], "weight_decay": 0.0},
            ],
            lr=1e-2,
        )

    theirs = reference(
        tiny_llama_path,
        5,
        make_optimizer=by_hand,
        schedule=lambda optimizer: get_cosine_schedule_with_warmup(optimizer, 2, 5),
        max_grad_norm=0.5,
    )
    moved = False
    for (name, p), q in zip(sorted(ours.model.named_parameters()), local_parameters(theirs)):
        # clipping's factor is computed in float64 here, in float32 by torch: ~1e-6 apart after 5 updates of ~1e-2
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    for (name, p), q in zip(sorted(ours.model.named_parameters()), local_parameters(initial)):
        moved |= "norm" in name and not torch.equal(p, q)
    assert moved  # norm weights train too, only without decay


def test_the_clipping_factor_is_the_global_norms(tiny_llama_path):
    trainer = LocalTrainer(tiny_llama_path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, max_grad_norm=0.01))
    grads = mean_grads(trainer.model, trainer.params, batches(1)[0])
    total = float(torch.cat([g.double().flatten() for g in grads]).norm())
    assert trainer.clip_scale(grads) == pytest.approx(0.01 / (total + 1e-6), rel=1e-12)
    assert LocalTrainer(tiny_llama_path, TrainConfig()).clip_scale(grads) == 1.0  # no clipping by default


def test_a_resumed_reference_goes_on_with_the_schedule(tiny_llama_path):
    config = TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, warmup_steps=10, lr=1e-2)
    trainer = LocalTrainer(tiny_llama_path, config, steps_done=4)
    trainer.step(batches(1)[0])
    assert trainer.optimizer.param_groups[0]["lr"] == lr_at(config.recipe(), 4) == 4e-3
    assert trainer.recipe == RunRecipe(lr=1e-2, warmup_steps=10, batch_size=BATCH)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # an untied head, and a head tied to the embeddings
def test_a_lora_reference_saves_an_adapter_peft_loads_and_resumes_from_it(family, request, tmp_path):
    """`swarmlm train --local --train-mode lora --save`: the adapters, embeddings, norm and head as a peft adapter
    folder (what `swarmlm export --adapter-only` writes of a swarm's run); a reference resumed from it and its
    optimizer state goes on as the uninterrupted one; a folder of another rank is refused."""
    from peft import PeftModel

    path = request.getfixturevalue(f"tiny_{family}_path")
    config = dict(lr=1e-2, train_mode="lora")
    whole = trained(path, 3, **config)
    first = trained(path, 2, **config)
    first.save_pretrained(tmp_path / "adapter")
    saved = first.state_dict()
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}

    ids = batches(1)[0]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, first.model(ids).logits, atol=1e-5, rtol=0)

    resumed = LocalTrainer(path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, **config), steps_done=2)
    resumed.load_adapter(tmp_path / "adapter")
    resumed.load_state_dict(saved)
    resumed.step(batches(3)[2])
    for (name, p), (_, q) in zip(sorted(resumed.model.named_parameters()), sorted(whole.model.named_parameters())):
        assert torch.equal(p, q), name

    other = LocalTrainer(
        path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, lr=1e-2, train_mode="lora", lora_rank=4)
    )
    with pytest.raises(ValueError, match="other adapters than this run's"):
        other.load_adapter(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"holds no adapter_model\.safetensors"):
        resumed.load_adapter(tmp_path)


def test_a_model_whose_attention_sdpa_refuses_trains_with_its_eager_attention(tmp_path):
    """Gemma 2 caps attention scores, which sdpa refuses: the reference computes as the peers do, eagerly."""
    from transformers import AutoConfig

    from tests.client.test_families import FAMILIES
    from tests.helpers.models import _common, save_random_model

    path = save_random_model(AutoConfig.for_model("gemma2", **{**_common(4), **FAMILIES["gemma2"]}), tmp_path / "g")
    trainer = LocalTrainer(path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, lr=1e-2))
    batch = batches(1)[0]
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = sum(float(lm_loss(eager(ids).logits, ids, 128)) * ids.shape[0] for ids in batch.split(MICRO))
    assert trainer.step(batch).loss == pytest.approx(expected / BATCH, rel=1e-6)


def test_a_reference_saved_with_an_overlapped_sync_still_to_land_resumes_as_the_uninterrupted_one(tiny_llama_path):
    """`--local-steps 2 --sync-overlap 1`: saved after update 1, whose sync lands after update 2, the reference
    keeps the sync's pseudo-gradients and the weights they were taken at; resumed from it (weights copied as a
    checkpoint would hold them), it lands the step and goes on bit for bit as the run that never stopped."""
    config = dict(lr=1e-2, local_steps=2, sync_overlap=1)
    whole = trained(tiny_llama_path, 4, **config)
    first = trained(tiny_llama_path, 2, **config)
    assert first.pending is not None and first.pending.lands == 2
    saved, weights = first.state_dict(), {n: p.detach().clone() for n, p in first.model.named_parameters()}
    resumed = LocalTrainer(
        tiny_llama_path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, **config), steps_done=2
    )
    with torch.no_grad():
        for name, p in resumed.model.named_parameters():
            p.copy_(weights[name])
    resumed.load_state_dict(saved)
    for batch in batches(4)[2:]:
        resumed.step(batch)
    for (name, p), (_, q) in zip(sorted(resumed.model.named_parameters()), sorted(whole.model.named_parameters())):
        assert torch.equal(p, q), name
