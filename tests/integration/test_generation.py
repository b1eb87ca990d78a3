"""A real swarm (bootstrap + peer processes via the CLI) against the local Hugging Face model with the same weights.

Every family runs on live peers with its own spans, all in one swarm started once for the module. Generation
tests compare the per-step logits of `generate()` (fp32, atol 1e-4), not only the tokens: a decode step at a
wrong position or over a wrong cache moves the logits by whole units (see tests/test_models.py), far past it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from client import AutoDistributedModelForCausalLM
from protocol.errors import BadRequestError
from protocol.records import prefix_for_model
from tests.helpers.generation import ATOL, assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny
from tests.helpers.processes import Swarm

FAMILIES = {
    # family: spans served by one peer each
    "llama": [(0, 2), (2, 4)],  # its second peer is reached only over libp2p (P2P_SPAN)
    "mistral": [(0, 3), (3, 4)],
    "qwen2": [(0, 1), (1, 4)],
    "qwen3": [(0, 1), (1, 3), (3, 4)],
}
BF16_PREFIX = "tiny-llama-bf16"
P2P_FAMILY, P2P_SPAN = "llama", (2, 4)  # served with --transport p2p: every llama test goes through libp2p too


@pytest.fixture(scope="module")
def swarm_of_families(tmp_path_factory):
    """One swarm serving every family (and the llama in bfloat16 under its own prefix): {family: model path}."""
    paths = {
        family: make_tiny(family, tmp_path_factory.mktemp("models") / f"tiny-{family}", seed=0) for family in FAMILIES
    }
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        for family, spans in FAMILIES.items():
            for start, end in spans:
                p2p = ("--transport", "p2p") if (family, (start, end)) == (P2P_FAMILY, P2P_SPAN) else ()
                swarm.start_peer(paths[family], "--blocks", f"{start}:{end}", *p2p)
        for start, end in [(0, 3), (3, 4)]:
            swarm.start_peer(
                paths["llama"], "--blocks", f"{start}:{end}", "--dtype", "bfloat16", "--dht-prefix", BF16_PREFIX
            )
        for family, spans in FAMILIES.items():
            swarm.wait_online(prefix_for_model(str(paths[family])), spans, timeout_s=120)
        swarm.wait_online(BF16_PREFIX, [(0, 3), (3, 4)], timeout_s=120)
        yield swarm, paths


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, swarm_of_families):
    """(remote model, local reference model) for one family."""
    swarm, paths = swarm_of_families
    path = paths[request.param]
    remote = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    try:
        if request.param == P2P_FAMILY:  # the route really goes through libp2p for the peer that announces it
            with torch.no_grad():
                remote(torch.tensor([[3, 4, 5]]))
            assert [hop.endpoint.startswith("p2p:") for hop in remote.sequence.last_route] == [False, True]
        yield remote, local
    finally:
        remote.shutdown()


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=generator)


def test_client_holds_only_embeddings_norm_and_head(served):
    remote, _local = served
    names = {name for name, _ in remote.named_parameters()}
    assert names <= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert not any("layers" in name for name, _ in remote.named_parameters())


def test_logits_match_local_model(served):
    remote, local = served
    ids = _ids(2, 17)
    with torch.no_grad():
        expected = local(ids).logits
        got = remote(ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_greedy_generation_is_identical(served):
    remote, local = served
    ids = _ids(1, 6, seed=1)
    expected = generate_with_logits(local, ids, max_new_tokens=24, do_sample=False)
    assert len(set(expected[0][0, 6:].tolist())) >= 10  # an informative reference (tests/test_models.py)
    assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=24, do_sample=False), expected)


def test_seeded_sampling_is_identical(served):
    remote, local = served
    ids = _ids(1, 5, seed=2)
    options = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=40, repetition_penalty=1.3)
    torch.manual_seed(123)
    expected = generate_with_logits(local, ids, **options)
    torch.manual_seed(123)
    assert_same_generation(generate_with_logits(remote, ids, **options), expected)


def test_speculative_decoding_is_plain_greedy(served, request):
    """Drafts from the context and from the local model itself (every draft kept): the same tokens as plain greedy
    decoding, on every family; Mistral's sliding window allows it within its 16 tokens only, and says so beyond."""
    remote, local = served
    ids = _ids(1, 6, seed=6)
    new = 8 if "mistral" in request.node.callspec.id else 16
    expected = local.generate(ids, max_new_tokens=new, do_sample=False)
    assert remote.generate(ids, max_new_tokens=new, prompt_lookup_num_tokens=3).tolist() == expected.tolist()
    assert remote.generate(ids, max_new_tokens=new, assistant_model=local).tolist() == expected.tolist()
    assert remote.speculative_stats.accepted == remote.speculative_stats.drafted > 0
    if "mistral" in request.node.callspec.id:
        with pytest.raises(BadRequestError, match="sliding-window layers keep only the last 16 tokens"):
            remote.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=3)


def test_generate_calls_share_one_session(served):
    remote, local = served
    ids = _ids(1, 5, seed=3)
    expected_ids, expected_logits = generate_with_logits(local, ids, max_new_tokens=15, do_sample=False)
    with remote.inference_session(max_length=32) as session:
        first = generate_with_logits(remote, ids, max_new_tokens=5, do_sample=False)
        second = generate_with_logits(remote, first[0], max_new_tokens=6, do_sample=False)  # the whole sequence so far
        third = generate_with_logits(remote, second[0][:, -1:], max_new_tokens=4, do_sample=False)  # only the new token
        # the last token of each call is only sent by the next call
        assert session.position == expected_ids.shape[1] - 1
    assert_same_generation(first, (expected_ids[:, :10], expected_logits[:, :5]))
    assert_same_generation(second, (expected_ids[:, :16], expected_logits[:, 5:11]))
    assert_same_generation(third, (expected_ids[:, 15:], expected_logits[:, 11:]))


def test_batch_with_left_padding_is_identical(served):
    remote, local = served
    ids = _ids(2, 9, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0  # pad token
    options = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert_same_generation(generate_with_logits(remote, ids, **options), generate_with_logits(local, ids, **options))
    with torch.no_grad():
        torch.testing.assert_close(
            remote(ids, attention_mask=mask).logits[mask.bool()],
            local(ids, attention_mask=mask).logits[mask.bool()],
            atol=ATOL,
            rtol=0,
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
    assert [c[0] for c in streamer.chunks[1:]] == out[0, ids.shape[1] :].tolist()


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


def test_bfloat16_end_to_end(swarm_of_families):
    """Peers and client in bfloat16 against the same model run locally in bfloat16.

    Tolerance from the dtype: bfloat16 keeps 8 significant bits, so one rounding of a logit of size |x| moves
    it by up to |x| * 2**-8. The swarm's bfloat16 run may round differently from the local one (its hidden
    states cross the wire in bfloat16 as they stay in bfloat16 locally, but kernels may order sums
    differently), so its distance to the fp32 logits must be of the same order as the local bfloat16 run's:
    at most twice that, plus a few roundings of the largest logit.
    """
    swarm, paths = swarm_of_families
    path = paths["llama"]
    assert {info.dtype for info in swarm.snapshot(BF16_PREFIX, 4).online().values()} == {"bfloat16"}
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(path), initial_peers=swarm.initial_peers, dht_prefix=BF16_PREFIX, dtype=torch.bfloat16
    )
    try:
        ids = _ids(1, 6, seed=7)
        got_ids, got_logits = generate_with_logits(remote, ids, max_new_tokens=16, do_sample=False)
    finally:
        remote.shutdown()
    # teacher-forced references on the swarm's own tokens, so that one near-tie cannot make the runs diverge
    steps = got_logits.shape[1]
    reference = {}
    for dtype in (torch.float32, torch.bfloat16):
        local = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            reference[dtype] = local(got_ids[:, :-1]).logits[:, -steps:].float()
    got_logits = got_logits.float()
    local_error = (reference[torch.bfloat16] - reference[torch.float32]).abs().max().item()
    swarm_error = (got_logits - reference[torch.float32]).abs().max().item()
    rounding = reference[torch.float32].abs().max().item() * 2**-8
    assert swarm_error <= 2 * local_error + 4 * rounding, (swarm_error, local_error, rounding)
    # greedy picks the largest logit: where the fp32 reference has a clear winner, the swarm agrees with it
    top2 = reference[torch.float32].topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * swarm_error
    assert clear.sum() >= steps // 2
    expected_tokens = reference[torch.float32].argmax(-1)
    assert torch.equal(got_ids[:, -steps:][clear], expected_tokens[clear])
