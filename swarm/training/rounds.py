"""Averaging rounds among a known group: the members come from the trainer's commit, so there is no matchmaking.

Every member of a round is told the same round id and the same member list. The group id is derived from the round
id, members are ordered by peer id, and every member gets the same share of the tensors to reduce (equal bandwidths,
so hivemind's load balancing gives the same fractions everywhere); then hivemind's butterfly all-reduce runs among
exactly those members. Weights are uniform, and receivers enforce it: whatever weight a sender puts on its parts, it
counts as 1, so no member can weigh itself up. Callers scale their tensors before a round (a stage's gradient sums
over the micro-batches the commit gave it, say) instead.

A round is complete only when, in this member's view, every member sent every part it owed this member's reducer
and every reducer sent back every averaged part. hivemind otherwise carries on quietly: a sender that stops is left
out of the parts it had not sent, and a reducer that fails leaves its parts at this member's own values. Such a
round reports what was missing instead of tensors. Only listed members may send parts; a listed member is trusted
to reduce its own share honestly (a Byzantine reducer is out of scope: members compare digests of the result).

The averager process also serves this member's state to joiners that ask for it (swarm/training/state.py verifies
what it downloads); in a private swarm, only to peers whose signed progress is in the group's record.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# typing's, not collections.abc's: hivemind tells streaming RPCs by the `_name` that only typing's alias has
from typing import AsyncIterator  # noqa: UP035

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.compression import NoCompression, ScaledFloat16Compression, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, aiter_with_timeout, anext, as_aiter, enter_asynchronously
from hivemind.utils.streaming import combine_from_streaming

from swarm.training.allreduce import RoundRunner, round_group_id
from swarm.training.codec import Int8Compression
from swarm.training.members import OwnerCache, verified_progress
from swarm.training.process import bounded_call, exit_with_parent

logger = logging.getLogger(__name__)

# the codecs by our names (hivemind's 8-bit ones, UNIFORM_8BIT and QUANTILE_8BIT, fail to decode with numpy 2);
# a member's averager process gets its own copy of each, so that int8's error feedback is that member's
COMPRESSIONS = {"none": NoCompression(), "float16": ScaledFloat16Compression(), "int8": Int8Compression()}


@dataclass(frozen=True, kw_only=True)
class RoundSettings:
    """How a member's rounds wait on the others. The sender timeout also bounds how far apart members may enter a
    round: a part that arrives before this member entered waits that long for it."""

    sender_timeout_s: float = 10.0
    """A member silent this long (at the start, or between parts) is left out, and the round is incomplete."""
    part_size_bytes: int = 1 << 19
    """Tensors cross in parts of up to this many bytes."""
    start_timeout_s: float = 60.0
    """How long the averager process may take to start."""
    compression: str = "none"
    """How parts travel: "none" (float64, exact), "float16" (each part scaled by its mean and deviation, a
    quarter of the bytes) or "int8" (blocks of 64 values with a scale each, an eighth of the bytes, with error
    feedback: swarm/training/codec.py); compressed or not, every member ends with identical tensors
    (swarm/training/allreduce.py)."""

    def __post_init__(self) -> None:
        for name in ("sender_timeout_s", "part_size_bytes", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {self.compression!r}")


@dataclass(frozen=True, kw_only=True)
class RoundResult:
    """How a round went for this member."""

    complete: bool
    """Every member sent every part and every reducer answered, in this member's view (others may see a fault)."""
    tensors: list[torch.Tensor] | None
    """The averaged tensors, when complete (else None: partial averages are never handed out)."""
    seconds: float
    """From entering the round to its end."""
    members: tuple[str, ...]
    """The round's members, in their order."""
    reason: str = ""
    """Why it is not complete."""
    sent_bytes: int = 0
    """Bytes of the parts this member sent to the others' reducers (their answers are as large; 0 alone)."""


class RoundAverager(DecentralizedAverager):
    """A member's averager process: rounds among known groups (`average`) and its state for joiners.

    `tensors` fixes the schema (shapes, dtypes) of what every round averages. `state` returns this member's state for
    joiners, (epoch, tensors): a consistent copy (it is called from a background thread while training goes on) whose
    state_digest is the param_digest this member announces; it is served once `serve_state()` is called. `private`:
    in a private swarm, the state goes only to peers with signed progress under `progress_key`.

    Every member must run this very class: hivemind names a call's handler after the servicer's class, so a subclass
    would speak another protocol.
    """

    _runner_type = RoundRunner

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        *,
        prefix: str,
        settings: RoundSettings,
        state: Callable[[], tuple[int, Sequence[torch.Tensor]]] | None = None,
        private: bool = False,
        progress_key: str = "",
        start: bool = True,
    ):
        if dht.client_mode:
            raise ValueError("a training group member needs a DHT node that accepts connections (client_mode=False)")
        if private and not progress_key:
            raise ValueError("a private swarm's averager needs the group's progress_key, to know who may download")
        self.settings, self._state, self._private, self._progress_key = settings, state, private, progress_key
        self._round_lock, self._stop = threading.Lock(), threading.Event()
        self._send_lock = threading.Lock()  # the control pipe takes one message at a time, from any thread
        self._abandoned: collections.deque[bytes] = collections.deque(maxlen=64)  # rounds a later attempt replaced
        self._round_tasks: dict[bytes, asyncio.Task] = {}  # in the averager's process: the rounds under way
        self._owners = OwnerCache()
        self._rounds_changed: asyncio.Event | None = None  # created in the averager's process
        self._schema = [(t.shape, t.dtype) for t in tensors]
        super().__init__(
            [t.detach().cpu().clone() for t in tensors],
            dht,
            start=False,
            prefix=prefix,
            allow_state_sharing=False,
            compression=COMPRESSIONS[settings.compression],
            part_size_bytes=settings.part_size_bytes,
            sender_timeout=settings.sender_timeout_s,
            reducer_timeout=2 * settings.sender_timeout_s,  # hivemind: must exceed the sender timeout
            shutdown_timeout=2,
        )
        if start:
            try:
                self.run_in_background(await_ready=True, timeout=settings.start_timeout_s)
            except BaseException:
                self.shutdown()
                raise

    @property
    def member_id(self) -> str:
        return self.peer_id.to_base58()

    # --- the host's side ---

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        handler = signal.getsignal(signal.SIGINT)  # hivemind ignores SIGINT in *this* process before it forks
        try:
            super().run_in_background(await_ready=await_ready, timeout=timeout)
        finally:
            if threading.current_thread() is threading.main_thread() and handler is not None:
                signal.signal(signal.SIGINT, handler)

    def average(
        self, tensors: Sequence[torch.Tensor], *, round_id: bytes, members: Sequence[str], timeout_s: float
    ) -> RoundResult:
        """Average `tensors` with exactly `members` (base58 peer ids, this one included), blocking.

        Every member must call this with the same `round_id` and members within `settings.sender_timeout_s` of each
        other; take a fresh round id for each attempt, so that late parts of a failed one cannot join the next.
        Weights are uniform: scale the tensors beforehand. Alone, this member gets its own tensors at once.

        Raises:
            ValueError: this member is not listed, or the tensors do not have the averager's shapes and dtypes.
        """
        ordered = tuple(sorted(set(members)))
        if self.member_id not in ordered:
            raise ValueError(f"round members {list(ordered)} do not include this member {self.member_id}")
        if not isinstance(round_id, bytes) or not 0 < len(round_id) <= 256:
            raise ValueError(f"round_id must be 1-256 bytes, got {round_id!r:.80}")
        if [(t.shape, t.dtype) for t in tensors] != self._schema:
            raise ValueError(f"round tensors {[(t.shape, t.dtype) for t in tensors]} are not {self._schema}")
        if len(ordered) == 1:
            return RoundResult(complete=True, tensors=list(tensors), seconds=0.0, members=ordered)
        if not self.is_alive():  # a process killed mid-round may hold the shared tensors' lock for good
            return RoundResult(complete=False, tensors=None, seconds=0.0, members=ordered, reason="averager is gone")
        began = time.perf_counter()
        with self._round_lock:  # the shared tensors hold one round at a time
            if round_id in self._abandoned:  # replaced while it waited for the round before it
                return RoundResult(
                    complete=False, tensors=None, seconds=0.0, members=ordered, reason="abandoned for a later attempt"
                )
            with self.get_tensors() as shared:
                for dst, src in zip(shared, tensors):
                    dst.copy_(src)
            future = MPFuture()
            round_kwargs = dict(round_id=round_id, members=ordered, timeout_s=timeout_s, future=future)
            with self._send_lock:
                self._outer_pipe.send(("_run_round", [], round_kwargs))
            try:
                problems, sent = bounded_call(
                    future.result, self, timeout_s + 10, self._stop, f"round {round_id.hex()}"
                )
            except Exception as exc:
                problems, sent = [repr(exc)], 0
            averaged = None
            if not problems:
                with self.get_tensors() as shared:
                    averaged = [t.clone() for t in shared]
        seconds = time.perf_counter() - began
        if problems:
            logger.warning("averaging round %s of %s incomplete: %s", round_id.hex(), self.prefix, "; ".join(problems))
        return RoundResult(
            complete=not problems,
            tensors=averaged,
            seconds=seconds,
            members=ordered,
            reason="; ".join(problems),
            sent_bytes=sent,
        )

    def abandon(self, round_id: bytes) -> None:
        """End round `round_id` at once, as incomplete, if it is under way or waiting for its turn: a later attempt
        replaced it (one round runs at a time, so a failed one would hold the next until its timeout, and members one
        attempt apart would never meet)."""
        self._abandoned.append(round_id)
        if self.is_alive():
            with self._send_lock:
                self._outer_pipe.send(("_abandon_round", [round_id], {}))

    def serve_state(self, serve: bool = True) -> None:
        """Let joiners download this member's state (or stop)."""
        self.allow_state_sharing = serve

    def download_state(self, peer_id: str, *, timeout_s: float, max_bytes: int) -> list[torch.Tensor]:
        """The state tensors that member `peer_id` sends (unverified: see swarm/training/state.py).

        Raises:
            RuntimeError: it sent nothing (it does not serve its state, or refused us), or more than `max_bytes`.
            TimeoutError: not done within `timeout_s`.
        """
        future = MPFuture()
        kwargs = dict(peer_id=peer_id, timeout_s=timeout_s, max_bytes=max_bytes, future=future)
        self._outer_pipe.send(("_download_state", [], kwargs))
        return bounded_call(future.result, self, timeout_s + 10, self._stop, f"downloading the state of {peer_id}")

    def get_current_state(self):
        if self._state is None:
            raise RuntimeError("this member has no state to share")
        epoch, tensors = self._state()
        return {"epoch": int(epoch)}, [t.detach().cpu() for t in tensors], None

    def shutdown(self) -> None:
        """Stop the process (idempotent); a round under way in another thread ends as incomplete."""
        self._stop.set()
        if self.is_alive():
            try:
                super().shutdown()
            except Exception as exc:
                logger.debug("averager shutdown failed: %r", exc)
        if self.is_alive():
            self.kill()
            self.join(5)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler the starter's event loop installed
        # hivemind's float16 codec wraps the message's read-only bytes in tensors it only reads (its statistics)
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        threading.Thread(target=exit_with_parent, args=(self._parent_pid,), daemon=True).start()
        super().run()

    # --- in the averager's process ---

    async def _run_round(self, *, round_id: bytes, members: tuple[str, ...], timeout_s: float, future: MPFuture):
        self._round_tasks[round_id] = asyncio.current_task()
        try:
            future.set_result(await self._round(round_id, members, timeout_s))
        except asyncio.CancelledError:
            if not future.done():
                future.set_result((["abandoned for a later attempt"], 0))
        except BaseException as exc:
            if not future.done():
                future.set_result(([f"the round failed: {exc!r}"], 0))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._round_tasks.pop(round_id, None)

    async def _abandon_round(self, round_id: bytes) -> None:
        task = self._round_tasks.get(round_id)
        if task is not None:
            task.cancel()

    async def _round(self, round_id: bytes, members: tuple[str, ...], timeout_s: float) -> tuple[list[str], int]:
        """(what kept the round from being complete, bytes sent)."""
        group_id = round_group_id(self.prefix, round_id)
        if group_id in self._running_groups:
            return [f"round {round_id.hex()} is already running here"], 0
        peer_ids = tuple(PeerID.from_base58(member) for member in members)
        fractions = load_balance_peers(self.total_size, [None] * len(peer_ids))  # equal shares, the same everywhere
        with self._register_allreduce_group(GroupInfo(group_id, peer_ids, gathered=())):
            registered = self._running_groups[group_id]
            try:
                return await asyncio.wait_for(self._reduce(group_id, peer_ids, fractions, registered), timeout_s)
            except asyncio.TimeoutError:
                runner = registered.result() if registered.done() and not registered.cancelled() else None
                if runner is None:
                    return [f"not done within {timeout_s:g}s"], 0
                return [f"not done within {timeout_s:g}s", *runner.problems()], runner.sent_bytes
            finally:
                if not registered.done():
                    registered.cancel()

    async def _reduce(self, group_id: bytes, peer_ids, fractions, registered: asyncio.Future) -> tuple[list[str], int]:
        async with enter_asynchronously(self.get_tensors()) as local:
            runner = self._runner_type(
                p2p=self._p2p,
                servicer_type=type(self),
                prefix=self.prefix,
                group_id=group_id,
                tensors=local,
                ordered_peer_ids=peer_ids,
                peer_fractions=fractions,
                modes=(AveragingMode.NODE,) * len(peer_ids),
                weight=1.0,
                **{k: v for k, v in self.allreduce_kwargs.items() if k != "min_vector_size"},  # not the runner's
            )
            registered.set_result(runner)
            self._round_registered().set()
            outputs = runner.run()
            index = 0
            try:
                async for output in outputs:  # each tensor's average, as its reducer answered it
                    local[index].copy_(output)
                    index += 1
            except Exception as exc:
                self._settle_feedback(complete=False)
                return [*runner.problems(), f"the all-reduce failed: {exc!r}"], runner.sent_bytes
            finally:
                await outputs.aclose()  # on a timeout too: stops its tasks, which hold the shared tensors
            problems = runner.problems()
            self._settle_feedback(complete=not problems)
            return problems, runner.sent_bytes

    def _settle_feedback(self, complete: bool) -> None:
        """int8's error feedback keeps what a complete round's parts lost, and forgets a failed round's."""
        codec = self.allreduce_kwargs["compression"]
        if not isinstance(codec, Int8Compression):
            return
        if complete:
            codec.commit()
        else:
            codec.discard()

    def _round_registered(self) -> asyncio.Event:
        if self._rounds_changed is None:
            self._rounds_changed = asyncio.Event()
        return self._rounds_changed

    async def _runner_for(self, group_id: bytes) -> RoundRunner | None:
        """The runner of a round this member runs, waiting up to the sender timeout for it to begin here."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.sender_timeout_s
        while group_id not in self._running_groups:
            event = self._round_registered()
            event.clear()
            if loop.time() >= deadline:
                return None
            try:
                await asyncio.wait_for(event.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return None
        registered = self._running_groups[group_id]
        await asyncio.wait({registered}, timeout=max(0.0, deadline - loop.time()))
        return registered.result() if registered.done() and not registered.cancelled() else None

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        request = await anext(stream)
        runner = await self._runner_for(request.group_id)
        if runner is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in runner.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        logger.debug("refused a join request of %s: rounds of %s have known members", context.remote_id, self.prefix)
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self._private and not await self._published_progress(context.remote_id.to_base58()):
            logger.warning(
                "refused to send the state of %s to %s: no signed progress in the group", self.prefix, context.remote_id
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

    async def _declare_for_download_periodically(self):
        """Not declared: joiners choose donors from the group's signed progress (swarm/training/state.py)."""

    async def _download_state(self, *, peer_id: str, timeout_s: float, max_bytes: int, future: MPFuture):
        try:
            future.set_result(await asyncio.wait_for(self._fetch_state(peer_id, max_bytes), timeout_s))
        except BaseException as exc:
            if not future.done():
                future.set_exception(
                    TimeoutError(f"no state within {timeout_s:g}s")
                    if isinstance(exc, asyncio.TimeoutError)
                    else RuntimeError(str(exc) or repr(exc))
                )
            if not isinstance(exc, Exception):
                raise

    async def _fetch_state(self, peer_id: str, max_bytes: int) -> list[torch.Tensor]:
        stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        tensors, parts, received = [], [], 0
        async for message in aiter_with_timeout(stream, self.settings.sender_timeout_s):
            received += len(message.tensor_part.buffer) + len(message.metadata)
            if received > max_bytes:
                raise RuntimeError(f"{peer_id} sent more than the {max_bytes} bytes a state of ours takes")
            if message.tensor_part.dtype and parts:  # the first part of the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not tensors:
            raise RuntimeError(f"{peer_id} sent no state (it does not share it, or refused us)")
        return tensors
