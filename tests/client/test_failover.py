"""Peers crash, stall, run out of cache or end sessions in the middle of work; the client's results do not change.

On an in-memory swarm (tests/helpers/fake_swarm.py): real peer handlers over blocks of the tiny Llama, scripted to
fail at a chosen answer. The peer meant to fail announces a higher throughput, so that routes go to it first. Each
test checks that the client noticed (failovers and recoveries counted) and compares everything it computed with the
local model: tokens and per-step logits of generation, logits of forward, input gradients of backward.
tests/integration/test_failover.py kills and stops real peer processes.
"""

from __future__ import annotations

import time

import pytest
import torch

from client.transport import ChannelPool, InferenceStream
from peer.config import ServingLimits
from protocol import swarmlm_pb2 as pb
from protocol.errors import NoPeersError
from tests.helpers.fake_swarm import FakeSwarm, Fault
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import MOE_CONFIGS, VOCAB_SIZE, save_random_model

FAST = 10.0  # the throughput of a peer that routes should choose first (the others announce 1)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def _spans(session) -> list[tuple[int, int]]:
    return [(s.hop.start, s.hop.end) for s in session.remote.spans]


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_a_mixture_of_experts_generation_survives_a_crash(tmp_path, family):
    """The router's choices travel with nothing but the hidden states: a replacement peer of the span, replayed the
    session's history, picks the same experts, and the tokens and logits stay the local model's (Mixtral,
    Qwen2-MoE with its dense layer and shared expert, Qwen3-MoE)."""
    from transformers import AutoModelForCausalLM

    path = save_random_model(MOE_CONFIGS[family](4), tmp_path / family, seed=4)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _ids(1, 6, seed=8)
    expected = generate_with_logits(local, ids, max_new_tokens=20, do_sample=False)
    with FakeSwarm(path) as swarm:
        swarm.add_peer(0, 2)
        crashing = swarm.add_peer(2, 4, throughput=FAST, faults=[Fault("crash", after=10)])
        swarm.add_peer(2, 4)
        remote = swarm.client()
        try:
            with remote.inference_session(max_length=32) as session:
                got = generate_with_logits(remote, ids, max_new_tokens=20, do_sample=False)
                assert crashing.server.down, "the peer did not crash: the test proves nothing"
                assert session.recoveries >= 1
            assert_same_generation(got, expected)
        finally:
            remote.shutdown()


@pytest.mark.parametrize(
    "failing, spans, batch, forward_steps",
    [
        (1, [(0, 2), (2, 4), (2, 4)], 1, True),  # a peer of the second half crashes (steps pushed peer to peer)
        (1, [(0, 2), (2, 4), (2, 4)], 1, False),  # the same with every step sent by the client
        (0, [(0, 2), (0, 2), (2, 4)], 2, True),  # the first span's peer crashes while a left-padded batch generates
    ],
    ids=["second-span", "second-span-client-driven", "first-span-padded-batch"],
)
def test_generation_survives_a_crash(fake_swarm, tiny_llama_local, failing, spans, batch, forward_steps):
    peers = [
        fake_swarm.add_peer(a, b, throughput=FAST, faults=[Fault("crash", after=30)])
        if i == failing
        else fake_swarm.add_peer(a, b)
        for i, (a, b) in enumerate(spans)
    ]
    ids = _ids(batch, 6, seed=7)
    common = dict(pad_token_id=0)
    if batch > 1:
        common["attention_mask"] = torch.ones_like(ids)
        common["attention_mask"][1, :3] = 0
        ids[1, :3] = 0
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=48, do_sample=False, **common)
    remote = fake_swarm.client(forward_steps=forward_steps)
    try:
        with remote.inference_session(max_length=80) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=48, do_sample=False, **common)
            assert peers[failing].server.down, "the peer did not crash: the test proves nothing"
            assert session.recoveries >= 1 and remote.sequence.failovers >= 1
            assert peers[failing].peer_id not in {s.hop.peer_id for s in session.remote.spans}
        assert_same_generation(got, expected)
        assert (sum(peer.forwarder.pushed for peer in peers) > 0) == forward_steps
        # sampling with a seed is unchanged too, on the peers that are left
        sampling = dict(max_new_tokens=16, do_sample=True, top_k=20, **common)
        torch.manual_seed(5)
        sampled_expected = generate_with_logits(tiny_llama_local, ids, **sampling)
        torch.manual_seed(5)
        assert_same_generation(generate_with_logits(remote, ids, **sampling), sampled_expected)
    finally:
        remote.shutdown()


def test_span_is_rerouted_to_two_peers(fake_swarm, tiny_llama_local):
    """The one peer of blocks 0:4 crashes; peers of 0:2 and 2:4 take over, the second replayed the first's outputs."""
    whole = fake_swarm.add_peer(0, 4, faults=[Fault("crash", after=20)])  # one hop beats two at equal throughput
    fake_swarm.add_peer(0, 2)
    fake_swarm.add_peer(2, 4)
    ids = _ids(1, 6, seed=8)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=40, do_sample=False)
    remote = fake_swarm.client()
    try:
        with remote.inference_session(max_length=64) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=40, do_sample=False)
            assert whole.server.down and session.recoveries == 1
            assert _spans(session) == [(0, 2), (2, 4)]
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()


def test_a_stalled_peer_times_out_and_is_replaced(fake_swarm, tiny_llama_local):
    """A peer that stops answering (still announced ONLINE) is timed out after request_timeout_s and replaced."""
    fake_swarm.add_peer(0, 2)
    stalled = fake_swarm.add_peer(2, 4, throughput=FAST, faults=[Fault("stall", after=20)])
    fake_swarm.add_peer(2, 4)
    ids = _ids(1, 5, seed=9)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=40, do_sample=False)
    remote = fake_swarm.client(request_timeout_s=0.5)
    try:
        with remote.inference_session(max_length=64) as session:
            began = time.monotonic()
            got = generate_with_logits(remote, ids, max_new_tokens=40, do_sample=False)
            assert stalled.server.stalled and session.recoveries >= 1 and remote.sequence.failovers >= 1
            assert time.monotonic() - began < 10
            assert stalled.peer_id not in {s.hop.peer_id for s in session.remote.spans}
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()


def test_an_overloaded_peer_is_replaced(fake_swarm, tiny_llama_local):
    """The cache of the peer the client routes to is taken by another session after the client saw it free:
    CacheFullError, and the client goes to the other peer of those blocks."""
    preferred = fake_swarm.add_peer(0, 4, throughput=FAST, cache_tokens=64)
    other = fake_swarm.add_peer(0, 4, cache_tokens=64)
    ids = _ids(1, 5, seed=10)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=20, do_sample=False)
    # a long directory refresh: the client keeps believing the peer has room, as it would between two refreshes
    remote = fake_swarm.client(connect_timeout_s=0.2, directory_refresh_s=300.0)
    pool = ChannelPool(1 << 26, connect=fake_swarm.network.connect)
    blocker = InferenceStream(pool, preferred.endpoint)
    try:
        with remote.inference_session(max_length=8) as session:
            remote.generate(ids, max_new_tokens=2, do_sample=False)
            assert [s.hop.peer_id for s in session.remote.spans] == [preferred.peer_id]
        span = pb.Span(model=fake_swarm.prefix, start=0, end=4)
        opening = pb.OpenSession(span=span, session_id="blocker", max_length=64, batch_size=1)
        remote._run(blocker.request(pb.InferenceRequest(open=opening), 5.0))
        with remote.inference_session(max_length=32) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=20, do_sample=False)
            assert [s.hop.peer_id for s in session.remote.spans] == [other.peer_id]
        assert remote.sequence.failovers == 1 and remote.sequence.bans.strikes(preferred.peer_id) == 1
        assert_same_generation(got, expected)
    finally:
        remote._run(blocker.close())
        remote._run(pool.close())
        remote.shutdown()


def test_forward_and_backward_fail_over(fake_swarm, tiny_llama_local):
    """A peer dies between two hops of a backward, then one dies as a forward is sent to it: both are redone
    elsewhere, with the local model's gradients and logits."""
    for a, b in [(0, 2), (0, 2), (2, 4), (2, 4)]:
        fake_swarm.add_peer(a, b)
    local = tiny_llama_local
    ids = _ids(2, 10, seed=11)
    embeds = local.get_input_embeddings()(ids).detach()
    expected_in = embeds.clone().requires_grad_(True)
    local(inputs_embeds=expected_in, labels=ids).loss.backward()
    with torch.no_grad():
        expected_logits = local(ids).logits

    remote = fake_swarm.client(verify_fraction=0.0)  # a spot check's calls would be counted below
    sequence = remote.sequence
    try:
        got_in = embeds.clone().requires_grad_(True)
        loss = remote(inputs_embeds=got_in, labels=ids).loss
        assert [(hop.start, hop.end) for hop in sequence.last_route] == [(0, 2), (2, 4)]

        # backward runs blocks 2:4 first; the peer of 0:2 dies once that hop has answered
        backward_hops, call_backward = [], sequence._call_backward

        async def kill_before_second_hop(hop, *args):
            if len(backward_hops) == 1:
                fake_swarm.peer(hop.peer_id).kill()
            backward_hops.append(hop)
            return await call_backward(hop, *args)

        sequence._call_backward = kill_before_second_hop
        loss.backward()
        assert [(hop.start, hop.end) for hop in backward_hops[:2]] == [(2, 4), (0, 2)]
        assert sequence.failovers == 1
        torch.testing.assert_close(got_in.grad, expected_in.grad, atol=1e-5, rtol=1e-4)

        # a forward whose peer of blocks 2:4 dies as the request is sent is retried on the other one
        forward_hops, call_forward = [], sequence._call_forward

        async def kill_on_arrival(hop, *args):
            if hop.start == 2 and not forward_hops:
                forward_hops.append(hop)
                fake_swarm.peer(hop.peer_id).kill()
            return await call_forward(hop, *args)

        sequence._call_forward = kill_on_arrival
        with torch.no_grad():
            got_logits = remote(ids).logits
        assert forward_hops and sequence.failovers == 2
        assert forward_hops[0].peer_id not in {hop.peer_id for hop in sequence.last_route}
        torch.testing.assert_close(got_logits, expected_logits, atol=1e-4, rtol=0)
    finally:
        remote.shutdown()


def test_no_peer_left_raises_typed_error_in_bounded_time(fake_swarm):
    fake_swarm.add_peer(0, 2)
    second = fake_swarm.add_peer(2, 4)
    remote = fake_swarm.client(wait_for_peers_s=0.5, request_timeout_s=5.0, retry_delay_s=0.05)
    try:
        ids = _ids(1, 4, seed=12)
        remote.generate(ids, max_new_tokens=2, do_sample=False)
        second.kill()  # its record stays in the directory, as a crashed peer's stays in the DHT until it expires
        began = time.monotonic()
        with pytest.raises(NoPeersError, match=r"blocks 2-3 .*swarmlm peer .* --blocks 2:4"):
            remote.generate(ids, max_new_tokens=4, do_sample=False)
        assert time.monotonic() - began < 10
        assert remote.sequence.failovers == 1, "the dead peer was tried more than once"
    finally:
        remote.shutdown()


def test_a_client_reopens_a_session_that_reached_its_lifetime_and_keeps_the_peer(fake_swarm, tiny_llama_local):
    """The peer ends the session at its lifetime mid-generation; the client opens a new one there, replays, and goes
    on exactly, without banning a peer that did nothing wrong (the other peer would take over if it did)."""
    lifetime_s = 0.3
    kept = fake_swarm.add_peer(0, 4, throughput=FAST, limits=ServingLimits(session_lifetime_s=lifetime_s))
    fake_swarm.add_peer(0, 4)
    ids = _ids(1, 6, seed=13)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=12, do_sample=False)
    remote = fake_swarm.client(min_session_lifetime_s=lifetime_s - 0.1)
    slow = _SlowStreamer(0.06)  # 12 tokens take 0.72 s: the session reaches its lifetime on the way
    try:
        with remote.inference_session(max_length=20) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=12, do_sample=False, streamer=slow)
            assert session.recoveries >= 1, "the session never reached its lifetime: the test proves nothing"
            assert [s.hop.peer_id for s in session.remote.spans] == [kept.peer_id]
        assert remote.sequence.failovers == 0 and not remote.sequence.bans.banned()
        # after a replay the cache was built by one prefill, not step by step: rounding differs a little
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()


class _SlowStreamer:
    """A generate() streamer that waits `delay_s` after each token."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def put(self, value) -> None:
        time.sleep(self.delay_s)

    def end(self) -> None:
        pass
