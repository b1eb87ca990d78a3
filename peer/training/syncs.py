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
from swarm.training.outer import MemberSyncs, agreed_sync, sync_due

if TYPE_CHECKING:
    from peer.training.span import Compute, SpanTraining


class Syncs(MemberSyncs):
    """The outer optimizer of `training` (a SpanTraining of a run with local steps) and its syncs."""

    def __init__(self, training: SpanTraining):
        super().__init__(training.masters, training.recipe)
        self.training = training
        self.outcome: tuple[int, int, str] | None = None  # (update, try, digest) of the latest sync's try here

    async def after_inner_step(self, status: pb.RoundStatus, compute: Compute) -> None:
        """In the Apply of update `training.epoch` (of round `status`), after its inner step: the outer step of an
        overlapped sync due now, then this update's sync."""
        epoch = self.training.epoch
        await self.land(epoch, compute)
        if not sync_due(epoch, self.local_steps):
            return
        if self.overlap:
            what = f"the overlapped sync of update {epoch} of run {self.training.run_id!r}"
            await self.overlap_from(epoch, compute, lambda deltas: self._round(deltas, status, overlapped=True), what)
            return
        deltas = await compute(self.outer.pseudo_gradients)
        averaged = await self._round(deltas, status)
        if averaged is not None:
            await compute(lambda: self.outer_step(averaged))

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

    def outer_step(self, averaged: list[torch.Tensor], *, carry: bool = False) -> None:
        with self.training._lock:  # against a joiner copying the state
            super().outer_step(averaged, carry=carry)

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


async def _ready(value):
    return value
