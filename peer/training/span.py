"""A training peer: the span's trainable tensors, its optimizer, and its place in the span's training group.

Backward requests of a run add their parameter gradients (weighted by their batch size); a background loop
publishes this peer's progress and, once the group holds `target_batch_size` samples, averages with it and
updates (swarm/training/averaging.py). Updates run on the compute thread, between requests, never under one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from peer.blocks import BlockSpan
from peer.config import TrainingConfig
from protocol.errors import BadRequestError, StaleEpochError, StateDownloadError
from protocol.vocab import TrainMode
from swarm.training.averaging import TrainingGroup, digest, group_key, has_nonfinite
from swarm.training.optim import make_optimizer, set_step_count, state_tensors

logger = logging.getLogger(__name__)


class SpanTraining:
    """The trainable state of one span, and the loop that updates it with its group."""

    def __init__(self, span: BlockSpan, config: TrainingConfig, dht, prefix: str, *, swarm_key=None):
        self.span, self.config = span, config
        if config.mode == TrainMode.LORA:
            from peer.lora import LoraSettings, add_lora  # peft is needed only for LoRA

            params = add_lora(span, LoraSettings(rank=config.lora_rank, alpha=2.0 * config.lora_rank), seed=0)
        else:
            params = [p for _, p in sorted(span.layers.named_parameters())]
            for p in params:
                p.requires_grad_(True)
        self.params = params
        self.optimizer = make_optimizer(config.optimizer, params, lr=config.lr, weight_decay=config.weight_decay)
        self.group = TrainingGroup(
            dht,
            group_key(prefix, config.run_id, f"{span.start}-{span.end}"),
            params,
            self.optimizer,
            settings=config.averaging,
            swarm_key=swarm_key,
        )
        self._digest: tuple[int, str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None  # set when gradients arrive, so the loop looks at once
        self._catch_up_after = 0.0  # after a failed catch-up, when to try again
        self.saved_as = (
            Path(config.save_dir) / f"{prefix}.{config.run_id}.{span.start}-{span.end}.pt" if config.save_dir else None
        )

    @property
    def run_id(self) -> str:
        return self.config.run_id

    @property
    def epoch(self) -> int:
        return self.group.epoch

    @property
    def samples(self) -> int:
        return self.group.samples

    # --- requests (on the compute thread) ---

    def check(self, run_id: str, blocks: tuple[int, int], epoch: int) -> None:
        if run_id != self.run_id:
            raise BadRequestError(f"this peer trains run {self.run_id!r}, not {run_id!r}; route to peers of your run")
        if blocks != (self.span.start, self.span.end):
            raise BadRequestError(
                f"a training backward must cover this peer's whole span "
                f"{self.span.start}:{self.span.end}, got {blocks[0]}:{blocks[1]}"
            )
        if epoch != self.epoch or self.group.closing:
            raise StaleEpochError(
                f"this peer is at update {self.epoch} of run {self.run_id!r}, the gradient is for "
                f"update {epoch}{' (being applied now)' if epoch == self.epoch else ''}; recompute it against "
                f"the weights after the update"
            )

    def backward(
        self,
        outputs: torch.Tensor,
        inputs: torch.Tensor,
        grad: torch.Tensor,
        *,
        run_id: str,
        blocks: tuple[int, int],
        epoch: int,
    ) -> torch.Tensor:
        """Gradient w.r.t. `inputs`; the parameters' gradients join the next update."""
        self.check(run_id, blocks, epoch)  # again: an update may have come while the request waited
        with torch.enable_grad():
            grads = torch.autograd.grad(outputs, [inputs, *self.params], grad, allow_unused=True)
        param_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads[1:])]
        if has_nonfinite(param_grads):
            raise BadRequestError("the gradients are not finite; check grad_outputs and the learning rate")
        self.group.accumulate(param_grads, samples=inputs.shape[0])
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._woken.set)
        return grads[0]

    def digest(self) -> str:
        if self._digest is None or self._digest[0] != self.epoch:
            self._digest = (self.epoch, digest(self.params))
        return self._digest[1]

    def weights(self) -> dict[str, torch.Tensor]:
        """The span's current weights named as in the checkpoint (LoRA merged in)."""
        from peer import lora

        if self.config.mode == TrainMode.LORA:
            return lora.merged_layer_state(self.span)
        return lora.layer_state(self.span)

    # --- joining and updating ---

    def join(self) -> None:
        """Resume from the save file, then copy the group's state if the group is ahead (blocking, bounded)."""
        if self.saved_as is not None and self.saved_as.exists():
            self._resume()
        members = self.group.progress()
        ahead = [pid for pid, p in members.items() if pid != self.group.peer_id and p.epoch > self.epoch]
        if ahead:
            logger.info(
                "group %s is at update %d; copying its state", self.group.key, max(members[pid].epoch for pid in ahead)
            )
            try:
                self.group.load_state()
            except StateDownloadError:
                # the members seen may have left since (their progress outlives them by a few seconds)
                if any(p.epoch > self.epoch for pid, p in self.group.progress().items() if pid != self.group.peer_id):
                    raise
                logger.warning(
                    "the members of %s that were ahead left; starting from update %d", self.group.key, self.epoch
                )
        self.group.share_state()
        self.group.publish()

    async def run(self, compute: Callable[[Callable], Awaitable], on_update: Callable[[], None]) -> None:
        """Publish progress and update with the group whenever it holds its target batch. Runs until cancelled."""
        group, settings = self.group, self.config.averaging
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._woken.clear()
            try:
                members = await asyncio.to_thread(group.progress)
                same = {pid: p for pid, p in members.items() if p.epoch == group.epoch}
                if sum(p.samples for p in same.values()) >= self.config.target_batch_size:
                    await self._update(len(same), compute)
                    on_update()
                elif (
                    max(p.epoch for p in members.values()) > group.epoch
                    and not group.closing
                    and time.monotonic() >= self._catch_up_after
                ):
                    # its samples can never complete an update the others have made: drop them and catch up
                    logger.warning(
                        "group %s moved on without this peer (update %d, here %d); dropping %d samples "
                        "and copying its state",
                        group.key,
                        max(p.epoch for p in members.values()),
                        group.epoch,
                        group.samples,
                    )
                    try:
                        await compute(lambda: (group.discard(), group.load_state()))
                    except StateDownloadError as exc:  # try again later, not at every tick
                        self._catch_up_after = time.monotonic() + settings.load_state_timeout_s
                        logger.warning("%s", exc)
                busy = any(p.samples for p in same.values())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the DHT may be briefly unreachable; training goes on next tick
                logger.warning("training loop: %r", exc)
                busy = False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), settings.progress_period_s / (5 if busy else 1))

    async def _update(self, members: int, compute) -> None:
        grads, samples = await compute(self.group.take)
        grads, state, epoch = await asyncio.to_thread(self.group.average, grads, samples, members)
        if has_nonfinite(grads) or (state is not None and has_nonfinite(state)):
            logger.warning("update %d of %s is not finite; skipping it", epoch, self.group.key)
            grads, state = None, None
        await compute(lambda: self.group.apply(grads, state, epoch))
        logger.info(
            "update %d of run %r applied (%d samples here, %d group members)", epoch, self.run_id, samples, members
        )
        if self.config.save_every and epoch % self.config.save_every == 0:
            await compute(self.save)

    # --- saving ---

    def save(self) -> None:
        if self.saved_as is None:
            return
        self.saved_as.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "epoch": self.epoch,
            "params": [p.detach().cpu() for p in self.params],
            "optimizer": [t.detach().cpu() for t in state_tensors(self.optimizer)],
        }
        tmp = self.saved_as.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.saved_as)
        logger.info("saved update %d to %s", self.epoch, self.saved_as)

    def _resume(self) -> None:
        state = torch.load(self.saved_as, map_location="cpu", weights_only=True)
        live = [*self.params, *state_tensors(self.optimizer)]
        saved = [*state["params"], *state["optimizer"]]
        if len(saved) != len(live) or any(s.shape != t.shape for s, t in zip(saved, live)):
            raise ValueError(
                f"{self.saved_as} holds another span's or mode's state; move it away or choose another --save-dir"
            )
        with torch.no_grad():
            for dst, src in zip(live, saved):
                dst.copy_(src)
        self.group.epoch = int(state["epoch"])
        set_step_count(self.optimizer, self.group.epoch)
        logger.info("resumed run %r at update %d from %s", self.run_id, self.epoch, self.saved_as)

    def shutdown(self) -> None:
        try:
            self.save()
        except Exception as exc:
            logger.warning("could not save the training state: %r", exc)
        self.group.shutdown()
