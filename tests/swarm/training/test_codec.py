"""The int8 codec of rounds (swarm/training/codec.py): an eighth of float64's bytes, error feedback per part."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import CompressionInfo

from swarm.training.codec import Int8Compression


def _part(values: torch.Tensor, key=0, index=0) -> CompressionInfo:
    return CompressionInfo.from_tensor(values, key=key).get_part(index, values.numel())


def test_a_part_round_trips_within_a_rounding_of_its_block_in_an_eighth_of_the_bytes():
    codec = Int8Compression(feedback=False)
    values = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    message = codec.compress(values, _part(values))
    decoded = codec.extract(message)
    assert decoded.dtype == torch.float64 and decoded.shape == values.shape
    blocks = values.reshape(-1)[:960].view(-1, 64).abs().amax(dim=1)
    assert float((decoded - values)[:960].view(-1, 64).abs().amax(dim=1).sub(blocks / 254).max()) <= 1e-6
    assert len(message.buffer) == 16 * (64 + 4)  # 1000 values in 16 blocks: 1.09 bytes a value
    zeros = torch.zeros(70, dtype=torch.float64)
    assert torch.equal(codec.extract(codec.compress(zeros, _part(zeros))), zeros)


def test_nan_and_inf_travel_as_they_are():
    codec = Int8Compression()
    values = torch.tensor([1.0, float("nan"), float("inf"), -2.0], dtype=torch.float64)
    decoded = codec.extract(codec.compress(values, _part(values)))
    assert torch.equal(decoded.isnan(), values.isnan()) and decoded[2] == float("inf") and decoded[3] == -2.0


def test_feedback_cancels_the_losses_of_committed_rounds_only():
    values = torch.randn(640, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1e-3
    values[0] = 1.0  # one large value per block row 0: the rest of its block rounds coarsely
    with_feedback, without = Int8Compression(), Int8Compression(feedback=False)
    sums = {}
    for codec in (with_feedback, without):
        total = torch.zeros_like(values)
        for _ in range(8):
            total += codec.extract(codec.compress(values, _part(values)))
            codec.commit()
        sums[codec.feedback] = float((total - 8 * values).abs().max())
    assert sums[True] < sums[False] / 4, sums  # the sum over rounds stays within about one rounding
    # a failed round's losses are forgotten: the part is sent again as before, not corrected twice
    again = Int8Compression()
    first = again.extract(again.compress(values, _part(values)))
    again.discard()
    assert torch.equal(again.extract(again.compress(values, _part(values))), first)
    # parts are told apart by tensor and index: one's losses never leak into another
    other = again.extract(again.compress(values, _part(values, key=1)))
    assert torch.equal(other, first)


def test_messages_it_cannot_read_are_refused():
    codec = Int8Compression()
    values = torch.ones(64, dtype=torch.float64)
    message = codec.compress(values, _part(values))
    message.buffer = message.buffer[:-1]
    with pytest.raises(ValueError, match="has 67 bytes"):
        codec.extract(message)
    message.compression = 2  # another codec's
    with pytest.raises(ValueError, match="members disagree"):
        codec.extract(message)
