"""Training groups: processes that train the same tensors and update them together, on hivemind's averaging.

The peers that serve the same blocks in one run form a group, and so do the trainers of a run (for the
embeddings and head). Each member accumulates gradients, weighted by samples, and publishes its progress
(epoch, samples) in the DHT every fraction of a second. Once the group holds its target batch, every member
at that epoch enters one hivemind all-reduce of gradients, parameters and optimizer statistics, weighted by
samples, and applies the same update. Averaging the parameters and statistics too (not only gradients)
costs traffic, but heals any divergence in one round: after a failed round, a member that joined with stale
weights (weight 0 when it brought no samples), or rounding. A member alone skips the all-reduce.

A joining member copies the state of a member (`load_state`), bounded in time: hivemind's own retry loop
around this never gives up when nobody answers.

Progress records are signed (swarm/training/members.py). The protocol that replaces this one: rounds among the
members a trainer's commit names (rounds.py) and state copied only when a majority vouches for it (state.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

# typing's, not collections.abc's: hivemind tells streaming RPCs by the `_name` that only typing's alias has
from typing import AsyncIterator  # noqa: UP035

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from protocol.errors import StateDownloadError
from protocol.records import TrainingProgress
from swarm.training.members import GroupProgress, OwnerCache, progress_key, verified_progress
from swarm.training.optim import set_step_count, state_tensors
from swarm.training.process import bounded_call, exit_with_parent
from swarm.training.settings import AveragingSettings
from swarm.trust.groupgate import TAG_FIELD, GroupGate
from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)


class _Averager(DecentralizedAverager):
    """hivemind's averager process, serving this member's state to joiners and stopping when its parent dies.

    With a `gate` (a private swarm), only members of the swarm may join its rounds or download its state
    (swarm/trust/groupgate.py); `progress_key` is the DHT record of the members' signed progress.
    """

    def __init__(self, tensors, dht, *, state: Callable, gate: GroupGate | None, progress_key: str, **kwargs):
        self._state, self._starter_pid = state, os.getpid()
        self._gate, self._progress_key, self._owners = gate, progress_key, OwnerCache()
        super().__init__(tensors, dht, start=False, **kwargs)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._gate is not None and not self._gate.admits(request.gather, context.remote_id.to_bytes()):
            logger.warning(
                "refused a join request of %s to %s: no valid swarm member tag", context.remote_id, self.prefix
            )
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self._gate is not None and not await self._published_progress(context.remote_id.to_base58()):
            logger.warning(
                "refused to send the state of %s to %s: not a member of the group", self.prefix, context.remote_id
            )
            return
        async for part in super().rpc_download_state(request, context):
            yield part

    async def _published_progress(self, peer_id: str) -> bool:
        try:
            found = await asyncio.wait_for(self.dht.get(self._progress_key, latest=True, return_future=True), 10)
        except Exception as exc:
            logger.debug("reading the members of %s failed: %r", self.prefix, exc)
            return False
        return found is not None and peer_id in verified_progress(found.value, self._owners)

    def get_current_state(self):
        return self._state()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler the starter's event loop installed
        threading.Thread(target=exit_with_parent, args=(self._starter_pid,), daemon=True).start()
        super().run()


class TrainingGroup:
    """This process's membership in the group `key`: accumulate, publish progress, average and update.

    `accumulate` and `take`/`apply` touch the live tensors and must run where the caller's computations run
    (a peer's compute thread); `average` blocks and runs anywhere.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        key: str,
        params: Sequence[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        settings: AveragingSettings,
        progress_ttl_s: float | None = None,
        swarm_key: SwarmKey | None = None,
    ):
        """`progress_ttl_s`: how long our published progress stays valid without renewal; by default 4 publish
        periods, so that a member that died soon stops counting towards the group's batch. A group that does not
        count samples (the trainers) can keep records longer, which survives DHT stores that lag under load.
        `swarm_key`: a private swarm's key, which gates the group's averaging RPCs (swarm/trust/groupgate.py)."""
        self.dht, self.key, self.settings = dht, key, settings
        self._gate = GroupGate(swarm_key) if swarm_key is not None else None
        self.progress_ttl_s = progress_ttl_s or 4 * settings.progress_period_s
        self._progress = GroupProgress(dht, key, ttl_s=self.progress_ttl_s)
        self.params, self.optimizer = list(params), optimizer
        self.peer_id = dht.peer_id.to_base58()
        self.epoch, self.samples = 0, 0
        self.closing = False  # between take() and apply(): gradients for this epoch come too late
        self._taken = 0  # samples of this epoch taken for the update under way (still announced)
        self.grads = [torch.zeros_like(p) for p in self.params]  # sums of gradient x samples
        self.failed_rounds = 0
        self.last_round_s: float | None = None  # how long the latest successful all-reduce took
        self._lock = threading.Lock()  # accumulate/take versus a joiner reading our state
        self._stop = threading.Event()
        live = self._live_tensors()
        # gradients cross the all-reduce in float64: hivemind hands each member its own value plus the averaged
        # difference, and in float32 that sum rounds to the ulp of the member's own gradient, which differs per
        # member; Adam divides by |g| + eps and so magnified it into whole 1e-5s between members. In float64 every
        # member rounds back to the same float32 average, and the group stays bit-identical.
        shared = [
            *(torch.zeros_like(g, device="cpu", dtype=torch.float64) for g in self.grads),
            *(torch.zeros_like(t, device="cpu") for t in live),
        ]
        # hivemind's averager sets SIGINT to be ignored in *this* process before it forks; put ours back
        handler = signal.getsignal(signal.SIGINT)
        self.averager = _Averager(
            shared,
            dht,
            state=self._state,
            gate=self._gate,
            progress_key=progress_key(key),
            prefix=key.replace(".", "_") + "_avg",
            min_group_size=2,
            min_matchmaking_time=settings.matchmaking_time_s,
            allreduce_timeout=settings.averaging_timeout_s,
            # hivemind: a request timeout above the matchmaking time can deadlock matchmaking
            request_timeout=max(0.5, min(3.0, settings.matchmaking_time_s / 2)),
            allow_state_sharing=False,
            declare_state_period=max(5.0, settings.progress_period_s * 10),
            shutdown_timeout=2,
        )
        try:
            self.averager.run_in_background(await_ready=True, timeout=60)
        finally:
            if threading.current_thread() is threading.main_thread() and handler is not None:
                signal.signal(signal.SIGINT, handler)
        # published from a thread of its own, so that a long update does not let our record lapse
        self._publisher = threading.Thread(target=self._publish_forever, name="training-progress", daemon=True)
        self._publisher.start()
        self.publish()  # now: in a private swarm, members send their state only to peers that published

    def _live_tensors(self) -> list[torch.Tensor]:
        return [*(p.data for p in self.params), *state_tensors(self.optimizer)]

    # --- accumulating ---

    def accumulate(self, grads: Sequence[torch.Tensor], samples: int) -> None:
        """Add the gradients of a mean loss over `samples` samples."""
        with self._lock:
            for acc, grad in zip(self.grads, grads):
                acc.add_(grad.to(acc.dtype), alpha=samples)
            self.samples += samples

    def discard(self) -> None:
        with self._lock:
            for acc in self.grads:
                acc.zero_()
            self.samples = 0

    # --- progress ---

    def _publish_forever(self) -> None:
        while not self._stop.wait(self.settings.progress_period_s):
            try:
                self.publish()
            except Exception as exc:  # the DHT may be briefly unreachable
                logger.debug("publishing progress failed: %r", exc)

    def publish(self) -> None:
        """Tell the group our epoch and samples, signed (returns at once; the store completes in the background)."""
        self._progress.publish(TrainingProgress(epoch=self.epoch, samples=self.samples + self._taken))

    def progress(self) -> dict[str, TrainingProgress]:
        """Peer id -> progress of every member heard from lately (verified records only), ourselves included (as we
        are now)."""
        members = self._progress.members()
        members[self.peer_id] = TrainingProgress(epoch=self.epoch, samples=self.samples + self._taken)
        return members

    def expected_members(self) -> int:
        """How many members (ourselves included) to expect in this epoch's round: those whose progress is at this
        epoch or, a publish behind under load, at the one before. One that does not come costs the round's
        timeout, after which this member updates alone."""
        return sum(1 for p in self.progress().values() if p.epoch >= self.epoch - 1)

    # --- one update ---

    def take(self) -> tuple[list[torch.Tensor], int]:
        """The mean gradients accumulated so far and their sample count; accumulation starts afresh."""
        with self._lock:
            samples = self.samples
            grads = [acc / max(samples, 1) for acc in self.grads]
            for acc in self.grads:
                acc.zero_()
            self.samples = 0
            self.closing, self._taken = True, samples
        return grads, samples

    def average(self, grads: list[torch.Tensor], samples: int, members: int) -> tuple[list, list | None, int]:
        """Average with the group (blocking): returns (gradients, parameters and statistics or None, new epoch).

        Alone (members == 1), or when the round fails, this member's own gradients are used and its own
        parameters kept; a failed round is logged and the next one makes the group identical again.
        """
        if members <= 1:
            return grads, None, self.epoch + 1
        n = len(grads)
        with self.averager.get_tensors() as shared:
            for dst, src in zip(shared, [*grads, *self._live_tensors()]):
                dst.copy_(src, non_blocking=False)
        began = time.perf_counter()
        try:
            # the whole timeout to find the group: under load, members see each other's progress seconds apart
            gathered = bounded_call(
                lambda: self.averager.step(
                    weight=float(samples), gather=self._gather(), timeout=self.settings.averaging_timeout_s
                ),
                self.averager,
                self.settings.averaging_timeout_s + 10,
                self._stop,
                f"averaging round of {self.key}",
            )
        except Exception as exc:
            self.failed_rounds += 1
            logger.warning(
                "averaging with the group %s failed (%r); updating with this member's own gradients", self.key, exc
            )
            return grads, None, self.epoch + 1
        self.last_round_s = time.perf_counter() - began
        epochs = [g.get("epoch", 0) for g in gathered.values() if isinstance(g, dict)] or [self.epoch]
        with self.averager.get_tensors() as shared:
            averaged = [t.clone() for t in shared]
        logger.info("averaged with %d members of %s in %.2fs", len(gathered), self.key, self.last_round_s)
        grads = [g.to(p.dtype) for g, p in zip(averaged[:n], self.params)]
        return grads, averaged[n:], max(epochs) + 1

    def _gather(self) -> dict:
        gather = {"epoch": self.epoch}
        if self._gate is not None:
            gather[TAG_FIELD] = self._gate.tag(self.dht.peer_id.to_bytes())
        return gather

    def apply(self, grads: list[torch.Tensor] | None, state: list[torch.Tensor] | None, epoch: int) -> None:
        """Take the averaged parameters and statistics (if any), then update with `grads` (None: no update)."""
        with self._lock, torch.no_grad():
            if state is not None:
                for live, value in zip(self._live_tensors(), state):
                    live.copy_(value)
            if grads is not None:
                for p, g in zip(self.params, grads):
                    p.grad = g.to(device=p.device, dtype=p.dtype)
                set_step_count(self.optimizer, self.epoch)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.epoch, self.closing, self._taken = epoch, False, 0
            set_step_count(self.optimizer, epoch)
        self.averager.state_sharing_priority = float(epoch)

    # --- joining ---

    def _state(self):
        with self._lock:
            return {"epoch": self.epoch}, [t.detach().cpu().clone() for t in self._live_tensors()], None

    def share_state(self) -> None:
        """Let joining members copy our state (once ours is the group's)."""
        self.averager.allow_state_sharing = True
        self.averager.state_sharing_priority = float(self.epoch)

    def load_state(self) -> int:
        """Copy a member's parameters, statistics and epoch; returns the epoch.

        Raises StateDownloadError when no member answered within the load-state timeout.
        """
        deadline = time.monotonic() + self.settings.load_state_timeout_s
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            try:
                loaded = self.averager.load_state_from_peers(wait=True, timeout=max(1.0, min(left, 30.0)))
            except Exception as exc:  # a timeout, or a donor that vanished mid-download
                logger.warning("downloading the group's state failed: %r", exc)
                loaded = None
            if loaded is not None:
                metadata, tensors = loaded
                live = self._live_tensors()
                if len(tensors) == len(live) and all(t.shape == v.shape for t, v in zip(tensors, live)):
                    epoch = int(metadata.get("epoch", 0)) if isinstance(metadata, dict) else 0
                    with self._lock, torch.no_grad():
                        for dst, src in zip(live, tensors):
                            dst.copy_(src)
                        self.epoch = epoch
                        set_step_count(self.optimizer, epoch)
                    for acc in self.grads:
                        acc.zero_()
                    self.samples = 0
                    logger.info("copied the state of group %s at epoch %d", self.key, epoch)
                    return epoch
                logger.warning("a member of %s sent a state of another shape; trying another", self.key)
            attempt += 1
            if time.monotonic() + 1.0 > deadline:
                raise StateDownloadError(
                    f"no member of training group {self.key} sent its state within "
                    f"{self.settings.load_state_timeout_s:g}s ({attempt} attempts); check that its peers are "
                    f"reachable, raise the load-state timeout, or start a new run with another --run-id"
                )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def shutdown(self) -> None:
        self._stop.set()
        if self.averager.is_alive():
            try:
                self.averager.shutdown()
            except Exception as exc:
                logger.debug("averager shutdown failed: %r", exc)
        if self.averager.is_alive():
            self.averager.kill()
            self.averager.join(5)


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, to compare parameters across processes."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def group_key(prefix: str, run_id: str, part: str) -> str:
    """DHT key of a training group: the model, the run, and the blocks ("0-4") or "trainers"."""
    return f"{prefix}.train.{run_id}.{part}"


def has_nonfinite(tensors: Sequence[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
