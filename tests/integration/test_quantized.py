"""Quantized peers (`swarmlm peer --quantize`) on live processes: exact against the model with rounded weights.

One swarm serves a tiny Llama twice over, once from an int8 peer and once from an nf4 peer (all 4 blocks each). A
client that asks for a quantization uses only the peers holding their weights so: its logits and greedy tokens
equal those of the local model whose decoder layers' linear weights are rounded the same way. A client that asks
for none (the default) uses neither and says which flag would; nobody can export the rounded weights as the
checkpoint's. The rounding itself is tests/peer/test_quantize.py's.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from client.training.export import fetch_peer_weights
from peer.capacity import capacity
from peer.quantize import dequantized_copy_
from protocol.errors import BadRequestError, NoPeersError
from protocol.records import prefix_for_model
from protocol.vocab import Quantization
from swarm.models.checkpoint import load_config
from tests.helpers.generation import ATOL, assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny
from tests.helpers.processes import Swarm

MODES = [Quantization.INT8, Quantization.NF4]


@pytest.fixture(scope="module")
def quantized_swarm(tmp_path_factory):
    """(swarm, model path), with an int8 and an nf4 peer ONLINE."""
    path = make_tiny("llama", tmp_path_factory.mktemp("llama") / "tiny-llama", seed=2)
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        for mode in MODES:
            swarm.start_peer(path, "--blocks", "0:4", "--quantize", str(mode))
        prefix = prefix_for_model(str(path))
        swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == 2, 120, "2 quantized peers ONLINE")
        yield swarm, path


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_swarm_computes_the_model_with_rounded_weights(quantized_swarm, mode):
    swarm, path = quantized_swarm
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dequantized_copy_(local.model.layers, mode)  # the embeddings and head stay the client's own
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(path), initial_peers=swarm.initial_peers, quantization=mode
    )
    try:
        ids = _ids(2, 11, seed=1)
        with torch.no_grad():
            torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=ATOL, rtol=0)
        prompt = _ids(1, 5, seed=2)
        expected = generate_with_logits(local, prompt, max_new_tokens=12, do_sample=False)
        assert_same_generation(generate_with_logits(remote, prompt, max_new_tokens=12, do_sample=False), expected)
        (hop,) = remote._run(remote.sequence.plan(0, 4, inference=False))
        with pytest.raises(BadRequestError, match="--quantize"):  # rounded weights are not the checkpoint's
            remote._run(fetch_peer_weights(remote.sequence.pool, hop.endpoint, remote.sequence.prefix, 0, 4))
    finally:
        remote.shutdown()


def test_a_client_that_asks_for_no_quantization_uses_no_quantized_peer_and_says_how_to(quantized_swarm):
    swarm, path = quantized_swarm
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(path), initial_peers=swarm.initial_peers, wait_for_peers_s=1.0
    )
    try:
        with pytest.raises(NoPeersError, match=r"1 hold int8 weights, 1 hold nf4 weights: pass quantization='int8'"):
            remote(_ids(1, 4, seed=3))
    finally:
        remote.shutdown()


def test_auto_rounds_only_as_far_as_the_blocks_must_to_fit_and_says_what_fits(quantized_swarm):
    """`--quantize auto` with a budget that holds the 4 blocks as int8 but not in full: the peer logs how many
    blocks fit at each setting, takes int8, announces it, and loads within the budget."""
    swarm, path = quantized_swarm
    config = load_config(path)
    found = capacity(path, config, torch.float32, 1, range(4))
    budget = 4 * found.per_block[Quantization.INT8] + 1024
    assert found.per_block[Quantization.NONE] * 4 > budget
    peer = swarm.start_peer(
        path, "--blocks", "0:4", "--memory-budget", str(budget), "--quantize", "auto", "--dht-prefix", "tiny-auto"
    )
    try:
        (info,) = swarm.wait_online("tiny-auto", [(0, 4)], timeout_s=120).online().values()
        assert info.quantization == "int8"
        assert "--quantize auto: int8 for blocks 0:4" in peer.stderr(), peer.logs()
        assert re.search(r"blocks that fit in \S+ KiB: none \d, int8 4, nf4 4 \(of 4\)", peer.stderr()), peer.logs()
    finally:
        assert swarm.terminate(peer, timeout_s=60) == 0, peer.logs()
