"""A peer that lies through a real proxy: the client bans it, routes its blocks to an honest peer, and its results
stay exact.

One swarm for the module: two honest peers and a liar (tests/helpers/liar.py: a real `swarmlm peer` behind a proxy
that corrupts chosen answers) all serve all blocks. The liar announces a far higher throughput, so that every
client routes to it first. For two lies on inference and one on backward, the test rewrites the liar's mode file,
runs a fresh client (greedy generation, or a forward and backward) and checks that:

- the client's results equal the local model's (tokens and per-step logits, logits and input gradients);
- the liar told its lie, and the client struck it (banned, or set aside for the noise lie) and nobody else;
- nothing reached the caller: no error, whatever the liar's error code said.

Every other lie, on every method, is told by in-memory peers in tests/client/test_lying_peers.py, in milliseconds.
Inference lies start a few tokens in, so that the client replays a history into the honest peer. The noise lie
("perturb": finite, of the right shape) only a check by other peers sees: that client checks every step it can
(`verify_inference=1`), the two honest peers outvote the liar, and generation is redone without it (the session sets
it aside; two against one bans nobody, since two colluders could be the two).
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
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny_llama
from tests.helpers.processes import Swarm

NUM_LAYERS = 4
PROMPT = 6
LIE_FROM = PROMPT + 2  # the third decode step and later
LIAR = Path(__file__).resolve().parents[1] / "helpers" / "liar.py"
LIAR_THROUGHPUT = 1e6  # the honest peer announces 1: routing prefers the liar by far

CASES = [("inference", "step_id"), ("inference", "perturb"), ("backward", "nan")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-liar", num_layers=NUM_LAYERS, seed=3)


@pytest.fixture(scope="module")
def local(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


class LyingSwarm:
    def __init__(self, swarm: Swarm, model_path: Path, mode_file: Path):
        self.swarm, self.model_path, self.mode_file = swarm, model_path, mode_file
        swarm.start_bootstrap()
        self.honest = swarm.start_peer(model_path, "--blocks", f"0:{NUM_LAYERS}", "--throughput", "1")
        self.spare = swarm.start_peer(model_path, "--blocks", f"0:{NUM_LAYERS}", "--throughput", "1")
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
            "the honest peers and the liar to be ONLINE",
        )
        (self.liar_id,) = [pid for pid, info in snapshot.online().items() if info.throughput == LIAR_THROUGHPUT]
        self.honest_id, self.spare_id = sorted(pid for pid in snapshot.online() if pid != self.liar_id)

    def lie(self, method: str, lie: str) -> None:
        self.mode_file.write_text(json.dumps({"lie": lie, "on": method, "from_position": LIE_FROM}))

    def lies_told(self, method: str, lie: str) -> int:
        return self.liar.stdout().count(f"lied: {lie} on {method.capitalize()}\n")

    def connect(self, **options):
        return AutoDistributedModelForCausalLM.from_pretrained(
            str(self.model_path), initial_peers=self.swarm.initial_peers, **options
        )


@pytest.fixture(scope="module")
def lying(tmp_path_factory, model_path):
    workdir = tmp_path_factory.mktemp("lying-swarm")
    with Swarm(workdir / "swarm") as swarm:
        yield LyingSwarm(swarm, model_path, workdir / "mode.json")


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method, lie", CASES, ids=[f"{m}-{lie}" for m, lie in CASES])
def test_a_lying_peer_is_banned_and_the_results_stay_exact(lying, local, method, lie):
    told_before = lying.lies_told(method, lie)
    lying.lie(method, lie)
    remote = lying.connect(verify_inference=1.0 if lie == "perturb" else 0.0)
    try:
        if method == "inference":
            ids = _ids(1, PROMPT, seed=21)
            expected = generate_with_logits(local, ids, max_new_tokens=10, do_sample=False)
            got = generate_with_logits(remote, ids, max_new_tokens=10, do_sample=False)
            assert_same_generation(got, expected)
            assert remote.sequence.recoveries >= 1
            if lie == "perturb":  # caught by a check, not by the answer's form
                stats = remote.sequence.spot_checks.stats
                assert stats.outvoted == [lying.liar_id] and stats.caught == []
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
        assert lying.lies_told(method, lie) > told_before, "the liar was not asked: the test proves nothing"
        bans = remote.sequence.bans
        assert bans.strikes(lying.honest_id) == bans.strikes(lying.spare_id) == 0
        if lie != "perturb":  # an answer of the wrong form is a failure of the call: banned
            assert bans.strikes(lying.liar_id) >= 1 and remote.sequence.failovers == bans.strikes(lying.liar_id)
    finally:
        lying.lie(method, "honest")
        remote.shutdown()


def test_a_record_pointing_at_another_peers_server_is_an_impostor(lying, local):
    """A stranger announces the honest peer's endpoint under its own key, faster than anyone: the server there
    cannot sign the client's nonce with the stranger's key, so the client bans the stranger and stays exact."""
    from protocol.records import ModelRecord, ServerInfo
    from swarm.dht.directory import announce
    from swarm.dht.node import start_dht, stop_dht

    prefix = prefix_for_model(str(lying.model_path))
    honest = lying.swarm.snapshot(prefix, NUM_LAYERS).servers[lying.honest_id]
    stranger = start_dht(lying.swarm.initial_peers)
    try:
        fake = ServerInfo.from_wire({**honest.to_wire(), "throughput": 1e7})
        assert not announce(stranger, prefix, fake, ModelRecord(num_blocks=NUM_LAYERS, repository="x"), expiration_s=60)
        impostor = stranger.peer_id.to_base58()
        lying.swarm.wait_for(
            lambda: impostor in lying.swarm.snapshot(prefix, NUM_LAYERS).online(), 30, "the stranger's record"
        )
        remote = lying.connect()
        try:
            ids = _ids(1, PROMPT, seed=23)
            expected = generate_with_logits(local, ids, max_new_tokens=6, do_sample=False)
            assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
            bans = remote.sequence.bans
            assert bans.strikes(impostor) == 1 and impostor in bans.banned()
            assert bans.strikes(lying.honest_id) == 0
            assert remote.sequence.paths.get(impostor) is None
        finally:
            remote.shutdown()
    finally:
        stop_dht(stranger)


def test_a_strangers_plain_values_under_every_block_key_erase_nothing(lying, local):
    """A stranger with a plain hivemind DHT and hivemind's own signature check stores a plain value, pinned 1e7 s
    ahead, under every block key, and a megabyte under a subkey of its own: no honest node keeps either, and a fresh
    client still finds every peer and generates exactly."""
    from hivemind.dht.crypto import RSASignatureValidator

    from protocol.records import block_key
    from swarm.dht.node import start_plain_dht, stop_dht
    from tests.helpers.dht_store import Padding, store_in_node

    prefix = prefix_for_model(str(lying.model_path))
    stranger = start_plain_dht(lying.swarm.initial_peers, record_validators=[RSASignatureValidator()])
    try:
        for block in range(NUM_LAYERS):
            # (the plain value last: a subkey stored after it, with a later expiry, would replace it by a dictionary)
            store_in_node(stranger, block_key(prefix, block), "junk", Padding(1 << 20), expiration_s=1e7)
            store_in_node(stranger, block_key(prefix, block), None, "erased", expiration_s=1e7)
        assert {lying.honest_id, lying.liar_id} <= set(lying.swarm.snapshot(prefix, NUM_LAYERS).online())
        remote = lying.connect()
        try:
            ids = _ids(1, PROMPT, seed=24)
            expected = generate_with_logits(local, ids, max_new_tokens=6, do_sample=False)
            assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
            bans = remote.sequence.bans  # (the impostor of the test above may still have a record: not these)
            assert bans.strikes(lying.honest_id) == bans.strikes(lying.spare_id) == bans.strikes(lying.liar_id) == 0
        finally:
            remote.shutdown()
    finally:
        stop_dht(stranger)
