"""The reference for swarm training: the same model, data order, micro-batches and update, in one process.

`swarmlm train --local` runs it; the tests and the `train_swarm` benchmark compare the swarm against it. An update
follows the run's recipe as the swarm applies it: mean gradients of the step's micro-batches (weighted by their
samples), clipped by their global norm, then the optimizer with the schedule's learning rate for that update and
weight decay spared on norms, biases and embeddings; all in float32. With local steps (`--local-steps H`), every H
updates end with the outer step of one worker (swarm/training/outer.py), as a run whose stages have one member each
and one trainer computes it; with `--sync-overlap N` that step lands N updates later, on top of them. In a LoRA run (`--train-mode lora`) the
decoder layers get the adapters a peer adds (peer/lora.py: the same initialization, by block and layer name) and
only those train there, with the embeddings, final norm and head, as in the swarm.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from client.config import TrainConfig
from client.training.microbatches import lm_loss
from client.training.trainer import StepResult, local_named_parameters, local_parameters
from protocol.vocab import TrainMode
from swarm.models.checkpoint import attention_for, load_config
from swarm.models.routers import aux_coefficient
from swarm.training.optim import make_optimizer, set_lr, set_step_count, state_tensors
from swarm.training.outer import OuterStep, PendingSync, sync_due
from swarm.training.recipe import RunRecipe, clip_scale, global_norm, lr_at


class LocalTrainer:
    """Trains the whole model here, step for step as SwarmTrainer trains it with the swarm."""

    def __init__(
        self, model_path: str | Path, config: TrainConfig, *, recipe: RunRecipe | None = None, steps_done: int = 0
    ):
        """`recipe`: the run's (by default `config.recipe()`, this trainer's batch as the run's); `steps_done`: the
        updates already applied (resuming), which the schedule goes on from."""
        self.config, self.model_path = config, Path(model_path)
        self.recipe = recipe if recipe is not None else config.recipe()
        attention = attention_for(load_config(Path(model_path)))  # as the peers compute
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=attention
        )
        self.model.eval()  # as the peers run their blocks: no dropout
        self.aux_coef = aux_coefficient(self.model.config, config.router_aux_loss_coef)
        self.lora = self.recipe.train_mode == TrainMode.LORA
        if self.lora:
            self.params = _add_lora(self.model, self.recipe)
        else:
            self.params = local_parameters(self.model)
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = make_optimizer(self.recipe, self.model, self.params)
        # local steps (DiLoCo): one worker's inner steps, and its outer step every local_steps updates
        self.outer = (
            OuterStep(self.params, lr=self.recipe.outer_lr, momentum=self.recipe.outer_momentum)
            if self.recipe.local_steps > 1
            else None
        )
        self.pending: PendingSync | None = None  # an overlapped sync whose outer step has not landed yet
        self.steps_done = steps_done

    def step(self, batch: torch.Tensor) -> StepResult:
        began = time.perf_counter()
        sums = [torch.zeros_like(p) for p in self.params]
        losses = []
        for ids in batch.split(self.config.micro_batch_size):
            with torch.enable_grad():
                if self.aux_coef:  # transformers' own load-balancing loss, as its forward adds it
                    out = self.model(input_ids=ids, use_cache=False, output_router_logits=True)
                    loss = lm_loss(out.logits, ids, self.model.config.vocab_size) + self.aux_coef * out.aux_loss
                else:
                    out = self.model(input_ids=ids, use_cache=False)
                    loss = lm_loss(out.logits, ids, self.model.config.vocab_size)
                grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            for acc, grad in zip(sums, grads):
                if grad is not None:
                    acc.add_(grad, alpha=ids.shape[0])
            losses.append(float(loss.detach()) * ids.shape[0])
        with torch.no_grad():
            mean = [acc / batch.shape[0] for acc in sums]
            scale = self.clip_scale(mean)
            for p, grad in zip(self.params, mean):
                p.grad = grad if scale == 1.0 else grad * scale
            set_lr(self.optimizer, lr_at(self.recipe, self.steps_done))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.outer is not None:
                self._outer_step()
        self.steps_done += 1
        return StepResult(
            self.steps_done,
            sum(losses) / batch.shape[0],
            batch.shape[0],
            batch.numel(),
            time.perf_counter() - began,
            {},
            trainer_samples=batch.shape[0],
        )

    def _outer_step(self) -> None:
        """After update `steps_done`: the outer step of an overlapped sync due now, then this update's sync."""
        overlap = self.recipe.sync_overlap
        if self.pending is not None and self.steps_done >= self.pending.lands:
            self.outer.apply(self.pending.averaged, carry=True)  # one worker: the average is its own
            self.pending = None
        if sync_due(self.steps_done, self.recipe.local_steps):
            if overlap:
                self.pending = PendingSync(self.steps_done + overlap, averaged=self.outer.take())
            else:
                self.outer.apply(self.outer.pseudo_gradients())

    def clip_scale(self, grads: list[torch.Tensor]) -> float:
        """The factor the step's mean gradients are clipped by (1: none): from each tensor's squared norm, summed as
        the swarm sums its stages' and the trainer's."""
        if self.recipe.max_grad_norm == 0.0:
            return 1.0
        return clip_scale(global_norm(float(g.double().pow(2).sum()) for g in grads), self.recipe.max_grad_norm)

    def state_dict(self) -> dict:
        """What a resumed reference needs besides its weights: its update count and optimizer statistics."""
        state = {
            "epoch": self.steps_done,
            "optimizer": [t.detach().cpu().clone() for t in state_tensors(self.optimizer)],
        }
        if self.outer is not None:
            state["outer"] = [t.detach().cpu().clone() for t in self.outer.state()]
        if self.pending is not None:
            state["pending_sync"] = {
                "lands": self.pending.lands,
                "averaged": self.pending.averaged,
                "taken": self.outer.taken,
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        live = state_tensors(self.optimizer)
        if len(state["optimizer"]) != len(live) or any(s.shape != t.shape for s, t in zip(state["optimizer"], live)):
            raise ValueError("the saved optimizer state does not fit this model")
        outer = self.outer.state() if self.outer is not None else []
        if len(state.get("outer", [])) != len(outer):
            raise ValueError("the save is of a run with other local steps (--local-steps): resume it with the same")
        with torch.no_grad():
            for dst, src in zip([*live, *outer], [*state["optimizer"], *state.get("outer", [])]):
                dst.copy_(src)
        self.steps_done = int(state["epoch"])
        set_step_count(self.optimizer, self.steps_done)
        pending = state.get("pending_sync")
        if pending is not None:
            self.pending = PendingSync(int(pending["lands"]), averaged=pending["averaged"])
            self.outer.taken = [t.clone() for t in pending["taken"]]

    def save_pretrained(self, path: str | Path) -> None:
        """The model as a checkpoint; in a LoRA run, the adapters and the embeddings, norm and head as a peft adapter
        folder, as `swarmlm export --adapter-only` writes the swarm's (the blocks' weights stay the checkpoint's)."""
        if not self.lora:
            self.model.save_pretrained(path, safe_serialization=True)
            return
        from client.training.adapters import write_adapter

        config = self.model.config
        write_adapter(
            path,
            self._adapters(),
            self._trainer_part(),
            rank=self.recipe.lora_rank,
            alpha=self.recipe.lora_alpha,
            base_model=self.model_path,
            num_blocks=config.num_hidden_layers,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def load_adapter(self, path: str | Path) -> None:
        """Go on from a LoRA run's `save_pretrained` folder: its adapters, embeddings, norm and head.

        Raises:
            ValueError: not a LoRA reference, or the folder's tensors are not this run's (other names or shapes).
        """
        from client.training.adapters import read_adapter

        if not self.lora:
            raise ValueError("only a LoRA reference (--train-mode lora) resumes from an adapter folder")
        saved, live = read_adapter(path), {**self._adapters(), **self._trainer_part()}
        if "lm_head.weight" not in live:  # tied: peft keeps a copy of the embeddings as the head
            saved.pop("lm_head.weight", None)
        if set(saved) != set(live) or any(saved[n].shape != t.shape for n, t in live.items()):
            odd = sorted(set(saved) ^ set(live)) or [n for n, t in live.items() if saved[n].shape != t.shape]
            raise ValueError(
                f"{path} holds other adapters than this run's (first of them: {odd[:3]}); resume with the model, "
                f"--lora-rank and --lora-alpha the save was made with"
            )
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(saved[name])

    def _adapters(self) -> dict[str, torch.Tensor]:
        from swarm.training.adapters import adapter_params

        return dict(adapter_params(self.model.model.layers, 0))

    def _trainer_part(self) -> dict[str, torch.Tensor]:
        """The embeddings, final norm and head by checkpoint name (the head left out when tied to the embeddings)."""
        return {name: p for name, p in local_named_parameters(self.model) if not name.startswith("model.layers.")}

    def close(self) -> None:
        pass


def _add_lora(model: torch.nn.Module, recipe: RunRecipe) -> list[torch.nn.Parameter]:
    """Add the adapters the peers add to every decoder layer; the parameters that train: the embeddings, final norm
    and head (each once), then the adapters, all others frozen."""
    from swarm.training.adapters import LoraSettings, inject_lora

    trainer_part = [p for name, p in local_named_parameters(model) if not name.startswith("model.layers.")]
    settings = LoraSettings(rank=recipe.lora_rank, alpha=recipe.lora_alpha)
    adapters = inject_lora(model.model.layers, 0, settings, seed=0)  # the seed the peers use (peer/training/span.py)
    model.requires_grad_(False)
    return trainer_part + adapters
