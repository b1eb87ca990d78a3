"""`swarmlm export` reads a peer's State stream only as far as the checkpoint's tensors go (client/training/export.py):
a peer that sends names or shapes the checkpoint does not have, or streams rows without end, is at fault, and its
reader holds no more than the span's weights. Against a real gRPC server on 127.0.0.1 that streams what it is told."""

from __future__ import annotations

import asyncio

import pytest
import torch

from client.training.export import fetch_peer_weights
from protocol import swarmlm_pb2 as pb
from protocol.errors import PeerFaultError
from protocol.packing import Packer
from tests.helpers.servicers import served

EXPECTED = {"model.layers.0.mlp.weight": (8, 4), "model.layers.0.norm.weight": (4,)}
WEIGHT = torch.arange(32.0).reshape(8, 4)
NORM = torch.ones(4)


def _part(name: str, tensor: torch.Tensor, last: bool = True):
    packer = Packer()
    return packer.pack(pb.StatePart(name=name, tensor=packer.tensor(tensor), last=last))


class Streaming:
    """A peer whose State stream is `parts()`: honest, or not."""

    def __init__(self, parts):
        self.parts, self.sent = parts, 0

    async def state(self, request, context):
        for part in self.parts():
            self.sent += 1
            await context.write(part)


def _fetch(servicer) -> dict[str, torch.Tensor]:
    async def run():
        async with served(servicer) as (endpoint, pool):
            return await fetch_peer_weights(pool, endpoint, "m", 0, 1, EXPECTED)

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_an_honest_stream_in_pieces_is_read_whole():
    honest = Streaming(
        lambda: [
            _part("model.layers.0.mlp.weight", WEIGHT[:5], last=False),
            _part("model.layers.0.mlp.weight", WEIGHT[5:]),
            _part("model.layers.0.norm.weight", NORM),
        ]
    )
    got = _fetch(honest)
    assert torch.equal(got["model.layers.0.mlp.weight"], WEIGHT) and torch.equal(
        got["model.layers.0.norm.weight"], NORM
    )


def test_a_name_the_checkpoint_lacks_is_the_peers_fault():
    with pytest.raises(PeerFaultError, match="do not have"):
        _fetch(Streaming(lambda: [_part("model.layers.0.extra", NORM)]))


def test_a_wrong_shape_is_the_peers_fault():
    with pytest.raises(PeerFaultError, match=r"the checkpoint's is \[8, 4\]"):
        _fetch(Streaming(lambda: [_part("model.layers.0.mlp.weight", torch.zeros(2, 5))]))


def test_rows_without_end_stop_at_the_tensors_size():
    def endless():
        while True:
            yield _part("model.layers.0.mlp.weight", torch.zeros(4, 4), last=False)

    peer = Streaming(endless)
    with pytest.raises(PeerFaultError, match="12 rows"):
        _fetch(peer)
    # HTTP/2 flow control lets the server run ahead of its reader by a window (hundreds of these small parts, more
    # on a busy machine); a reader that kept reading would have taken parts for the whole call, by the thousand
    assert peer.sent < 10_000, "the reader kept reading"
