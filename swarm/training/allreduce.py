"""hivemind's butterfly all-reduce among a fixed group of members, as rounds.py runs it.

Changes to hivemind's runner, by subclassing: every sender's parts weigh 1 whatever weight it sends (callers
scale their tensors instead, so no member can weigh itself up); parts are summed in their own dtype (hivemind's
reducer sums in float32, which would round float64 gradients); the runner records which senders did not
contribute fully and which reducers did not answer, which hivemind only logs, so that a partial round is seen; and
it counts the bytes of the parts it sends.

With a lossy compression (`compressed`), hivemind would hand each member its own value plus the compressed
difference from the average, a different rounding on every member, and members compare digests of the result.
So a reducer answers the compressed average itself, the same bytes to every sender, and keeps for its own part
what those bytes decode to: every member ends with identical tensors.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence

# typing's, not collections.abc's: hivemind tells streaming RPCs by the `_name` that only typing's alias has
from typing import AsyncIterator  # noqa: UP035

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

logger = logging.getLogger(__name__)


def round_group_id(prefix: str, round_id: bytes) -> bytes:
    """hivemind's group id of a round: the same for every member, distinct per group and round."""
    return hashlib.sha256(b"swarmlm-round\0" + prefix.encode() + b"\0" + round_id).digest()[:20]


class _Reducer(TensorPartReducer):
    """hivemind's reducer, summing each part in its own dtype: its accumulators are float32 whatever the tensors."""

    def __init__(self, part_shapes, num_senders: int, part_dtypes: Sequence[torch.dtype]):
        self.part_dtypes = tuple(part_dtypes)
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        if not self.finished.is_set():
            shape = self.part_shapes[self.current_part_index]
            self.accumulator = torch.zeros(shape, dtype=self.part_dtypes[self.current_part_index])

    def missing_senders(self) -> list[int]:
        """Senders that did not contribute every part (never started, stopped, or were banned midway)."""
        return [
            index
            for index in range(self.num_senders)
            if min(self.num_parts_received[index], self.sender_failed_after[index]) < self.num_parts
        ]


class RoundRunner(AllReduceRunner):
    """hivemind's all-reduce among a fixed group, with uniform weights and a record of what failed."""

    def __init__(self, *, compressed: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.compressed = compressed  # answer averages, not differences (see the module's docstring)
        # of the parts this member sent to the others' reducers (their answers are as large; a reducer may still be
        # answering when its own outputs are complete, so what it answers is not counted here)
        self.sent_bytes = 0
        parts = self.parts_for_local_averaging
        self.tensor_part_reducer.num_senders = 0  # (so that it does not log, unused, that it received nothing)
        self.tensor_part_reducer.finalize()  # replaced by one that sums float64 parts in float64
        self.tensor_part_reducer = _Reducer(
            tuple(part.shape for part in parts), len(self.sender_peer_ids), [part.dtype for part in parts]
        )
        self.failed_reducers: set[PeerID] = set()

    async def _communicate_with_peer(self, peer_id: PeerID):
        try:
            if self.compressed and peer_id == self.peer_id:
                await self._reduce_own_parts()
            else:
                await super()._communicate_with_peer(peer_id)
        except BaseException:
            self.failed_reducers.add(peer_id)
            raise

    async def _reduce_own_parts(self) -> None:
        """This member's share as its own reducer, keeping what its answer to the others decodes to."""
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part, weight=1.0)
            decoded = deserialize_torch_tensor(self._encode(averaged))
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)

    def _encode(self, tensor: torch.Tensor):
        return self.tensor_part_container.compression.compress(tensor, CompressionInfo.from_tensor(tensor))

    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            self.sent_bytes += len(message.tensor_part.buffer)
            yield message

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        if not self.compressed:
            async for message in super()._accumulate_parts_streaming(stream, sender_index):
                yield message
            return
        # hivemind's, answering the average itself (the same bytes for every sender), not its difference
        part_index = 0
        try:
            async for tensor_part in amap_in_executor(
                lambda msg: deserialize_torch_tensor(msg.tensor_part),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=1.0
                    )
                    part_index += 1
                except BannedException:
                    break  # the sender was banned: nothing more is owed to it
                answer = await asyncio.get_running_loop().run_in_executor(None, self._encode, averaged)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=answer)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if context.remote_id not in self.sender_peer_ids:  # hivemind would fail on an unknown sender mid-call
            logger.warning("refused parts of %s: not a member of round %s", context.remote_id, self.group_id.hex())
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(_weighing_one(stream), context):
            yield message

    def problems(self) -> list[str]:
        """What kept the round from being complete, in this member's view (empty: it was)."""
        found = []
        missing = [self.sender_peer_ids[i] for i in self.tensor_part_reducer.missing_senders()]
        if missing:
            found.append(f"no full contribution from {_names(missing)}")
        if self.failed_reducers:
            found.append(f"no averaged parts from {_names(self.failed_reducers)}")
        elif self.tensor_part_container.failed_size:
            found.append(f"{self.tensor_part_container.failed_size} values were not averaged")
        return found


async def _weighing_one(stream: AsyncIterator[averaging_pb2.AveragingData]):
    async for message in stream:
        message.weight = 1.0
        yield message


def _names(peer_ids) -> str:
    return ", ".join(sorted(peer.to_base58() for peer in peer_ids))
