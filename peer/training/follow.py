"""A training member in step with its group and its trainers, between the calls it answers.

- It publishes its progress, and copies the group's state when a majority is ahead for good (it was left out of
  an update, or its Apply never came).
- An update whose trainers all died after committing it, before any Apply came, is dropped once their records have
  lapsed: nobody would apply it, and it would refuse the micro-batches of the trainers left for good. Unless one of
  them had decided it (peer/training/decision.py): then other stages may have applied it, and this one applies it
  as decided. So it does too when the trainer that decided it went on to the next update: its Apply here was lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from peer.training.decision import Decision, decision_for
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, StaleEpochError
from swarm.training.recipe import publish_recipe

if TYPE_CHECKING:
    from peer.training.span import Compute, SpanTraining

logger = logging.getLogger(__name__)

RECIPE_RENEW_S = 60.0  # recipe records live 240 s: every member vouches for its run's again well before
ORPHAN_GRACE_S = 2.0  # an update's trainers must look gone in reads this far apart: one read can miss a record


class Follower:
    """Keeps `training` in step with its group and its run's trainers (on the event loop, until cancelled)."""

    def __init__(self, training: SpanTraining):
        self.training = training
        self._ahead_since: float | None = None  # when the group was first seen ahead of this member
        self._orphaned_since: float | None = None  # when the trainers of the update's commits were first seen gone
        self._decision: Decision | None = None  # a trainer's decision on the round under way, seen in its record

    async def run(self, compute: Compute, on_update: Callable[[], None]) -> None:
        """Publish progress, copy the group's state when a majority is ahead for good, and finish or drop updates
        whose trainers are gone."""
        await asyncio.gather(self._follow_group(compute, on_update), self._watch_trainers(compute, on_update))

    async def _watch_trainers(self, compute: Compute, on_update: Callable[[], None]) -> None:
        """Finish or drop updates whose trainers are gone (apart from catching up, which can take a load-state
        timeout)."""
        while True:
            try:
                await self._settle_if_orphaned(compute, on_update)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the DHT may be briefly unreachable
                logger.warning("reading the run's trainers: %r", exc)
            await asyncio.sleep(self.training.config.averaging.progress_period_s)

    async def _follow_group(self, compute: Compute, on_update: Callable[[], None]) -> None:
        training = self.training
        renewed = 0.0
        while True:
            try:
                epoch = training.epoch
                progress = await compute(training.progress)
                await asyncio.to_thread(training.group.publish, progress)
                if time.monotonic() - renewed > RECIPE_RENEW_S:
                    await asyncio.to_thread(
                        publish_recipe, training.group.averager.dht, training.prefix, training.run_id, training.recipe
                    )
                    renewed = time.monotonic()
                claim = await asyncio.to_thread(training.group.majority)
                if self.behind(claim):
                    await self._catch_up(compute)
                    on_update()
                elif training.epoch != epoch:
                    on_update()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the DHT may be briefly unreachable; training goes on next tick
                logger.warning("training loop: %r", exc)
            await asyncio.sleep(training.config.averaging.progress_period_s)

    def behind(self, claim: tuple[int, str] | None) -> bool:
        """Whether to copy the group's state: a majority is past this member's update, and this member is not in the
        middle of that update (or has been past it for a whole round's timeout: its Apply never came).

        With local steps also a majority at this update that vouches for another state: a sync that failed for some
        members only (they skipped its outer step) leaves them apart for good otherwise, as each later sync moves
        every member from its own last sync. Only while it holds no micro-batch of the update: copying drops them."""
        training = self.training
        busy = training.status.state in (pb.RoundStatus.AVERAGING, pb.RoundStatus.AVERAGED)
        if training.outer is not None and claim is not None and claim[0] == training.epoch:
            mine = training.vouched_now()
            if not busy and not training.samples and mine is not None and claim[1] != mine:
                return True
        if claim is None or claim[0] <= training.epoch:
            self._ahead_since = None
            return False
        now = time.monotonic()
        self._ahead_since = self._ahead_since or now
        return not busy or now - self._ahead_since > training.config.averaging.averaging_timeout_s

    async def _settle_if_orphaned(self, compute: Compute, on_update: Callable[[], None]) -> None:
        """Apply the round as a trainer decided it when that trainer has gone on past the update (its Apply here was
        lost) or when every trainer the update's commits follow has been gone (no live record in the run's group of
        trainers) for ORPHAN_GRACE_S (it may have applied it at other stages before it died); drop the commits of
        trainers gone without deciding."""
        training = self.training
        commits, trainers = training.commits, training.commits.trainers()
        if trainers is None or training.trainers is None:
            self._orphaned_since = None
            return
        records = await asyncio.to_thread(training.trainers.members)
        if commits is not training.commits:
            self._orphaned_since = None
            return
        decision = decision_for(records, training.status)
        if decision is not None:
            self._decision = decision  # kept once the record lapses: it lives a few reads longer than the trainer
        decision = self._decision
        if decision is not None and (decision.epoch, decision.round_id) != (training.epoch, training.status.round_id):
            decision = None
        if any(t in records and not records[t].left for t in trainers):
            self._orphaned_since = None
            decider = records.get(decision.trainer) if decision is not None else None
            if decider is not None and decider.epoch > decision.epoch and not training.applying():
                await self._apply_decided(decision, compute, on_update, "went on past it without applying it here")
            return
        now = time.monotonic()
        self._orphaned_since = self._orphaned_since or now
        if now - self._orphaned_since < ORPHAN_GRACE_S or training.applying():
            return
        self._orphaned_since = None
        if decision is not None and await self._apply_decided(
            decision, compute, on_update, "is gone without applying it here"
        ):
            return
        dropped = training.drop_update(trainers)
        logger.warning(
            "update %d of run %r: its trainers %s are gone without applying it; dropped their commits and %d samples",
            training.epoch,
            training.run_id,
            [t[-8:] for t in trainers],
            dropped,
        )

    async def _apply_decided(
        self, decision: Decision, compute: Compute, on_update: Callable[[], None], why: str
    ) -> bool:
        """Apply the round under way as `decision` says; whether it was applied."""
        training = self.training
        logger.warning(
            "update %d of run %r: its trainer %s decided it and %s; applying it as decided (clip scale %.4g)",
            training.epoch,
            training.run_id,
            decision.trainer[-8:],
            why,
            decision.clip_scale,
        )
        try:
            await training.apply_decided(decision, compute)
        except (BadRequestError, StaleEpochError) as exc:  # the round changed meanwhile: nothing to apply
            logger.warning(
                "update %d of run %r: applying it as decided failed: %s", training.epoch, training.run_id, exc
            )
            return False
        on_update()
        return True

    async def _catch_up(self, compute: Compute) -> None:
        training = self.training
        logger.warning(
            "group %s moved on without this peer (here update %d): dropping %d samples and copying its state",
            training.group.key,
            training.epoch,
            training.samples,
        )
        verified = await asyncio.to_thread(training.group.load_state, training.state())
        await compute(lambda: training.load_state(verified.epoch, verified.tensors))
        self._ahead_since = None
