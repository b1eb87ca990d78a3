"""Compressed activations (`ClientConfig.wire_dtype`, `swarmlm train --wire-dtype`), on an in-memory swarm.

Hidden states and gradients travel to the peers compressed, and the peers answer (and push steps on) compressed
too. "none" stays exact; float16, bfloat16 and blockwise int8 change the results by their rounding only: the logits
and input gradients stay within the bounds measured below of the local model's, but are not its bits (so the
compression did happen). The tiny Llama is served as 0:2 and 2:4, so every tensor crosses two hops each way.
"""

from __future__ import annotations

import pytest
import torch

from client.config import ClientConfig
from tests.helpers.generation import generate_with_logits
from tests.helpers.models import VOCAB_SIZE

# |swarm - local| / |local| (norms), per wire dtype, for (logits, input gradients): their rounding at every hop,
# amplified through the tiny random model's four layers (8-bit's error on the hidden states, alone 0.5%, reaches 3%
# in the logits and 12% in the gradients here)
TOLERANCE = {"none": (1e-5, 1e-5), "float16": (5e-3, 5e-3), "bfloat16": (2e-2, 3e-2), "int8": (6e-2, 2e-1)}


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def _forward_backward(model, ids: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = embeds.clone().requires_grad_(True)
    out = model(inputs_embeds=inputs, labels=ids)
    out.loss.backward()
    return out.logits.detach(), inputs.grad


@pytest.mark.parametrize("wire_dtype", list(TOLERANCE))
def test_training_passes_stay_within_the_wire_dtypes_rounding(fake_swarm, tiny_llama_local, wire_dtype):
    fake_swarm.add_peer(0, 2)
    fake_swarm.add_peer(2, 4)
    ids = torch.randint(3, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(61))
    embeds = tiny_llama_local.get_input_embeddings()(ids).detach()
    expected = _forward_backward(tiny_llama_local, ids, embeds)
    remote = fake_swarm.client(wire_dtype=wire_dtype, verify_fraction=0.0)
    try:
        got = _forward_backward(remote, ids, embeds)
    finally:
        remote.shutdown()
    for mine, reference, tolerance in zip(got, expected, TOLERANCE[wire_dtype]):
        assert _relative(mine, reference) <= tolerance
        if wire_dtype != "none":
            assert not torch.equal(mine, reference), "nothing was rounded: the compression did not happen"


@pytest.mark.parametrize("forward_steps", ["never", "always"], ids=["client-driven", "pushed"])
def test_generation_with_int8_activations_stays_within_their_rounding(fake_swarm, tiny_llama_local, forward_steps):
    fake_swarm.add_peer(0, 2)
    fake_swarm.add_peer(2, 4)
    ids = torch.randint(3, VOCAB_SIZE, (1, 8), generator=torch.Generator().manual_seed(62))
    # the local model fed the swarm's tokens: the logits at each step are then comparable
    remote = fake_swarm.client(wire_dtype="int8", forward_steps=forward_steps, verify_inference=0.0)
    try:
        tokens, logits = generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False)
    finally:
        remote.shutdown()
    with torch.no_grad():
        expected = tiny_llama_local(tokens[:, :-1]).logits[:, ids.shape[1] - 1 :]
    assert _relative(logits, expected) <= TOLERANCE["int8"][0]
    assert not torch.equal(logits, expected)


def test_an_unknown_wire_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"wire_dtype must be one of .*'int4'"):
        ClientConfig(initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), wire_dtype="int4")
