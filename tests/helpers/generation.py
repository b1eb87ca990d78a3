"""Comparing a generation with its reference: the same tokens and the same logits at every step."""

from __future__ import annotations

import torch
from transformers.generation.streamers import BaseStreamer

ATOL = 1e-4  # fp32: cached vs uncached computation differs by ~1e-5 on the test models


def generate_with_logits(model, ids: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.generate()` with the raw logits of every step: (sequences, logits [batch, steps, vocab])."""
    out = model.generate(ids, output_logits=True, return_dict_in_generate=True, **options)
    return out.sequences, torch.stack(out.logits, dim=1)


def assert_same_generation(got, expected, atol: float = ATOL) -> None:
    """Same tokens, and the same logits at every step (pairs from `generate_with_logits`)."""
    (got_ids, got_logits), (expected_ids, expected_logits) = got, expected
    assert got_ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(got_logits, expected_logits, atol=atol, rtol=0)


class ActAfter(BaseStreamer):
    """Calls `act` once `after` new tokens were streamed: a failure in the middle of generate()."""

    def __init__(self, after: int, act):
        self.after, self.act, self.seen, self.acted = after, act, -1, False

    def put(self, value):
        self.seen += 1  # the first put is the prompt
        if self.seen == self.after and not self.acted:
            self.act()
            self.acted = True

    def end(self):
        pass
