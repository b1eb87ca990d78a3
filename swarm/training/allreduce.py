"""hivemind's butterfly all-reduce among a fixed group of members, as rounds.py runs it.

Changes to hivemind's runner, by subclassing: every sender's parts weigh 1 whatever weight it sends (callers
scale their tensors instead, so no member can weigh itself up); parts are summed in their own dtype (hivemind's
reducer sums in float32, which would round float64 gradients); the runner records which senders did not
contribute fully and which reducers did not answer, which hivemind only logs, so that a partial round is seen; and
it counts the bytes of the parts it sends.

hivemind hands each member its own value plus the (compressed) difference from the average: a different rounding
on every member, even uncompressed in float64 (a mean over three members has every bit of the mantissa), and
members compare digests of the result. So a reducer answers the average itself, the same bytes to every sender,
and keeps for its own part what those bytes decode to: every member ends with identical tensors. Compressed parts
are decoded by the round's own codec, not by the one their message names (hivemind's registry, which has no codec
for int8 parts: swarm/training/codec.py).
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
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

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

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
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
        self._answers: dict[int, asyncio.Future] = {}  # part index -> its encoded average, the same for every sender

    async def _communicate_with_peer(self, peer_id: PeerID):
        try:
            if peer_id == self.peer_id:
                await self._reduce_own_parts()
            else:
                await self._exchange_parts(peer_id)
        except BaseException:
            self.failed_reducers.add(peer_id)
            raise

    async def _exchange_parts(self, peer_id: PeerID) -> None:
        """hivemind's exchange with another member's reducer: our parts to it, its averages back, decoded by our codec."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def decode(message):
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                return self._decode(message.tensor_part)

            part_index = 0
            async for averaged in amap_in_executor(
                decode,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != self.tensor_part_container.num_parts_by_peer[peer_index]:
                raise AllreduceException(f"{peer_id} answered {part_index} parts, not the parts it was sent")
        except BaseException:
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _reduce_own_parts(self) -> None:
        """This member's share as its own reducer, keeping what its answer to the others decodes to."""
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part, weight=1.0)
            decoded = self._decode(await self._answer(part_index, averaged))
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)

    async def _answer(self, part_index: int, averaged: torch.Tensor):
        """The average of a part of ours as sent, encoded once: every sender gets the same bytes, and a codec with
        error feedback (int8) sees each average once. Its part is known by the group and its index in our share."""
        if part_index not in self._answers:
            info = CompressionInfo.from_tensor(averaged, key=("average", self.ordered_peer_ids)).get_part(part_index, 0)
            self._answers[part_index] = asyncio.get_running_loop().run_in_executor(
                None, self.tensor_part_container.compression.compress, averaged, info
            )
        return await asyncio.shield(self._answers[part_index])

    def _decode(self, serialized) -> torch.Tensor:
        return self.tensor_part_container.compression.extract(serialized)

    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            self.sent_bytes += len(message.tensor_part.buffer)
            yield message

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # hivemind's, answering the average itself (the same bytes for every sender), not its difference
        part_index = 0
        try:
            async for tensor_part in amap_in_executor(
                lambda msg: self._decode(msg.tensor_part),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=1.0
                    )
                except BannedException:
                    break  # the sender was banned: nothing more is owed to it
                answer = await self._answer(part_index, averaged)
                part_index += 1
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
