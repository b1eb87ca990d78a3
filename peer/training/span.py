"""A training peer: the span's trainable tensors, float32 masters, its optimizer, and its part in each update.

- Backward requests of the run add each micro-batch's gradients once (peer/training/accumulators.py).
- A trainer's commit says what an update consists of (peer/training/commits.py); the members named average
  exactly that among themselves (swarm/training/rounds.py) and report the result's digest and squared norm.
- Apply, from the trainer, updates the float32 masters with the recipe's optimizer, learning rate for this update
  and the trainer's clipping factor, then casts them into the span's compute weights.
- A member left out of a commit, or one that finds a majority of its group ahead, drops what it holds and copies
  the group's state, checked against the digest the majority announces (swarm/training/state.py). Once it has
  applied an update, the majority is that of the members of its last round not behind the update its trainers
  announce. Between calls, peer/training/follow.py keeps it in step, and finishes or drops an update whose
  trainers are gone.
- With local steps, an update's Apply steps on the member's own gradients, and every H-th also syncs
  (peer/training/syncs.py).

Heavy work (backward, apply, copying state) runs on the compute thread; the rest on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from peer.blocks import BlockSpan
from peer.config import TrainingConfig
from peer.training.accumulators import Accumulators, HeldMismatch
from peer.training.commits import Commits, RoundPlan
from peer.training.decision import Decision
from peer.training.follow import Follower
from peer.training.syncs import Syncs
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, DHTUnavailableError, StaleEpochError
from protocol.records import TrainingProgress
from protocol.vocab import TrainMode
from swarm.training.group import GroupMember, digest, group_key, has_nonfinite, trainers_key
from swarm.training.members import GroupReader
from swarm.training.optim import make_optimizer, set_step_count, state_tensors
from swarm.training.outer import vouched_digest
from swarm.training.recipe import RunRecipe, lr_at
from swarm.training.state import applied_by_trainers, deciding

logger = logging.getLogger(__name__)

Compute = Callable[[Callable], Awaitable]

NORM_WINDOW = 64  # accepted micro-batches whose gradient norms make the running median
NORM_WARMUP = 8  # below this many, any finite gradient is accepted
MAX_NORM_RATIO = 100.0  # a gradient this many times the median norm is refused as an outlier (or an attack)
LOCAL_ROUND_WAIT_S = 5.0  # a round with no one to average with, awaited by the commit that starts it


class SpanTraining:
    """The trainable state of one span, and the handlers of its run's training calls."""

    def __init__(self, span: BlockSpan, config: TrainingConfig, recipe: RunRecipe, prefix: str):
        """`recipe`: the run's, adopted (swarm/training/recipe.py); `config`: this peer's saving and timing."""
        self.span, self.config, self.recipe, self.prefix = span, config, recipe, prefix
        self.group: GroupMember | None = None  # once start_group() joined the span's group
        self.trainers: GroupReader | None = None  # the run's trainers' records, read from then on
        if recipe.train_mode == TrainMode.LORA:
            from peer.lora import LoraSettings, add_lora  # peft is needed only for LoRA

            params = add_lora(span, LoraSettings(rank=recipe.lora_rank, alpha=recipe.lora_alpha), seed=0)
            named = [(f"adapter.{i}", p) for i, p in enumerate(params)]
        else:
            named = sorted(span.layers.named_parameters())
            for _, p in named:
                p.requires_grad_(True)
        self.params = [p for _, p in named]
        # float32 masters: in bfloat16 an update of 1e-4 on a weight of 1.0 rounds away; the compute copy is
        # re-cast from them after each update (a float32 span trains its own weights)
        self.masters = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone()) for p in self.params
        ]
        masters_named = [(name, m) for (name, _), m in zip(named, self.masters)]
        self.optimizer = make_optimizer(recipe, span.layers, masters_named)
        # with local steps (DiLoCo), rounds average the weights' change every H updates, not each update's gradients
        self.syncs = Syncs(self) if recipe.local_steps > 1 else None
        self.outer = self.syncs.outer if self.syncs is not None else None
        self._mid_update = False  # while an update is applied: no consistent state to share
        self.accumulators = Accumulators(self.masters)
        self.epoch = 0
        self.commits = Commits(0)
        self.status = pb.RoundStatus(epoch=0, state=pb.RoundStatus.IDLE)
        self._averaged: list[torch.Tensor] | None = None
        self._round: asyncio.Task | None = None
        self._applying: asyncio.Lock | None = None  # made on the event loop that serves Apply
        self._last_apply: tuple[int, str, pb.ApplyResponse] | None = None  # (epoch, round id, answer)
        self._norms: deque[float] = deque(maxlen=NORM_WINDOW)
        self._digest: tuple[int, str] | None = None
        self.applied_samples = 0
        self.applied_round = pb.RoundStatus()  # the status of the last applied update's round
        self.applied_members: tuple[str, ...] = ()  # the members of that round (this one too)
        self._plan: RoundPlan | None = None  # the round under way
        self._lock = threading.Lock()  # an update versus a joiner copying the state
        self.saved_as = (
            Path(config.save_dir) / f"{prefix}.{config.run_id}.{span.start}-{span.end}.pt" if config.save_dir else None
        )

    @property
    def run_id(self) -> str:
        return self.config.run_id

    @property
    def samples(self) -> int:
        return sum(samples for _, samples in self.accumulators.held().values())

    # --- backward (checks on the event loop, the computation on the compute thread) ---

    def check(self, run_id: str, blocks: tuple[int, int], epoch: int, micro_batch: pb.MicroBatch) -> None:
        if run_id != self.run_id:
            raise BadRequestError(f"this peer trains run {self.run_id!r}, not {run_id!r}; route to peers of your run")
        if blocks != (self.span.start, self.span.end):
            raise BadRequestError(
                f"a training backward must cover this peer's whole span {self.span.start}:{self.span.end}, got "
                f"{blocks[0]}:{blocks[1]}"
            )
        if epoch != self.epoch:
            raise StaleEpochError(
                f"this peer is at update {self.epoch} of run {self.run_id!r}, the gradient is for update {epoch}; "
                f"recompute it against the weights of update {self.epoch}"
            )
        if not micro_batch.trainer:
            raise BadRequestError("a training backward needs its micro_batch id (trainer, index, samples)")
        trainers = self.commits.trainers()
        if trainers is not None and micro_batch.trainer not in trainers:
            # its trainers have committed the update without this one (it came late): never mix it in
            raise StaleEpochError(
                f"update {epoch} of run {self.run_id!r} is committed here without trainer {micro_batch.trainer[-8:]}; "
                f"send it to the next one"
            )

    def backward(
        self,
        outputs: list[torch.Tensor],
        inputs: torch.Tensor,
        grads: list[torch.Tensor],
        micro_batch: pb.MicroBatch,
        epoch: int,
    ) -> torch.Tensor:
        """Gradient w.r.t. `inputs` of `outputs` (the span's, and the routers' sums where the loss has a part in them)
        given `grads`; the parameters' gradients join the update once per micro-batch id."""
        if epoch != self.epoch:  # an update may have come while the request waited
            raise StaleEpochError(f"this peer moved to update {self.epoch} while the gradient for {epoch} waited")
        trainer, index = micro_batch.trainer, int(micro_batch.index)
        if self.accumulators.holds(trainer, index):  # sent again (its answer was lost): answer, add nothing
            with torch.enable_grad():
                (grad_inputs,) = torch.autograd.grad(outputs, inputs, grads)
            return grad_inputs
        with torch.enable_grad():
            found = torch.autograd.grad(outputs, [inputs, *self.params], grads, allow_unused=True)
        param_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, found[1:])]
        if has_nonfinite(param_grads):
            raise BadRequestError("the gradients are not finite; check grad_outputs and the learning rate")
        self._check_norm(param_grads, int(micro_batch.samples))
        if micro_batch.samples != inputs.shape[0]:
            raise BadRequestError(f"micro_batch.samples is {micro_batch.samples}, the batch is {inputs.shape[0]}")
        self.accumulators.add(trainer, index, inputs.shape[0], param_grads)
        return found[0]

    def _check_norm(self, grads: list[torch.Tensor], samples: int) -> None:
        """Refuse a gradient far above the run's usual ones: one sender must not own an update."""
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
        if len(self._norms) >= NORM_WARMUP and norm > MAX_NORM_RATIO * statistics.median(self._norms):
            raise BadRequestError(
                f"the gradient's norm {norm:.3g} is over {MAX_NORM_RATIO:g}x the run's median "
                f"{statistics.median(self._norms):.3g}; refused. If every trainer gets this, the run diverges: restart "
                f"it from a save with a lower --lr (with --local-steps under ~50, a lower --outer-momentum)"
            )
        self._norms.append(norm)

    def held(self) -> list[pb.TrainerIndices]:
        return [
            pb.TrainerIndices(trainer=t, indices=indices, samples=samples)
            for t, (indices, samples) in sorted(self.accumulators.held().items())
        ]

    # --- commit, round, apply (on the event loop) ---

    async def commit(self, request: pb.CommitRequest) -> pb.RoundStatus:
        self._check_call(request.run_id, request.span)
        if request.epoch < self.epoch:  # a late or repeated commit of an update applied here
            return self.status
        if request.epoch > self.epoch:
            return self._set_status(pb.RoundStatus.FAILED, f"behind: at update {self.epoch}, not {request.epoch}")
        if self._last_apply is not None and self._last_apply[0] == request.epoch:
            return self.status
        self.commits.add(request)
        me = self.group.peer_id
        if self.commits.fenced(me):
            self.accumulators.clear()
            return self._set_status(pb.RoundStatus.FENCED, f"left out of update {self.epoch}")
        plan = self.commits.plan(me)
        if plan is None:
            if self.commits.split():
                return self._set_status(pb.RoundStatus.WAITING, "the trainers' commits name different trainers", True)
            return self._set_status(pb.RoundStatus.WAITING, "waiting for the other trainers' commits")
        if plan.round_id != self.status.round_id:
            if self._round is not None and not self._round.done() and self.status.round_id:
                self.group.abandon(bytes.fromhex(self.status.round_id))  # a later attempt replaces it
            self.status = pb.RoundStatus(
                epoch=self.epoch,
                state=pb.RoundStatus.AVERAGING,
                round_id=plan.round_id,
                samples=plan.samples,
                trainers=plan.trainers,
                version=plan.version,
            )
            self._averaged = None
            self._plan = plan
            self._round = asyncio.ensure_future(self._run_round(plan))
            if self.outer is not None or len(plan.members) == 1:
                # nothing to average with others: done at once, and the answer tells the trainer without another look
                await asyncio.wait({self._round}, timeout=LOCAL_ROUND_WAIT_S)
        return self.status

    def _set_status(self, state: int, reason: str = "", split: bool = False) -> pb.RoundStatus:
        self.status = pb.RoundStatus(epoch=self.epoch, state=state, reason=reason, split=split)
        return self.status

    async def _run_round(self, plan: RoundPlan) -> None:
        try:
            total, samples = self.accumulators.total(plan.mine)
            # uniform weights, pre-scaled: the round's mean is the sum of every member's gradients over the
            # update's samples, and no member can weigh its own share up (swarm/training/rounds.py)
            scale = len(plan.members) / max(plan.samples, 1)
            began = time.perf_counter()
            sent_bytes = 0
            if self.outer is not None:  # local steps: each member steps on its own gradients (None: it holds none)
                averaged = [t / samples for t in total] if samples else None
            elif len(plan.members) == 1:
                averaged = [t / max(plan.samples, 1) for t in total]
            else:
                # a retry comes as a new commit version, whose plan has a new id: late parts of a failed round
                # cannot join the next, and every member derives the same id from the same commits
                round_id = bytes.fromhex(plan.round_id)
                result = await asyncio.to_thread(
                    self.group.average,
                    [t * scale for t in total],
                    round_id=round_id,
                    members=list(plan.members),
                    timeout_s=self.config.averaging.averaging_timeout_s,
                )
                if not result.complete:
                    raise RuntimeError(f"round incomplete: {result.reason}")
                averaged, sent_bytes = result.tensors, result.sent_bytes
            if self.status.round_id != plan.round_id:
                return  # a later commit replaced this round
            self._averaged = averaged
            self.status = pb.RoundStatus(
                epoch=self.epoch,
                state=pb.RoundStatus.AVERAGED,
                round_id=plan.round_id,
                grad_digest=digest(averaged or []),
                grad_sq_norm=float(sum(float(t.pow(2).sum()) for t in averaged or [])),
                samples=plan.samples,
                trainers=plan.trainers,
                version=plan.version,
            )
            if self.outer is not None:
                logger.info(
                    "update %d of run %r: averaged its own %d of %d samples (a local step)",
                    self.epoch,
                    self.run_id,
                    samples,
                    plan.samples,
                )
            else:
                logger.info(
                    "update %d of run %r: averaged %d samples (%d here) among %d members in %.2fs, %d bytes sent",
                    self.epoch,
                    self.run_id,
                    plan.samples,
                    samples,
                    len(plan.members),
                    time.perf_counter() - began,
                    sent_bytes,
                )
        except asyncio.CancelledError:
            raise
        except HeldMismatch as exc:
            if self.status.round_id == plan.round_id:
                self._set_status(pb.RoundStatus.FAILED, f"holds other micro-batches than committed: {exc}")
        except Exception as exc:
            logger.warning("update %d of run %r: the round failed: %s", self.epoch, self.run_id, exc)
            if self.status.round_id == plan.round_id:
                self._set_status(pb.RoundStatus.FAILED, f"round failed: {exc}")

    async def apply(self, request: pb.ApplyRequest, compute: Compute) -> pb.ApplyResponse:
        self._check_call(request.run_id, request.span)
        if self._applying is None:
            self._applying = asyncio.Lock()
        async with self._applying:  # every trainer of an update sends Apply: the second must find it applied
            return await self._apply_once(request, compute)

    async def _apply_once(self, request: pb.ApplyRequest, compute: Compute) -> pb.ApplyResponse:
        if self._last_apply is not None and self._last_apply[:2] == (request.epoch, request.round_id):
            return self._last_apply[2]  # applied already: the answer was lost
        if request.epoch != self.epoch:
            raise StaleEpochError(f"this peer is at update {self.epoch}, not {request.epoch}")
        status = self.status
        if status.state != pb.RoundStatus.AVERAGED or status.round_id != request.round_id:
            raise BadRequestError(
                f"update {self.epoch} is not averaged for round {request.round_id[:12]} here (state "
                f"{pb.RoundStatus.State.Name(status.state)}, round {status.round_id[:12]})"
            )
        if status.grad_digest != request.grad_digest:
            raise BadRequestError("the averaged gradients here are not the ones the trainer names")
        if not 0 < request.clip_scale <= 1:
            raise BadRequestError(f"clip_scale must lie in (0, 1], got {request.clip_scale}")
        averaged, scale = self._averaged, request.clip_scale
        if self.outer is None:
            await compute(lambda: self._apply(averaged, scale, status))
        else:
            await self._apply_local_steps(averaged, scale, status, compute)
        response = pb.ApplyResponse(
            epoch=self.epoch, param_digest=await compute(self.digest), applied_samples=status.samples
        )
        self._last_apply = (request.epoch, request.round_id, response)
        if self.config.save_every and self.epoch % self.config.save_every == 0:
            await compute(self.save)
        return response

    def _apply(self, averaged: list[torch.Tensor], scale: float, status: pb.RoundStatus) -> None:
        """The update (of round `status`): the optimizer on the float32 masters, then the compute weights cast from
        them."""
        self._mid_update = True
        try:
            self._inner_step(averaged, scale)
            self._finish_apply(status)
        finally:
            self._mid_update = False

    def _inner_step(self, averaged: list[torch.Tensor] | None, scale: float) -> None:
        """The recipe's optimizer on the float32 masters (averaged None: no gradients here, nothing moves)."""
        if averaged is None:
            return
        lr = lr_at(self.recipe, self.epoch)
        with self._lock, torch.no_grad():
            for master, g in zip(self.masters, averaged):
                master.grad = (g * scale).to(device=master.device, dtype=torch.float32)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            set_step_count(self.optimizer, self.epoch)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    async def _apply_local_steps(
        self, own: list[torch.Tensor] | None, scale: float, status: pb.RoundStatus, compute: Compute
    ) -> None:
        """An update of a run with local steps: the inner step on this member's own gradients, then its syncs'
        part (peer/training/syncs.py)."""
        self._mid_update = True
        try:
            await compute(lambda: self._inner_step(own, scale))
            await self.syncs.after_inner_step(status, compute)
            await compute(lambda: self._finish_apply(status))
        finally:
            self._mid_update = False

    def _finish_apply(self, status: pb.RoundStatus) -> None:
        """Cast the compute weights from the masters and move to the next update."""
        with self._lock, torch.no_grad():
            for param, master in zip(self.params, self.masters):
                if param is not master:
                    param.copy_(master)
        # before the next update shows in Info: a trainer that sees it must see which round got here
        applied = pb.RoundStatus()
        applied.CopyFrom(status)
        applied.state = pb.RoundStatus.APPLIED
        self.applied_round, self.applied_samples = applied, status.samples
        plan = self._plan
        self.applied_members = plan.members if plan is not None and plan.round_id == status.round_id else ()
        self._finish_update(self.epoch + 1)

    def _finish_update(self, epoch: int) -> None:
        self.epoch = epoch
        set_step_count(self.optimizer, epoch)
        self.accumulators.clear()
        self.commits = Commits(epoch)
        self._averaged = None
        self.status = pb.RoundStatus(epoch=epoch, state=pb.RoundStatus.IDLE)

    def _check_call(self, run_id: str, span: pb.Span) -> None:
        if run_id != self.run_id or (span.start, span.end) != (self.span.start, self.span.end):
            raise BadRequestError(
                f"this peer trains blocks {self.span.start}:{self.span.end} of run {self.run_id!r}, not "
                f"{span.start}:{span.end} of {run_id!r}"
            )

    # --- state ---

    def state(self) -> list[torch.Tensor]:
        """The trainable state, as the group shares it: float32 masters, then the optimizer's statistics (with local
        steps, then the weights at the last sync and the outer momentum)."""
        outer = self.outer.state() if self.outer is not None else []
        return [*self.masters, *state_tensors(self.optimizer), *outer]

    def vouched(self, state: list[torch.Tensor]) -> str:
        """The digest members announce of `state`: all of it, or with local steps the part every member shares
        between syncs (the weights at the last sync and the outer momentum, the state's last tensors)."""
        return vouched_digest(state, self.outer)

    def digest(self) -> str:
        """The digest of the state this member vouches for (compute thread: it reads every state tensor)."""
        with self._lock:
            if self._digest is None or self._digest[0] != self.epoch:
                self._digest = (self.epoch, self.vouched(self.state()))
            return self._digest[1]

    def vouched_now(self) -> str | None:
        """The digest of this update's state, once computed (None before)."""
        digest = self._digest
        return digest[1] if digest is not None and digest[0] == self.epoch else None

    def shared_state(self) -> tuple[int, list[torch.Tensor]]:
        """(epoch, a copy of the state) for a joiner: consistent, never half an update, nor taken while an overlapped
        sync's outer step has yet to land."""
        with self._lock:
            if self._mid_update:
                raise RuntimeError(f"update {self.epoch} is being applied; ask again")
            if self.syncs is not None:
                self.syncs.check_copyable()
            return self.epoch, [t.detach().cpu().clone() for t in self.state()]

    def load_state(self, epoch: int, tensors: list[torch.Tensor]) -> None:
        """Take the group's state at `epoch` (compute thread): masters, statistics, then the compute weights."""
        live = self.state()
        if len(tensors) != len(live) or any(t.shape != v.shape for t, v in zip(tensors, live)):
            raise ValueError("a state of another span or mode")
        with self._lock, torch.no_grad():
            for dst, src in zip(live, tensors):
                dst.copy_(src)
            for param, master in zip(self.params, self.masters):
                if param is not master:
                    param.copy_(master)
            if self.syncs is not None:
                self.syncs.drop_pending()
        self._finish_update(epoch)
        self._digest = None

    def weights(self) -> dict[str, torch.Tensor]:
        """The span's current weights named as in the checkpoint (LoRA merged in)."""
        from peer import lora

        if self.recipe.train_mode == TrainMode.LORA:
            return lora.merged_layer_state(self.span)
        return lora.layer_state(self.span)

    def require_adapters(self) -> None:
        """Raises BadRequestError unless this run trains LoRA adapters."""
        if self.recipe.train_mode != TrainMode.LORA:
            raise BadRequestError(
                f"run {self.run_id!r} trains full weights ({self.recipe.train_mode}), not LoRA adapters: "
                "export it without --adapter-only"
            )

    def adapters(self) -> dict[str, torch.Tensor]:
        """A LoRA run's adapters, unmerged, named as peer/lora.py names them (`swarmlm export --adapter-only`)."""
        from peer import lora

        self.require_adapters()
        return lora.adapter_state(self.span)

    def save(self) -> None:
        if self.saved_as is None:
            return
        self.saved_as.parent.mkdir(parents=True, exist_ok=True)
        state = {"epoch": self.epoch, "state": [t.detach().cpu() for t in self.state()]}
        tmp = self.saved_as.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.saved_as)
        logger.info("saved update %d to %s", self.epoch, self.saved_as)

    def resume(self) -> bool:
        """Load the save file if there is one (its state must fit this span and mode)."""
        if self.saved_as is None or not self.saved_as.exists():
            return False
        saved = torch.load(self.saved_as, map_location="cpu", weights_only=True)
        try:
            self.load_state(int(saved["epoch"]), saved["state"])
        except (KeyError, ValueError):
            raise ValueError(
                f"{self.saved_as} holds another span's or mode's state; move it away or choose another --save-dir"
            ) from None
        logger.info("resumed run %r at update %d from %s", self.run_id, self.epoch, self.saved_as)
        return True

    # --- the group: joining, progress, catching up ---

    def start_group(self, dht, *, swarm_key=None) -> None:
        """Join the span's group of the run (on the main thread: hivemind's averager touches signal handlers)."""
        self.trainers = GroupReader(dht, trainers_key(self.prefix, self.run_id))
        self.group = GroupMember(
            dht,
            stage_group_key(self.prefix, self.run_id, self.span),
            grads_like=self.masters,
            state=self.shared_state,
            settings=self.config.averaging,
            swarm_key=swarm_key,
            compression=self.recipe.averaging_compression,
            deciding=self._deciding,
            digest_of=self.vouched,
        )

    def _deciding(self, members: dict[str, TrainingProgress]) -> dict[str, TrainingProgress]:
        """The group's records this member decides by (state.deciding): those of the members of the last round
        applied here that are not behind the update its trainers announce (a strict majority of those still live).
        Only trainers and members this one averaged with count: a stranger's records do not."""
        trainers = set(self.applied_round.trainers)
        if not any(p.epoch > self.epoch for p in members.values()):
            return members  # no claim to catch up to, whoever decides: the trainers' records need no read
        applied = 0
        if trainers:
            try:
                records = self.trainers.members()
            except DHTUnavailableError as exc:
                logger.warning("could not read the trainers of run %r: %s", self.run_id, exc)
            else:
                applied = applied_by_trainers({t: p for t, p in records.items() if t in trainers})
        return deciding(members, self.group.peer_id, comembers=self.applied_members, applied=applied)

    def join(self) -> None:
        """Resume from the save file, then copy the group's state if a majority of it vouches for another one
        (blocking, bounded by the load-state timeout); then vouch for ours and serve it."""
        self.resume()
        claim = self.group.majority()
        if claim is not None and (claim[0] > self.epoch or (claim[0] == self.epoch and claim[1] != self.digest())):
            logger.info("group %s is at update %d; copying its state", self.group.key, claim[0])
            verified = self.group.load_state(self.state())
            self.load_state(verified.epoch, verified.tensors)
        self.group.publish(self.progress())
        self.group.serve_state(True)

    def progress(self) -> TrainingProgress:
        """The record this member publishes in its group (compute thread: it digests the state)."""
        return TrainingProgress(
            epoch=self.epoch,
            samples=self.samples,
            param_digest=self.digest(),
            **(self.syncs.record(self.epoch) if self.syncs is not None else {}),
        )

    async def run(self, compute: Compute, on_update: Callable[[], None]) -> None:
        """Keep in step with the group and the run's trainers (peer/training/follow.py). Runs until cancelled."""
        await Follower(self).run(compute, on_update)

    def applying(self) -> bool:
        """Whether an Apply is under way."""
        return self._applying is not None and self._applying.locked()

    async def apply_decided(self, decision: Decision, compute: Compute) -> pb.ApplyResponse:
        """Apply the averaged round as a trainer decided it (its Apply never came)."""
        request = pb.ApplyRequest(
            run_id=self.run_id,
            span=pb.Span(model=self.prefix, start=self.span.start, end=self.span.end),
            epoch=self.epoch,
            round_id=self.status.round_id,
            grad_digest=self.status.grad_digest,
            clip_scale=decision.clip_scale,
        )
        return await self.apply(request, compute)

    def drop_update(self, trainers) -> int:
        """Drop the update's commits and the micro-batches of `trainers` (gone without applying it); how many
        samples were dropped."""
        if self._round is not None and not self._round.done() and self.status.round_id:
            self.group.abandon(bytes.fromhex(self.status.round_id))
        dropped = self.accumulators.drop(trainers)
        self.commits = Commits(self.epoch)
        self._averaged = None
        self.status = pb.RoundStatus(epoch=self.epoch, state=pb.RoundStatus.IDLE)
        return dropped

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.save()
        if self._round is not None:
            self._round.cancel()
        if self.group is not None:
            self.group.shutdown()


def stage_group_key(prefix: str, run_id: str, span: BlockSpan) -> str:
    return group_key(prefix, run_id, f"{span.start}-{span.end}")
