"""A peer that computes slightly wrong results: spot checks find it, ban it, and the client's results stay exact.

On an in-memory swarm (tests/helpers/fake_swarm.py): three honest peers and a corrupter serve all blocks. The corrupter
adds noise of 1e-2 x std to its answers (lie "perturb" of tests/helpers/liar.py), which stay finite and of the right
shape and dtype, so client/checks.py lets them through. It announces a far higher throughput, so that every route
goes to it first. Clients check every hop (verify_fraction=1, seeded).

- With only honest answers, the results are bitwise those of a client that does not check, and nobody is banned.
- A corrupter of forward or of backward is banned at its first wrong answer (three honest peers outvote it),
  and every result, that first one included, matches the local model.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fake_swarm import Fault
from tests.helpers.models import VOCAB_SIZE

LIAR_THROUGHPUT = 1e6  # the honest peers announce 1: routing prefers the corrupter by far
MAX_PASSES = 5  # forward+backward passes within which the corrupter must be banned


def _swarm(fake_swarm, corrupt_on: list[str] = ()):
    """(the honest peers' ids, the corrupter), all serving blocks 0:4."""
    honest = [fake_swarm.add_peer(0, 4).peer_id for _ in range(3)]
    faults = [Fault("perturb", method=method) for method in corrupt_on]
    return honest, fake_swarm.add_peer(0, 4, throughput=LIAR_THROUGHPUT, faults=faults)


def _embeds(local, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(seed))
    return ids, local.get_input_embeddings()(ids).detach()


def _forward_backward(model, ids, embeds) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits, and the gradient of the loss w.r.t. the input embeddings."""
    inputs = embeds.clone().requires_grad_(True)
    out = model(inputs_embeds=inputs, labels=ids)
    out.loss.backward()
    return out.logits.detach(), inputs.grad


def _assert_matches_local(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]):
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=1e-4, rtol=1e-4)


def test_with_honest_peers_checks_change_no_result_and_ban_nobody(fake_swarm, tiny_llama_local):
    honest, corrupter = _swarm(fake_swarm)
    ids, embeds = _embeds(tiny_llama_local, seed=31)
    plain, checked = fake_swarm.client(verify_fraction=0.0), fake_swarm.client(verify_fraction=1.0, verify_seed=0)
    try:
        expected = _forward_backward(plain, ids, embeds)
        got = _forward_backward(checked, ids, embeds)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        _assert_matches_local(got, _forward_backward(tiny_llama_local, ids, embeds))
        stats = checked.sequence.spot_checks.stats
        assert stats.verified == 2 and stats.mismatches == 0 and stats.unverifiable == 0  # one hop each way
        assert plain.sequence.spot_checks.stats.verified == 0
        bans = checked.sequence.bans
        assert all(bans.strikes(pid) == 0 for pid in [corrupter.peer_id, *honest])
        assert checked.sequence.failovers == 0
    finally:
        plain.shutdown()
        checked.shutdown()


@pytest.mark.parametrize("method", ["forward", "backward"])
def test_a_corrupter_is_banned_within_a_few_passes_and_results_match_local(fake_swarm, tiny_llama_local, method):
    local = tiny_llama_local
    honest, corrupter = _swarm(fake_swarm, [method])
    remote = fake_swarm.client(verify_fraction=1.0, verify_seed=0)
    stats = remote.sequence.spot_checks.stats
    try:
        for passes in range(1, MAX_PASSES + 1):
            ids, embeds = _embeds(local, seed=40 + passes)
            _assert_matches_local(_forward_backward(remote, ids, embeds), _forward_backward(local, ids, embeds))
            if stats.caught:
                break
        assert stats.caught == [corrupter.peer_id], f"not banned within {MAX_PASSES} passes: {stats}"
        assert corrupter.acted > 0, "the corrupter was not asked: the test proves nothing"
        assert stats.mismatches == 1 and stats.unresolved == 0
        bans = remote.sequence.bans
        assert corrupter.peer_id in bans.banned()
        assert all(bans.strikes(pid) == 0 for pid in honest)

        # afterwards the corrupter (still lying) is not used, and results stay exact
        ids, embeds = _embeds(local, seed=50)
        _assert_matches_local(_forward_backward(remote, ids, embeds), _forward_backward(local, ids, embeds))
        assert corrupter.peer_id not in {hop.peer_id for hop in remote.sequence.last_route}
        assert stats.mismatches == 1
    finally:
        remote.shutdown()
