"""Agreeing on a round's outcome before anyone applies it.

A round can end complete for some members and incomplete for others: a reducer's answer lost on its way to one
member only. Applying it where it completed and skipping it elsewhere leaves the members apart for good, so each
member publishes its outcome of a try in its signed progress record (`round`: the try number, `round_digest`: the
digest of what it averaged, "x" when incomplete) and applies only once every member of the try got the same. Any
other outcome makes every member try again under the next try number. A member whose record is gone (or says it
left) is left out of the next try.

The run's trainers agree so on the average of their own parts (client/training/cotrainers.py), and a stage's
members on each outer sync of a run with local steps (peer/training/span.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.errors import TrainingFaultError
from protocol.records import TrainingProgress

logger = logging.getLogger(__name__)

POLL_S = 0.05
MAX_RETRY_PAUSE_S = 2.0
GONE_GRACE_S = 1.0  # a record must be missing from reads this far apart: one read under load can miss it

T = TypeVar("T")

Read = Callable[[], Awaitable[Mapping[str, TrainingProgress]]]
"""Reads the group's records: peer id -> verified progress (GroupMember.members, off the event loop)."""

RoundOf = Callable[[TrainingProgress], tuple[int, int, str]]
"""Where a record says a member stands in a round: (the update the round is of, its try number, its outcome)."""


def update_round(progress: TrainingProgress) -> tuple[int, int, str]:
    """A round within the member's update (its record's `round` fields)."""
    return progress.epoch, progress.round, progress.round_digest


def overlapped_sync(progress: TrainingProgress) -> tuple[int, int, str]:
    """An overlapped sync, which goes on while the member is at later updates (its record's `sync` fields)."""
    return progress.sync_update, progress.sync_round, progress.sync_digest


@dataclass(frozen=True)
class Outcome:
    """What the members' records say of one try."""

    agreed: bool
    members: tuple[str, ...]
    """The members still there (the caller too)."""
    attempt: int
    """The next try's number, when not agreed."""
    why: str


@dataclass(frozen=True)
class Settled(Generic[T]):
    value: T
    members: tuple[str, ...]
    """The members that agreed on it."""
    attempt: int
    """The try they agreed on."""


async def settle(
    try_round: Callable[[int, tuple[str, ...]], Awaitable[tuple[T | None, str]]],
    publish: Callable[[int, str], Awaitable[None]],
    read: Read,
    *,
    me: str,
    epoch: int,
    members: Sequence[str],
    attempt: int = 0,
    give_up_s: float,
    what: str,
    regroup: Callable[[], Awaitable[Sequence[str]]] | None = None,
    round_of: RoundOf = update_round,
) -> Settled[T]:
    """Tries of a round among `members` from try `attempt` on, until every member still there got the same.

    Args:
        try_round: (try number, members) -> (the result, its digest), or (None, "x") when incomplete here; a try's
            round id must follow from its number (and what the round is of), so that all members meet in it.
        publish: announces this member's outcome of a try (number, digest) in its record, at update `epoch`.
        read: the group's records.
        give_up_s: how long to keep trying.
        what: names the round in logs and errors.
        regroup: after a failed try, the members of the next, from the records, where
            each member chose its own at first: members that chose different ones never meet in a round (they
            derive other ids) and would fail every try, so they converge on what the records say now.
        round_of: which fields of a record speak of this round (`publish` writes them).

    Raises:
        TrainingFaultError: no agreement within `give_up_s`.
    """
    members = tuple(sorted(members))
    deadline = time.monotonic() + give_up_s
    for failed in itertools.count():
        if failed:  # a try that keeps failing at once (a member that ends with another average) is not spun
            await asyncio.sleep(min(POLL_S * 2**failed, MAX_RETRY_PAUSE_S))
        value, digest = await try_round(attempt, members)
        await publish(attempt, digest)
        outcome = await agree(
            read, me=me, epoch=epoch, attempt=attempt, members=members, digest=digest, round_of=round_of
        )
        if outcome.agreed:
            return Settled(value, members, attempt)
        if time.monotonic() > deadline:
            raise TrainingFaultError(f"{what}: the members could not agree on a round: {outcome.why}")
        members, attempt = outcome.members, outcome.attempt
        if regroup is not None:
            members = tuple(sorted(set(await regroup()) | {me}))
        logger.warning(
            "%s: the round failed (%s); trying again (try %d, %d members)", what, outcome.why, attempt, len(members)
        )


async def agree(
    read: Read,
    *,
    me: str,
    epoch: int,
    attempt: int,
    members: Sequence[str],
    digest: str,
    round_of: RoundOf = update_round,
) -> Outcome:
    """Wait for every member's outcome of try `attempt` of the round of update `epoch` (this member's is
    `digest`); `round_of` reads a record's."""
    missing_since: dict[str, float] = {}
    while True:
        records = await read()
        now = time.monotonic()
        for pid in members:
            there = pid == me or (pid in records and not records[pid].left)
            if there:
                missing_since.pop(pid, None)
            else:
                missing_since.setdefault(pid, now)
        gone = sorted(pid for pid, since in missing_since.items() if now - since >= GONE_GRACE_S)
        if gone:
            logger.warning("members %s left during update %d; going on without them", _short(gone), epoch)
            left = tuple(pid for pid in members if pid not in gone)
            return Outcome(False, left, attempt + 1, f"members {_short(gone)} left")
        outcomes = {pid: round_of(records[pid]) for pid in members if pid != me and pid in records}
        ahead = max((r for u, r, _ in outcomes.values() if u == epoch), default=attempt)
        if ahead > attempt:  # another member saw this try fail already
            return Outcome(False, tuple(members), ahead, "another member's try failed")
        done = [d for u, r, d in outcomes.values() if u == epoch and r == attempt]
        if len(done) == len(members) - 1 and all(done):
            agreed = digest != "x" and all(d == digest for d in done)
            return Outcome(agreed, tuple(members), attempt + (not agreed), _disagreement(digest, outcomes, attempt))
        if any(u > epoch for u, _, _ in outcomes.values()):  # it applied: it saw everyone agree
            return Outcome(digest != "x", tuple(members), attempt + 1, "this member's try failed")
        await asyncio.sleep(POLL_S)


def _disagreement(digest: str, outcomes: Mapping[str, tuple[int, int, str]], attempt: int) -> str:
    """Why try `attempt` did not agree, as the members' records of it say ("" when it did)."""
    if digest == "x":
        return "this member's round was incomplete"
    failed = [pid for pid, (_, r, d) in outcomes.items() if r == attempt and d == "x"]
    if failed:
        return f"incomplete at members {_short(failed)}"
    other = [pid for pid, (_, r, d) in outcomes.items() if r == attempt and d != digest]
    return f"members {_short(other)} ended with another average" if other else ""


def _short(peer_ids) -> str:
    return ", ".join(sorted(pid[-8:] for pid in peer_ids))
