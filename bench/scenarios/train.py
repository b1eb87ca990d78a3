"""Forward+backward: `model(input_ids, labels=...).loss.backward()` through the remote blocks, tokens/s vs local.

Both sides do the same fine-tuning work: the transformer blocks are frozen (peers never update theirs; the
local model's blocks get requires_grad=False) and gradients flow through them to the trainable embeddings
and LM head. Peers keep each forward's activations for its backward (peer/activations.py), with their
default memory for it; a backward that misses them recomputes the forward.
"""

from __future__ import annotations

import contextlib

import torch

from bench.harness import ModelRun, Split, sync_for
from bench.scenarios.decode import prompt_ids
from bench.stats import Row, Summary, Target, time_call

TRAIN_TARGET = Target("ratio", ">=", 0.8, ">= 0.8x local")
TINY_TRAIN_TARGET = Target("ratio", ">=", 0.85, ">= 0.85x local")


@contextlib.contextmanager
def frozen_blocks(model: torch.nn.Module):
    """Blocks frozen, every other parameter trainable, for the body; the flags are restored afterwards."""
    saved = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        for name, p in model.named_parameters():
            p.requires_grad_(".layers." not in f".{name}")
        yield model
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(saved[name])
            p.grad = None


def step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss)


def run(model_run: ModelRun, split: Split) -> list[Row]:
    plan, model, client = model_run.plan, model_run.model, split.client
    sync = sync_for(plan.device)
    ids = prompt_ids(model.config.vocab_size, plan.train_seq, seed=1, batch=plan.train_batch)
    local_ids = ids.to(plan.device)
    tokens = plan.train_batch * plan.train_seq
    local_s, swarm_s, losses = [], [], {}
    with frozen_blocks(model_run.reference) as reference, frozen_blocks(client):
        losses["reference"] = step(reference, local_ids)
        losses["ours"] = step(client, ids)
        for _ in range(plan.repeats):
            local_s.append(time_call(lambda: step(reference, local_ids), sync))
            swarm_s.append(time_call(lambda: step(client, ids)))
    target = (TINY_TRAIN_TARGET if model.name == "tiny" else TRAIN_TARGET) if split.count == 3 else None
    return [
        Row(
            scenario="train",
            config=model.name,
            variant=f"{split.count} peer{'s' * (split.count > 1)}, {plan.train_batch}x{plan.train_seq}",
            metric="forward+backward",
            unit="tokens/s",
            ours=Summary.of([tokens / s for s in swarm_s]),
            reference=Summary.of([tokens / s for s in local_s]),
            reference_name="local HF model",
            target=target,
            extra={"seconds": {"ours": swarm_s, "reference": local_s}, "loss": losses},
        )
    ]
