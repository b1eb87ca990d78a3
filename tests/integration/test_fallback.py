"""A peer whose announced endpoint cannot be connected to (a port forward gone wrong) is still served over libp2p.

The peer listens on a free port but announces port 9 of loopback, where nothing listens, and says it is
reached directly (`--transport direct`, so no probe corrects it). The client's first connection fails at
connect time; it falls back to the peer's libp2p tunnel, and its results equal the local model's.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model
from swarm.net.tunnel import tunnel_address
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE


def test_a_client_falls_back_to_libp2p_when_the_endpoint_does_not_connect(swarm, tiny_llama_path):
    swarm.start_bootstrap()
    swarm.start_peer(tiny_llama_path, "--blocks", "0:4", "--transport", "direct", "--announce-host", "127.0.0.1:9")
    ((peer_id, info),) = swarm.wait_online(prefix_for_model(str(tiny_llama_path)), [(0, 4)]).online().items()
    assert info.transport == "direct" and info.endpoint == "127.0.0.1:9"
    local = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB_SIZE, (1, 5), generator=torch.Generator().manual_seed(2))
    remote = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=swarm.initial_peers)
    try:
        got = generate_with_logits(remote, ids, max_new_tokens=12, do_sample=False)
        assert_same_generation(got, generate_with_logits(local, ids, max_new_tokens=12, do_sample=False))
        assert remote.sequence.paths[peer_id] == tunnel_address(peer_id)
        assert remote.sequence.failovers == 0  # found at connect time, before any request failed
    finally:
        remote.shutdown()
