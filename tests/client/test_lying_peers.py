"""A peer that lies: the client bans it, routes its blocks to an honest peer, and its results stay exact.

On an in-memory swarm (tests/helpers/fake_swarm.py): an honest peer and a liar serve all blocks; the liar announces a
far higher throughput, so that every route goes to it first. For each lie and each method the test checks that:

- the client's results equal the local model's (tokens and per-step logits, logits and input gradients);
- the liar told its lie, and the client struck it (banned) and nobody else;
- nothing reached the caller: no error, whatever the liar's error code said.

Inference lies start at the fourth step, so that the client replays a history into the honest peer. A record that
announces another peer's server is an impostor. tests/integration/test_lying_peer.py lies through a real proxy.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fake_swarm import Fault
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE

PROMPT = 6
LIE_FROM_STEP = 3  # steps answered honestly first: the prompt and two decode steps
LIAR_THROUGHPUT = 1e6  # the honest peer announces 1: routing prefers the liar by far

TENSOR_LIES = ["bad_request", "shape", "dtype", "nan", "empty"]
CASES = [("inference", lie) for lie in [*TENSOR_LIES, "kind", "position", "step_id"]] + [
    (method, lie) for method in ("forward", "backward") for lie in TENSOR_LIES
]


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def _fault(method: str, lie: str) -> Fault:
    after = LIE_FROM_STEP if method == "inference" else 0
    if lie == "bad_request":  # refused as if the client's input were wrong
        return Fault("error", method=method, after=after, code="bad_request")
    return Fault(lie, method=method, after=after)


@pytest.mark.parametrize("method, lie", CASES, ids=[f"{m}-{lie}" for m, lie in CASES])
def test_a_lying_peer_is_banned_and_the_results_stay_exact(fake_swarm, tiny_llama_local, method, lie):
    local = tiny_llama_local
    honest = fake_swarm.add_peer(0, 4)
    liar = fake_swarm.add_peer(0, 4, throughput=LIAR_THROUGHPUT, faults=[_fault(method, lie)])
    remote = fake_swarm.client(verify_fraction=0.0)
    try:
        if method == "inference":
            ids = _ids(1, PROMPT, seed=21)
            expected = generate_with_logits(local, ids, max_new_tokens=10, do_sample=False)
            got = generate_with_logits(remote, ids, max_new_tokens=10, do_sample=False)
            assert_same_generation(got, expected)
            assert remote.sequence.recoveries >= 1
        else:
            ids = _ids(2, 8, seed=22)
            embeds = local.get_input_embeddings()(ids).detach()
            expected_in = embeds.clone().requires_grad_(True)
            expected = local(inputs_embeds=expected_in, labels=ids)
            expected.loss.backward()
            got_in = embeds.clone().requires_grad_(True)
            got = remote(inputs_embeds=got_in, labels=ids)
            torch.testing.assert_close(got.logits, expected.logits.detach(), atol=1e-4, rtol=0)
            got.loss.backward()
            torch.testing.assert_close(got_in.grad, expected_in.grad, atol=1e-5, rtol=1e-4)
        assert liar.acted > 0, "the liar was not asked: the test proves nothing"
        bans = remote.sequence.bans
        assert bans.strikes(liar.peer_id) >= 1 and bans.strikes(honest.peer_id) == 0
        assert remote.sequence.failovers == bans.strikes(liar.peer_id)
    finally:
        remote.shutdown()


def test_a_record_pointing_at_another_peers_server_is_an_impostor(fake_swarm, tiny_llama_local):
    """A stranger announces the honest peer's endpoint under its own key, faster than anyone: the server there
    cannot sign the client's nonce with the stranger's key, so the client bans the stranger and stays exact."""
    honest = fake_swarm.add_peer(0, 4)
    impostor = fake_swarm.add_peer(0, 4, throughput=1e7, announce=honest.endpoint)
    remote = fake_swarm.client()
    try:
        ids = _ids(1, PROMPT, seed=23)
        expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=6, do_sample=False)
        assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
        bans = remote.sequence.bans
        assert bans.strikes(impostor.peer_id) == 1 and impostor.peer_id in bans.banned()
        assert bans.strikes(honest.peer_id) == 0
        assert remote.sequence.paths.get(impostor.peer_id) is None
        assert honest.answered["info"] >= 2, "the impostor's record was not dialed: the test proves nothing"
    finally:
        remote.shutdown()
