"""Tensors' bytes in a message's `payload` field: one copy to send them, none to receive them.

Sending: `Packer.tensor` gives each tensor a `Tensor` of metadata only (its offset in the payload) and keeps
a view of its bytes; `Packed.SerializeToString` joins the payload field and the rest of the message in one
copy. The result is an ordinary protobuf message (the payload field comes first; protobuf allows any order).
Receiving: `unpack` finds the payload among the top-level fields and parses only the rest with protobuf;
`codec.decode_tensor` then reads each tensor in place from the received bytes.

A received message is hostile until checked, and `unpack` keeps it cheap: it counts the fields (nested ones
and repeated numbers included) before protobuf builds anything, accepts one payload field at most, and
refuses a payload that its tensors do not cover (bytes of no tensor beyond alignment padding, or overlaps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from protocol import codec
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, SwarmError

PAYLOAD_FIELD = 15
ALIGN = 64  # tensors start at multiples of this from the start of the message
INLINE_BYTES = 32 * 1024  # smaller tensors keep their bytes in `Tensor.data`: fewer steps beat fewer copies
MAX_FIELDS = 1024  # fields and repeated numbers in one message, nested ones included
MAX_DEPTH = 8  # nested messages (ours nest 3 deep)
_CONTINUED = bytes(range(0x80, 0x100))  # varint bytes that another byte follows
_PAYLOAD_TAG = bytes([(PAYLOAD_FIELD << 3) | 2])  # field 15, length-delimited


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while shift < 64:
        if pos >= len(data):
            raise BadRequestError("malformed message: it ends inside a varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise BadRequestError("malformed message: a varint longer than 10 bytes")


def field_spans(data: bytes) -> list[tuple[int, int]]:
    """[start, end) of each top-level field of a well-formed message (for tools that take messages apart)."""
    pos, found = 0, []
    while pos < len(data):
        start = pos
        key, pos = _read_varint(data, pos)
        kind = key & 7
        if kind == 0:
            _, pos = _read_varint(data, pos)
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        else:
            length, pos = _read_varint(data, pos)
            pos += length
        found.append((start, pos))
    return found


def payload_field(body: bytes) -> bytes:
    """`body` as a raw payload field, to put into a serialized message."""
    return _PAYLOAD_TAG + varint(len(body)) + body


class Packer:
    """Collects the tensors of one message; `pack(message)` then gives what to send."""

    def __init__(self):
        self._chunks: list = []
        self._size = 0

    def tensor(self, tensor: torch.Tensor, compression: int = pb.NONE) -> pb.Tensor:
        if tensor.numel() * tensor.element_size() < INLINE_BYTES:
            return codec.encode_tensor(tensor, compression)
        shape = list(tensor.shape)
        tensor, dtype, compression = codec.wire_form(tensor, compression)
        pad = -self._size % ALIGN
        if pad:
            self._chunks.append(bytes(pad))
            self._size += pad
        offset = self._size
        self._chunks.append(tensor.reshape(-1).view(torch.uint8).numpy())
        self._size += tensor.numel() * tensor.element_size()
        return pb.Tensor(shape=shape, dtype=dtype, compression=compression, in_payload=True, offset=offset)

    def optional(self, tensor: torch.Tensor | None, compression: int = pb.NONE) -> pb.Tensor | None:
        return None if tensor is None else self.tensor(tensor, compression)

    def pack(self, message):
        """What to send: `message`, built with this packer's tensors, with their bytes (a `Packed`)."""
        if not self._chunks:
            return message
        # padding ahead of the tensors, so that each starts at a multiple of ALIGN from the message start
        for length_bytes in range(1, 11):  # the bytes of the payload's length, which depends on the padding
            lead = -(len(_PAYLOAD_TAG) + length_bytes) % ALIGN
            if len(varint(lead + self._size)) == length_bytes:
                break
        if lead:
            _shift_offsets(message, lead)
        head = _PAYLOAD_TAG + varint(lead + self._size) + bytes(lead)
        return Packed(message, [head, *self._chunks])


@dataclass(frozen=True)
class Packed:
    """A message and its tensors' bytes, serialized together only when gRPC sends it."""

    message: object
    chunks: list

    def SerializeToString(self) -> bytes:  # the name gRPC's serializer calls
        return b"".join([*self.chunks, self.message.SerializeToString()])


def _shift_offsets(message, delta: int) -> None:
    """Add `delta` to the offset of every payload tensor in `message`, nested messages included."""
    for _, tensor in _payload_tensors(message):
        tensor.offset += delta


@dataclass(frozen=True)
class Received:
    """A received message and a read-only view of its payload (empty if it has none).

    `error` is set when the bytes were refused (`message` is then empty): see protocol/service.py.
    """

    message: object
    payload: memoryview
    error: SwarmError | None = None

    def check(self) -> None:
        """Raise why the bytes were refused, if they were."""
        if self.error is not None:
            raise self.error


def unpack(cls, data: bytes) -> Received:
    """Parse `data` as a `cls`, leaving its payload in place in `data`.

    Memory stays within about the size of `data`: fields are counted (MAX_FIELDS) before protobuf builds
    anything, one payload field at most is accepted, and the payload tensors must cover the payload.

    Raises:
        BadRequestError: the bytes are not a well-formed `cls`, naming what is wrong.
    """
    payload = _scan(cls.DESCRIPTOR, data, 0, len(data), [MAX_FIELDS], top=True)
    if payload is None:
        message, view = _parse(cls, data), memoryview(b"")
    else:
        field_start, start, end = payload
        # the rest of the message without the payload field; senders put it first, so usually no copy
        rest = memoryview(data)[end:] if field_start == 0 else data[:field_start] + data[end:]
        message, view = _parse(cls, rest), memoryview(data)[start:end]
    _check_covered(message, len(view))
    return Received(message, view)


def _parse(cls, data):
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise BadRequestError(f"malformed message: not a valid {cls.DESCRIPTOR.name}: {exc}") from None


def _scan(descriptor, data, pos: int, end: int, budget: list[int], top: bool = False, depth: int = 0):
    """Walk the fields of data[pos:end] (a `descriptor` message), nested messages included, spending `budget`.

    Returns (field start, bytes start, bytes end) of the payload field at the top level, or None.
    """
    if depth > MAX_DEPTH:
        raise BadRequestError(f"malformed message: messages nested more than {MAX_DEPTH} deep")
    payload = None
    while pos < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise BadRequestError(f"malformed message: more than {MAX_FIELDS} fields (ours have fewer than 100)")
        field_start = pos
        key, pos = _read_varint(data, pos)
        kind = key & 7
        if kind == 0:
            _, pos = _read_varint(data, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == 2:
            length, pos = _read_varint(data, pos)
            if pos + length > end:
                raise BadRequestError("malformed message: a field runs past the end of the message")
            field = descriptor.fields_by_number.get(key >> 3)
            if top and key >> 3 == PAYLOAD_FIELD:
                if payload is not None:
                    raise BadRequestError(
                        f"malformed message: more than one payload field ({PAYLOAD_FIELD}); "
                        f"send all tensors' bytes in one"
                    )
                payload = (field_start, pos, pos + length)
            elif field is not None and field.message_type is not None:
                _scan(field.message_type, data, pos, pos + length, budget, depth=depth + 1)
            elif field is not None and field.is_repeated:  # packed numbers: at least one byte each
                budget[0] -= _count_packed(data, pos, length)
            pos += length
        else:
            raise BadRequestError(f"malformed message: unsupported wire type {kind}")
        if pos > end:
            raise BadRequestError("malformed message: a field runs past the end of the message")
    return payload


def _count_packed(data, pos: int, length: int) -> int:
    """How many varints data[pos:pos + length] holds (bytes without the continuation bit), or an upper bound."""
    if length > 10 * MAX_FIELDS:
        return length  # over the budget however they are counted
    return len(bytes(data[pos : pos + length]).translate(None, _CONTINUED))


def _check_covered(message, payload_size: int) -> None:
    """The payload tensors of `message` must not overlap, and leave only padding (< ALIGN bytes) unused."""
    ranges = sorted(
        (*codec.payload_range(tensor, name, payload_size), name) for name, tensor in _payload_tensors(message)
    )
    used, last = 0, None
    for start, end, name in ranges:
        if start < used:
            raise BadRequestError(f"malformed message: {name} overlaps {last} in the payload")
        if start - used >= ALIGN:
            raise BadRequestError(
                f"malformed message: payload bytes {used}:{start} (before {name}) belong to no tensor"
            )
        used, last = end, name
    if payload_size - used >= ALIGN:
        raise BadRequestError(f"malformed message: payload bytes {used}:{payload_size} belong to no tensor")


def _payload_tensors(message):
    """(field name, Tensor) of each payload tensor in `message`, nested messages included."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        for item in value if field.is_repeated else (value,):
            if isinstance(item, pb.Tensor):
                if item.in_payload:
                    yield field.name, item
            else:
                yield from _payload_tensors(item)
