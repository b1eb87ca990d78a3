"""DiLoCo's outer step (`--local-steps H`, Douillard et al. 2023): rounds every H updates instead of every update.

Between syncs each member of a group applies its inner optimizer (the recipe's) to its own gradients alone. After
every H-th update the group averages its *pseudo-gradients* (the weights at the last sync minus the weights now)
and each member applies them from the last sync's weights with Nesterov momentum: the outer optimizer, whose
defaults are DiLoCo's (lr 0.7, momentum 0.9). One round per H updates sends H times less than a round per update.

The arithmetic is torch's SGD with nesterov=True and no dampening, done in float64 from float32 state, so that a
peer, a trainer and the one-process reference (`swarmlm train --local --local-steps H`) compute the same bits.

With `--sync-overlap N` (Streaming DiLoCo, Douillard et al. 2025) nobody waits for a sync's round: the members take
the pseudo-gradients after update e, go on with N more inner steps while the round runs in the background, and
after update e + N land the outer step on top of those steps (the weights become the new sync point plus what the
N steps moved them). Those steps are counted in the next sync's pseudo-gradients, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from protocol.errors import TrainingFaultError
from swarm.training import agreement

logger = logging.getLogger(__name__)


def sync_due(epoch: int, local_steps: int) -> bool:
    """Whether update `epoch` (0-based) ends with a sync: after every `local_steps`-th inner step."""
    return local_steps > 1 and (epoch + 1) % local_steps == 0


class OuterStep:
    """The outer optimizer over `params` (float32 tensors updated in place): the weights at the last sync and the
    momentum, both part of the state a group shares."""

    def __init__(self, params: Sequence[torch.Tensor], *, lr: float, momentum: float):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.anchors = [p.detach().clone() for p in self.params]
        self.momenta = [torch.zeros_like(p) for p in self.params]
        self.taken: list[torch.Tensor] | None = None  # the weights an overlapped sync's pseudo-gradients were taken at

    def state(self) -> list[torch.Tensor]:
        """The weights at the last sync, then the momentum: identical on every member after a complete round."""
        return [*self.anchors, *self.momenta]

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """The weights at the last sync minus the weights now, in float64 (what the group averages)."""
        return [a.double() - p.detach().double() for a, p in zip(self.anchors, self.params)]

    def take(self) -> list[torch.Tensor]:
        """The pseudo-gradients of an overlapped sync, remembering the weights they were taken at (`apply` with
        carry lands the outer step on the steps taken since)."""
        self.taken = [p.detach().clone() for p in self.params]
        return self.pseudo_gradients()

    @torch.no_grad()
    def apply(self, averaged: Sequence[torch.Tensor], *, carry: bool = False) -> None:
        """Move every parameter from its last sync by the averaged pseudo-gradients, with Nesterov momentum; the
        result is the next sync's starting point. `carry`: an overlapped sync (`take`), whose weights keep what the
        inner steps since it was taken moved them: the new sync point plus (weights now - weights taken)."""
        if len(averaged) != len(self.params):
            raise ValueError(f"{len(averaged)} pseudo-gradients for {len(self.params)} parameters")
        if carry and self.taken is None:
            raise ValueError("an overlapped outer step needs the weights its pseudo-gradients were taken at (take)")
        taken = self.taken if carry else [None] * len(self.params)
        for p, anchor, momentum, delta, before in zip(self.params, self.anchors, self.momenta, averaged, taken):
            delta = delta.to(device=p.device, dtype=torch.float64)
            buf = momentum.double() * self.momentum + delta
            step = delta + self.momentum * buf
            momentum.copy_(buf)
            anchor.copy_(anchor.double() - self.lr * step)
            p.copy_(anchor if before is None else anchor.double() + (p.double() - before.double()))
        if carry:
            self.taken = None

    def drop_taken(self) -> None:
        """Forget an overlapped sync's weights: it was skipped, or the state was replaced."""
        self.taken = None


@dataclass
class PendingSync:
    """An overlapped sync (`sync_overlap` N > 0): taken after update e, its round runs in the background, and its
    outer step lands after update `lands` (e + N)."""

    lands: int
    round: asyncio.Future | None = None
    """The round under way (`in_background`); None once its outcome is known (`averaged`)."""
    averaged: list[torch.Tensor] | None = None
    """The averaged pseudo-gradients, or None: the sync is skipped, and the next one carries its change."""

    async def outcome(self) -> list[torch.Tensor] | None:
        """The averaged pseudo-gradients (None: skipped), once the round has ended."""
        if self.round is not None:
            self.averaged, self.round = await self.round, None
        return self.averaged


class MemberSyncs:
    """A member's outer step and its overlapped sync still to land, as a stage member (peer/training/syncs.py) and a
    trainer (client/training/syncs.py) both keep them.

    `run` in the methods below runs a function on the thread that owns the weights, and returns its result.
    """

    def __init__(self, params: Sequence[torch.Tensor], recipe):
        self.outer = OuterStep(params, lr=recipe.outer_lr, momentum=recipe.outer_momentum)
        self.local_steps, self.overlap = recipe.local_steps, recipe.sync_overlap
        self.pending: PendingSync | None = None  # an overlapped sync whose outer step has not landed yet

    def outer_step(self, averaged: Sequence[torch.Tensor], *, carry: bool = False) -> None:
        """The outer step (on the weights' thread)."""
        self.outer.apply(averaged, carry=carry)

    async def land(self, epoch: int, run: Callable[[Callable], Awaitable]) -> None:
        """After update `epoch`: the outer step of the overlapped sync due now, on top of the inner steps since (its
        round waited for only if it has not ended); nothing when none is due."""
        pending = self.pending
        if pending is None or epoch < pending.lands:
            return
        self.pending = None
        averaged = await pending.outcome()
        if averaged is None:
            await run(self.outer.drop_taken)
        else:
            await run(lambda: self.outer_step(averaged, carry=True))

    async def overlap_from(
        self,
        epoch: int,
        run: Callable[[Callable], Awaitable],
        sync: Callable[[list[torch.Tensor]], Awaitable],
        what: str,
    ) -> None:
        """Take the pseudo-gradients after update `epoch` and start `sync` of them in the background; its outer step
        lands `overlap` updates later (`land`)."""
        deltas = await run(self.outer.take)
        self.pending = PendingSync(epoch + self.overlap, in_background(sync(deltas), what))

    def check_copyable(self) -> None:
        """Raises RuntimeError while an outer step has yet to land: a copy of the state would miss it, and differ
        from the others' for good."""
        pending = self.pending
        if pending is not None:
            raise RuntimeError(f"a sync lands after update {pending.lands}; ask again then")

    def drop_pending(self) -> None:
        """The state was replaced by a copy, which holds what the syncs did: one under way here is moot."""
        self.pending = None
        self.outer.drop_taken()


def in_background(sync: Awaitable[list[torch.Tensor] | None], what: str) -> asyncio.Future:
    """An overlapped sync's round as a task that ends in None (skipped) rather than an error: nobody awaits it once
    the state was copied meanwhile, and a round that fails here is one the members skip."""

    async def run() -> list[torch.Tensor] | None:
        try:
            return await sync
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("%s failed: %r; the next sync carries its change", what, exc)
            return None

    return asyncio.ensure_future(run())


def vouched_digest(state: Sequence[torch.Tensor], outer: OuterStep | None) -> str:
    """The digest a member announces of its `state` (which ends with `outer.state()`): all of it in a synchronous
    run; with local steps only the part every member shares between syncs, as their own weights differ."""
    from swarm.training.state import state_digest  # hivemind loads only with a group

    if outer is None:
        return state_digest(state)
    return state_digest(state[len(state) - len(outer.state()) :])


async def agreed_sync(
    group,
    deltas: list[torch.Tensor],
    *,
    base_round_id: bytes,
    epoch: int,
    members: Sequence[str],
    settings,
    publish: Callable[[int, str], Awaitable[None]],
    what: str,
    round_of: agreement.RoundOf = agreement.update_round,
) -> list[torch.Tensor] | None:
    """The mean of the pseudo-gradients of `members` (a round of `group`, a GroupMember, under `settings`, its
    AveragingSettings), once all of them got the same (swarm/training/agreement.py): a round complete here and
    incomplete at another member is tried again by all, so that no member takes an outer step the others skip.
    `publish` announces this member's outcome of a try in its record, at update `epoch` (in the fields `round_of`
    reads: an overlapped sync's are its own). None when they cannot agree for a long while: then every member skips
    it, and the next sync carries its change."""

    def try_round(attempt: int, members: tuple[str, ...]):
        round_id = hashlib.sha256(base_round_id + f"|outer|{attempt}".encode()).digest()
        return sync_round(
            group, deltas, round_id=round_id, members=members, timeout_s=settings.averaging_timeout_s, what=what
        )

    try:
        settled = await agreement.settle(
            try_round,
            publish,
            lambda: asyncio.to_thread(group.members),
            me=group.peer_id,
            epoch=epoch,
            members=members,
            give_up_s=4 * settings.progress_period_s + 4 * settings.averaging_timeout_s,
            what=what,
            round_of=round_of,
        )
    except TrainingFaultError as exc:
        logger.warning("%s; every member skips it, and the next sync carries its change", exc)
        return None
    return settled.value


async def sync_round(
    group, deltas: list[torch.Tensor], *, round_id: bytes, members: Sequence[str], timeout_s: float, what: str
) -> tuple[list[torch.Tensor] | None, str]:
    """One try of a sync: (the mean of the pseudo-gradients of `members`, a round of `group`, a GroupMember; its
    digest), or (None, "x") when the round was incomplete here. `what` names it in the logs."""
    from swarm.training.state import state_digest  # hivemind loads only with a group

    began = time.perf_counter()
    result = await asyncio.to_thread(
        group.average, deltas, round_id=round_id, members=list(members), timeout_s=timeout_s
    )
    if not result.complete:
        logger.warning("%s: the sync round was incomplete here (%s)", what, result.reason)
        return None, "x"
    logger.info(  # bench/train_runs.py reads the members, seconds and bytes
        "%s: synced among %d members in %.2fs, %d bytes sent",
        what,
        len(members),
        time.perf_counter() - began,
        result.sent_bytes,
    )
    return result.tensors, state_digest(result.tensors)
