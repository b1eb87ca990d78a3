"""A trainer: routes pipelined micro-batches through the peers of a run and trains the local parts.

One step, synchronous (the swarm then computes what one process would):
1. wait until every stage of the run has applied the previous update;
2. run the batch's micro-batches, several in flight at once: embeddings here, the blocks on one peer per
   stage (forward kept for the backward; the backward goes to any peer of the stage, chosen by load), loss
   and head here, then backward through the stages, which accumulate their parameter gradients;
3. wait until every stage has updated, redoing on a live member the backward calls that a dead peer took
   with it;
4. update the embeddings, norm and head, averaged with the run's other trainers if there are any.

Loss weighting is the same everywhere: each micro-batch's mean loss is weighted by its samples, and each
update divides by all the samples of the step (swarm/training/averaging.py), exactly as the local reference does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from client.config import TrainConfig
from client.sequence import TakenBackward, TrainingTag
from protocol import swarmlm_pb2 as pb
from protocol.errors import StaleEpochError, StateDownloadError, SwarmError
from swarm.dht.node import start_dht, stop_dht
from swarm.training.averaging import TrainingGroup, group_key, has_nonfinite
from swarm.training.optim import make_optimizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePeer:
    """A live peer of the run, as its Info answer and record describe it."""

    span: tuple[int, int]
    epoch: int
    """Updates its stage has applied."""
    samples: int
    """Samples it holds towards the next update."""
    updating: bool
    """In the middle of an update: its group has what it needs, and counts as growing."""


@dataclass
class StepResult:
    step: int
    loss: float
    samples: int
    tokens: int
    seconds: float
    stage_epochs: dict[tuple[int, int], int]


def local_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainer's own parameters (embeddings, final norm, head), each once even when tied, in a fixed order."""
    seen, params = set(), []
    for _, p in sorted(model.named_parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean next-token cross-entropy over a micro-batch, as transformers computes it with labels=input_ids."""
    return ForCausalLMLoss(logits=logits, labels=ids, vocab_size=vocab_size)


# Trainers' progress records count no samples, only who is in the run, so they may outlive lagging DHT stores (a
# 2 s record lapsed under load, and a trainer that missed its co-trainer updated alone); a trainer that died is
# still expected for this long, which costs at most a round's timeout or two.
TRAINER_PROGRESS_TTL_S = 15.0


class SwarmTrainer:
    """Trains `model` (a connected DistributedModelForCausalLM) with the peers of `config.run_id`.

    `step(batch)` blocks; its work runs on the model's event loop and, for local tensors, on one thread.
    """

    def __init__(self, model, config: TrainConfig):
        self.model, self.config = model, config
        self.sequence = model.sequence
        self.sequence.run_id = config.run_id
        self.params = local_parameters(model)
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = make_optimizer(config.optimizer, self.params, lr=config.lr, weight_decay=config.weight_decay)
        # a node that accepts connections (the model's own DHT is a client): trainers average through it
        self.dht = start_dht(
            self.sequence.config.initial_peers, host=config.host, swarm_key=self.sequence.config.swarm_key
        )
        try:
            self.group = TrainingGroup(
                self.dht,
                group_key(self.sequence.prefix, config.run_id, "trainers"),
                self.params,
                self.optimizer,
                settings=config.averaging,
                progress_ttl_s=TRAINER_PROGRESS_TTL_S,
                swarm_key=self.sequence.config.swarm_key,
            )
        except BaseException:
            stop_dht(self.dht)
            raise
        self.local = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-local")
        self.steps_done = 0
        self.redone = 0  # backward calls redone because the peer that took them died before its update
        self.stale = 0  # micro-batches that reached a stage after it had updated
        try:  # a trainer joining a run copies the other trainers' state first
            if any(pid != self.group.peer_id and p.epoch > 0 for pid, p in self.group.progress().items()):
                try:
                    self.group.load_state()
                except StateDownloadError as exc:
                    # their records outlive them: those may have left (a restarted trainer sees its old self);
                    # if not, the next round averages our parameters into theirs
                    logger.warning("starting from this trainer's own weights: %s", exc)
            self.group.share_state()
        except BaseException:
            self.close()
            raise

    def step(self, batch: torch.Tensor) -> StepResult:
        """Train on `batch` ([batch_size, seq_len] token ids) and return the step's mean loss."""
        if batch.shape[0] != self.config.batch_size:
            raise ValueError(f"expected a batch of {self.config.batch_size} sequences, got {batch.shape[0]}")
        future = self.model.submit(self._step(batch))
        try:
            # in short waits: a Ctrl+C that another thread of this process received runs its handler (raising
            # KeyboardInterrupt here) only once this thread wakes, and a step may wait for a long time
            while not future.done():
                concurrent.futures.wait([future], timeout=0.5)
            return future.result()
        except BaseException:  # Ctrl+C: stop the step's work too, not only the wait for it
            future.cancel()
            raise

    async def _local(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.local, fn)

    async def _step(self, batch: torch.Tensor) -> StepResult:
        began = time.perf_counter()
        epochs = await self._wait_for_stages(wait=True)
        tag = TrainingTag(self.config.run_id, epochs)
        done: list[TakenBackward] = []
        limit = self.config.max_in_flight or batch.shape[0]
        gate = asyncio.Semaphore(limit)
        micro = list(batch.split(self.config.micro_batch_size))
        losses = await asyncio.gather(*(self._micro_batch(ids, tag, gate, done) for ids in micro))
        updated = await self._wait_for_update(tag, done)
        if updated:
            members = await asyncio.to_thread(self.group.expected_members)
            grads, samples = await self._local(self.group.take)
            grads, state, epoch = await asyncio.to_thread(self.group.average, grads, samples, members)
            if has_nonfinite(grads) or (state is not None and has_nonfinite(state)):
                logger.warning("the trainers' update %d is not finite; skipping it", epoch)
                grads, state = None, None
            await self._local(lambda: self.group.apply(grads, state, epoch))
        self.steps_done += 1
        loss = sum(loss * ids.shape[0] for loss, ids in zip(losses, micro)) / batch.shape[0]
        stage_epochs = await self._wait_for_stages(wait=False)
        return StepResult(
            self.steps_done, loss, batch.shape[0], batch.numel(), time.perf_counter() - began, stage_epochs
        )

    async def _micro_batch(
        self, ids: torch.Tensor, tag: TrainingTag, gate: asyncio.Semaphore, done: list[TakenBackward]
    ) -> float:
        async with gate:
            model = self.model
            positions = torch.arange(ids.shape[1]).unsqueeze(0)

            def embed():
                with torch.enable_grad():
                    return model.model.embed_tokens(ids)

            hidden = await self._local(embed)
            outputs, records = await self.sequence.forward(hidden.detach(), None, positions, keep_for_backward=True)

            def head():
                with torch.enable_grad():
                    out = outputs.detach().requires_grad_(True)
                    loss = lm_loss(model.lm_head(model.model.norm(out)), ids, model.config.vocab_size)
                    grads = torch.autograd.grad(loss, [out, *self.params], allow_unused=True)
                return float(loss.detach()), grads[0], grads[1:]

            loss, grad_out, head_grads = await self._local(head)
            try:
                grad_in = await self.sequence.backward(grad_out, records, None, positions, training=tag, done=done)
            except StaleEpochError as exc:  # a stage updated without this micro-batch (another trainer filled it)
                self.stale += 1
                logger.warning("a micro-batch came after its stage's update and was dropped: %s", exc)
                return loss

            def embed_backward():
                with torch.enable_grad():
                    grads = torch.autograd.grad(hidden, self.params, grad_in, allow_unused=True)
                total = [_add(a, b, p) for a, b, p in zip(head_grads, grads, self.params)]
                self.group.accumulate(total, samples=ids.shape[0])

            await self._local(embed_backward)
            return loss

    # --- the stages' updates ---

    async def _stage_epochs(self) -> dict[str, StagePeer]:
        """Peer id -> state of every live peer of the run (those that answer an Info call)."""
        snapshot = await self.sequence.snapshot(refresh=True)

        async def ask(peer_id, info):
            try:
                address = await self.sequence.address_of(peer_id, info)
                response = await self.sequence.pool.unary(address, "info", pb.InfoRequest(), 5.0)
            except SwarmError:
                return None
            if response.run_id != self.config.run_id:
                return None
            return peer_id, StagePeer(
                (info.start_block, info.end_block), int(response.epoch), int(response.samples), response.updating
            )

        answers = await asyncio.gather(*(ask(pid, info) for pid, info in snapshot.online().items()))
        return dict(answer for answer in answers if answer is not None)

    async def _wait_for_stages(self, *, wait: bool) -> dict[tuple[int, int], int]:
        """Span -> epoch of each stage, once every live peer of a stage is at its stage's highest epoch."""
        deadline = time.monotonic() + self.config.step_timeout_s
        while True:
            peers = await self._stage_epochs()
            spans: dict[tuple[int, int], list[int]] = {}
            for peer in peers.values():
                spans.setdefault(peer.span, []).append(peer.epoch)
            settled = all(min(e) == max(e) for e in spans.values())
            if settled or not wait or time.monotonic() > deadline:
                if not settled and wait:
                    logger.warning("peers of a stage disagree on their update: %s", spans)
                return {span: max(e) for span, e in spans.items()}
            await asyncio.sleep(0.05)

    async def _wait_for_update(self, tag: TrainingTag, done: list[TakenBackward]) -> bool:
        """Wait until every stage has moved past `tag`'s epochs; False if that stalled.

        Other trainers may still be filling the update: the wait lasts while the stages' samples grow, and
        gives up `step_timeout_s` after they stopped growing (a trainer died, or this one is alone), so that
        the next batch adds to the same update instead of waiting forever.
        """
        deadline = time.monotonic() + self.config.step_timeout_s
        last_progress = None
        while True:
            peers = await self._stage_epochs()
            pending = {p.span for p in peers.values() if p.epoch <= tag.epochs.get(p.span, -1)}
            if not pending:
                return True
            lost = [t for t in done if t.hop.peer_id not in peers and (t.hop.start, t.hop.end) in pending]
            for item in lost:
                done.remove(item)
                await self._redo(item, tag, done)
            # a peer that enters an update counts as growing too: its group has what it needs
            progress = (sum(p.samples for p in peers.values()), sum(p.updating for p in peers.values()))
            if progress != last_progress:
                last_progress, deadline = progress, time.monotonic() + self.config.step_timeout_s
            if time.monotonic() > deadline:
                logger.warning(
                    "stages %s did not update, and got no samples for %.0fs; going on (the next batch "
                    "adds to the same update)",
                    sorted(pending),
                    self.config.step_timeout_s,
                )
                return False
            await asyncio.sleep(0.05)

    async def _redo(self, taken: TakenBackward, tag: TrainingTag, done: list[TakenBackward]) -> None:
        """Send a dead peer's share of the step again, to a live peer of its stage."""
        hop, inputs, grad = taken.hop, taken.inputs, taken.grad
        await self.sequence.report_failure(hop, SwarmError("left before its stage updated"))
        positions = torch.arange(inputs.shape[1]).unsqueeze(0)
        try:
            _, records = await self.sequence.forward(
                inputs, None, positions, hop.start, hop.end, keep_for_backward=True
            )
            await self.sequence.backward(grad, records, None, positions, training=tag, done=done)
            self.redone += 1
        except StaleEpochError:  # the stage is updating already, without it
            self.stale += 1

    def close(self) -> None:
        """Stop the local thread, the group's averager and the DHT node (idempotent)."""
        self.local.shutdown(wait=False, cancel_futures=True)
        self.group.shutdown()
        stop_dht(self.dht)


def _add(a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if a is None and b is None:
        return torch.zeros_like(like)
    if a is None or b is None:
        return a if b is None else b
    return a + b
