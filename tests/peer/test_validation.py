"""peer.validation: NaN and inf are found in every float dtype a peer accepts, finite extremes pass."""

from __future__ import annotations

import pytest
import torch

from peer.validation import check_hidden
from protocol.errors import BadRequestError

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_rejected(dtype, bad):
    hidden = torch.randn(2, 3, 8).to(dtype)
    hidden[1, 2, 5] = bad
    with pytest.raises(BadRequestError, match="NaN or inf"):
        check_hidden(hidden, hidden_size=8, dtype=dtype)
    with pytest.raises(BadRequestError, match="NaN or inf"):  # also when not contiguous
        check_hidden(hidden.transpose(0, 1), hidden_size=8, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_largest_finite_values_pass(dtype):
    hidden = torch.full((1, 2, 8), torch.finfo(dtype).max, dtype=dtype)
    hidden[0, 1] = torch.finfo(dtype).min
    check_hidden(hidden, hidden_size=8, dtype=dtype)
