"""Tensor <-> protobuf `Tensor` codec: shape, dtype (bfloat16 included), optional float16 compression."""

from __future__ import annotations

import math
import warnings

import torch

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_FLOAT16_MAX = torch.finfo(torch.float16).max

# Received bytes are read-only, and torch says so when a tensor views them; they are private to the one
# request that carried them, so the warning is silenced, for calls from this module only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise BadRequestError(f"dtype {dtype} cannot be sent; supported: {sorted(DTYPES)}") from None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise BadRequestError(f"unknown tensor dtype {name!r}; supported: {sorted(DTYPES)}") from None


def wire_form(tensor: torch.Tensor, compression: int = pb.NONE) -> tuple[torch.Tensor, str, int]:
    """The contiguous CPU tensor to send, its dtype's name and the compression applied.

    FLOAT16 compression applies to float32/float64 only (it would not shrink the rest).
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    original = dtype_name(tensor.dtype)
    if compression == pb.FLOAT16 and tensor.dtype in (torch.float32, torch.float64):
        # clamp rather than overflow: inf would be rejected as bad input on the other side
        tensor = tensor.clamp(-_FLOAT16_MAX, _FLOAT16_MAX).to(torch.float16)
    else:
        compression = pb.NONE
    return tensor.contiguous(), original, compression


def encode_tensor(tensor: torch.Tensor, compression: int = pb.NONE) -> pb.Tensor:
    """A `Tensor` message holding the bytes itself (`packing.Packer` sends large ones with fewer copies)."""
    tensor, original, compression = wire_form(tensor, compression)
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return pb.Tensor(shape=list(tensor.shape), dtype=original, data=data, compression=compression)


def decode_tensor(message: pb.Tensor, name: str = "tensor", payload: memoryview | None = None) -> torch.Tensor:
    """Deserialize a tensor, checking that its bytes match its shape and dtype.

    A tensor in the message's `payload` is read in place when it is aligned: it then shares memory with the
    received message (private to this request), so it costs no copy.
    """
    dtype = parse_dtype(message.dtype)
    wire_dtype = torch.float16 if message.compression == pb.FLOAT16 else dtype
    if message.compression not in (pb.NONE, pb.FLOAT16):
        raise BadRequestError(f"{name}: unknown compression {message.compression}")
    shape = tuple(message.shape)
    if any(dim < 0 for dim in shape):
        raise BadRequestError(f"{name}: negative dimension in shape {list(shape)}")
    itemsize = torch.empty((), dtype=wire_dtype).element_size()
    expected = math.prod(shape) * itemsize
    if message.in_payload:
        if message.data:
            raise BadRequestError(f"{name}: a tensor in the payload must not carry data of its own")
        available = len(payload) if payload is not None else 0
        if message.offset + expected > available:
            raise BadRequestError(f"{name}: shape {list(shape)} of {message.dtype} needs {expected} bytes at "
                                  f"offset {message.offset} of the payload, which has {available}")
    elif len(message.data) != expected:
        raise BadRequestError(
            f"{name}: shape {list(shape)} of {message.dtype} needs {expected} bytes, got {len(message.data)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if message.in_payload:
        tensor = torch.frombuffer(payload, dtype=wire_dtype, count=expected // itemsize, offset=message.offset)
        if tensor.data_ptr() % itemsize:  # a sender that did not align it: copy rather than read unaligned
            tensor = tensor.clone()
    else:
        tensor = torch.frombuffer(bytearray(message.data), dtype=wire_dtype)
    tensor = tensor.reshape(shape)
    return tensor.to(dtype) if wire_dtype != dtype else tensor


def encode_optional(tensor: torch.Tensor | None, compression: int = pb.NONE) -> pb.Tensor | None:
    return None if tensor is None else encode_tensor(tensor, compression)


def decode_optional(message, field: str, payload: memoryview | None = None) -> torch.Tensor | None:
    """Decode `message.field` if it was set, else None."""
    return decode_tensor(getattr(message, field), field, payload) if message.HasField(field) else None
