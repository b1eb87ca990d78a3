"""Tensor <-> protobuf `Tensor` codec: shape, dtype (bfloat16 included), optional float16 compression."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

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
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)


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


MAX_NDIM = 8  # our tensors have at most 3 dimensions; more is a malformed message
MAX_ELEMENTS = 1 << 40  # product of the nonzero dimensions: far past any message, far below int64 overflow
_FLOAT16_ORIGINALS = (torch.float32, torch.float64)  # what `wire_form` compresses


@dataclass(frozen=True)
class Layout:
    """What a `Tensor` message says about its bytes, checked: the dtype, the dtype on the wire, the shape."""

    dtype: torch.dtype
    wire_dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def layout(message: pb.Tensor, name: str = "tensor") -> Layout:
    """Check a `Tensor` message's dtype, compression and shape (not its bytes).

    Raises:
        BadRequestError: naming `name` and what is wrong.
    """
    if message.compression not in (pb.NONE, pb.FLOAT16):
        raise BadRequestError(f"{name}: unknown compression {message.compression}")
    dtype = parse_dtype(message.dtype)
    wire_dtype = dtype
    if message.compression == pb.FLOAT16:
        if dtype not in _FLOAT16_ORIGINALS:
            raise BadRequestError(
                f"{name}: FLOAT16 compression applies to float32 and float64 tensors, "
                f"not {message.dtype}; send it uncompressed"
            )
        wire_dtype = torch.float16
    if len(message.shape) > MAX_NDIM:
        raise BadRequestError(f"{name}: {len(message.shape)} dimensions, at most {MAX_NDIM} are accepted")
    shape = tuple(message.shape)
    if any(dim < 0 for dim in shape):
        raise BadRequestError(f"{name}: negative dimension in shape {list(shape)}")
    if math.prod(dim or 1 for dim in shape) > MAX_ELEMENTS:
        raise BadRequestError(f"{name}: shape {list(shape)} is too large to be a tensor")
    itemsize = torch.empty((), dtype=wire_dtype).element_size()
    return Layout(dtype, wire_dtype, shape, math.prod(shape) * itemsize)


def payload_range(message: pb.Tensor, name: str, payload_size: int) -> tuple[int, int]:
    """[start, end) of a payload tensor's bytes in a payload of `payload_size` bytes, checked."""
    nbytes = layout(message, name).nbytes
    if message.data:
        raise BadRequestError(f"{name}: a tensor in the payload must not carry data of its own")
    if message.offset + nbytes > payload_size:
        raise BadRequestError(
            f"{name}: shape {list(message.shape)} of {message.dtype} needs {nbytes} bytes at "
            f"offset {message.offset} of the payload, which has {payload_size}"
        )
    return message.offset, message.offset + nbytes


def decode_tensor(message: pb.Tensor, name: str = "tensor", payload: memoryview | None = None) -> torch.Tensor:
    """Deserialize a tensor, checking that its bytes match its shape and dtype.

    A tensor in the message's `payload` is read in place when it is aligned: it then shares memory with the
    received message (private to this request), so it costs no copy.

    Raises:
        BadRequestError: naming `name` and what is wrong (dtype, compression, shape, bytes).
    """
    form = layout(message, name)
    if message.in_payload:
        payload_range(message, name, len(payload) if payload is not None else 0)
    elif len(message.data) != form.nbytes:
        raise BadRequestError(
            f"{name}: shape {list(form.shape)} of {message.dtype} needs {form.nbytes} bytes, got {len(message.data)}"
        )
    if form.nbytes == 0:
        return torch.empty(form.shape, dtype=form.dtype)
    itemsize = torch.empty((), dtype=form.wire_dtype).element_size()
    if message.in_payload:
        tensor = torch.frombuffer(payload, dtype=form.wire_dtype, count=form.nbytes // itemsize, offset=message.offset)
        if tensor.data_ptr() % itemsize:  # a sender that did not align it: copy rather than read unaligned
            tensor = tensor.clone()
    else:
        tensor = torch.frombuffer(bytearray(message.data), dtype=form.wire_dtype)
    tensor = tensor.reshape(form.shape)
    return tensor.to(form.dtype) if form.wire_dtype != form.dtype else tensor


def encode_optional(tensor: torch.Tensor | None, compression: int = pb.NONE) -> pb.Tensor | None:
    return None if tensor is None else encode_tensor(tensor, compression)


def decode_optional(message, field: str, payload: memoryview | None = None) -> torch.Tensor | None:
    """Decode `message.field` if it was set, else None."""
    return decode_tensor(getattr(message, field), field, payload) if message.HasField(field) else None
