"""A trainer: routes pipelined micro-batches through the peers of a run and trains the local parts.

One step is one update of the whole model (the swarm computes what one process would):
1. find every stage's members at the run's current update (client/training/stages.py);
2. run the batch's micro-batches, several in flight at once, through one member per stage, each added once by
   one member (client/training/microbatches.py);
3. commit the update to every member, wait for each stage's round, and apply it everywhere with one clipping
   factor from the global norm (client/training/update.py);
4. apply the same update to the embeddings, norm and head here.

Loss weighting is the same everywhere: each micro-batch's mean loss is weighted by its samples, and each update
divides by all the samples of the step, exactly as the local reference (client/training/local.py) does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from client.config import TrainConfig
from client.training.cotrainers import CoTrainers
from client.training.ledger import Ledger
from client.training.microbatches import MicroBatches
from client.training.stages import INFO_TIMEOUT_S, Span, Stages
from client.training.syncs import TrainerSyncs
from client.training.update import Averaged, Update
from protocol.errors import (
    StaleEpochError,
    StateDownloadError,
    SwarmError,
    TrainingFaultError,
)
from protocol.records import TrainingProgress
from swarm.dht.node import start_dht, stop_dht
from swarm.training.group import TRAINER_PROGRESS_TTL_S
from swarm.training.optim import make_optimizer, set_step_count, state_tensors
from swarm.training.outer import vouched_digest
from swarm.training.recipe import RunRecipe, adopt_recipe, clip_scale, global_norm, lr_at

logger = logging.getLogger(__name__)

MAX_LATE_STEPS = 20  # tries of one batch whose update moves on without it (other trainers going on meanwhile)
ORPHAN_MARGIN_S = 10.0  # past a dead trainer's record lifetime: the stages drop its update within ORPHAN_GRACE_S
ORPHAN_POLL_S = 1.0


@dataclass
class StepResult:
    step: int
    loss: float
    samples: int
    """Samples of this trainer's batch."""
    tokens: int
    seconds: float
    stage_epochs: dict[tuple[int, int], int]
    """Span -> updates its members have applied after this step."""
    stage_samples: dict[tuple[int, int], int] = field(default_factory=dict)
    """Span -> the samples its members applied in this step's update (all trainers together)."""
    trainer_samples: int = 0
    """The samples the trainers' own update (embeddings, norm, head) applied."""
    faults: list[str] = field(default_factory=list)
    """What went wrong in this step and was repaired (a member fenced, a round repeated)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of the step by phase: `ready` (waiting for the stages to open the update), `micro_batches` (compute
    and the wire), `rounds` (the trainers' and stages' rounds), `decide` (storing the decision on the update),
    `apply` (the stages' and own update), `sync` (local steps' outer sync, and the new state's record). All but
    `micro_batches` is waiting on others."""


class Phases:
    """Seconds between marks: `end(name)` closes the phase that began at the last mark."""

    def __init__(self, began: float):
        self.mark, self.seconds = began, {}

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.mark
        self.mark = now


def local_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainer's own parameters (embeddings, final norm, head), each once even when tied, in a fixed order."""
    return [p for _, p in local_named_parameters(model)]


def local_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    seen, params = set(), []
    for name, p in sorted(model.named_parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            params.append((name, p))
    return params


class SwarmTrainer:
    """Trains `model` (a connected DistributedModelForCausalLM) with the peers of `config.run_id`.

    `step(batch)` blocks; its work runs on the model's event loop and, for local tensors, on one thread.
    """

    def __init__(self, model, config: TrainConfig, *, epoch: int | None = None):
        """`epoch`: the update this trainer's own parts are at (resuming from a save); None adopts the stages'."""
        self.model, self.config = model, config
        self.sequence = model.sequence
        self.sequence.run_id = config.run_id
        named = local_named_parameters(model)
        self.params = [p for _, p in named]
        for p in self.params:
            p.requires_grad_(True)
        # a node that accepts connections (the model's own DHT is a client): it signs this trainer's records
        self.dht = start_dht(
            self.sequence.config.initial_peers, host=config.host, swarm_key=self.sequence.config.swarm_key
        )
        try:
            self.trainer_id = self.dht.peer_id.to_base58()
            self.recipe: RunRecipe = adopt_recipe(
                self.dht, self.sequence.prefix, config.run_id, config.recipe_overrides(), config.recipe()
            )
            self.optimizer = make_optimizer(self.recipe, model, named)
        except BaseException:
            stop_dht(self.dht)
            raise
        self.syncs = TrainerSyncs(self) if self.recipe.local_steps > 1 else None  # local steps (DiLoCo)
        self.outer = self.syncs.outer if self.syncs is not None else None
        self.stages = Stages(self.sequence, config.run_id)
        self.local = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-local")
        self.micro_batches = MicroBatches(model, self.params, self.stages, config, self.trainer_id, self._local)
        self.epoch = epoch
        self.steps_done = 0
        try:
            self.trainers = CoTrainers(
                self.dht,
                self.sequence.prefix,
                config,
                params=self.params,
                state=self._shared_state,
                stages_epoch=self._stages_epoch,
                swarm_key=self.sequence.config.swarm_key,
                compression=self.recipe.averaging_compression,
                digest_of=self._vouched,
            )
            self._join_trainers()
        except BaseException:
            self.close()
            raise

    # --- the blocking facade ---

    def step(self, batch: torch.Tensor) -> StepResult:
        """Train on `batch` ([batch_size, seq_len] token ids) and return the step's mean loss and what was applied.

        Raises:
            TrainingFaultError: the update could not be completed exactly; nothing of it was applied here.
        """
        if batch.shape[0] != self.config.batch_size:
            raise ValueError(f"expected a batch of {self.config.batch_size} sequences, got {batch.shape[0]}")
        future = self.model.submit(self._step_retrying(batch))
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

    # --- one step ---

    async def _step_retrying(self, batch: torch.Tensor) -> StepResult:
        """A step; one whose update moved on without it (it was late among several trainers) is done again at the
        next update: its micro-batches at the stages are left out of the update they missed. Refused as late with
        no other trainer left, it waits: the stages hold an update that trainers now dead committed without it,
        and drop it once their records have lapsed (peer/training/follow.py)."""
        late = 0
        orphaned_until = None
        while True:
            try:
                return await self._step(batch)
            except StaleEpochError as exc:
                alone = await asyncio.to_thread(self._catch_up_trainers, self.epoch)
                if alone:
                    if orphaned_until is None:
                        orphaned_until = time.monotonic() + TRAINER_PROGRESS_TTL_S + ORPHAN_MARGIN_S
                        logger.warning("%s; no other trainer is left: waiting for the stages to drop that update", exc)
                    if time.monotonic() > orphaned_until:
                        raise TrainingFaultError(
                            f"the stages still refuse this trainer's micro-batches, and no other trainer is left "
                            f"to apply the update they hold: {exc}"
                        ) from exc
                    await asyncio.sleep(ORPHAN_POLL_S)
                    continue
                late += 1
                if late == MAX_LATE_STEPS:
                    raise TrainingFaultError(f"this trainer missed {MAX_LATE_STEPS} updates in a row: {exc}") from exc
                logger.warning("%s; doing this batch again at the next update", exc)

    def _catch_up_trainers(self, missed: int | None) -> bool:
        """After update `missed` went on without it: copy the state that a majority of the trainers vouches for
        once they have applied it. Whether no other trainer was left to copy from (this one goes on with its own).

        Meanwhile its record names the update it means to join, vouching for no state: the other trainers wait for
        it there as for one still computing, or a trainer that updates alone faster than a copy takes would never
        be caught up with. It joins past an overlapped sync of theirs still to land: they serve no state before,
        and waiting for it at that update would hold them all."""
        missed = -1 if missed is None else missed
        landing = self.trainers.last_landing(self.recipe.sync_overlap)
        joining = max(missed, (self._stages_epoch() or 0) - 1, landing) + 1
        self.trainers.publish(TrainingProgress(epoch=joining, samples=0, param_digest=""))
        self.trainers.wait_until_past(max(missed, landing))
        try:
            verified = self.trainers.load_state(self.state())
        except StateDownloadError as exc:
            if self.trainers.others():
                raise
            # the trainers that applied it are gone, and their parts with them: what is left is ours
            if self._stages_epoch() != self.epoch:
                logger.warning(
                    "%s; this trainer's embeddings and head go on from their own state (update %s)", exc, self.epoch
                )
                self.epoch = None  # the next step adopts the stages' update
            return True
        self._load_state(verified.epoch, verified.tensors)
        return False

    async def _step(self, batch: torch.Tensor) -> StepResult:
        began = time.perf_counter()
        phases = Phases(began)
        epoch, members = await self.stages.ready(None, self.config.step_timeout_s)
        if self.epoch is not None and epoch > self.epoch:
            raise StaleEpochError(f"the stages are at update {epoch}, this trainer's own parts at {self.epoch}")
        if self.epoch is not None and epoch < self.epoch:  # members are still applying the last update
            epoch, members = await self.stages.ready(self.epoch, self.config.step_timeout_s)
        if self.epoch is None and epoch > 0:
            if await asyncio.to_thread(self.trainers.majority) is not None:  # other trainers: take their state
                raise StaleEpochError(f"the stages are at update {epoch}; this trainer joins the others there")
            logger.warning(
                "the run's stages have applied %d updates; this trainer's embeddings and head %s",
                epoch,
                "go on from their own state, which missed the updates of trainers now gone"
                if self.steps_done
                else "start from the checkpoint (resume a trainer with --save to continue its own)",
            )
        self.epoch = epoch
        self.trainers.publish(
            TrainingProgress(epoch=epoch, samples=0, param_digest=self.trainers.progress.param_digest)
        )
        left_out = await self.stages.left_out(members, epoch)
        self.sequence.avoid = frozenset(left_out)  # no micro-batch goes to a peer outside the update
        sat_out = [f"update {epoch}: peer {pid[-8:]} sits it out ({why})" for pid, why in sorted(left_out.items())]
        for fault in sat_out:
            logger.warning("%s", fault)
        ledger = Ledger(members)
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        gate = asyncio.Semaphore(self.config.max_in_flight or batch.shape[0])
        micro = list(batch.split(self.config.micro_batch_size))
        phases.end("ready")
        losses = await asyncio.gather(
            *(self.micro_batches.run(i, ids, epoch, ledger, sums, gate) for i, ids in enumerate(micro))
        )
        for span in members:
            if not ledger.complete(span, len(micro)):
                raise AssertionError(f"stage {span} does not hold every micro-batch once: {ledger.holdings(span)}")
        phases.end("micro_batches")
        if self.outer is None:
            trainers, mean = await self.trainers.average(epoch, sums, batch.shape[0])
        else:  # local steps: each trainer steps on its own gradients; the trainers only agree on who is in
            trainers = await self.trainers.rendezvous(epoch, batch.shape[0])
            mean = [s / batch.shape[0] for s in sums]

        update = Update(
            self.stages,
            run_id=self.config.run_id,
            prefix=self.sequence.prefix,
            epoch=epoch,
            trainer=self.trainer_id,
            trainers=list(trainers),
            members=members,
            ledger=ledger,
            redo=lambda span, pid: self.micro_batches.fence(span, pid, epoch, ledger),
            round_timeout_s=self.config.averaging.averaging_timeout_s,
            trainers_alive=lambda: asyncio.to_thread(self.trainers.alive),
            local_steps=self.outer is not None,
            agree=functools.partial(self.trainers.agree_on, epoch, batch.shape[0], trainers)
            if self.outer is not None
            else None,
        )
        done = await update.average()
        trainers = update.agreed or trainers
        trainers, mean = await self._settle_with_stages(epoch, sums, batch.shape[0], trainers, mean, done)
        head_sq = float(sum(float(g.double().pow(2).sum()) for g in mean))
        total_norm = global_norm([*(d.grad_sq_norm for d in done.values()), head_sq])
        scale = clip_scale(total_norm, self.recipe.max_grad_norm)
        phases.end("rounds")
        # stored before any Apply goes: a stage that gets none because this trainer dies now applies it as decided
        await asyncio.to_thread(self.trainers.decide, epoch, [d.round_id for d in done.values()], scale)
        phases.end("decide")
        applied = await update.apply(done, scale)
        await self._local(lambda: self._apply_local(mean, scale, epoch))
        phases.end("apply")
        if self.syncs is not None:
            await self.syncs.after_update(epoch, trainers)
        self.epoch = epoch + 1
        self.trainers.publish(
            TrainingProgress(epoch=self.epoch, samples=0, param_digest=await self._local(self._digest))
        )
        phases.end("sync")
        self.steps_done += 1
        loss = sum(loss * ids.shape[0] for loss, ids in zip(losses, micro)) / batch.shape[0]
        result = StepResult(
            self.steps_done,
            loss,
            batch.shape[0],
            batch.numel(),
            phases.mark - began,
            dict.fromkeys(members, epoch + 1),
            stage_samples=applied,
            trainer_samples=sum(trainers.values()),
            faults=[*sat_out, *update.faults],
            phases=phases.seconds,
        )
        logger.info(
            "update %d applied: samples per stage %s, trainer %d, global norm %.4g (scale %.3g)%s",
            epoch,
            {f"{s[0]}:{s[1]}": n for s, n in sorted(applied.items())},
            batch.shape[0],
            total_norm,
            scale,
            f", {len(result.faults)} faults repaired" if result.faults else "",
        )
        return result

    async def _settle_with_stages(
        self,
        epoch: int,
        sums: list[torch.Tensor],
        samples: int,
        trainers: dict[str, int],
        mean: list[torch.Tensor],
        done: dict[Span, Averaged],
    ) -> tuple[dict[str, int], list[torch.Tensor]]:
        """(trainers, mean) of the trainers whose micro-batches the stages' rounds hold: a trainer that died after
        the trainers' round and before its commits counted is left out of the stages' update, so its gradients of
        the trainers' parts are taken out too, by averaging again among the others."""
        held = {averaged.trainers for averaged in done.values()}
        if len(held) != 1:
            raise TrainingFaultError(f"the stages' rounds of update {epoch} hold different trainers: {sorted(held)}")
        kept = held.pop()
        if set(kept) == set(trainers):
            return trainers, mean
        if not set(kept) <= set(trainers) or self.trainer_id not in kept:
            raise TrainingFaultError(f"the stages' rounds of update {epoch} hold trainers {kept}, not {list(trainers)}")
        if self.outer is not None:  # local steps: this trainer's mean is its own, whoever else is in
            return {t: trainers[t] for t in kept}, mean
        logger.warning(
            "update %d: trainers %s died before the stages took their micro-batches; their parts' gradients are left "
            "out too",
            epoch,
            [t[-8:] for t in trainers if t not in kept],
        )
        return await self.trainers.settle(
            epoch, sums, samples, {t: trainers[t] for t in kept}, attempt=self.trainers.first_try(epoch)
        )

    # --- the run's other trainers ---

    def _join_trainers(self) -> None:
        """Copy the state of the run's trainers when a majority of them vouches for one ahead of ours."""
        claim = self.trainers.majority()
        if claim is not None and self.epoch is None and claim[0] > 0:
            verified = self.trainers.load_state(self.state())
            self._load_state(verified.epoch, verified.tensors)
            logger.info("copied the other trainers' state at update %d", verified.epoch)
        self.trainers.start(TrainingProgress(epoch=self.epoch or 0, samples=0, param_digest=self._digest()))

    def _stages_epoch(self) -> int | None:
        """Stages.applied_everywhere, from a thread other than the model's loop (None when it fails)."""
        try:
            return self.model.submit(self.stages.applied_everywhere()).result(timeout=3 * INFO_TIMEOUT_S)
        except (SwarmError, concurrent.futures.TimeoutError) as exc:
            logger.warning("could not read the stages' updates: %r", exc)
            return None

    # --- the trainer's own parts ---

    def state(self) -> list[torch.Tensor]:
        """The trainer's part of the run's state: its parameters, then the optimizer's statistics (with local steps,
        then the weights at the last sync and the outer momentum)."""
        outer = self.outer.state() if self.outer is not None else []
        return [*(p.data for p in self.params), *state_tensors(self.optimizer), *outer]

    def _vouched(self, state: list[torch.Tensor]) -> str:
        """The digest trainers announce of `state`: all of it, or with local steps the part they share between syncs
        (the weights at the last sync and the outer momentum, the state's last tensors)."""
        return vouched_digest(state, self.outer)

    def _shared_state(self) -> tuple[int, list[torch.Tensor]]:
        """(epoch, a copy of the state) for a joining trainer; none while an overlapped sync's outer step has yet to
        land: the copy would miss it, and differ from the others for good."""
        if self.syncs is not None:
            self.syncs.check_copyable()
        return self.epoch or 0, [t.detach().cpu().clone() for t in self.state()]

    def _digest(self) -> str:
        return self._vouched(self.state())

    def _load_state(self, epoch: int, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for dst, src in zip(self.state(), tensors):
                dst.copy_(src)
        if self.syncs is not None:
            self.syncs.drop_pending()
        self.epoch = epoch
        set_step_count(self.optimizer, epoch)

    def _apply_local(self, mean: list[torch.Tensor], scale: float, epoch: int) -> None:
        lr = lr_at(self.recipe, epoch)
        with torch.no_grad():
            for p, g in zip(self.params, mean):
                p.grad = (g * scale).to(p.dtype)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            set_step_count(self.optimizer, epoch)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """What a resumed trainer needs besides its weights: its update count and optimizer statistics, and an
        overlapped sync whose outer step has not landed (its round waited for)."""
        state = {"epoch": self.epoch, "optimizer": [t.detach().cpu().clone() for t in state_tensors(self.optimizer)]}
        if self.syncs is not None:
            state.update(self.syncs.saved())
        return state

    def load_state_dict(self, state: dict) -> None:
        live = state_tensors(self.optimizer)
        saved = state["optimizer"]
        if len(saved) != len(live) or any(s.shape != t.shape for s, t in zip(saved, live)):
            raise ValueError("the saved optimizer state does not fit this model's trainer parts")
        outer = self.outer.state() if self.outer is not None else []
        if len(state.get("outer", [])) != len(outer):
            raise ValueError("the save is of a run with other local steps (--local-steps): resume it with the same")
        with torch.no_grad():
            for dst, src in zip([*live, *outer], [*saved, *state.get("outer", [])]):
                dst.copy_(src)
        self.epoch = int(state["epoch"])
        set_step_count(self.optimizer, self.epoch)
        if self.syncs is not None:
            self.syncs.load(state)

    def close(self) -> None:
        """Stop the local thread, the trainers' group and the DHT node (idempotent)."""
        self.local.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "trainers", None) is not None:
            self.trainers.close()
        stop_dht(self.dht)
