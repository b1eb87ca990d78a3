"""A peer that serves more blocks than its memory budget holds (`swarmlm peer --memory-budget --offload disk`), on a
live process: exact against the local model, and its block files gone once it stops.

The budget is sized from the checkpoint so that one block stays resident and three stream through the two slots.
In-process exactness (prefill, decode, batches, partial spans, backward, quantized blocks) and the budget's split
are tests/peer/test_offload.py's.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from peer.offload import STREAM_SLOTS, block_bytes, kv_token_bytes
from protocol.records import prefix_for_model
from swarm.models.checkpoint import load_config
from tests.helpers.generation import ATOL, assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny
from tests.helpers.processes import Swarm

CACHE_TOKENS = 300


def test_a_streaming_peer_computes_the_local_model_and_removes_its_block_files(tmp_path):
    path = make_tiny("llama", tmp_path / "tiny-llama", seed=4)
    config = load_config(path)
    largest = max(block_bytes(path, config, 0, 4, torch.float32))
    budget = (STREAM_SLOTS + 1) * largest + CACHE_TOKENS * kv_token_bytes(config, 0, 4, torch.float32)
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        peer = swarm.start_peer(
            path,
            "--blocks",
            "0:4",
            "--memory-budget",
            str(budget),
            "--offload",
            "disk",
            "--cache-tokens",
            str(CACHE_TOKENS),
        )
        swarm.wait_online(prefix_for_model(str(path)), [(0, 4)], timeout_s=120)
        assert "1 blocks resident, 3 streamed through 2 slots" in peer.stderr(), peer.logs()
        assert f"a KV cache of {CACHE_TOKENS} tokens" in peer.stderr(), peer.logs()  # what the budget leaves
        stored = list((peer.cache_dir / "offload").rglob("block-*.weights"))
        assert sorted(f.name for f in stored) == [f"block-{i}.weights" for i in (1, 2, 3)]

        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        remote = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
        try:
            ids = torch.randint(3, VOCAB_SIZE, (2, 11), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=ATOL, rtol=0)
            prompt = ids[:1, :5]
            expected = generate_with_logits(local, prompt, max_new_tokens=12, do_sample=False)
            assert_same_generation(generate_with_logits(remote, prompt, max_new_tokens=12, do_sample=False), expected)
        finally:
            remote.shutdown()
        assert swarm.terminate(peer) == 0, peer.logs()
        assert list((peer.cache_dir / "offload").iterdir()) == [], peer.logs()
