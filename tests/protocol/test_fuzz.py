"""Property tests of what a peer or client reads off the wire: codec, packing, DHT records.

Whatever the bytes, the outcome is a typed swarmlm error (a SwarmError) or a decode; a valid message decodes
to exactly what was encoded. Inputs are random bytes, mutations of valid messages (bit flips, truncation,
duplicated fields, inserted payload fields, giant varints), and random shapes, dtypes and offsets.
Memory is checked in test_packing.py (`test_memory_stays_near_the_message_size`).
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import swarmlm_pb2 as pb
from protocol.codec import DTYPES, decode_tensor, encode_tensor
from protocol.errors import BadRequestError, InvalidRecordError, SwarmError
from protocol.packing import INLINE_BYTES, Packer, field_spans, payload_field, unpack
from protocol.records import ServerInfo, ServerState

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CLASSES = [
    pb.ForwardRequest,
    pb.BackwardRequest,
    pb.InferenceRequest,
    pb.ForwardResponse,
    pb.InferenceResponse,
    pb.StatePart,
    pb.InfoRequest,
    pb.InfoResponse,
    pb.StateRequest,
]


def _tensors(message, path=""):
    """(name, Tensor) of every tensor field set in `message`, nested messages included."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        for item in value if field.is_repeated else (value,):
            if isinstance(item, pb.Tensor):
                yield field.name, item
            else:
                yield from _tensors(item)


def _read(cls, data: bytes):
    """What a receiver does: unpack, then decode every tensor. Returns the decoded tensors, or raises."""
    received = unpack(cls, data)
    return received, {
        name: decode_tensor(tensor, name, received.payload) for name, tensor in _tensors(received.message)
    }


def _typed_or_decoded(cls, data: bytes):
    try:
        received, tensors = _read(cls, data)
    except SwarmError:
        return None
    for name, tensor in tensors.items():  # a decode matches its metadata
        message = dict(_tensors(received.message))[name]
        assert list(tensor.shape) == list(message.shape)
    return received, tensors


# --- valid messages, and mutations of them ---

_SMALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]


@st.composite
def tensors(draw, big: bool | None = None):
    dtype = draw(st.sampled_from(_SMALL_DTYPES))
    itemsize = torch.empty((), dtype=dtype).element_size()
    big = draw(st.booleans()) if big is None else big
    rows = INLINE_BYTES // itemsize + draw(st.integers(0, 100)) if big else draw(st.integers(0, 20))
    shape = draw(st.sampled_from([(rows,), (1, rows, 1), (1, 1, rows)]))
    seed = draw(st.integers(0, 2**16))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100
    return values > 0 if dtype == torch.bool else values.to(dtype)


@st.composite
def valid_messages(draw):
    """(message class, serialized bytes, {tensor field: tensor}) of a valid request or response."""
    kind = draw(st.sampled_from(["forward", "backward", "step", "response"]))
    packer = Packer()
    sent = {"hidden_states": draw(tensors())}
    if kind == "backward":
        sent["grad_outputs"] = draw(tensors())
    if draw(st.booleans()):
        sent["position_ids"] = draw(tensors(big=False))
    fields = {}
    for name, tensor in sent.items():
        # ignored for other dtypes, as by wire_form
        compression = draw(st.sampled_from([pb.NONE, pb.FLOAT16, pb.BFLOAT16, pb.INT8]))
        fields[name] = packer.tensor(tensor, compression)
        if fields[name].compression != pb.NONE:
            sent[name] = decode_tensor(encode_tensor(tensor, compression))  # what arrives
    if kind == "forward":
        cls, message = pb.ForwardRequest, pb.ForwardRequest(span=pb.Span(model="m", end=2), backward_id="b", **fields)
    elif kind == "backward":
        cls, message = pb.BackwardRequest, pb.BackwardRequest(span=pb.Span(model="m", end=2), epoch=3, **fields)
    elif kind == "step":
        cls, message = pb.InferenceRequest, pb.InferenceRequest(step=pb.InferenceStep(session_id="s", **fields))
    else:
        fields.pop("position_ids", None)
        sent = {"hidden_states": sent["hidden_states"]}
        cls = pb.InferenceResponse
        message = pb.InferenceResponse(step=pb.StepResult(hidden_states=fields["hidden_states"], position=7))
    return cls, packer.pack(message).SerializeToString(), sent


@st.composite
def mutations(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "truncate", "duplicate", "payload", "varint", "splice", "drop"]))
    if kind == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            pos = draw(st.integers(0, len(out) - 1))
            out[pos] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    fields = field_spans(data)
    start, end = draw(st.sampled_from(fields))
    if kind == "duplicate":
        return data[:end] + data[start:end] * draw(st.integers(1, 3)) + data[end:]
    if kind == "drop":
        return data[:start] + data[end:]
    if kind == "payload":
        return data[:start] + payload_field(draw(st.binary(max_size=200))) + data[start:]
    if kind == "varint":  # a giant or overlong varint where a field starts
        return (
            data[:start]
            + draw(st.sampled_from([b"\xff" * 11, b"\x80" * 10 + b"\x01", b"\x7a\xff\xff\xff\xff\x0f"]))
            + data[start:]
        )
    return data[:start] + draw(st.binary(min_size=1, max_size=40)) + data[start:]


@FUZZ
@given(valid_messages())
def test_valid_messages_decode_exactly(message):
    cls, data, sent = message
    _, got = _read(cls, data)
    assert set(got) == set(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@FUZZ
@given(st.data())
def test_mutated_messages_are_typed_errors_or_decodes(data):
    cls, raw, _ = data.draw(valid_messages())
    mutated = data.draw(mutations(raw))
    _typed_or_decoded(cls, mutated)


@FUZZ
@given(st.sampled_from(CLASSES), st.binary(max_size=600))
def test_random_bytes_are_typed_errors_or_decodes(cls, raw):
    _typed_or_decoded(cls, raw)


# --- one tensor, random metadata ---

_DIMS = st.one_of(st.integers(-3, 70), st.sampled_from([0, 2**31, 2**40, 2**62, 2**63 - 1]))


@FUZZ
@given(
    shape=st.lists(_DIMS, max_size=10),
    dtype=st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=8)),
    compression=st.integers(0, 3),
    data=st.binary(max_size=300),
    in_payload=st.booleans(),
    offset=st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1)),
    payload=st.binary(max_size=300),
)
def test_random_tensor_metadata_is_a_typed_error_or_matches_it(
    shape, dtype, compression, data, in_payload, offset, payload
):
    message = pb.Tensor(
        shape=shape, dtype=dtype, compression=compression, data=data, in_payload=in_payload, offset=offset
    )
    try:
        tensor = decode_tensor(message, "t", memoryview(payload))
    except BadRequestError:
        return
    assert list(tensor.shape) == shape and tensor.dtype == DTYPES[dtype]
    wire = torch.float16 if compression == pb.FLOAT16 else tensor.dtype
    source = len(payload) - offset if in_payload else len(data)
    assert math.prod(shape) * torch.empty((), dtype=wire).element_size() <= source


# --- DHT records ---

_JSONISH = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20), st.binary(max_size=8)
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
_VALID_INFO = ServerInfo(
    state=ServerState.ONLINE,
    start_block=0,
    end_block=4,
    throughput=10.0,
    cache_tokens_left=96,
    dtype="float32",
    version="1",
    endpoint="127.0.0.1:5000",
).to_wire()


def _typed_or_record(raw):
    try:
        info = ServerInfo.from_wire(raw)
    except InvalidRecordError:
        return
    assert ServerInfo.from_wire(info.to_wire()) == info


@FUZZ
@given(st.one_of(_JSONISH, st.dictionaries(st.sampled_from(sorted(_VALID_INFO)), _JSONISH, max_size=12)))
def test_random_records_are_typed_errors_or_records(raw):
    _typed_or_record(raw)


@FUZZ
@given(st.sampled_from(sorted(_VALID_INFO)), _JSONISH, st.booleans())
def test_records_with_one_field_changed_are_typed_errors_or_records(key, value, drop):
    raw = dict(_VALID_INFO)
    if drop:
        raw.pop(key)
    else:
        raw[key] = value
    _typed_or_record(raw)
