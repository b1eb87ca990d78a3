"""A peer that computes slightly wrong results: spot checks find it, ban it, and the client's results stay exact.

One swarm for the module: two honest peers and a corrupter serve all blocks. The corrupter is tests/helpers/liar.py
(a real `swarmlm peer` behind a proxy) in mode `perturb`: it adds noise of 1e-2 x std to its answers, which
stay finite and of the right shape and dtype, so client/checks.py lets them through. It announces a far higher
throughput, so that every route goes to it first. Clients check every hop (verify_fraction=1, seeded).

- With only honest answers, the results are bitwise those of a client that does not check, and nobody is banned.
- A corrupter of forward or of backward is banned at its first wrong answer (two honest peers outvote it),
  and every result, that first one included, matches the local model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model
from tests.helpers.models import VOCAB_SIZE, make_tiny_llama
from tests.helpers.processes import Swarm

NUM_LAYERS = 4
LIAR = Path(__file__).resolve().parents[1] / "helpers" / "liar.py"
LIAR_THROUGHPUT = 1e6  # the honest peers announce 1: routing prefers the corrupter by far
MAX_PASSES = 5  # forward+backward passes within which the corrupter must be banned


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-spot", num_layers=NUM_LAYERS, seed=5)


@pytest.fixture(scope="module")
def local(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


class CorruptingSwarm:
    def __init__(self, swarm: Swarm, model_path: Path, mode_file: Path):
        self.swarm, self.model_path, self.mode_file = swarm, model_path, mode_file
        self.corrupt_on([])
        swarm.start_bootstrap()
        for _ in range(2):
            swarm.start_peer(model_path, "--blocks", f"0:{NUM_LAYERS}", "--throughput", "1")
        self.liar = swarm.start_peer(
            model_path,
            "--blocks",
            f"0:{NUM_LAYERS}",
            "--throughput",
            str(LIAR_THROUGHPUT),
            command=[sys.executable, str(LIAR), str(mode_file)],
        )
        prefix = prefix_for_model(str(model_path))
        snapshot = swarm.wait_for(
            lambda: (s := swarm.snapshot(prefix, NUM_LAYERS)) and len(s.online()) == 3 and s,
            120,
            "two honest peers and the corrupter to be ONLINE",
        )
        (self.liar_id,) = [pid for pid, info in snapshot.online().items() if info.throughput == LIAR_THROUGHPUT]
        self.honest_ids = sorted(pid for pid in snapshot.online() if pid != self.liar_id)

    def corrupt_on(self, methods: list[str]) -> None:
        self.mode_file.write_text(json.dumps({"lie": "perturb" if methods else "honest", "on": methods}))

    def lies_told(self) -> int:
        return self.liar.stdout().count("lied: perturb on ")

    def connect(self, **options):
        return AutoDistributedModelForCausalLM.from_pretrained(
            str(self.model_path), initial_peers=self.swarm.initial_peers, **options
        )


@pytest.fixture(scope="module")
def corrupting(tmp_path_factory, model_path):
    workdir = tmp_path_factory.mktemp("spot-swarm")
    with Swarm(workdir / "swarm") as swarm:
        yield CorruptingSwarm(swarm, model_path, workdir / "mode.json")


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


def test_with_honest_peers_checks_change_no_result_and_ban_nobody(corrupting, local):
    ids, embeds = _embeds(local, seed=31)
    plain, checked = corrupting.connect(verify_fraction=0.0), corrupting.connect(verify_fraction=1.0, verify_seed=0)
    try:
        expected = _forward_backward(plain, ids, embeds)
        got = _forward_backward(checked, ids, embeds)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        _assert_matches_local(got, _forward_backward(local, ids, embeds))
        stats = checked.sequence.spot_checks.stats
        assert stats.verified == 2 and stats.mismatches == 0 and stats.unverifiable == 0  # one hop each way
        assert plain.sequence.spot_checks.stats.verified == 0
        bans = checked.sequence.bans
        assert all(bans.strikes(pid) == 0 for pid in [corrupting.liar_id, *corrupting.honest_ids])
        assert checked.sequence.failovers == 0
    finally:
        plain.shutdown()
        checked.shutdown()


@pytest.mark.parametrize("method", ["forward", "backward"])
def test_a_corrupter_is_banned_within_a_few_passes_and_results_match_local(corrupting, local, method):
    told_before = corrupting.lies_told()
    corrupting.corrupt_on([method])
    remote = corrupting.connect(verify_fraction=1.0, verify_seed=0)
    stats = remote.sequence.spot_checks.stats
    try:
        for passes in range(1, MAX_PASSES + 1):
            ids, embeds = _embeds(local, seed=40 + passes)
            _assert_matches_local(_forward_backward(remote, ids, embeds), _forward_backward(local, ids, embeds))
            if stats.caught:
                break
        assert stats.caught == [corrupting.liar_id], f"not banned within {MAX_PASSES} passes: {stats}"
        assert corrupting.lies_told() > told_before, "the corrupter was not asked: the test proves nothing"
        assert stats.mismatches == 1 and stats.unresolved == 0
        bans = remote.sequence.bans
        assert corrupting.liar_id in bans.banned()
        assert all(bans.strikes(pid) == 0 for pid in corrupting.honest_ids)

        # afterwards the corrupter (still lying) is not used, and results stay exact
        ids, embeds = _embeds(local, seed=50)
        _assert_matches_local(_forward_backward(remote, ids, embeds), _forward_backward(local, ids, embeds))
        assert corrupting.liar_id not in {hop.peer_id for hop in remote.sequence.last_route}
        assert stats.mismatches == 1
    finally:
        corrupting.corrupt_on([])
        remote.shutdown()
