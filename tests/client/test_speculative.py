"""Speculative decoding (client/speculative.py) on an in-memory swarm against the local model with the same weights.

Greedy output must be the local model's plain greedy output, token for token, whatever the drafts: drafts that are
all kept (the local model itself as the assistant), drafts mostly refused (another model as the assistant), n-gram
drafts from a repetitive context, a left-padded batch, a session continued by a second generate(), and a peer that
crashes between verification steps. Each test also checks that drafts were both proposed and kept or refused, so
that it exercises what it claims. Sampling is compared with the exact distribution of plain sampling.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.api.engine import SwarmBackend
from client.api.metrics import ApiMetrics
from client.api.schemas import Sampling
from client.speculative import AssistantDrafter, NgramDrafter
from protocol.errors import BadRequestError
from tests.helpers.fake_swarm import Fault
from tests.helpers.models import VOCAB_SIZE, make_tiny_llama


def _repetitive(batch: int, seed: int) -> torch.Tensor:
    """Prompts whose continuation the context predicts in part: a random segment, then that segment again."""
    segment = torch.randint(3, VOCAB_SIZE, (batch, 6), generator=torch.Generator().manual_seed(seed))
    return torch.cat([segment, segment, segment[:, :3]], dim=1)


def _plain(local, ids, **options):
    return local.generate(ids, do_sample=False, pad_token_id=0, **options)


@pytest.fixture
def remote(fake_swarm):
    fake_swarm.add_peer(0, 2)
    fake_swarm.add_peer(2, 4)
    model = fake_swarm.client()
    try:
        yield model
    finally:
        model.shutdown()


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """Another tiny Llama (other weights, the same vocabulary): an assistant whose drafts are mostly refused."""
    path = make_tiny_llama(tmp_path_factory.mktemp("models") / "other-llama", num_layers=2, seed=1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_prompt_lookup_is_plain_greedy(remote, tiny_llama_local):
    """A random model seldom continues its context, so the drafts are mostly refused here; the bench shows them
    kept on real text (bench/scenarios/speculative.py), and the assistant tests below keep drafts in the swarm."""
    ids = _repetitive(1, seed=3)
    expected = _plain(tiny_llama_local, ids, max_new_tokens=40)
    got = remote.generate(ids, max_new_tokens=40, prompt_lookup_num_tokens=4, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    assert remote.speculative_stats.drafted > 0 and remote.speculative_stats.tokens == 40


def test_ngram_drafts_are_what_followed_the_earliest_match_of_the_last_tokens():
    drafter = NgramDrafter(num_tokens=3, max_ngram=2)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6], [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 9]])
    mask = torch.tensor([[0, 0, *[1] * 11], [0, *[1] * 12]])
    # row 0: "5 6" first came before 7 8 9; row 1: "4 9" never came before, nor did 9
    assert drafter.propose(ids, mask, 3) == [[7, 8, 9], []]
    assert drafter.propose(ids[:1, :-1], mask[:1, :-1], 2) == [[]]  # "6 5" is new, and one token predicts little
    assert NgramDrafter(3, max_ngram=1).propose(ids[:1, :-1], mask[:1, :-1], 2) == [[6, 7]]  # "5" came before 6 7
    # the length: 1 fewer after a round that kept none, unchanged after one that kept some, 2 more (to 3) after all
    lengths = []
    for drafted, kept in ((3, 0), (2, 0), (1, 1), (3, 1), (3, 3), (3, 3)):
        drafter.kept(ids, drafted, kept)
        lengths.append(drafter.length())
    assert lengths == [2, 1, 3, 3, 3, 3]


@pytest.mark.parametrize("assistant", ["same-weights", "other-weights"])
def test_an_assistant_model_gives_plain_greedy_whether_its_drafts_are_kept_or_refused(
    remote, tiny_llama_local, other_llama, assistant
):
    drafter = tiny_llama_local if assistant == "same-weights" else other_llama
    ids = torch.randint(3, VOCAB_SIZE, (1, 7), generator=torch.Generator().manual_seed(11))
    expected = _plain(tiny_llama_local, ids, max_new_tokens=32)
    got = remote.generate(ids, max_new_tokens=32, assistant_model=drafter, pad_token_id=0)
    stats = remote.speculative_stats
    assert got.tolist() == expected.tolist()
    if assistant == "same-weights":  # every draft is the swarm's own token: a round trip makes several
        assert stats.accepted == stats.drafted > 0 and stats.rounds <= 32 // 3, stats
    else:  # refusals: the peers went back in their caches, and the output is still exact
        assert stats.accepted < stats.drafted, stats


def test_a_left_padded_batch_and_a_continued_session(remote, tiny_llama_local):
    ids = _repetitive(2, seed=5)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    expected = _plain(tiny_llama_local, ids, attention_mask=mask, max_new_tokens=20)
    with remote.inference_session(max_length=64):
        got = remote.generate(
            ids, attention_mask=mask, max_new_tokens=20, assistant_model=tiny_llama_local, pad_token_id=0
        )
        assert got.tolist() == expected.tolist()
        assert remote.speculative_stats.accepted > 0
        # the whole conversation again, and more: only the new part is sent, on the caches the first call left
        more = torch.cat([got, got[:, -6:]], dim=1)
        more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        expected_more = _plain(tiny_llama_local, more, attention_mask=more_mask, max_new_tokens=12)
        got_more = remote.generate(
            more, attention_mask=more_mask, max_new_tokens=12, prompt_lookup_num_tokens=3, pad_token_id=0
        )
    assert got_more.tolist() == expected_more.tolist()


def test_a_session_continued_with_only_the_new_tokens(remote, tiny_llama_local):
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(12))
    with remote.inference_session(max_length=64) as session:
        first = remote.generate(ids, max_new_tokens=8, assistant_model=tiny_llama_local, pad_token_id=0)
        assert session.position == first.shape[1] - 1  # the last token of a call is only sent by the next
        follow = torch.cat([first[:, -1:], torch.tensor([[5, 6, 7]])], dim=1)  # what the session has not seen
        second = remote.generate(follow, max_new_tokens=8, assistant_model=tiny_llama_local, pad_token_id=0)
    whole = torch.cat([first, follow[:, 1:]], dim=1)
    assert first.tolist() == _plain(tiny_llama_local, ids, max_new_tokens=8).tolist()
    assert (
        second[:, follow.shape[1] :].tolist()
        == _plain(tiny_llama_local, whole, max_new_tokens=8)[:, whole.shape[1] :].tolist()
    )


def test_the_peers_caches_hold_the_kept_tokens_only(fake_swarm, tiny_llama_local, other_llama):
    """After refused drafts every peer's cache equals, layer by layer, the cache of plain decoding of the output."""
    peers = [fake_swarm.add_peer(0, 2), fake_swarm.add_peer(2, 4)]
    remote = fake_swarm.client()
    ids = torch.randint(3, VOCAB_SIZE, (1, 5), generator=torch.Generator().manual_seed(2))
    try:
        with remote.inference_session(max_length=40):
            got = remote.generate(ids, max_new_tokens=16, assistant_model=other_llama, pad_token_id=0)
            assert remote.speculative_stats.accepted < remote.speculative_stats.drafted
            caches = [_only_session_cache(peer) for peer in peers]
        with remote.inference_session(max_length=40):
            plain = remote.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
            plain_caches = [_only_session_cache(peer, exclude=caches) for peer in peers]
    finally:
        remote.shutdown()
    assert got.tolist() == plain.tolist()
    held = got.shape[1] - 1  # the last token is never sent
    for peer, cache, plain_cache in zip(peers, caches, plain_caches):
        for index in range(peer.start, peer.end):  # the cache is indexed by the model's layer index
            layer, plain_layer = cache.layers[index], plain_cache.layers[index]
            assert layer.keys.shape[-2] == held
            torch.testing.assert_close(layer.keys, plain_layer.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values, plain_layer.values, atol=1e-5, rtol=0)


def _only_session_cache(peer, exclude=()):
    sessions = [s for s in peer.servicer.streams.sessions.values() if not any(s.cache is c for c in exclude)]
    assert len(sessions) == 1, sessions
    return sessions[0].cache


def test_a_peer_crashing_between_verification_steps_is_replaced_and_the_output_is_unchanged(
    fake_swarm, tiny_llama_local, other_llama
):
    fake_swarm.add_peer(0, 2)
    crashing = fake_swarm.add_peer(2, 4, throughput=10.0, faults=[Fault("crash", after=6)])
    fake_swarm.add_peer(2, 4)
    remote = fake_swarm.client()
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = _plain(tiny_llama_local, ids, max_new_tokens=30)
    try:
        with remote.inference_session(max_length=64) as session:
            got = remote.generate(ids, max_new_tokens=30, assistant_model=other_llama, pad_token_id=0)
            assert crashing.server.down and session.recoveries >= 1
    finally:
        remote.shutdown()
    assert got.tolist() == expected.tolist()


def test_sampling_keeps_plain_samplings_distribution(remote, tiny_llama_local):
    """Chi-square of the first two sampled tokens (top-3, so 9 outcomes) over seeded runs against the exact joint
    distribution that plain sampling draws from. The local model drafts, so drafts are kept and refused at random."""
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(9))
    runs, options = 240, dict(do_sample=True, top_k=3, max_new_tokens=2, pad_token_id=0)
    with torch.no_grad():
        first = _top_k_probs(tiny_llama_local(ids).logits[0, -1], 3)
        exact = {}
        for a, pa in first.items():
            second = _top_k_probs(tiny_llama_local(torch.cat([ids, torch.tensor([[a]])], 1)).logits[0, -1], 3)
            exact |= {(a, b): pa * pb for b, pb in second.items()}
    seen = dict.fromkeys(exact, 0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(runs):
        out = remote.generate(ids, assistant_model=tiny_llama_local, generator=generator, **options)
        seen[tuple(out[0, -2:].tolist())] += 1
    assert remote.speculative_stats.drafted > 0
    chi2 = sum((seen[k] - runs * p) ** 2 / (runs * p) for k, p in exact.items())
    # 8 degrees of freedom: P(chi2 > 26.1) = 0.001 for a sampler with the right distribution
    assert chi2 < 26.1, (chi2, seen, {k: round(runs * p, 1) for k, p in exact.items()})


def _top_k_probs(logits: torch.Tensor, k: int) -> dict[int, float]:
    values, indices = logits.float().topk(k)
    return dict(zip(indices.tolist(), values.softmax(-1).tolist()))


def test_bad_arguments_are_refused_with_what_to_do(remote, other_llama):
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(BadRequestError, match="either assistant_model or prompt_lookup_num_tokens"):
        remote.generate(ids, max_new_tokens=4, assistant_model=other_llama, prompt_lookup_num_tokens=3)
    with pytest.raises(BadRequestError, match="does not take repetition_penalty"):
        remote.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3, repetition_penalty=1.2)
    with pytest.raises(BadRequestError, match="prompt_lookup_num_tokens and max_matching_ngram_size must be >= 1"):
        remote.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=0)


class _Tokenizer:
    eos_token_id = None


def test_the_api_decodes_speculatively_and_reports_it_in_its_metrics(remote, tiny_llama_local, other_llama):
    """`swarmlm api --speculative`: the backend's generations are the local model's greedy tokens, several a round
    trip, and /metrics counts rounds, drafts and kept drafts."""
    for drafter, kept_some in (
        (lambda: AssistantDrafter(tiny_llama_local, 4, adapt=True), True),
        (lambda: AssistantDrafter(other_llama, 4, adapt=True), False),
        (lambda: NgramDrafter(4), False),
    ):
        backend = SwarmBackend(remote, _Tokenizer(), "tiny", drafter=drafter)
        prompt = _repetitive(1, seed=21)  # n-grams to draft from
        expected = tiny_llama_local.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
        tokens = backend.tokens(prompt[0].tolist(), 12, Sampling(temperature=0.0))
        assert list(tokens) == expected[0, prompt.shape[1] :].tolist()
        totals = backend.speculative
        assert totals.tokens == 12 and totals.drafted > 0 and (totals.accepted > 0) >= kept_some
        metrics = ApiMetrics(lambda: 0, totals).render().decode()
        assert f"swarmlm_api_speculative_tokens_total {float(totals.tokens)}" in metrics
        assert f"swarmlm_api_speculative_accepted_total {float(totals.accepted)}" in metrics


def test_concurrent_speculative_sessions_on_one_peer_stay_exact(fake_swarm, tiny_llama_local):
    """Two generations verifying drafts at the same time on one peer, which may batch their steps of several tokens
    (peer/batching.py; tests/peer/test_batching.py batches them for certain): each output is the local model's."""
    peer = fake_swarm.add_peer(0, 4)
    clients = [fake_swarm.client() for _ in range(2)]
    prompts = [torch.randint(3, VOCAB_SIZE, (1, 5), generator=torch.Generator().manual_seed(30 + i)) for i in range(2)]
    results: list = [None, None]

    def run(i: int) -> None:
        results[i] = clients[i].generate(
            prompts[i], max_new_tokens=24, assistant_model=copy.deepcopy(tiny_llama_local), pad_token_id=0
        )

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        for client in clients:
            client.shutdown()
    for prompt, got in zip(prompts, results):
        assert got.tolist() == _plain(tiny_llama_local, prompt, max_new_tokens=24).tolist()
    assert peer.servicer.streams.batcher.batches > 0  # the steps went through the batcher
