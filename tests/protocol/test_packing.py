"""protocol.packing: tensors in the payload are exact, aligned, read in place, and still plain protobuf."""

from __future__ import annotations

import numpy
import pytest
import torch

from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_optional, decode_tensor, encode_tensor
from protocol.errors import BadRequestError
from protocol.packing import ALIGN, INLINE_BYTES, Packer, unpack

BIG = INLINE_BYTES // 4 + 1  # float32 elements that go to the payload


def _packed(hidden: torch.Tensor, **tensors) -> bytes:
    packer = Packer()
    message = pb.InferenceRequest(step=pb.InferenceStep(
        session_id="s", hidden_states=packer.tensor(hidden), prefix_length=3,
        **{name: packer.tensor(t) for name, t in tensors.items()}))
    return packer.pack(message).SerializeToString()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_roundtrip_big_and_small_tensors(dtype):
    per_row = INLINE_BYTES // torch.empty((), dtype=dtype).element_size() // 2 + 3
    big = (torch.randn(2, per_row, 1) * 100).to(dtype)
    small = torch.arange(5).reshape(1, 5)
    received = unpack(pb.InferenceRequest, _packed(big, position_ids=small))
    step = received.message.step
    assert step.hidden_states.in_payload and not step.position_ids.in_payload
    assert torch.equal(decode_tensor(step.hidden_states, "h", received.payload), big)
    assert torch.equal(decode_optional(step, "position_ids", received.payload), small)
    assert decode_optional(step, "attention_mask", received.payload) is None
    assert step.session_id == "s" and step.prefix_length == 3


def test_payload_tensors_are_aligned_and_read_in_place():
    raw = _packed(torch.randn(1, BIG, 1), attention_mask=torch.ones(1, BIG * 3, dtype=torch.int64))
    received = unpack(pb.InferenceRequest, raw)
    assert received.payload.obj is raw  # the received bytes themselves, not a copy
    message_start = numpy.frombuffer(raw, dtype=numpy.uint8).ctypes.data
    for name in ("hidden_states", "attention_mask"):
        tensor = decode_tensor(getattr(received.message.step, name), name, received.payload)
        assert (tensor.data_ptr() - message_start) % ALIGN == 0, name
        assert message_start <= tensor.data_ptr() < message_start + len(raw), f"{name} was copied"


def test_any_protobuf_reader_sees_the_same_message():
    hidden = torch.randn(1, BIG, 1)
    raw = _packed(hidden)
    parsed = pb.InferenceRequest.FromString(raw)  # plain protobuf, no knowledge of packing
    message = parsed.step.hidden_states
    assert parsed.step.session_id == "s"
    got = torch.frombuffer(bytearray(parsed.payload[message.offset:]), dtype=torch.float32)[: hidden.numel()]
    assert torch.equal(got.reshape(hidden.shape), hidden)


def test_unaligned_payload_from_another_sender_is_copied():
    hidden = torch.randn(1, BIG, 1)
    payload = b"\0" + hidden.numpy().tobytes()  # a sender that does not align
    message = pb.InferenceRequest(step=pb.InferenceStep(hidden_states=pb.Tensor(
        shape=list(hidden.shape), dtype="float32", in_payload=True, offset=1)), payload=payload)
    received = unpack(pb.InferenceRequest, message.SerializeToString())
    assert torch.equal(decode_tensor(received.message.step.hidden_states, "h", received.payload), hidden)


def test_message_without_payload_unpacks_as_usual():
    message = pb.ForwardResponse(hidden_states=encode_tensor(torch.ones(1, 2, 3)))
    received = unpack(pb.ForwardResponse, message.SerializeToString())
    assert len(received.payload) == 0
    assert torch.equal(decode_tensor(received.message.hidden_states, "h", received.payload), torch.ones(1, 2, 3))


@pytest.mark.parametrize("offset, words", [(10**6, "offset 1000000"), (2**63, "offset")])
def test_payload_reference_out_of_range_is_bad_request(offset, words):
    message = pb.ForwardResponse(hidden_states=pb.Tensor(shape=[2, 2], dtype="float32", in_payload=True,
                                                         offset=offset), payload=b"\0" * 16)
    received = unpack(pb.ForwardResponse, message.SerializeToString())
    with pytest.raises(BadRequestError, match=words):
        decode_tensor(received.message.hidden_states, "hidden_states", received.payload)


def test_payload_tensor_must_not_carry_data():
    message = pb.ForwardResponse(hidden_states=pb.Tensor(shape=[1], dtype="float32", in_payload=True,
                                                         data=b"\0" * 4), payload=b"\0" * 4)
    received = unpack(pb.ForwardResponse, message.SerializeToString())
    with pytest.raises(BadRequestError, match="must not carry data"):
        decode_tensor(received.message.hidden_states, "hidden_states", received.payload)


@pytest.mark.parametrize("raw", [b"\x0a", b"\x0a\x05ab", b"\xff" * 11, b"\x7a\x80", b"\x0b"])
def test_malformed_bytes_are_bad_request(raw):
    with pytest.raises(BadRequestError, match="malformed"):
        unpack(pb.ForwardResponse, raw)
