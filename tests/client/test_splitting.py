"""Requests cut to the caps peers announce (client/splitting.py): what exceeds a peer's --max-request-tokens or
--max-attention-cost is sent in pieces, which compute exactly what the whole would, instead of being refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from client.splitting import route_caps, row_chunks, step_chunks
from peer.admission import WorkLimits
from peer.config import ServingLimits
from protocol.errors import MessageTooLargeError
from protocol.records import DEFAULT_MAX_REQUEST_TOKENS, ServerInfo, ServerState
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE

CAPS = WorkLimits(max_request_tokens=16, max_attention_cost=16 * 20)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_pieces_fit_every_cap_and_cover_the_request():
    assert row_chunks(5, 6, (16, 10_000)) == [(0, 2), (2, 4), (4, 5)]
    assert row_chunks(5, 6, (1000, 80)) == [(0, 2), (2, 4), (4, 5)]  # 2 rows x 6 x 6 = 72 pairs of attention
    with pytest.raises(MessageTooLargeError, match="one sequence of 20 tokens exceeds"):
        row_chunks(1, 20, (16, 10_000))
    pieces = step_chunks(2, 30, 4, (16, 2 * 8 * 24))
    assert pieces[0][0] == 0 and pieces[-1][1] == 30 and all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    for begin, end in pieces:
        assert 2 * (end - begin) <= 16 and 2 * (end - begin) * (4 + end) <= 2 * 8 * 24
    with pytest.raises(MessageTooLargeError, match="batch 3 on 100 cached tokens"):
        step_chunks(3, 1, 100, (16, 200))
    info = ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0, cache_tokens_left=8,
                      dtype="float32", version="3", endpoint="a:1", max_request_tokens=100)  # fmt: skip
    assert route_caps([info, None]) == (100, info.max_attention_cost)
    tiny = info.model_copy(update={"max_request_tokens": 1, "max_attention_cost": 1})
    assert route_caps([tiny]) == (16, 256)  # a liar's tiny caps are not honoured below these
    assert route_caps([]) == (DEFAULT_MAX_REQUEST_TOKENS, info.max_attention_cost)
    assert "max_request_tokens" in info.to_wire() and "max_attention_cost" not in info.to_wire()


def test_forward_backward_and_generation_over_the_caps_equal_the_local_model(fake_swarm, tiny_llama_local):
    for start, end in [(0, 2), (2, 4)]:
        fake_swarm.add_peer(start, end, limits=ServingLimits(work=CAPS))
    local = tiny_llama_local
    ids = _ids(3, 10, seed=1)  # 30 tokens a request, over 16: in rows of one
    embeds = local.get_input_embeddings()(ids).detach()
    expected_in = embeds.clone().requires_grad_(True)
    local(inputs_embeds=expected_in, labels=ids).loss.backward()
    remote = fake_swarm.client(verify_fraction=0.0, verify_inference=0.0)
    try:
        got_in = embeds.clone().requires_grad_(True)
        out = remote(inputs_embeds=got_in, labels=ids)
        out.loss.backward()
        with torch.no_grad():
            torch.testing.assert_close(out.logits, local(ids).logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(got_in.grad, expected_in.grad, atol=1e-5, rtol=1e-4)
        # a prompt of 2 x 12 tokens, over both caps, goes in steps; then one token a step
        prompt = _ids(2, 12, seed=2)
        expected = generate_with_logits(local, prompt, max_new_tokens=6, do_sample=False)
        assert_same_generation(generate_with_logits(remote, prompt, max_new_tokens=6, do_sample=False), expected)
        assert all(peer.acted == 0 for peer in fake_swarm.peers)
        with pytest.raises(MessageTooLargeError, match="one sequence of 17 tokens"):
            remote(_ids(1, 17, seed=3))
        assert remote.sequence.failovers == 0  # said at once: no peer was blamed for it
    finally:
        remote.shutdown()
