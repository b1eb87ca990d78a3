"""A peer that comes back under the same peer id (it keeps its key, swarm/trust/identity.py) at another endpoint: a
client that had measured it dials its new endpoint, with no failure on the old one."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE
from tests.helpers.processes import Swarm

NUM_LAYERS = 4


def test_a_peer_back_at_another_endpoint_is_dialed_there(tmp_path, tiny_llama_path):
    local = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    prefix = prefix_for_model(str(tiny_llama_path))
    identity = tmp_path / "peer.key"
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(31))
    expected = generate_with_logits(local, ids, max_new_tokens=6, do_sample=False)
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        first = swarm.start_peer(tiny_llama_path, "--blocks", f"0:{NUM_LAYERS}", "--identity", str(identity))
        ((peer_id, before),) = swarm.wait_online(prefix, [(0, NUM_LAYERS)]).online().items()
        remote = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers, directory_refresh_s=0.2
        )
        try:
            assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
            swarm.kill(first)
            swarm.start_peer(tiny_llama_path, "--blocks", f"0:{NUM_LAYERS}", "--identity", str(identity))
            swarm.wait_for(
                lambda: (
                    (info := swarm.snapshot(prefix, NUM_LAYERS).online().get(peer_id)) is not None
                    and info.endpoint != before.endpoint
                ),
                60,
                "the peer back at another endpoint",
            )
            assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
            assert remote.sequence.failovers == 0, "the client dialed the peer's old endpoint"
        finally:
            remote.shutdown()
