"""A stage member's view of one update: the trainers' commits, the round they define, and its status.

Each trainer of an update sends its own commit, naming every trainer of the update and every member of the stage
with the micro-batches it holds from that trainer. The round starts once a commit from each named trainer is
here; its id is a digest of what they say, so that members with different views never meet in one round. Plain
data and pure functions: peer/training/span.py does the computing and the calls.

A trainer that sees a fault commits again under its next version; the round follows the lowest of the trainers'
latest versions, each trainer's commit up to it. So a round is replaced only once every trainer of the update has
tried again: one that saw every stage averaged may already be applying it, and one trainer's late retry must not
take that round away from the stages it has not reached yet.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError

MAX_TRAINERS = 64
MAX_MEMBERS = 256
MAX_VERSIONS_KEPT = 16  # per trainer: a trainer gives up an update after 10 (client/training/update.py)


@dataclass(frozen=True)
class RoundPlan:
    """What the commits of an update say, once complete."""

    round_id: str
    version: int
    """The commit version it follows: the lowest of the trainers' latest versions."""
    trainers: tuple[str, ...]
    """The trainers whose micro-batches it takes, sorted."""
    members: tuple[str, ...]
    """Every member of the stage in the round, sorted."""
    mine: dict[str, list[int]]
    """Trainer -> the indices this member must hold (every trainer of the update, possibly none)."""
    samples: int
    """The update's samples over the whole stage."""


@dataclass
class Commits:
    """The commits received for the update at `epoch`."""

    epoch: int
    by_trainer: dict[str, dict[int, pb.CommitRequest]] = field(default_factory=dict)
    """trainer -> version -> its commit"""

    def add(self, request: pb.CommitRequest) -> None:
        """Keep `request` beside its trainer's other versions (the latest MAX_VERSIONS_KEPT).

        Raises:
            BadRequestError: a malformed commit (its sender not among its trainers, too many names, a member
                named twice).
        """
        if not request.trainer or request.trainer not in request.trainers:
            raise BadRequestError("a commit's trainer must be among the trainers it names")
        if len(request.trainers) > MAX_TRAINERS or len(request.members) > MAX_MEMBERS:
            raise BadRequestError(f"a commit names at most {MAX_TRAINERS} trainers and {MAX_MEMBERS} members")
        names = [m.peer_id for m in request.members]
        if len(set(names)) != len(names) or not all(names):
            raise BadRequestError("a commit names each member once, by peer id")
        versions = self.by_trainer.setdefault(request.trainer, {})
        versions[request.version] = request
        while len(versions) > MAX_VERSIONS_KEPT:
            del versions[min(versions)]

    def latest(self, trainer: str) -> pb.CommitRequest:
        versions = self.by_trainer[trainer]
        return versions[max(versions)]

    def _at(self, trainer: str, version: int) -> pb.CommitRequest:
        """The trainer's latest commit up to `version` (its earliest here, when every one here is later)."""
        versions = self.by_trainer[trainer]
        upto = [v for v in versions if v <= version]
        return versions[max(upto) if upto else min(versions)]

    def _followed(self, trainers: list[str]) -> tuple[int, dict[str, pb.CommitRequest]]:
        """(the version the round follows, each trainer's commit up to it)."""
        version = min(max(self.by_trainer[t]) for t in trainers)
        return version, {t: self._at(t, version) for t in trainers}

    def plan(self, me: str) -> RoundPlan | None:
        """The round, once a commit of every trainer named is here and they name the same trainers; else None.

        A member named by no commit is fenced (`fenced`); it has no plan.
        """
        trainers = self.trainers()
        if trainers is None:
            return None
        version, followed = self._followed(trainers)
        members: set[str] = set()
        mine: dict[str, list[int]] = {t: [] for t in trainers}
        samples = 0
        for trainer in trainers:
            commit = followed[trainer]
            for holding in commit.members:
                members.add(holding.peer_id)
                for held in holding.held:
                    if held.trainer != trainer:
                        raise BadRequestError(f"trainer {trainer[-8:]}'s commit lists another trainer's micro-batches")
                    samples += held.samples
                    if holding.peer_id == me:
                        mine[trainer] = sorted(held.indices)
        if me not in members:
            return None
        # the id names what the round averages, and the attempt it follows: late parts of a failed round cannot join
        # the next one
        digest = hashlib.sha256(f"{self.epoch}|{version}".encode())
        for trainer in trainers:
            for holding in sorted(followed[trainer].members, key=lambda h: h.peer_id):
                held = [(h.trainer, sorted(h.indices)) for h in holding.held]
                digest.update(f"|{trainer}>{holding.peer_id}:{held}".encode())
        return RoundPlan(digest.hexdigest(), version, tuple(trainers), tuple(sorted(members)), mine, samples)

    def trainers(self) -> list[str] | None:
        """The trainers of the update: a set of trainers each of whose commits names exactly that set (the largest
        such, by name on a tie); None until there is one. A trainer whose commit names others than they do (it was
        late to its trainers' rendezvous) is not in it: its micro-batches go to the next update."""
        agreeing = []
        for trainer in self.by_trainer:
            named = tuple(sorted(self.latest(trainer).trainers))
            if all(t in self.by_trainer and tuple(sorted(self.latest(t).trainers)) == named for t in named):
                agreeing.append(named)
        return list(max(agreeing, key=lambda t: (len(t), t))) if agreeing else None

    def split(self) -> bool:
        """Whether these commits can never start a round: every trainer that one names has committed, and no set of
        them names the same trainers (each took the trainers it met at its rendezvous, which a run with local steps
        does not otherwise agree on). Only commits that name other trainers, once they agree, can start one."""
        if not self.by_trainer or self.trainers() is not None:
            return False
        named = set().union(*(self.latest(t).trainers for t in self.by_trainer))
        return named <= set(self.by_trainer)

    def fenced(self, me: str) -> bool:
        """Whether commits of every trainer named are here and none of them names this member."""
        trainers = self.trainers()
        if trainers is None:
            return False
        _, followed = self._followed(trainers)
        return all(me not in {m.peer_id for m in commit.members} for commit in followed.values())
