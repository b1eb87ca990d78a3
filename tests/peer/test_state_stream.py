"""The State call's streams (peer/state_stream.py): one caller at a time, a piece at a time, a write timeout, and
no pieces of two updates mixed. Against real tensors, with callers that read, stall or never come back; the gRPC
path is exercised by `swarmlm export` in tests/integration/test_training.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.state_stream import MAX_WAITING, StateStreams
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import OverloadedError, TrainingFaultError
from protocol.packing import unpack

PIECE_BYTES = 4096
WEIGHTS = {
    "a.weight": torch.randn(64, 32, generator=torch.Generator().manual_seed(0)),  # 8 KiB: two pieces
    "b.bias": torch.randn(32, generator=torch.Generator().manual_seed(1)),
    "c.scale": torch.tensor(2.0),
}


async def _inline(fn):
    return fn()


def _streams(write_timeout_s: float = 5.0) -> StateStreams:
    return StateStreams(_inline, write_timeout_s, piece_bytes=PIECE_BYTES)


class Reader:
    """A caller: keeps what it was sent, or stalls on its first piece (never reads) while `stall` is set."""

    def __init__(self, stall: bool = False):
        self.parts: list[pb.StatePart] = []
        self.stall = stall

    async def write(self, packed) -> None:
        if self.stall:
            await asyncio.Event().wait()
        self.parts.append(unpack(pb.StatePart, packed.SerializeToString()))

    def weights(self) -> dict[str, torch.Tensor]:
        pieces: dict[str, list[torch.Tensor]] = {}
        for part in self.parts:
            pieces.setdefault(part.message.name, []).append(
                decode_tensor(part.message.tensor, part.message.name, part.payload)
            )
        return {name: torch.cat(p) if len(p) > 1 else p[0] for name, p in pieces.items()}


def test_a_reader_gets_every_tensor_in_pieces():
    reader = Reader()
    asyncio.run(_streams().stream(lambda: WEIGHTS, reader.write))
    got = reader.weights()
    assert set(got) == set(WEIGHTS) and all(torch.equal(got[k], WEIGHTS[k]) for k in WEIGHTS)
    assert len(reader.parts) == 4 and [p.message.last for p in reader.parts] == [False, True, True, True]


def test_thirty_callers_that_never_read_hold_one_stream_and_the_rest_are_refused():
    async def main():
        streams = _streams(write_timeout_s=0.3)
        copies = []

        def weights():  # counts how often the weights are read: once per stream that runs
            copies.append(1)
            return WEIGHTS

        stalled = [Reader(stall=True) for _ in range(30)]
        results = await asyncio.gather(*(streams.stream(weights, r.write) for r in stalled), return_exceptions=True)
        refused = [r for r in results if isinstance(r, OverloadedError)]
        timed_out = [r for r in results if isinstance(r, TimeoutError)]
        assert len(refused) == 30 - 1 - MAX_WAITING and len(timed_out) == 1 + MAX_WAITING, results
        assert "one caller at a time" in str(refused[0]) and streams.refused == len(refused)
        assert len(copies) == 1 + MAX_WAITING, "a stream read the weights without running"
        # then an honest caller gets everything
        reader = Reader()
        await streams.stream(weights, reader.write)
        assert all(torch.equal(reader.weights()[k], WEIGHTS[k]) for k in WEIGHTS)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_an_update_applied_mid_stream_ends_it():
    epoch = [3]
    reader = Reader()

    async def write(part) -> None:
        await reader.write(part)
        epoch[0] = 4  # an update lands after the first piece

    with pytest.raises(TrainingFaultError, match="update 3 to 4"):
        asyncio.run(_streams().stream(lambda: WEIGHTS, write, lambda: epoch[0]))
    assert len(reader.parts) == 1
