"""Tensors' bytes in a message's `payload` field: one copy to send them, none to receive them.

Sending: `Packer.tensor` gives each tensor a `Tensor` of metadata only (its offset in the payload) and keeps
a view of its bytes; `Packed.SerializeToString` joins the payload field and the rest of the message in one
copy. The result is an ordinary protobuf message (the payload field comes first; protobuf allows any order).
Receiving: `unpack` finds the payload among the top-level fields and parses only the rest with protobuf;
`codec.decode_tensor` then reads each tensor in place from the received bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol import codec
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError

PAYLOAD_FIELD = 15
ALIGN = 64  # tensors start at multiples of this from the start of the message
INLINE_BYTES = 32 * 1024  # smaller tensors keep their bytes in `Tensor.data`: fewer steps beat fewer copies
_PAYLOAD_TAG = bytes([(PAYLOAD_FIELD << 3) | 2])  # field 15, length-delimited


def _varint(value: int) -> bytes:
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


class Packer:
    """Collects the tensors of one message; `pack(message)` then gives what to send."""

    def __init__(self):
        self._chunks: list = []
        self._size = 0

    def tensor(self, tensor: torch.Tensor, compression: int = pb.NONE) -> pb.Tensor:
        if tensor.numel() * tensor.element_size() < INLINE_BYTES:
            return codec.encode_tensor(tensor, compression)
        tensor, dtype, compression = codec.wire_form(tensor, compression)
        pad = -self._size % ALIGN
        if pad:
            self._chunks.append(bytes(pad))
            self._size += pad
        offset = self._size
        self._chunks.append(tensor.reshape(-1).view(torch.uint8).numpy())
        self._size += tensor.numel() * tensor.element_size()
        return pb.Tensor(shape=list(tensor.shape), dtype=dtype, compression=compression, in_payload=True,
                         offset=offset)

    def optional(self, tensor: torch.Tensor | None, compression: int = pb.NONE) -> pb.Tensor | None:
        return None if tensor is None else self.tensor(tensor, compression)

    def pack(self, message):
        """What to send: `message`, built with this packer's tensors, with their bytes (a `Packed`)."""
        if not self._chunks:
            return message
        # padding ahead of the tensors, so that each starts at a multiple of ALIGN from the message start
        for length_bytes in range(1, 11):  # the bytes of the payload's length, which depends on the padding
            lead = -(len(_PAYLOAD_TAG) + length_bytes) % ALIGN
            if len(_varint(lead + self._size)) == length_bytes:
                break
        if lead:
            _shift_offsets(message, lead)
        head = _PAYLOAD_TAG + _varint(lead + self._size) + bytes(lead)
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
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        for item in value if field.is_repeated else (value,):
            if isinstance(item, pb.Tensor):
                if item.in_payload:
                    item.offset += delta
            else:
                _shift_offsets(item, delta)


@dataclass(frozen=True)
class Received:
    """A received message and a read-only view of its payload (empty if it has none)."""

    message: object
    payload: memoryview


def unpack(cls, data: bytes) -> Received:
    """Parse `data` as a `cls`, leaving its payload in place in `data`."""
    pos, payloads = 0, []  # (field start, bytes start, bytes end) of each payload field
    while pos < len(data):
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
            if key >> 3 == PAYLOAD_FIELD:
                payloads.append((field_start, pos, pos + length))
            pos += length
        else:
            raise BadRequestError(f"malformed message: unsupported wire type {kind}")
        if pos > len(data):
            raise BadRequestError("malformed message: a field runs past the end of the message")
    if not payloads:
        return Received(cls.FromString(data), memoryview(b""))
    pieces, last = [], 0
    for field_start, _, end in payloads:
        pieces.append(data[last:field_start])
        last = end
    pieces.append(data[last:])
    _, start, end = payloads[-1]  # as in protobuf, the last occurrence wins
    return Received(cls.FromString(b"".join(pieces)), memoryview(data)[start:end])
