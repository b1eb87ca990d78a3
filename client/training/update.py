"""One update of every stage, driven by the trainer: commit, wait for the rounds, apply.

After its micro-batches, the trainer tells each member of each stage what the update consists of (a commit: the
members and the micro-batches each holds); the members average among exactly those members and report the
averaged gradients' digest and squared norm; once every member of every stage has averaged the same thing, the
trainer sends Apply with the clipping factor of the global norm, and each member applies it. A round that fails
is a fault, never an update: a member that is gone is fenced, its micro-batches are sent to other members, and the
update is committed again under a new version. A member that answers but cannot average is retried a few times.

With several trainers, each decides on its own: whoever sees every stage averaged first sends Apply. A member's
round is replaced only once every trainer has committed again (peer/training/commits.py), and a trainer decides
only on rounds that follow its own latest commit; once any member has applied the update, the others follow that
decision, whatever faults they saw: the members that no longer answer are left out of it, and micro-batches that a
repair sent elsewhere meanwhile are not counted again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from client.training.ledger import Ledger
from client.training.stages import INFO_TIMEOUT_S, Member, Span, Stages, refused
from protocol import swarmlm_pb2 as pb
from protocol.errors import StaleEpochError, SwarmError, TrainingFaultError
from swarm.training.group import TRAINER_PROGRESS_TTL_S

logger = logging.getLogger(__name__)

MAX_VERSIONS = 10  # commits of one update before the step gives up (each after a fault)
POLL_S = 0.05

Redo = Callable[[Span, str], Awaitable[None]]
"""Fence a member of a stage and send its micro-batches to other members (the trainer's)."""


@dataclass(frozen=True)
class Averaged:
    """A stage's round, done: what every member averaged."""

    round_id: str
    grad_digest: str
    grad_sq_norm: float
    samples: int
    members: tuple[Member, ...]
    trainers: tuple[str, ...]
    """The trainers whose micro-batches it holds."""
    digests: dict[str, str] | None = None
    """With local steps: each member's digest of its own gradients (peer id -> digest), which Apply names; then
    grad_digest is unused and grad_sq_norm is the mean of the members'."""

    def digest_of(self, peer_id: str) -> str:
        return self.grad_digest if self.digests is None else self.digests[peer_id]


class Update:
    """Update `epoch` of every stage, with the micro-batches of `ledger` and of the other `trainers`."""

    def __init__(
        self,
        stages: Stages,
        *,
        run_id: str,
        prefix: str,
        epoch: int,
        trainer: str,
        trainers: list[str],
        members: dict[Span, dict[str, Member]],
        ledger: Ledger,
        redo: Redo,
        round_timeout_s: float,
        trainers_alive: Callable[[], Awaitable[set[str]]] | None = None,
        local_steps: bool = False,
        agree: Callable[[], Awaitable[dict[str, int]]] | None = None,
    ):
        """`local_steps`: the run's members step on their own gradients (recipe local_steps > 1), so the members of
        a stage report different gradients of one round. `agree`: the trainers of the update, agreed on with the
        other trainers (trainer id -> its samples), for when the stages' commits name different trainers (split):
        with local steps each trainer names those it met at its rendezvous, and nothing else agrees on them."""
        self.stages, self.run_id, self.prefix, self.epoch = stages, run_id, prefix, epoch
        self.trainer, self.trainers = trainer, trainers
        self.members, self.ledger, self.redo = members, ledger, redo
        self.round_timeout_s = round_timeout_s
        self.trainers_alive = trainers_alive
        self.local_steps = local_steps
        self.agree = agree
        self.agreed: dict[str, int] | None = None  # the trainers agreed on, once the stages' commits were split
        self.split_seen = False
        self.faults: list[str] = []  # what went wrong and was repaired, for the step's log line
        self.version = 0  # of this trainer's latest commit
        self.applied_seen = False  # whether the last look saw a member that applied the update

    def listed(self, span: Span) -> list[Member]:
        fenced = self.ledger.fenced()
        return [m for pid, m in sorted(self.members[span].items()) if pid not in fenced]

    def commit_request(self, span: Span, version: int) -> pb.CommitRequest:
        holdings = self.ledger.holdings(span)
        members = []
        for member in self.listed(span):
            indices = holdings.get(member.peer_id, [])
            held = [
                pb.TrainerIndices(trainer=self.trainer, indices=indices, samples=self.ledger.samples_of(span, indices))
            ]
            members.append(pb.Holding(peer_id=member.peer_id, held=held if indices else []))
        return pb.CommitRequest(
            run_id=self.run_id,
            span=pb.Span(model=self.prefix, start=span[0], end=span[1]),
            epoch=self.epoch,
            version=version,
            trainer=self.trainer,
            trainers=self.trainers,
            members=members,
        )

    async def average(self) -> dict[Span, Averaged]:
        """Commit until every stage's round is done; the result of each stage's round.

        Raises:
            TrainingFaultError: the rounds kept failing (MAX_VERSIONS commits, and with other trainers for as long as
                a dead one may still look alive), or a stage lost every member.
        """
        began, version = time.monotonic(), 0
        # a trainer of the update that died mid-update holds its commits' micro-batches until its record lapses
        patience_s = TRAINER_PROGRESS_TTL_S + self.round_timeout_s if len(self.trainers) > 1 else 0.0
        while version < MAX_VERSIONS or time.monotonic() - began < patience_s:
            version += 1
            for span in self.members:
                if not self.listed(span):
                    raise TrainingFaultError(f"stage {span[0]}:{span[1]} has no member left for update {self.epoch}")
            problems, answered = await self._commit(version)
            if not problems and (done := self._decided_at_commit(answered)) is not None:
                return done
            # after a commit that some member refused, one look: another trainer may have applied the update
            done, polled = await self._await_rounds(wait=not problems)
            if done is not None:
                return done
            if self.split_seen and self.agree is not None:
                await self._agree()
                continue
            await self._repair({**polled, **problems}, version)
        raise TrainingFaultError(
            f"update {self.epoch} of run {self.run_id!r} failed {version} times; the last faults: "
            f"{'; '.join(self.faults[-3:])}"
        )

    async def _commit(self, version: int) -> tuple[dict[tuple[Span, str], str], dict]:
        """Send this version's commit to every listed member: ((span, member) -> why one did not take it, (span,
        member) -> (member, the round status it answered) of those at this update)."""
        problems: dict[tuple[Span, str], str] = {}
        answered: dict[tuple[Span, str], tuple[Member, pb.RoundStatus]] = {}
        self.version = version

        async def send(span: Span, member: Member) -> None:
            try:
                response = await self.stages.call(member, "commit", self.commit_request(span, version), 30.0)
            except SwarmError as exc:
                if refused(exc):
                    self.stages.refused.add(member.peer_id)
                problems[(span, member.peer_id)] = f"commit failed: {exc}"
                return
            if response.status.epoch != self.epoch:
                return  # it applied this update already (the next look sees how), or fell behind (that look says)
            self._check_in(response.status)
            answered[(span, member.peer_id)] = (member, response.status)
            if response.status.state in (pb.RoundStatus.FAILED, pb.RoundStatus.FENCED):
                problems[(span, member.peer_id)] = response.status.reason or pb.RoundStatus.State.Name(
                    response.status.state
                )

        await asyncio.gather(*(send(span, m) for span in self.members for m in self.listed(span)))
        return problems, answered

    def _decided_at_commit(self, answered: dict) -> dict[Span, Averaged] | None:
        """Every stage's round, when the commit's answers already say that every member averaged it (a member with
        no one to average with answers once its round is done: with local steps, or alone in its stage)."""
        listed = {(span, m.peer_id) for span in self.members for m in self.listed(span)}
        return self._all_averaged(answered) if set(answered) == listed else None

    async def _await_rounds(
        self, *, wait: bool = True
    ) -> tuple[dict[Span, Averaged] | None, dict[tuple[Span, str], str]]:
        """(every stage's round once done, else None; (span, member) -> what is wrong there). Polls until done, a
        problem, or the round timeout; one look only unless `wait`."""
        deadline = time.monotonic() + (self.round_timeout_s if wait else 0.0)
        while True:
            # every member of every stage at once: one round trip a look, not one a stage
            listed = [(span, m) for span in self.members for m in self.listed(span)]
            answers = await asyncio.gather(*(self.stages.status(m, self.epoch) for _, m in listed))
            statuses = {(span, m.peer_id): (m, answer) for (span, m), answer in zip(listed, answers)}
            problems = {}
            for (span, pid), (_, status) in statuses.items():
                if not isinstance(status, BaseException) and status.epoch == self.epoch:
                    self._check_in(status)
                if isinstance(status, BaseException):
                    if refused(status):
                        self.stages.refused.add(pid)
                    problems[(span, pid)] = f"no answer: {status}"
                elif status.epoch > self.epoch + 1:  # past the next update too: it went on without this trainer
                    raise StaleEpochError(f"the stages are at update {status.epoch}, this trainer's is {self.epoch}")
                elif status.epoch != self.epoch:
                    problems[(span, pid)] = f"at update {status.epoch}, not {self.epoch}"
                elif status.state in (pb.RoundStatus.FAILED, pb.RoundStatus.FENCED):
                    problems[(span, pid)] = status.reason or pb.RoundStatus.State.Name(status.state)
            self.applied_seen = _applied(statuses)
            done = self._all_averaged(statuses)
            if done is not None:
                return done, {}
            if self.split_seen and self.agree is not None and self.agreed is None:
                return None, {}  # no round starts until the trainers agree on who is in (once agreed: wait for it)
            if self.applied_seen:
                problems = self._undecided(statuses)  # the members that do not answer are out of it, not at fault
            if problems or time.monotonic() > deadline:
                if not problems and wait:
                    problems = {key: "round not done in time" for key, (_, s) in statuses.items()}
                return None, problems
            await asyncio.sleep(POLL_S)

    def _check_in(self, status: pb.RoundStatus) -> None:
        """A round that takes other trainers' micro-batches but not ours: this trainer was late to the update. Also
        notes commits that name different trainers (`split`)."""
        if status.trainers and self.trainer not in status.trainers:
            raise StaleEpochError(
                f"update {self.epoch} was committed without this trainer (by {len(status.trainers)} others); its "
                f"batch goes to the next update"
            )
        self.split_seen = self.split_seen or status.split

    async def _agree(self) -> None:
        """The stages' commits name different trainers: agree with the others on who is in, for the next commit
        (again only if, once agreed, the stages stay split for a round timeout)."""
        self.split_seen = False
        self.agreed = await self.agree()
        fault = f"update {self.epoch}: the trainers' commits named different trainers; agreed on {len(self.agreed)}"
        self.faults.append(fault)
        logger.warning("%s", fault)
        self.trainers = list(self.agreed)

    def _all_averaged(self, statuses) -> dict[Span, Averaged] | None:
        """Every stage's round, when the update is decided: every member averaged the same round of this trainer's
        latest commit, or some member anywhere applied the update (members that do not answer are then left out:
        its Apply went, or goes, to every member of the round)."""
        decided = _applied(statuses)
        done = {}
        for span in self.members:
            mine = [statuses[(span, m.peer_id)] for m in self.listed(span)]
            if decided:
                mine = [(m, s) for m, s in mine if not isinstance(s, BaseException)]
            ready = (pb.RoundStatus.AVERAGED, pb.RoundStatus.APPLIED) if decided else (pb.RoundStatus.AVERAGED,)
            if not mine or any(isinstance(s, BaseException) or s.state not in ready for _, s in mine):
                return None
            if not decided and any(s.version < self.version for _, s in mine):
                return None  # a round this trainer asked to replace: another trainer's retry may replace it yet
            seen = {(s.round_id, "" if self.local_steps else s.grad_digest) for _, s in mine}
            if len(seen) != 1:
                return None  # members averaged different things: not done (their rounds fail, or a retry fixes it)
            first = mine[0][1]
            done[span] = Averaged(
                first.round_id,
                first.grad_digest,
                sum(s.grad_sq_norm for _, s in mine) / len(mine) if self.local_steps else first.grad_sq_norm,
                first.samples,
                tuple(m for m, _ in mine),
                tuple(sorted(first.trainers)),
                {m.peer_id: s.grad_digest for m, s in mine} if self.local_steps else None,
            )
        return done

    def _undecided(self, statuses) -> dict[tuple[Span, str], str]:
        """Once some member applied the update, the members that keep the others from following it."""
        return {
            (span, pid): f"the update was applied, but this member is {pb.RoundStatus.State.Name(s.state)} "
            f"(round {s.round_id[:12]})"
            for (span, pid), (_, s) in statuses.items()
            if not isinstance(s, BaseException) and s.state not in (pb.RoundStatus.AVERAGED, pb.RoundStatus.APPLIED)
        }

    async def _repair(self, problems: dict[tuple[Span, str], str], version: int) -> None:
        """Fence the members that are gone (their micro-batches go to others); the others are tried again once the
        other trainers had a moment to correct their own commits. A trainer of the update that is gone (it died
        before it committed) is left out: the members drop its micro-batches; not once a member applied the update
        (it died applying it: the rounds of its commits stand, and the others follow them)."""
        if self.trainers_alive is not None and len(self.trainers) > 1 and not self.applied_seen:
            alive = await self.trainers_alive()
            gone = [t for t in self.trainers if t != self.trainer and t not in alive]
            if gone:
                self.trainers = [t for t in self.trainers if t not in gone]
                self.faults.append(f"update {self.epoch}: trainers {', '.join(g[-8:] for g in gone)} gone")
        for (span, pid), why in sorted(problems.items()):
            fault = f"update {self.epoch} v{version}, stage {span[0]}:{span[1]}, peer {pid[-8:]}: {why}"
            self.faults.append(fault)
            logger.warning("%s", fault)
            # only a member that is gone is fenced: one that holds other micro-batches than a commit lists has seen a
            # commit that a later version corrects (a trainer moved micro-batches of a fenced member to it)
            if await self.stages.lost(pid):
                try:
                    await self.redo(span, pid)
                except StaleEpochError as exc:  # the stage applied the update meanwhile: the next look follows it
                    logger.warning("update %d moved on while this trainer repaired it: %s", self.epoch, exc)
        await asyncio.sleep(min(POLL_S * version, 1.0))

    async def apply(self, done: dict[Span, Averaged], clip_scale: float) -> dict[Span, int]:
        """Apply every stage's averaged update; span -> the samples its members applied."""
        applied: dict[Span, int] = {}

        async def apply_one(span: Span, averaged: Averaged, member: Member) -> pb.ApplyResponse | None:
            request = pb.ApplyRequest(
                run_id=self.run_id,
                span=pb.Span(model=self.prefix, start=span[0], end=span[1]),
                epoch=self.epoch,
                round_id=averaged.round_id,
                grad_digest=averaged.digest_of(member.peer_id),
                clip_scale=clip_scale,
            )
            deadline = time.monotonic() + self.round_timeout_s
            while True:  # an Apply whose answer was lost is sent again: applying twice is answered, not redone
                try:
                    return await self.stages.call(member, "apply", request, 60.0)
                except SwarmError as exc:
                    if await self.stages.lost(member.peer_id, exc):
                        self.faults.append(f"stage {span[0]}:{span[1]} peer {member.peer_id[-8:]} gone at apply")
                        return None
                    if time.monotonic() > deadline:  # it lives but cannot apply: it catches up from its group
                        fault = f"stage {span[0]}:{span[1]} peer {member.peer_id[-8:]} did not apply: {exc}"
                        self.faults.append(fault)
                        logger.warning("update %d: %s", self.epoch, fault)
                        return None
                    await asyncio.sleep(INFO_TIMEOUT_S / 5)

        # every stage at once: a member that vanished at apply must not hold the other stages back
        pairs = [(span, averaged, m) for span, averaged in done.items() for m in averaged.members]
        answers = await asyncio.gather(*(apply_one(*pair) for pair in pairs))
        for span in done:
            answered = [a for (s, _, _), a in zip(pairs, answers) if s == span and a is not None]
            digests = {a.param_digest for a in answered}
            if len(digests) > 1:
                fault = f"stage {span[0]}:{span[1]}: members differ after update {self.epoch} ({len(digests)} digests)"
                self.faults.append(fault)
                logger.warning("%s; the minority reloads the majority's state", fault)
            applied[span] = max((a.applied_samples for a in answered), default=0)
        return applied


def _applied(statuses) -> bool:
    """Whether some member answered that it applied the update: then the update is decided."""
    return any(not isinstance(s, BaseException) and s.state == pb.RoundStatus.APPLIED for _, s in statuses.values())
