"""A trainer's syncs in a run with local steps (DiLoCo, `--local-steps H`; swarm/training/outer.py).

Each trainer steps on its own embeddings', norm's and head's gradients; after every H-th update the trainers of the
update average their pseudo-gradients (each weighs the same) and take the outer step, once all agree on the
average (client/training/cotrainers.py). With `--sync-overlap N` the round runs in the background while the trainer
takes N more updates, and its outer step lands after the N-th, on top of their inner steps; meanwhile the trainer
serves no copy of its state, and a save waits for the round and keeps its outcome.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from protocol.errors import TrainingFaultError
from swarm.training.outer import MemberSyncs, PendingSync, sync_due

if TYPE_CHECKING:
    from client.training.trainer import SwarmTrainer

logger = logging.getLogger(__name__)


class TrainerSyncs(MemberSyncs):
    """The outer optimizer of `trainer`'s own parameters, and its syncs with the run's other trainers."""

    def __init__(self, trainer: SwarmTrainer):
        super().__init__(trainer.params, trainer.recipe)
        self.trainer = trainer

    async def after_update(self, epoch: int, trainers: dict[str, int]) -> None:
        """After update `epoch` (its trainers: `trainers`): the outer step of an overlapped sync due now, then this
        update's sync, overlapped or waited for."""
        local = self.trainer._local
        await self.land(epoch, local)
        if not sync_due(epoch, self.local_steps):
            return
        if not self.overlap:
            await self._waited(epoch, trainers)
            return
        sync = functools.partial(self.trainer.trainers.overlapped_sync, epoch, trainers=list(trainers))
        await self.overlap_from(epoch, local, sync, f"the trainers' overlapped sync of update {epoch}")

    async def _waited(self, epoch: int, trainers: dict[str, int]) -> None:
        """A sync the trainer waits for: pseudo-gradients averaged, then the outer step. One the trainers cannot
        agree on is skipped, as a stage skips a failed one: the next carries the change."""
        local, cotrainers = self.trainer._local, self.trainer.trainers
        deltas = await local(self.outer.pseudo_gradients)
        try:
            # its tries follow those of the trainers' agreement on who is in, as every trainer's do
            _, averaged = await cotrainers.settle(
                epoch, deltas, len(trainers), dict.fromkeys(trainers, 1), attempt=cotrainers.first_try(epoch)
            )
        except TrainingFaultError as exc:
            logger.warning(
                "update %d: the trainers' sync failed (%s); the next sync carries this one's change", epoch, exc
            )
            return
        await local(lambda: self.outer.apply(averaged))

    def saved(self) -> dict:
        """What a save holds of the syncs: the outer state, and an overlapped sync still to land (its round waited
        for, from a thread other than the model's loop)."""
        state = {"outer": [t.detach().cpu().clone() for t in self.outer.state()]}
        pending = self.pending
        if pending is not None:
            averaged = self.trainer.model.submit(pending.outcome()).result()
            state["pending_sync"] = {"lands": pending.lands, "averaged": averaged, "taken": self.outer.taken}
        return state

    def load(self, state: dict) -> None:
        """Take `saved()`'s part of a save (the outer state is checked and copied with the optimizer's)."""
        pending = state.get("pending_sync")
        if pending is not None:
            self.pending = PendingSync(int(pending["lands"]), averaged=pending["averaged"])
            self.outer.taken = [t.clone() for t in pending["taken"]]
