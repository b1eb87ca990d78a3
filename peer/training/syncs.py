"""A stage member's syncs in a run with local steps (DiLoCo, `--local-steps H`; swarm/training/outer.py).

After every H-th update the members of the update's round average their pseudo-gradients and each takes the outer
step, once every member got the same average (swarm/training/agreement.py), announcing its outcome of each try in
its record. With `--sync-overlap N` the round runs in the background while the member takes N more updates, and
its outer step lands in the Apply of the N-th, on top of that update's inner step; meanwhile the member serves no
copy of its state, which would miss that step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import torch

from protocol import swarmlm_pb2 as pb
from swarm.training import agreement
from swarm.training.outer import OuterStep, PendingSync, agreed_sync, in_background, sync_due

if TYPE_CHECKING:
    from peer.training.span import Compute, SpanTraining


class Syncs:
    """The outer optimizer of `training` (a SpanTraining of a run with local steps) and its syncs."""

    def __init__(self, training: SpanTraining):
        self.training, recipe = training, training.recipe
        self.outer = OuterStep(training.masters, lr=recipe.outer_lr, momentum=recipe.outer_momentum)
        self.overlap = recipe.sync_overlap
        self.outcome: tuple[int, int, str] | None = None  # (update, try, digest) of the latest sync's try here
        self.pending: PendingSync | None = None  # an overlapped sync whose outer step has not landed yet

    async def after_inner_step(self, status: pb.RoundStatus, compute: Compute) -> None:
        """In the Apply of update `training.epoch` (of round `status`), after its inner step: the outer step of an
        overlapped sync due now (its round waited for only if it has not ended), then this update's sync."""
        training = self.training
        pending = self.pending
        if pending is not None and training.epoch >= pending.lands:
            self.pending = None
            averaged = await pending.outcome()
            if averaged is None:
                await compute(self.outer.drop_taken)
            else:
                await compute(lambda: self._outer_step(averaged, carry=True))
        if not sync_due(training.epoch, training.recipe.local_steps):
            return
        if self.overlap:
            deltas = await compute(self.outer.take)
            what = f"the overlapped sync of update {training.epoch} of run {training.run_id!r}"
            round_ = in_background(self._round(deltas, status, overlapped=True), what)
            self.pending = PendingSync(training.epoch + self.overlap, round_)
            return
        deltas = await compute(self.outer.pseudo_gradients)
        averaged = await self._round(deltas, status)
        if averaged is not None:
            await compute(lambda: self._outer_step(averaged))

    def _round(
        self, deltas: list[torch.Tensor], status: pb.RoundStatus, *, overlapped: bool = False
    ) -> Awaitable[list[torch.Tensor] | None]:
        """The mean of the pseudo-gradients of the update's round's members, once all of them got the same
        (`agreed_sync`); None: every member skips it. Its update and members are read now: an overlapped one runs
        on while the member moves on."""
        training = self.training
        plan = training._plan
        members = plan.members if plan is not None and plan.round_id == status.round_id else ()
        epoch = training.epoch
        if len(members) <= 1:
            return _ready(deltas)

        async def publish(attempt: int, digest: str) -> None:
            self.outcome = (epoch, attempt, digest)
            progress = await asyncio.to_thread(training.progress)
            await asyncio.to_thread(training.group.publish, progress)

        return agreed_sync(
            training.group,
            deltas,
            base_round_id=bytes.fromhex(status.round_id),
            epoch=epoch,
            members=members,
            settings=training.config.averaging,
            publish=publish,
            what=f"the sync of update {epoch} of run {training.run_id!r}",
            round_of=agreement.overlapped_sync if overlapped else agreement.update_round,
        )

    def _outer_step(self, averaged: list[torch.Tensor], *, carry: bool = False) -> None:
        with self.training._lock:
            self.outer.apply(averaged, carry=carry)

    def record(self, epoch: int) -> dict[str, int | str]:
        """The fields of the member's record at update `epoch` that speak of its syncs: an overlapped one's in fields
        of their own, kept until the next sync (members still agreeing on it read them); a waited-for one's in the
        update's round fields, while at that update."""
        if self.overlap:
            update, attempt, digest = self.outcome or (-1, 0, "")
            return {"sync_update": update, "sync_round": attempt, "sync_digest": digest}
        if self.outcome is None or self.outcome[0] != epoch:
            return {}
        return {"round": self.outcome[1], "round_digest": self.outcome[2]}

    def check_copyable(self) -> None:
        """Raises RuntimeError while an outer step has yet to land: a copy of the state would miss it."""
        pending = self.pending
        if pending is not None:
            raise RuntimeError(f"a sync lands after update {pending.lands}; ask again then")

    def drop_pending(self) -> None:
        """The state was replaced by a copy, which holds what the group's syncs did: one under way here is moot."""
        self.pending = None
        self.outer.drop_taken()


async def _ready(value):
    return value
