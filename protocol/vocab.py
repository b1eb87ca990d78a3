"""Fixed vocabularies as string enums: members compare equal to their strings, so records and flags keep their text.

`StrEnum` is the standard library's from Python 3.11 on; on 3.10 an equivalent is defined here.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:

    class StrEnum(str, enum.Enum):
        """enum.StrEnum of Python 3.11: a str whose str() is its value."""

        def __str__(self) -> str:
            return str(self.value)


def choices(vocabulary: type[enum.Enum]) -> tuple[str, ...]:
    """The strings of a vocabulary, in definition order (for argparse choices and error messages)."""
    return tuple(member.value for member in vocabulary)


class Transport(StrEnum):
    """How clients reach a peer, as its record announces."""

    DIRECT = "direct"
    """gRPC at the announced endpoint."""
    P2P = "p2p"
    """gRPC through libp2p streams of the peer's DHT node, through a relay when it announces any."""


class DType(StrEnum):
    """Compute dtypes a peer may run and announce."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Quantization(StrEnum):
    """How a peer holds its blocks' linear weights (peer/quantize.py), as its record announces."""

    NONE = "none"
    """As the checkpoint has them, in the compute dtype."""
    INT8 = "int8"
    """int8 with a scale per output row: a quarter of float32's bytes."""
    NF4 = "nf4"
    """4-bit NormalFloat in blocks of 64: about a seventh of float32's bytes."""


class TrainMode(StrEnum):
    """What a training peer trains."""

    FULL = "full"
    """Every weight of its span."""
    LORA = "lora"
    """LoRA adapters of its span's linear layers."""


class WireDType(StrEnum):
    """How a client's hidden states and gradients, and the peers' answers to it, travel (lossy but the first)."""

    NONE = "none"
    """As computed: exact."""
    FLOAT16 = "float16"
    """float32 sent as float16: half the bytes, 11 bits of mantissa, values clamped to +-65504."""
    BFLOAT16 = "bfloat16"
    """float32 sent as bfloat16: half the bytes, 8 bits of mantissa, float32's range."""
    INT8 = "int8"
    """Blockwise 8-bit (64 values per block, each scaled by its max |x|): a quarter of float32's bytes."""


class Offload(StrEnum):
    """Where a peer keeps the blocks that its memory budget does not hold (peer/offload.py)."""

    NONE = "none"
    """Nowhere: every block is resident, and the budget must hold them all."""
    HOST = "host"
    """In host memory (pinned), copied to the GPU one block ahead of its use."""
    DISK = "disk"
    """In safetensors files, one per block, read one block ahead of its use."""
