"""One process's membership in a training group: the peers of one stage of a run, or a run's trainers.

Puts together what a member does with its group: its signed progress record (members.py), rounds among the
members a commit names (rounds.py), and copying the state that a majority vouches for (state.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence

import hivemind
import torch

from protocol.records import TrainingProgress
from swarm.training.members import GroupProgress, progress_key
from swarm.training.rounds import RoundAverager, RoundResult, RoundSettings
from swarm.training.settings import AveragingSettings
from swarm.training.state import VerifiedState, load_verified_state, majority_claim, state_digest
from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)

# trainers' progress records outlive a few lost stores under load: a trainer that missed its co-trainer would update
# alone; one that died is still expected this long, which costs at most a rendezvous's matchmaking time (a stage
# peer drops an update committed only by trainers gone this long: peer/training/span.py)
TRAINER_PROGRESS_TTL_S = 15.0


class GroupMember:
    """This process in the group `key` of `dht`'s swarm.

    Args:
        grads_like: what every round averages (shapes; rounds run in float64, see `average`).
        state: returns (epoch, state tensors) for a joiner to copy: a consistent copy, whose digest is the one this
            member announces.
        settings: the group's timing.
        swarm_key: a private swarm's key (state goes only to members whose signed progress is published).
        compression: how rounds send gradients (the run's recipe: every member must use the same).
        deciding: picks the records this member decides by, out of every member's (a stage: state.deciding).
            None: every record counts.
        digest_of: the digest this member announces of a state (default: of all of it), which a copy must match.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        key: str,
        *,
        grads_like: Sequence[torch.Tensor],
        state: Callable[[], tuple[int, Sequence[torch.Tensor]]],
        settings: AveragingSettings,
        swarm_key: SwarmKey | None = None,
        progress_ttl_s: float | None = None,
        compression: str = "none",
        deciding: Callable[[dict[str, TrainingProgress]], dict[str, TrainingProgress]] | None = None,
        digest_of: Callable[[Sequence[torch.Tensor]], str] = state_digest,
    ):
        self.key, self.settings, self._deciding, self.digest_of = key, settings, deciding, digest_of
        self.progress = GroupProgress(dht, key, ttl_s=progress_ttl_s or 4 * settings.progress_period_s)
        self.peer_id = self.progress.peer_id
        # hivemind's averager sets SIGINT to be ignored in *this* process before it forks; RoundAverager puts it back
        self.averager = RoundAverager(
            [torch.zeros(t.shape, dtype=torch.float64) for t in grads_like],
            dht,
            prefix=key.replace(".", "_") + "_rounds",
            settings=RoundSettings(sender_timeout_s=max(settings.matchmaking_time_s, 5.0), compression=compression),
            state=state,
            private=swarm_key is not None,
            progress_key=progress_key(key),
        )
        self._stop = threading.Event()

    def average(
        self, tensors: Sequence[torch.Tensor], *, round_id: bytes, members: Sequence[str], timeout_s: float
    ) -> RoundResult:
        """A round among exactly `members` (blocking); float64 in and out, so that no float32 sum rounds a gradient
        before the average, and every member gets the same bytes (swarm/training/allreduce.py)."""
        return self.averager.average(
            [t.to(torch.float64) for t in tensors], round_id=round_id, members=members, timeout_s=timeout_s
        )

    def abandon(self, round_id: bytes) -> None:
        """End round `round_id` at once, as incomplete: a later attempt replaced it (RoundAverager.abandon)."""
        self.averager.abandon(round_id)

    def publish(self, progress: TrainingProgress):
        """Store our record; returns the store's future at once (it completes in the background)."""
        return self.progress.publish(progress)

    def members(self) -> dict[str, TrainingProgress]:
        """Peer id -> verified progress of every member heard from lately (this one too, once its record is in)."""
        return self.progress.members()

    def voters(self) -> dict[str, TrainingProgress]:
        """The records of `members()` this member decides by (`deciding`)."""
        members = self.members()
        return members if self._deciding is None else self._deciding(members)

    def majority(self) -> tuple[int, str] | None:
        """The (epoch, state digest) a strict majority of the other members' `voters()` announce, or None."""
        return majority_claim({pid: p for pid, p in self.voters().items() if pid != self.peer_id})

    def load_state(
        self, like: Sequence[torch.Tensor], members: Callable[[], dict[str, TrainingProgress]] | None = None
    ) -> VerifiedState:
        """The state a majority vouches for, downloaded and checked (blocking, bounded by the load-state timeout).

        `members`: reads the records that may vote (default: `voters()`).

        Raises:
            StateDownloadError: none within the timeout.
        """
        return load_verified_state(
            self.averager,
            members or self.voters,
            like=like,
            timeout_s=self.settings.load_state_timeout_s,
            digest_of=self.digest_of,
        )

    def serve_state(self, serve: bool = True) -> None:
        self.averager.serve_state(serve)

    def shutdown(self) -> None:
        """Leave the group (the others stop counting this member at once), then stop the averager."""
        self._stop.set()
        self.progress.leave()
        self.averager.shutdown()


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, to compare parameters across processes."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def group_key(prefix: str, run_id: str, part: str) -> str:
    """DHT key of a training group: the model, the run, and the blocks ("0-4") or "trainers"."""
    return f"{prefix}.train.{run_id}.{part}"


def trainers_key(prefix: str, run_id: str) -> str:
    """DHT key of a run's group of trainers."""
    return group_key(prefix, run_id, "trainers")


def has_nonfinite(tensors: Sequence[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
