"""The reference for swarm training: the same model, data order, micro-batches and optimizer, in one process.

`swarmlm train --local` runs it; the tests and the `train_swarm` benchmark compare the swarm against it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from client.config import TrainConfig
from client.training.trainer import StepResult, lm_loss, local_parameters
from swarm.training.optim import make_optimizer


class LocalTrainer:
    """Trains the whole model here, step for step as SwarmTrainer trains it with the swarm."""

    def __init__(self, model_path: str | Path, config: TrainConfig, *, dtype: torch.dtype = torch.float32):
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        self.model.eval()  # as the peers run their blocks: no dropout
        self.params = local_parameters(self.model)
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = make_optimizer(config.optimizer, self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.steps_done = 0

    def step(self, batch: torch.Tensor) -> StepResult:
        began = time.perf_counter()
        sums = [torch.zeros_like(p) for p in self.params]
        losses = []
        for ids in batch.split(self.config.micro_batch_size):
            with torch.enable_grad():
                logits = self.model(input_ids=ids, use_cache=False).logits
                loss = lm_loss(logits, ids, self.model.config.vocab_size)
                grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            for acc, grad in zip(sums, grads):
                if grad is not None:
                    acc.add_(grad, alpha=ids.shape[0])
            losses.append(float(loss.detach()) * ids.shape[0])
        with torch.no_grad():
            for p, acc in zip(self.params, sums):
                p.grad = acc / batch.shape[0]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return StepResult(
            self.steps_done,
            sum(losses) / batch.shape[0],
            batch.shape[0],
            batch.numel(),
            time.perf_counter() - began,
            {},
        )

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path, safe_serialization=True)

    def close(self) -> None:
        pass
