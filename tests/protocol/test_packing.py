"""protocol.packing: tensors in the payload are exact, aligned, read in place, and still plain protobuf."""

from __future__ import annotations

import re
import tracemalloc

import numpy
import pytest
import torch

from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_optional, decode_tensor, encode_tensor
from protocol.errors import BadRequestError
from protocol.packing import ALIGN, INLINE_BYTES, MAX_FIELDS, Packer, payload_field, unpack

BIG = INLINE_BYTES // 4 + 1  # float32 elements that go to the payload


def _packed(hidden: torch.Tensor, **tensors) -> bytes:
    packer = Packer()
    message = pb.InferenceRequest(
        step=pb.InferenceStep(
            session_id="s",
            hidden_states=packer.tensor(hidden),
            prefix_length=3,
            **{name: packer.tensor(t) for name, t in tensors.items()},
        )
    )
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
    got = torch.frombuffer(bytearray(parsed.payload[message.offset :]), dtype=torch.float32)[: hidden.numel()]
    assert torch.equal(got.reshape(hidden.shape), hidden)


def test_unaligned_payload_from_another_sender_is_copied():
    hidden = torch.randn(1, BIG, 1)
    payload = b"\0" + hidden.numpy().tobytes()  # a sender that does not align
    message = pb.InferenceRequest(
        step=pb.InferenceStep(
            hidden_states=pb.Tensor(shape=list(hidden.shape), dtype="float32", in_payload=True, offset=1)
        ),
        payload=payload,
    )
    received = unpack(pb.InferenceRequest, message.SerializeToString())
    assert torch.equal(decode_tensor(received.message.step.hidden_states, "h", received.payload), hidden)


def test_message_without_payload_unpacks_as_usual():
    message = pb.ForwardResponse(hidden_states=encode_tensor(torch.ones(1, 2, 3)))
    received = unpack(pb.ForwardResponse, message.SerializeToString())
    assert len(received.payload) == 0
    assert torch.equal(decode_tensor(received.message.hidden_states, "h", received.payload), torch.ones(1, 2, 3))


@pytest.mark.parametrize("offset, words", [(10**6, "offset 1000000"), (2**63, "offset")])
def test_payload_reference_out_of_range_is_bad_request(offset, words):
    message = pb.ForwardResponse(
        hidden_states=pb.Tensor(shape=[2, 2], dtype="float32", in_payload=True, offset=offset), payload=b"\0" * 16
    )
    with pytest.raises(BadRequestError, match=words):  # refused as soon as the message is read
        unpack(pb.ForwardResponse, message.SerializeToString())
    with pytest.raises(BadRequestError, match=words):  # and by the decoder, for callers that skip unpack
        decode_tensor(message.hidden_states, "hidden_states", memoryview(message.payload))


def test_payload_tensor_must_not_carry_data():
    message = pb.ForwardResponse(
        hidden_states=pb.Tensor(shape=[1], dtype="float32", in_payload=True, data=b"\0" * 4), payload=b"\0" * 4
    )
    with pytest.raises(BadRequestError, match="must not carry data"):
        unpack(pb.ForwardResponse, message.SerializeToString())
    with pytest.raises(BadRequestError, match="must not carry data"):
        decode_tensor(message.hidden_states, "hidden_states", memoryview(message.payload))


@pytest.mark.parametrize("raw", [b"\x0a", b"\x0a\x05ab", b"\xff" * 11, b"\x7a\x80", b"\x0b"])
def test_malformed_bytes_are_bad_request(raw):
    with pytest.raises(BadRequestError, match="malformed"):
        unpack(pb.ForwardResponse, raw)


def test_a_second_payload_field_is_refused():
    raw = _packed(torch.randn(1, BIG, 1))
    with pytest.raises(BadRequestError, match="more than one payload field"):
        unpack(pb.InferenceRequest, raw + payload_field(b""))


def test_too_many_fields_are_refused_before_protobuf_parses_them():
    one = pb.InferenceRequest(step=pb.InferenceStep(session_id="s")).SerializeToString()  # 2 fields
    assert unpack(pb.InferenceRequest, one * 10).message.step.session_id == "s"  # protobuf merges repeats
    many = one * (MAX_FIELDS // 2 + 1)
    with pytest.raises(BadRequestError, match=f"more than {MAX_FIELDS} fields"):
        unpack(pb.InferenceRequest, many)


def test_a_shape_of_millions_of_dims_is_refused_by_its_count():
    tensor = pb.Tensor(shape=[1] * 3_000_000, dtype="float32")
    with pytest.raises(BadRequestError, match=f"more than {MAX_FIELDS} fields"):
        unpack(pb.ForwardResponse, pb.ForwardResponse(hidden_states=tensor).SerializeToString())


def test_unknown_fields_count_too():
    unknown = bytes([(14 << 3) | 0, 1]) * (MAX_FIELDS + 1)  # field 14 of ForwardResponse does not exist
    with pytest.raises(BadRequestError, match="fields"):
        unpack(pb.ForwardResponse, unknown)
    assert unpack(pb.ForwardResponse, unknown[:20]).payload.nbytes == 0


@pytest.mark.parametrize("raw", [b"\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x0a\x02\xff\xff"])
def test_protobuf_errors_become_bad_request(raw):
    with pytest.raises(BadRequestError, match="malformed"):
        unpack(pb.ForwardResponse, raw)
    with pytest.raises(BadRequestError, match="malformed"):
        unpack(pb.InfoResponse, b"\x12\x02\xff\xfe")  # invalid UTF-8 in a string field


def _with_payload(payload: bytes, *tensors: pb.Tensor) -> bytes:
    request = pb.BackwardRequest(**dict(zip(("hidden_states", "grad_outputs"), tensors)))
    return payload_field(payload) + request.SerializeToString()


def _in_payload(offset: int, elements: int = 16) -> pb.Tensor:
    return pb.Tensor(shape=[elements], dtype="float32", in_payload=True, offset=offset)


def test_payload_padding_is_accepted():
    raw = _with_payload(
        bytes(ALIGN - 1 + 64 + ALIGN - 1 + 64 + ALIGN - 1),
        _in_payload(ALIGN - 1),
        _in_payload(ALIGN - 1 + 64 + ALIGN - 1),
    )
    received = unpack(pb.BackwardRequest, raw)
    assert decode_tensor(received.message.grad_outputs, "g", received.payload).shape == (16,)


@pytest.mark.parametrize(
    "payload_bytes, offsets, words",
    [
        (64 + ALIGN, [0], "payload bytes 64:128 belong to no tensor"),
        (ALIGN + 64, [ALIGN], "payload bytes 0:64 (before hidden_states) belong to no tensor"),
        (64 + ALIGN + 64, [0, 64 + ALIGN], "payload bytes 64:128 (before grad_outputs)"),
        (96, [0, 32], "grad_outputs overlaps hidden_states"),
        (64, [0, 0], "overlaps"),
        (ALIGN, [], "payload bytes 0:64 belong to no tensor"),
    ],
)
def test_payload_bytes_of_no_tensor_or_shared_are_refused(payload_bytes, offsets, words):
    with pytest.raises(BadRequestError, match=re.escape(words)):
        unpack(pb.BackwardRequest, _with_payload(bytes(payload_bytes), *map(_in_payload, offsets)))


def test_memory_stays_near_the_message_size():
    """A few MB of crafted fields cost at most a few times their size to refuse or to read."""
    many_payloads = payload_field(b"") * (2 << 20)  # 4 MiB of payload fields
    many_fields = bytes([(14 << 3) | 0, 1]) * (2 << 20)
    big = _packed(torch.randn(1, 1 << 20, 1))  # a 4 MiB tensor, read in place
    for raw in (many_payloads, many_fields, big):
        tracemalloc.start()
        try:
            try:
                received = unpack(pb.InferenceRequest, raw)
                decode_tensor(received.message.step.hidden_states, "h", received.payload)
            except BadRequestError:
                pass
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 * len(raw) + (1 << 20), f"{peak} bytes held for {len(raw)} received"
