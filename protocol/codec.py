"""Tensor <-> protobuf `Tensor` codec: shape, dtype (bfloat16 included), optional compression of floating tensors.

Compression (what a sender asks for with `output_compression`, or applies to its own inputs) turns float32 and
float64 tensors into float16 or bfloat16 (2 bytes a value), or into blockwise 8-bit codes (INT8: 1 byte a value
plus 4 per block of 64, as SWARM parallelism sends activations): lossy by design, opt-in, and restored to the
original dtype on receipt.
"""

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


INT8_BLOCK = 64  # values per block of INT8 compression, each block scaled by its own max |x|
_WIDE = (torch.float32, torch.float64)
_ORIGINALS = {  # the dtypes each compression applies to (where it shrinks them)
    pb.FLOAT16: _WIDE,
    pb.BFLOAT16: _WIDE,
    pb.INT8: (*_WIDE, torch.float16, torch.bfloat16),
}
_HALF = {pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16}


def wire_form(tensor: torch.Tensor, compression: int = pb.NONE) -> tuple[torch.Tensor, str, int]:
    """The contiguous CPU tensor whose bytes to send, its original dtype's name and the compression applied.

    Compression applies where it shrinks the tensor (`_ORIGINALS`), else it is sent as it is; INT8's is a flat
    uint8 tensor of codes and scales (`int8_encode`), not of the original's shape.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    original = dtype_name(tensor.dtype)
    if tensor.dtype not in _ORIGINALS.get(compression, ()):
        return tensor.contiguous(), original, pb.NONE
    if compression == pb.INT8:
        if not bool(torch.isfinite(tensor).all()):  # sent as it is: the receiver's checks must see the NaN or inf
            return tensor.contiguous(), original, pb.NONE
        return int8_encode(tensor), original, compression
    limit = torch.finfo(_HALF[compression]).max
    # clamp rather than overflow: inf would be rejected as bad input on the other side
    return tensor.clamp(-limit, limit).to(_HALF[compression]).contiguous(), original, compression


def int8_encode(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (floating) as INT8 compression's bytes: the codes of every block, then each block's float32 scale."""
    flat = tensor.reshape(-1).float()
    blocks = -(-flat.numel() // INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK)
    padded[: flat.numel()] = flat
    padded = padded.view(blocks, INT8_BLOCK)
    scales = padded.abs().amax(dim=1)
    codes = torch.round(padded * (127.0 / scales.clamp_min(torch.finfo(torch.float32).tiny)).unsqueeze(1))
    codes = codes.clamp(-127, 127).to(torch.int8)
    return torch.cat([codes.reshape(-1).view(torch.uint8), scales.view(torch.uint8)])


def int8_nbytes(numel: int) -> int:
    blocks = -(-numel // INT8_BLOCK)
    return blocks * (INT8_BLOCK + 4)


def int8_decode(data: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    """The tensor of `shape` and `dtype` whose INT8 bytes `data` (uint8) holds.

    Raises:
        BadRequestError: a block's scale is negative or not finite.
    """
    numel = math.prod(shape)
    blocks = -(-numel // INT8_BLOCK)
    codes = data[: blocks * INT8_BLOCK].view(torch.int8).view(blocks, INT8_BLOCK)
    scales = data[blocks * INT8_BLOCK :].clone().view(torch.float32)  # clone: the scales may sit unaligned
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise BadRequestError(f"{name}: INT8 compression with a scale that is negative or not finite")
    values = codes.float() * (scales / 127.0).unsqueeze(1)
    return values.reshape(-1)[:numel].reshape(shape).to(dtype)


def encode_tensor(tensor: torch.Tensor, compression: int = pb.NONE) -> pb.Tensor:
    """A `Tensor` message holding the bytes itself (`packing.Packer` sends large ones with fewer copies)."""
    shape = list(tensor.shape)
    tensor, original, compression = wire_form(tensor, compression)
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return pb.Tensor(shape=shape, dtype=original, data=data, compression=compression)


MAX_NDIM = 8  # our tensors have at most 3 dimensions; more is a malformed message
MAX_ELEMENTS = 1 << 40  # product of the nonzero dimensions: far past any message, far below int64 overflow


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
    if message.compression != pb.NONE and message.compression not in _ORIGINALS:
        raise BadRequestError(f"{name}: unknown compression {message.compression}")
    dtype = parse_dtype(message.dtype)
    wire_dtype = dtype
    if message.compression != pb.NONE:
        if dtype not in _ORIGINALS[message.compression]:
            allowed = ", ".join(DTYPE_NAMES[d] for d in _ORIGINALS[message.compression])
            raise BadRequestError(
                f"{name}: {pb.Compression.Name(message.compression)} compression applies to {allowed} "
                f"tensors, not {message.dtype}; send it uncompressed"
            )
        wire_dtype = _HALF.get(message.compression, torch.uint8)
    if len(message.shape) > MAX_NDIM:
        raise BadRequestError(f"{name}: {len(message.shape)} dimensions, at most {MAX_NDIM} are accepted")
    shape = tuple(message.shape)
    if any(dim < 0 for dim in shape):
        raise BadRequestError(f"{name}: negative dimension in shape {list(shape)}")
    if math.prod(dim or 1 for dim in shape) > MAX_ELEMENTS:
        raise BadRequestError(f"{name}: shape {list(shape)} is too large to be a tensor")
    if message.compression == pb.INT8:
        return Layout(dtype, wire_dtype, shape, int8_nbytes(math.prod(shape)))
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
    if message.compression == pb.INT8:
        return int8_decode(tensor, form.shape, form.dtype, name)
    tensor = tensor.reshape(form.shape)
    return tensor.to(form.dtype) if form.wire_dtype != form.dtype else tensor


def encode_optional(tensor: torch.Tensor | None, compression: int = pb.NONE) -> pb.Tensor | None:
    return None if tensor is None else encode_tensor(tensor, compression)


def decode_optional(message, field: str, payload: memoryview | None = None) -> torch.Tensor | None:
    """Decode `message.field` if it was set, else None."""
    return decode_tensor(getattr(message, field), field, payload) if message.HasField(field) else None
