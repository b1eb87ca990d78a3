"""The random test models are informative: greedy decoding walks through many tokens, not one repeated.

With nearly flat logits (transformers' default init scale) a 24-token greedy run is one token repeated, and
bugs in positions or the KV cache leave the tokens unchanged; see tests/helpers/models.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tests.helpers.models import CONFIGS

MIN_DISTINCT = 10  # of 24 greedy tokens; the chosen scale gives 13-24 for these seeds


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_reference_has_many_distinct_tokens(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](4), dtype=torch.float32).eval()
    for seed in range(3):
        ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(seed))
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        distinct = len(set(out[0, 6:].tolist()))
        assert distinct >= MIN_DISTINCT, f"{family}, prompt seed {seed}: only {distinct} distinct greedy tokens"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_wrong_decode_position_moves_the_logits(family):
    """A decode step at position p+1 instead of p changes the logits far beyond the tests' 1e-4 tolerance."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](4), dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = []
        for position in (7, 8):
            cache = DynamicCache(config=model.config)
            model(ids[:, :7], cache=cache)
            logits.append(model(ids[:, 7:], cache=cache, position_ids=torch.tensor([[position]])).logits)
        right, wrong = logits
    assert (right - wrong).abs().max() > 1e-2
