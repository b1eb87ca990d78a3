"""Mixture-of-experts models on live peers, against the local Hugging Face model with the same weights.

transformers 5 fuses the experts of Mixtral and Qwen-MoE checkpoints on load (per-expert w1/w2/w3 or
gate/up/down become one gate_up_proj and one down_proj per layer), so a peer must convert a span's tensors as
transformers does (peer/blocks.py). One swarm serves the three families on split spans, Mixtral with two peers of
its second span: logits and greedy tokens equal the local model's (router top-k as transformers computes it), and
generation goes on exactly when the Mixtral peer on the route dies. In-process exactness (padding, caches,
rewinds) is tests/peer/test_blocks.py's, on the same configs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol import swarmlm_pb2 as pb
from protocol.records import prefix_for_model
from tests.helpers.generation import ATOL, ActAfter, assert_same_generation, generate_with_logits
from tests.helpers.models import MOE_CONFIGS, VOCAB_SIZE, save_random_model
from tests.helpers.peers import process_serving
from tests.helpers.processes import Swarm

FAMILIES = {
    # family: spans served by one peer each
    "mixtral": [(0, 2), (2, 4), (2, 4)],  # two peers of 2:4: one is killed mid-generation
    "qwen2_moe": [(0, 1), (1, 4)],  # block 1 is a plain MLP (mlp_only_layers), the others routed + shared experts
    "qwen3_moe": [(0, 3), (3, 4)],
}


@pytest.fixture(scope="module")
def moe_swarm(tmp_path_factory):
    """(swarm, {family: model path}, {family: peer processes})."""
    paths = {
        family: save_random_model(MOE_CONFIGS[family](4), tmp_path_factory.mktemp(family), seed=0)
        for family in FAMILIES
    }
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        peers = {
            family: [swarm.start_peer(paths[family], "--blocks", f"{a}:{b}") for a, b in spans]
            for family, spans in FAMILIES.items()
        }
        for family, spans in FAMILIES.items():
            prefix = prefix_for_model(str(paths[family]))
            swarm.wait_for(online(swarm, prefix, len(spans)), 120, f"{len(spans)} {family} peers ONLINE")
        yield swarm, paths, peers


def online(swarm: Swarm, prefix: str, count: int):
    """A probe: whether `count` peers of `prefix` are ONLINE."""
    return lambda: len(swarm.snapshot(prefix, 4).online()) == count


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_tokens_equal_the_local_model(moe_swarm, family):
    swarm, paths, _ = moe_swarm
    local = AutoModelForCausalLM.from_pretrained(paths[family], dtype=torch.float32).eval()
    remote = AutoDistributedModelForCausalLM.from_pretrained(str(paths[family]), initial_peers=swarm.initial_peers)
    try:
        ids = _ids(2, 13, seed=1)
        with torch.no_grad():
            torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=ATOL, rtol=0)
        prompt = _ids(1, 6, seed=2)
        expected = generate_with_logits(local, prompt, max_new_tokens=16, do_sample=False)
        assert_same_generation(generate_with_logits(remote, prompt, max_new_tokens=16, do_sample=False), expected)
    finally:
        remote.shutdown()


def test_a_peer_with_one_expert_a_layer_on_the_device_computes_the_same_and_counts_its_cache(moe_swarm):
    """`--expert-cache 1 --expert-store disk` (peer/experts.py): the Qwen3-MoE model from one peer holding one expert
    of each layer at a time, the others in files, exact against the local model; Info reports its hits, misses and
    prefetches, and the files go when the peer stops."""
    swarm, paths, _ = moe_swarm
    path = paths["qwen3_moe"]
    peer = swarm.start_peer(
        path,
        "--blocks",
        "0:4",
        "--expert-cache",
        "1",
        "--expert-prefetch",
        "--expert-store",
        "disk",
        "--dht-prefix",
        "qwen3-moe-cached",
    )
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(path), initial_peers=swarm.initial_peers, dht_prefix="qwen3-moe-cached"
    )
    try:
        ids = _ids(2, 11, seed=4)
        with torch.no_grad():
            torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=ATOL, rtol=0)
        prompt = _ids(1, 6, seed=5)
        expected = generate_with_logits(local, prompt, max_new_tokens=12, do_sample=False)
        assert_same_generation(generate_with_logits(remote, prompt, max_new_tokens=12, do_sample=False), expected)
        (hop,) = remote._run(remote.sequence.plan(0, 4, inference=False))
        info = remote._run(remote.sequence.pool.unary(hop.endpoint, "info", pb.InfoRequest(), 10.0))
        assert info.expert_misses > 0 and info.expert_hits > 0 and info.expert_prefetched > 0, info
        (folder,) = re.findall(r"the rest on disk in (\S+)", peer.stderr())
        assert len(list(Path(folder).glob("block-*.weights"))) == 4 * 4  # 4 experts of each of 4 layers
    finally:
        remote.shutdown()
        assert swarm.terminate(peer, timeout_s=60) == 0, peer.logs()
    assert "expert cache:" in peer.stderr() and "hit rate" in peer.stderr(), peer.logs()
    assert not Path(folder).exists()


def test_mixtral_generation_survives_the_death_of_a_peer_on_its_route(moe_swarm):
    swarm, paths, peers = moe_swarm
    path = paths["mixtral"]
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _ids(1, 5, seed=3)
    expected = generate_with_logits(local, prompt, max_new_tokens=24, do_sample=False)
    remote = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
    try:
        with remote.inference_session(max_length=40) as session:

            def kill_second_hop():
                (span,) = [s for s in session.remote.spans if s.hop.start == 2]
                swarm.kill(process_serving(peers["mixtral"], span.hop.endpoint))

            streamer = ActAfter(10, kill_second_hop)
            got = generate_with_logits(remote, prompt, max_new_tokens=24, do_sample=False, streamer=streamer)
            assert streamer.acted and session.recoveries >= 1
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()
