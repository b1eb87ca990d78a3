"""A real swarm (bootstrap + peer processes via the CLI) against the local Hugging Face model with the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model
from tests.helpers.models import make_tiny_llama, make_tiny_qwen3
from tests.helpers.processes import Swarm

FAMILIES = {
    # family: (builder, spans served by one peer each)
    "llama": (make_tiny_llama, [(0, 2), (2, 4)]),
    "qwen3": (make_tiny_qwen3, [(0, 1), (1, 3), (3, 4)]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    """(remote model, local reference model) for one family, peers running for the whole module."""
    builder, spans = FAMILIES[request.param]
    path = builder(tmp_path_factory.mktemp("models") / f"tiny-{request.param}", num_layers=4, seed=0)
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        for start, end in spans:
            swarm.start_peer(path, "--blocks", f"{start}:{end}")
        swarm.wait_online(prefix_for_model(str(path)), spans)
        remote = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        try:
            yield remote, local
        finally:
            remote.shutdown()


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)


def test_client_holds_only_embeddings_norm_and_head(served):
    remote, local = served
    names = {name for name, _ in remote.named_parameters()}
    assert names <= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert not any("layers" in name for name, _ in remote.named_parameters())


def test_logits_match_local_model(served):
    remote, local = served
    ids = _ids(2, 17)
    with torch.no_grad():
        expected = local(ids).logits
        got = remote(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_greedy_generation_is_identical(served):
    remote, local = served
    ids = _ids(1, 6, seed=1)
    expected = local.generate(ids, max_new_tokens=24, do_sample=False)
    got = remote.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, expected)


def test_seeded_sampling_is_identical(served):
    remote, local = served
    ids = _ids(1, 5, seed=2)
    options = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=40, repetition_penalty=1.3)
    torch.manual_seed(123)
    expected = local.generate(ids, **options)
    torch.manual_seed(123)
    got = remote.generate(ids, **options)
    assert torch.equal(got, expected)


def test_generate_calls_share_one_session(served):
    remote, local = served
    ids = _ids(1, 5, seed=3)
    expected = local.generate(ids, max_new_tokens=15, do_sample=False)
    with remote.inference_session(max_length=32) as session:
        first = remote.generate(ids, max_new_tokens=5, do_sample=False)
        second = remote.generate(first, max_new_tokens=6, do_sample=False)  # the whole sequence so far
        third = remote.generate(second[:, -1:], max_new_tokens=4, do_sample=False)  # only the new token
        # the last token of each call is only sent by the next call
        assert session.position == expected.shape[1] - 1
    assert torch.equal(second, expected[:, : second.shape[1]])
    assert torch.equal(third, expected[:, second.shape[1] - 1 :])


def test_batch_with_left_padding_is_identical(served):
    remote, local = served
    ids = _ids(2, 9, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0  # pad token
    expected = local.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = remote.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    with torch.no_grad():
        torch.testing.assert_close(
            remote(ids, attention_mask=mask).logits[mask.bool()],
            local(ids, attention_mask=mask).logits[mask.bool()],
            atol=1e-4, rtol=0,
        )


def test_streamer_sees_every_token(served):
    remote, _ = served

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    ids = _ids(1, 4, seed=5)
    out = remote.generate(ids, max_new_tokens=8, do_sample=False, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()  # the prompt first, then one token per step
    assert [c[0] for c in streamer.chunks[1:]] == out[0, ids.shape[1]:].tolist()


def test_gradients_flow_through_remote_blocks(served):
    remote, local = served
    ids = _ids(2, 12, seed=6)
    embeds = local.get_input_embeddings()(ids).detach()
    expected_in = embeds.clone().requires_grad_(True)
    expected_loss = local(inputs_embeds=expected_in, labels=ids).loss
    expected_loss.backward()
    got_in = embeds.clone().requires_grad_(True)
    got_loss = remote(inputs_embeds=got_in, labels=ids).loss
    got_loss.backward()
    torch.testing.assert_close(got_loss, expected_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_in.grad, expected_in.grad, atol=1e-5, rtol=1e-4)
    assert got_in.grad.abs().sum() > 0
