"""The run's other trainers, as one trainer sees them: meeting at each update, averaging the trainers' own parts
(embeddings, norm, head) with them, and agreeing on the result before anyone applies it.

The trainers of a run are a group of their own ("trainers", beside each stage's group): signed progress records,
rounds among exactly the trainers of an update, and the state a majority vouches for (swarm/training/group.py).
Anyone can publish a record there, so copying a state trusts only records at an update every stage has applied:
an honest trainer announces an update after the stages applied it, and a claim past them is made up.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import hivemind
import torch

from client.config import TrainConfig
from protocol.errors import DHTUnavailableError, InvalidRecordError, TrainingFaultError
from protocol.records import TrainingProgress, round_tag
from swarm.dht.node import dht_result
from swarm.training import agreement
from swarm.training.group import TRAINER_PROGRESS_TTL_S, GroupMember, trainers_key
from swarm.training.state import VerifiedState, majority_claim, others_gone, state_digest
from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)

POLL_S = 0.05
DECIDE_TIMEOUT_S = 10.0  # for the DHT to take a decision; past it the trainer applies anyway, and warns
DECIDE_TRIES = 3

T = TypeVar("T")


class CoTrainers:
    """This trainer in its run's group of trainers.

    Args:
        params: the trainer's own parameters (what the trainers' rounds average, shapes only).
        state: returns (epoch, state tensors) for a trainer that joins: a consistent copy.
        stages_epoch: returns the latest update every stage has applied (blocking), None when unknown.
        compression: how rounds send gradients (the run's recipe).
        digest_of: the digest this trainer announces of a state, which a copy must match (GroupMember).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        prefix: str,
        config: TrainConfig,
        *,
        params: Sequence[torch.Tensor],
        state: Callable[[], tuple[int, Sequence[torch.Tensor]]],
        stages_epoch: Callable[[], int | None],
        swarm_key: SwarmKey | None = None,
        compression: str = "none",
        digest_of: Callable[[Sequence[torch.Tensor]], str] = state_digest,
    ):
        self.dht, self.config = dht, config
        self.stages_epoch = stages_epoch
        self.trainer_id = dht.peer_id.to_base58()
        self.progress = TrainingProgress(epoch=0, samples=0)
        self._tries = (-1, 0)  # (an update, the try number past its last agreement's tries)
        self._sync: dict[str, int | str] = {}  # this trainer's outcome of its overlapped sync, in every record
        self._stop = threading.Event()
        self.group = GroupMember(
            dht,
            trainers_key(prefix, config.run_id),
            grads_like=params,
            state=state,
            settings=config.averaging,
            swarm_key=swarm_key,
            progress_ttl_s=TRAINER_PROGRESS_TTL_S,
            compression=compression,
            digest_of=digest_of,
        )
        self._publisher = threading.Thread(target=self._publish_forever, name="trainer-progress", daemon=True)

    def start(self, progress: TrainingProgress) -> None:
        """Announce `progress`, serve this trainer's state to joiners, and keep the record alive."""
        self.publish(progress)
        self.group.serve_state(True)
        self._publisher.start()

    def publish(self, progress: TrainingProgress) -> None:
        if self._sync:
            progress = progress.model_copy(update=self._sync)
        self.progress = progress
        self.group.publish(progress)

    def decide(self, epoch: int, rounds: Sequence[str], clip_scale: float, timeout_s: float = DECIDE_TIMEOUT_S) -> bool:
        """Store this trainer's decision on update `epoch` (the stages' round ids and the clipping factor), before its
        first Apply, so that a stage whose Apply never comes applies it all the same (peer/training/decision.py); the
        record says the rest as before. Whether the DHT took it within `timeout_s` (blocking)."""
        decided = tuple(sorted({round_tag(round_id) for round_id in rounds}))
        progress = self.progress.model_copy(update={"epoch": epoch, "decided": decided, "clip_scale": clip_scale})
        deadline = time.monotonic() + timeout_s
        try:
            progress = TrainingProgress.from_wire(progress.to_wire())  # validated: a record the DHT refuses is lost
            self.progress = progress
            # a store is refused where a record that expires later is held: the publisher thread's renewal of the
            # record before, racing this one; the next try expires later still
            for _ in range(DECIDE_TRIES):
                remaining = max(0.0, deadline - time.monotonic())
                if dht_result(self.dht, self.group.publish(progress), "storing a decision", remaining):
                    return True
            raise DHTUnavailableError(f"{DECIDE_TRIES} stores were refused")
        except (InvalidRecordError, DHTUnavailableError) as exc:  # more stages than a record holds; a DHT outage
            logger.warning("update %d: could not store this trainer's decision: %s", epoch, exc)
            return False

    def _publish_forever(self) -> None:
        while not self._stop.wait(self.config.averaging.progress_period_s):
            try:
                self.group.publish(self.progress)
            except Exception as exc:  # the DHT may be briefly unreachable
                logger.debug("publishing the trainer's progress failed: %r", exc)

    def credible(self) -> dict[str, TrainingProgress]:
        """The trainers' records, less those past the latest update every stage has applied (none when that is
        unknown: no stage answers), read in that order: a trainer's record shows an update after the stages' Info
        does (blocking)."""
        members = self.group.members()
        ceiling = self.stages_epoch()
        return {pid: p for pid, p in members.items() if ceiling is not None and p.epoch <= ceiling}

    def majority(self) -> tuple[int, str] | None:
        """The (epoch, state digest) a strict majority of the other credible trainers announce, or None."""
        return majority_claim({pid: p for pid, p in self.credible().items() if pid != self.trainer_id})

    def alive(self) -> set[str]:
        """The trainers heard from lately (this one too, once its record is in)."""
        return set(self.group.members())

    def others(self) -> set[str]:
        """The other credible trainers that have not left."""
        return {pid for pid, p in self.credible().items() if pid != self.trainer_id and not p.left}

    def load_state(self, like: Sequence[torch.Tensor]) -> VerifiedState:
        """The state a strict majority of the other credible trainers vouches for (blocking)."""
        return self.group.load_state(like, self.credible)

    def last_landing(self, overlap: int) -> int:
        """The update after which the latest overlapped sync (`--sync-overlap` `overlap`) of the other credible
        trainers lands, -1 for none: until then they serve no copy of their state (blocking)."""
        if not overlap:
            return -1
        others = [p for pid, p in self.credible().items() if pid != self.trainer_id and p.sync_update >= 0]
        return max((p.sync_update + overlap for p in others), default=-1)

    def wait_until_past(self, missed: int) -> None:
        """After update `missed` went on without this trainer: wait (bounded by the load-state timeout) until a
        majority of the other credible trainers vouches for a state past it, or none is left."""
        deadline = time.monotonic() + self.config.averaging.load_state_timeout_s
        while time.monotonic() < deadline:
            members = self.credible()
            others = {pid: p for pid, p in members.items() if pid != self.trainer_id}
            claim = majority_claim(others)
            if claim is not None and claim[0] > missed:
                return
            if others_gone(members, self.trainer_id):
                return  # nobody will vouch for a state past it
            time.sleep(self.config.averaging.progress_period_s)

    # --- one update ---

    async def rendezvous(self, epoch: int, samples: int) -> dict[str, int]:
        """The trainers of update `epoch`: trainer id -> its samples, once every trainer at that update is done with
        its micro-batches (one that has not been within the step timeout sits this update out)."""
        self.publish(TrainingProgress(epoch=epoch, samples=samples, param_digest=self.progress.param_digest))
        # a co-trainer at this update still computing is waited for: its record says it is there
        deadline = time.monotonic() + self.config.step_timeout_s
        while True:
            members = await asyncio.to_thread(self.group.members)
            at = {pid: p for pid, p in members.items() if p.epoch == epoch and not p.left}
            ready = {pid: p.samples for pid, p in at.items() if p.samples > 0}
            ready[self.trainer_id] = samples
            if len(ready) == len(at | {self.trainer_id: None}) or time.monotonic() > deadline:
                return dict(sorted(ready.items()))
            await asyncio.sleep(POLL_S)

    async def average(self, epoch: int, sums: list[torch.Tensor], samples: int) -> tuple[dict[str, int], list]:
        """(the trainers of update `epoch`, the mean gradients of the trainers' parts over all their samples).

        The trainers average their parts in a round, then agree through their records that every one of them got
        the same result before any applies it; a round that failed anywhere is tried again by all, under the next
        try number. A trainer whose record lapses (it died; records outlive it by TRAINER_PROGRESS_TTL_S at most)
        is left out and the others go on."""
        trainers = await self.rendezvous(epoch, samples)
        return await self.settle(epoch, sums, samples, trainers, regroup=True)

    async def settle(
        self,
        epoch: int,
        sums: list[torch.Tensor],
        samples: int,
        trainers: dict[str, int],
        attempt: int = 0,
        regroup: bool = False,
    ) -> tuple[dict[str, int], list]:
        """(the trainers that averaged, the mean gradients of the trainers' parts over their samples): rounds among
        `trainers` from try `attempt` on, until all agree on one (`average`, swarm/training/agreement.py). Called
        again with the trainers still there, and a later try number, when one died before the stages applied its
        micro-batches.

        `regroup`: after a failed try, the trainers of the next are those whose records are at this update with
        their samples (as `rendezvous` reads them): a trainer that met the others a moment before one of them
        announced this update chose fewer trainers than they did, and no try of either would ever meet."""
        return await self._agreed(
            epoch,
            samples,
            trainers,
            lambda attempt, chosen: self._round(epoch, sums, chosen, attempt),
            alone=[s / samples for s in sums],
            attempt=attempt,
            regroup=regroup,
            what=f"the trainers' round of update {epoch}",
        )

    async def agree_on(self, epoch: int, samples: int, trainers: dict[str, int]) -> dict[str, int]:
        """The trainers of update `epoch` in a run with local steps, where the trainers average nothing each update:
        the set that every one of them took (`trainers`: this trainer's choice at its rendezvous). Each trainer's
        commits name its set, and the stages take an update only from trainers that name the same one
        (peer/training/commits.py): one that met the others a moment before another announced the update leaves
        them all waiting, which the stages report (`split`, client/training/update.py). Then they agree on the set
        as on a round's result, and take again the trainers whose records show the update after a try that
        differed."""

        async def names(attempt: int, chosen: dict[str, int]) -> tuple[dict[str, int], str]:
            return chosen, hashlib.sha256(f"{epoch}|{sorted(chosen)}".encode()).hexdigest()

        agreed, _ = await self._agreed(
            epoch,
            samples,
            trainers,
            names,
            alone=None,
            attempt=self.first_try(epoch),
            regroup=True,
            what=f"the trainers of update {epoch}",
        )
        return agreed

    async def _agreed(
        self,
        epoch: int,
        samples: int,
        trainers: dict[str, int],
        try_round: Callable[[int, dict[str, int]], Awaitable[tuple[T | None, str]]],
        *,
        alone: T,
        attempt: int,
        regroup: bool,
        what: str,
    ) -> tuple[dict[str, int], T]:
        """(the trainers that agreed, the result they agreed on): tries of `try_round` among `trainers` until all
        agree (swarm/training/agreement.py); `alone` is the result of a trainer with no other."""
        trainers = dict(trainers)
        if len(trainers) == 1:  # alone: a trainer that comes later is late, and does its batch at the next update
            self._tries = (epoch, attempt)
            return trainers, alone

        async def at_update() -> list[str]:
            records = await asyncio.to_thread(self.group.members)
            at = {pid: p for pid, p in records.items() if p.epoch == epoch and p.samples > 0 and not p.left}
            trainers.update({pid: p.samples for pid, p in at.items() if pid != self.trainer_id})
            return [self.trainer_id, *(pid for pid in at if pid != self.trainer_id)]

        async def publish(attempt: int, digest: str) -> None:
            self.publish(
                TrainingProgress(
                    epoch=epoch,
                    samples=samples,
                    param_digest=self.progress.param_digest,
                    round=attempt,
                    round_digest=digest,
                )
            )

        settled = await agreement.settle(
            lambda attempt, members: try_round(attempt, {t: trainers[t] for t in members}),
            publish,
            lambda: asyncio.to_thread(self.group.members),
            me=self.trainer_id,
            epoch=epoch,
            members=list(trainers),
            attempt=attempt,
            give_up_s=TRAINER_PROGRESS_TTL_S + 4 * self.config.averaging.averaging_timeout_s,
            what=what,
            regroup=at_update if regroup else None,
        )
        self._tries = (epoch, settled.attempt + 1)  # the next agreement of this update starts past these tries
        return {t: trainers[t] for t in settled.members}, settled.value

    async def overlapped_sync(self, epoch: int, deltas: list[torch.Tensor], trainers: Sequence[str]) -> list | None:
        """The mean of the pseudo-gradients of `trainers` (those of update `epoch`) in a sync that runs while they go
        on with later updates (`--sync-overlap`): its tries are agreed on in the records' sync fields, beside each
        update's own agreement. None when they cannot agree: every trainer skips it."""
        if len(trainers) == 1:
            return deltas

        async def publish(attempt: int, digest: str) -> None:
            self._sync = {"sync_update": epoch, "sync_round": attempt, "sync_digest": digest}
            self.publish(self.progress)

        what = f"the trainers' overlapped sync of update {epoch}"
        try:
            settled = await agreement.settle(
                lambda attempt, members: self._round(epoch, deltas, dict.fromkeys(members, 1), attempt, of="sync"),
                publish,
                lambda: asyncio.to_thread(self.group.members),
                me=self.trainer_id,
                epoch=epoch,
                members=list(trainers),
                give_up_s=TRAINER_PROGRESS_TTL_S + 4 * self.config.averaging.averaging_timeout_s,
                what=what,
                round_of=agreement.overlapped_sync,
            )
        except TrainingFaultError as exc:
            logger.warning("%s; every trainer skips it, and the next sync carries its change", exc)
            return None
        return settled.value

    def first_try(self, epoch: int) -> int:
        """The number of the next agreement's first try at update `epoch`: past every try of this update's earlier
        agreements (the same at every trainer that took part in them), 0 at first."""
        update, attempt = self._tries
        return attempt if update == epoch else 0

    async def _round(
        self, epoch: int, sums: list[torch.Tensor], trainers: dict[str, int], attempt: int, of: str = "update"
    ) -> tuple[list | None, str]:
        """(the mean gradients of the trainers' parts over every trainer's samples, their digest), or (None, "x").
        `of`: "update", or "sync" for an overlapped sync, which may run beside a round of a later update."""
        total = sum(trainers.values())
        scale = len(trainers) / total  # uniform weights, pre-scaled (swarm/training/rounds.py)
        # the same id for every trainer of the try: what it averages, and the try number
        tag = "" if of == "update" else f"{of}|"
        round_id = hashlib.sha256(f"{tag}{epoch}|{attempt}|{sorted(trainers.items())}".encode()).digest()
        began = time.perf_counter()
        result = await asyncio.to_thread(
            self.group.average,
            [s.double() * scale for s in sums],
            round_id=round_id,
            members=list(trainers),
            timeout_s=self.config.averaging.averaging_timeout_s,
        )
        if not result.complete:
            return None, "x"
        logger.info(  # worded as a stage peer's round (peer/training/span.py): the bench reads both
            "update %d of run %r: averaged %d samples (%d here) among %d members in %.2fs, %d bytes sent",
            epoch,
            self.config.run_id,
            total,
            trainers[self.trainer_id],
            len(trainers),
            time.perf_counter() - began,
            result.sent_bytes,
        )
        return [t.to(torch.float32) for t in result.tensors], state_digest(result.tensors)

    def close(self) -> None:
        """Leave the group (the others stop counting this trainer at once) and stop publishing."""
        self._stop.set()
        self.group.shutdown()
