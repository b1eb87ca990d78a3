"""A request's inputs are checked as declared before they are decoded (peer/served.py): a tensor over the caps, or of
the wrong dtype or shape, is refused before its bytes are read or widened (float16 on the wire to the declared
float32 or float64), so it costs the peer no memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peer.admission import WorkLimits
from peer.served import ServedSpan
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, MessageTooLargeError
from protocol.packing import Packer, unpack

HIDDEN = 8


def _served() -> ServedSpan:
    config = SimpleNamespace(hidden_size=HIDDEN, max_position_embeddings=64, num_hidden_layers=2)
    served = ServedSpan(config, "m", WorkLimits(max_request_tokens=64))
    served.span = SimpleNamespace(dtype=torch.float32, start=0, end=2)
    return served


def _declared(shape: list[int], dtype: str, compression=pb.NONE, **fields) -> tuple[pb.ForwardRequest, memoryview]:
    """A request whose hidden states declare `shape` and `dtype` but carry no bytes: decoding it would fail (or
    allocate the declared size); the checks before decoding must refuse it first."""
    tensor = pb.Tensor(shape=shape, dtype=dtype, compression=compression)
    return pb.ForwardRequest(hidden_states=tensor, **fields), memoryview(b"")


@pytest.mark.parametrize(
    "shape, dtype, compression, error, words",
    [
        ([4096, 4096, HIDDEN], "float64", pb.FLOAT16, BadRequestError, "this peer computes in torch.float32"),
        ([4096, 64, HIDDEN], "float32", pb.FLOAT16, MessageTooLargeError, "--max-request-tokens"),
        ([2, 3, HIDDEN + 1], "float32", pb.NONE, BadRequestError, "hidden size 9"),
        ([2, HIDDEN], "float32", pb.NONE, BadRequestError, "[batch, seq, hidden]"),
    ],
    ids=["widened-dtype", "over-the-caps", "hidden-size", "two-dimensions"],
)
def test_declared_inputs_are_refused_before_their_bytes_are_read(shape, dtype, compression, error, words):
    served = _served()
    try:
        message, payload = _declared(shape, dtype, compression)
        with pytest.raises(error) as caught:
            served.inputs(message, payload)
        assert words in str(caught.value) and "bytes" not in str(caught.value)
    finally:
        served.close()


def test_a_mask_of_another_shape_is_refused_before_it_is_read():
    served = _served()
    try:
        message, payload = _declared([2, 3, HIDDEN], "float32")
        message.attention_mask.CopyFrom(pb.Tensor(shape=[2, 100000], dtype="int8"))
        with pytest.raises(BadRequestError, match=r"attention_mask must have shape \[2, 3\], got \[2, 100000\]"):
            served.inputs(message, payload)
    finally:
        served.close()


def test_good_inputs_decode():
    served = _served()
    try:
        packer = Packer()
        hidden = torch.randn(2, 3, HIDDEN)
        request = packer.pack(pb.ForwardRequest(hidden_states=packer.tensor(hidden)))
        received = unpack(pb.ForwardRequest, request.SerializeToString())
        got, mask, positions = served.inputs(received.message, received.payload)
        assert torch.equal(got, hidden) and mask is None and positions is None
    finally:
        served.close()
