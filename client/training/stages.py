"""The stages of a run as one trainer sees them: their members, and the commit and apply calls of an update.

A member is a peer of the run that serves one stage's blocks and answers Info at the stage's epoch. One that is
behind (it joined, or catches up after a fault) sits the update out. A member counts as lost only when its
connection is refused (its process is gone) or its record has left the directory (it has not announced itself for
a whole record lifetime); a slow one, or one that stopped answering for a few seconds, is waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from client.retry import describe
from client.routing import RouteHop
from client.sequence import RemoteSequence
from protocol import swarmlm_pb2 as pb
from protocol.errors import PeerUnavailableError, SwarmError, TrainingFaultError
from protocol.records import ServerInfo

logger = logging.getLogger(__name__)

Span = tuple[int, int]
INFO_TIMEOUT_S = 5.0
# a member of the last update that one directory read misses (a DHT read under load can) is read again this long
# before it sits the update out: two of three members sitting one update out leave no majority to catch up from
MISSED_GRACE_S = 3.0


@dataclass(frozen=True)
class Member:
    peer_id: str
    span: Span
    address: str
    epoch: int
    round: pb.RoundStatus


def refused(error: BaseException) -> bool:
    """Whether a failed call means the peer's process is gone: nothing listens at its address any more."""
    text = str(error).lower()
    return isinstance(error, PeerUnavailableError) and ("connection refused" in text or "failed to connect" in text)


class Stages:
    """The members of each stage of `run_id`, read from the directory and their Info answers."""

    def __init__(self, sequence: RemoteSequence, run_id: str):
        self.sequence, self.run_id = sequence, run_id
        self.refused: set[str] = set()  # peers whose connection was refused since the last directory read
        self.answered: dict[str, Member] = {}  # peer id -> its Info, of the last members() read
        self.last_update: set[str] = set()  # the members of the last update a step began, and those that sat it out
        self.listed: set[str] = set()  # the run's peers in the last directory read, answering or not

    async def members(self) -> dict[Span, dict[str, Member]]:
        """Every peer of the run that answers Info, by stage (fresh directory read)."""
        self.refused.clear()
        stages = await self._read(self.refused)
        self.answered = {pid: member for members in stages.values() for pid, member in members.items()}
        return stages

    async def applied_everywhere(self) -> int | None:
        """The latest update every stage has a member at (fresh directory read), None when no stage answers."""
        stages = await self._read(set())
        if not stages or not self._cover(stages):
            return None
        return min(max(m.epoch for m in members.values()) for members in stages.values())

    async def _read(self, refused_into: set[str]) -> dict[Span, dict[str, Member]]:
        """The run's peers that answer Info, by stage; those whose connection is refused go into `refused_into`."""
        snapshot = await self.sequence.snapshot(refresh=True)
        self.listed = set(snapshot.online())

        async def ask(peer_id: str, info: ServerInfo) -> Member | None:
            try:
                address = await self.sequence.address_of(peer_id, info)
                response = await self.sequence.pool.unary(address, "info", pb.InfoRequest(), INFO_TIMEOUT_S)
            except SwarmError as exc:
                if refused(exc):
                    refused_into.add(peer_id)
                return None
            if response.run_id != self.run_id:
                return None
            span = (info.start_block, info.end_block)
            return Member(peer_id, span, address, int(response.epoch), response.round)

        found = await asyncio.gather(*(ask(pid, info) for pid, info in snapshot.online().items()))
        stages: dict[Span, dict[str, Member]] = {}
        for member in found:
            if member is not None:
                stages.setdefault(member.span, {})[member.peer_id] = member
        return stages

    async def ready(self, epoch: int | None, timeout_s: float) -> tuple[int, dict[Span, dict[str, Member]]]:
        """(epoch, members at it per stage) once every stage has a member at one common epoch: `epoch`, or, when
        None, the epoch most members are at. Members at another epoch sit this update out.

        Raises:
            TrainingFaultError: no such state within `timeout_s` (the message names each stage's epochs).
        """
        began = time.monotonic()
        deadline = began + timeout_s
        while True:
            stages = await self.members()
            chosen = epoch
            if chosen is None and stages:
                chosen = Counter(m.epoch for members in stages.values() for m in members.values()).most_common(1)[0][0]
            at = {span: {pid: m for pid, m in members.items() if m.epoch == chosen} for span, members in stages.items()}
            if at and all(at.values()) and self._cover(at):
                missed = self.last_update - self.listed - self.refused
                if not missed or time.monotonic() - began > MISSED_GRACE_S:
                    return chosen, at
            if time.monotonic() > deadline:
                seen = {f"{s[0]}:{s[1]}": sorted(m.epoch for m in ms.values()) for s, ms in sorted(stages.items())}
                raise TrainingFaultError(
                    f"the stages of run {self.run_id!r} are not all at update {chosen} after {timeout_s:.0f}s "
                    f"(members' updates per stage: {seen}); start or wait for the missing stages' peers"
                )
            await asyncio.sleep(0.2)

    async def left_out(self, members: dict[Span, dict[str, Member]], epoch: int) -> dict[str, str]:
        """Peer id -> why, for every peer of the run that is not among `members` (update `epoch`'s) although it is in
        the directory or took part in the update before: it is at another update, it did not answer Info in time
        (stopped or overloaded for a moment), or the directory read missed it. Such a peer sits the update out, and
        copies its group's state once the group has moved on."""
        taking_part = {pid for span_members in members.values() for pid in span_members}
        online = (await self.sequence.snapshot()).online()
        why = {}
        for pid in online:
            if pid in taking_part:
                continue
            seen = self.answered.get(pid)
            if seen is None and pid in self.refused:
                why[pid] = "refuses connections: gone, its directory record not lapsed yet"
            elif seen is None:
                why[pid] = f"no Info answer within {INFO_TIMEOUT_S:g}s"
            elif seen.epoch != epoch:
                why[pid] = f"at update {seen.epoch}"
            else:
                why[pid] = "joined after the stages were read"
        for pid in self.last_update - taking_part - set(online):
            why[pid] = "not in the directory just now"
        # a peer that sat this update out while announced is still behind at the next one: named there too if the
        # directory misses it then (once: one that is gone for good is not named at every update)
        self.last_update = taking_part | {pid for pid in why if pid in online}
        return why

    def _cover(self, stages: dict[Span, dict[str, Member]]) -> bool:
        """Whether the stages' spans tile blocks [0, num_blocks) without gaps or overlaps."""
        position = 0
        for start, end in sorted(stages):
            if start != position:
                return False
            position = end
        return position == self.sequence.num_blocks

    async def lost(self, peer_id: str, error: BaseException | None = None) -> bool:
        """Whether `peer_id` is gone: its connection was refused, or its record has left the directory."""
        if peer_id in self.refused or (error is not None and refused(error)):
            self.refused.add(peer_id)
            return True
        snapshot = await self.sequence.snapshot(refresh=True)
        return peer_id not in snapshot.online()

    async def call(self, member: Member, method: str, request, timeout_s: float):
        return await self.sequence.pool.unary(member.address, method, request, timeout_s)

    async def status(self, member: Member, epoch: int) -> pb.RoundStatus | BaseException:
        """The member's round of update `epoch`: the one under way, or, once applied (another trainer of the same
        update sent Apply first), the round it applied."""
        try:
            response = await self.call(member, "info", pb.InfoRequest(), INFO_TIMEOUT_S)
        except SwarmError as exc:
            return exc
        applied = response.applied_round
        if response.round.epoch == epoch + 1 and applied.epoch == epoch and applied.round_id:
            return applied
        return response.round

    def hop(self, member: Member) -> RouteHop:
        return RouteHop(member.peer_id, member.span[0], member.span[1], member.address)

    def describe(self, member: Member) -> str:
        return describe(self.hop(member))
