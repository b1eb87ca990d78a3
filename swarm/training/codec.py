"""8-bit rounds (`--averaging-compression int8`): each part a member sends is int8 codes in blocks of 64 values with a
float32 scale per block, as activations travel with `--wire-dtype int8` (protocol/codec.py): 1.06 bytes a value
against float64's 8 and float16's 2.

Rounding each part to 8 bits loses about 0.4% of its block's largest value. With error feedback, what a part lost
is added to the same part in this member's next round, so that the losses cancel over rounds instead of adding up
(as 1-bit Adam and EF-SGD do): the updates' sum over rounds stays within one rounding of the exact sum. A part is
known by its tensor and its index: the tensors are cut into parts of a fixed size whatever the group, so a part
keeps its identity from round to round. The averages a reducer answers are rounded the same way, once per part
(the same bytes to every member, so that members stay identical), with feedback too, the part then known by the
group and its index in the reducer's share: in a group that stays the same, the updates members apply sum to the
exact sum within about one rounding. Losses of a round that fails are forgotten, not fed back (its parts are sent
again).

hivemind has no codec of this kind (its 8-bit codecs fail to decode under numpy 2 in hivemind 1.1.12), and decodes
parts by the codec their message names, so swarm/training/allreduce.py decodes every part with this one.
"""

from __future__ import annotations

import math
import threading

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2

from protocol.codec import INT8_BLOCK, dtype_name, int8_decode, int8_encode, int8_nbytes, parse_dtype

_RAW = NoCompression()


class Int8Compression(CompressionBase):
    """Blockwise int8 parts, with error feedback on the parts this member sends (`feedback`)."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT

    def __init__(self, feedback: bool = True):
        self.feedback = feedback
        self._residuals: dict[tuple, torch.Tensor] = {}  # (tensor, part) -> what its last sending lost
        self._pending: dict[tuple, torch.Tensor | None] = {}  # of the round under way: kept if it completes
        self._lock = threading.Lock()  # parts are compressed in executor threads

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        """A part (`info` says which, for the feedback; a key of None: no feedback)."""
        values = tensor.detach()
        part = (info.key, info.part_index) if self.feedback and info.key is not None else None
        if part is not None:
            with self._lock:
                residual = self._residuals.get(part)
            if residual is not None and residual.shape == values.shape:
                values = values + residual
        if not bool(torch.isfinite(values).all()):  # sent as it is: the average must show the NaN or inf
            if part is not None:
                with self._lock:
                    self._pending[part] = None
            return _RAW.compress(values, info)
        data = int8_encode(values)
        if part is not None:
            lost = values - int8_decode(data, tuple(values.shape), values.dtype, "a part")
            with self._lock:
                self._pending[part] = lost
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=data.numpy().tobytes(),
            size=values.shape,
            dtype=dtype_name(values.dtype),
            requires_grad=False,
        )

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        """The part a message holds, raw or int8.

        Raises:
            ValueError: a message of another codec, or a buffer of the wrong size.
            BadRequestError: a scale that is negative or not finite.
        """
        if serialized.compression == _RAW.compression_type:
            return _RAW.extract(serialized)
        if serialized.compression != self.compression_type:
            raise ValueError(
                f"a part of compression {serialized.compression}, not int8: members disagree on the recipe"
            )
        shape = tuple(serialized.size)
        numel = math.prod(shape)
        if len(serialized.buffer) != int8_nbytes(numel):
            raise ValueError(f"an int8 part of {numel} values has {len(serialized.buffer)} bytes")
        data = torch.frombuffer(bytearray(serialized.buffer), dtype=torch.uint8)
        return int8_decode(data, shape, parse_dtype(serialized.dtype), "an int8 part")

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (INT8_BLOCK + 4) / INT8_BLOCK / info.descriptor.dtype.itemsize

    def commit(self) -> None:
        """The round completed: what its parts lost is fed into the next."""
        with self._lock:
            for part, lost in self._pending.items():
                if lost is None:
                    self._residuals.pop(part, None)
                else:
                    self._residuals[part] = lost
            self._pending.clear()

    def discard(self) -> None:
        """The round failed: its parts will be sent again, with the residuals they had."""
        with self._lock:
            self._pending.clear()
