"""Peers die, hang or run out of cache in the middle of work; the client's results do not change.

Each test makes a failure happen at a chosen point of real work (SIGKILL of a peer's process group, SIGSTOP
of its process, a cache filled by another session), asserts that the client noticed it (failovers and
recoveries counted), and compares everything it computed with the local model: tokens and per-step logits
of generation, logits of forward, input gradients of backward.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from client.transport import ChannelPool, InferenceStream
from protocol import swarmlm_pb2 as pb
from protocol.errors import NoPeersError
from protocol.records import prefix_for_model
from tests.helpers.generation import ActAfter, assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny_llama
from tests.helpers.peers import process_serving
from tests.helpers.processes import Swarm

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-failover", num_layers=NUM_LAYERS, seed=1)


@pytest.fixture(scope="module")
def local(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _start(swarm: Swarm, model_path, spans, extra: dict[int, tuple[str, ...]] | None = None):
    """Peers serving `spans` (peer i gets `extra[i]` flags too), once all are ONLINE."""
    extra = extra or {}
    swarm.start_bootstrap()
    peers = [swarm.start_peer(model_path, "--blocks", f"{a}:{b}", *extra.get(i, ())) for i, (a, b) in enumerate(spans)]
    prefix = prefix_for_model(str(model_path))
    swarm.wait_for(
        lambda: len(swarm.snapshot(prefix, NUM_LAYERS).online()) == len(spans), 120, f"{len(spans)} peers to be ONLINE"
    )
    return peers


def _connect(swarm: Swarm, model_path, **options):
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(model_path), initial_peers=swarm.initial_peers, **options
    )


def _process_of(swarm: Swarm, peers, peer_id: str):
    """The peer process that announced `peer_id`."""
    info = swarm.snapshot(prefix_for_model(str(peers[0].model_path)), NUM_LAYERS).servers[peer_id]
    return process_serving(peers, info.endpoint)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def _pushed(remote, session) -> int:
    """Steps the first peer of the session's route pushed on to the next peer."""

    async def info():
        return await remote.sequence.pool.unary(session.remote.spans[0].hop.endpoint, "info", pb.InfoRequest(), 10.0)

    return remote._run(info()).pushed_steps


def _route_peer(session, start: int) -> str:
    """The peer id of the session's span that starts at block `start`."""
    (span,) = [s for s in session.remote.spans if s.hop.start == start]
    return span.hop.peer_id


@pytest.mark.parametrize(
    "failing_start, spans, batch, forward_steps",
    [
        (2, [(0, 2), (2, 4), (2, 4)], 1, True),  # a peer of the second half dies (steps pushed peer to peer)
        (2, [(0, 2), (2, 4), (2, 4)], 1, False),  # the same with every step sent by the client
        (0, [(0, 2), (0, 2), (2, 4)], 2, True),  # the first span's peer dies while a left-padded batch of 2 generates
    ],
    ids=["second-span", "second-span-client-driven", "first-span-padded-batch"],
)
def test_generation_survives_sigkill(swarm, model_path, local, failing_start, spans, batch, forward_steps):
    peers = _start(swarm, model_path, spans)
    ids = _ids(batch, 6, seed=7)
    common = dict(pad_token_id=0)
    if batch > 1:
        common["attention_mask"] = torch.ones_like(ids)
        common["attention_mask"][1, :3] = 0
        ids[1, :3] = 0
    expected = generate_with_logits(local, ids, max_new_tokens=48, do_sample=False, **common)
    remote = _connect(swarm, model_path, forward_steps=forward_steps)
    try:
        with remote.inference_session(max_length=80) as session:
            streamer = ActAfter(30, lambda: swarm.kill(_process_of(swarm, peers, _route_peer(session, failing_start))))
            got = generate_with_logits(remote, ids, max_new_tokens=48, do_sample=False, streamer=streamer, **common)
            assert streamer.acted
            assert session.recoveries >= 1 and remote.sequence.failovers >= 1
            assert (_pushed(remote, session) > 0) == forward_steps
        assert_same_generation(got, expected)
        # sampling with a seed is unchanged too, on the peers that are left
        sampling = dict(max_new_tokens=16, do_sample=True, top_k=20, **common)
        torch.manual_seed(5)
        sampled_expected = generate_with_logits(local, ids, **sampling)
        torch.manual_seed(5)
        assert_same_generation(generate_with_logits(remote, ids, **sampling), sampled_expected)
    finally:
        remote.shutdown()


def test_span_is_rerouted_to_two_peers(swarm, model_path, local):
    """The one peer of blocks 0:4 dies; peers of 0:2 and 2:4 take over, the second replayed the first's outputs."""
    peers = _start(swarm, model_path, [(0, 4), (0, 2), (2, 4)])
    ids = _ids(1, 6, seed=8)
    expected = generate_with_logits(local, ids, max_new_tokens=40, do_sample=False)
    remote = _connect(swarm, model_path)
    try:
        with remote.inference_session(max_length=64) as session:

            def kill_whole_span_peer():
                assert [(s.hop.start, s.hop.end) for s in session.remote.spans] == [(0, 4)], "expected one hop"
                swarm.kill(_process_of(swarm, peers, _route_peer(session, 0)))

            streamer = ActAfter(20, kill_whole_span_peer)
            got = generate_with_logits(remote, ids, max_new_tokens=40, do_sample=False, streamer=streamer)
            assert streamer.acted and session.recoveries == 1
            assert [(s.hop.start, s.hop.end) for s in session.remote.spans] == [(0, 2), (2, 4)]
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()


def test_hung_peer_times_out_and_is_replaced(swarm, model_path, local):
    """A peer whose process stops answering (SIGSTOP: still announced ONLINE) is timed out and replaced."""
    peers = _start(swarm, model_path, [(0, 2), (2, 4), (2, 4)])
    ids = _ids(1, 5, seed=9)
    expected = generate_with_logits(local, ids, max_new_tokens=40, do_sample=False)
    remote = _connect(swarm, model_path, request_timeout_s=3.0)
    hung = []
    try:
        with remote.inference_session(max_length=64) as session:

            def hang_route_peer():
                hung.append(_process_of(swarm, peers, _route_peer(session, 2)))
                swarm.kill(hung[0], signal.SIGSTOP, group=False)

            streamer = ActAfter(20, hang_route_peer)
            began = time.monotonic()
            got = generate_with_logits(remote, ids, max_new_tokens=40, do_sample=False, streamer=streamer)
            assert streamer.acted and session.recoveries >= 1 and remote.sequence.failovers >= 1
            assert time.monotonic() - began < 30
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()
        for proc in hung:
            swarm.kill(proc)  # SIGKILL ends a stopped process too


def test_overloaded_peer_is_replaced(swarm, model_path, local):
    """The cache of the peer the client routes to is taken by another session after the client saw it free:
    CacheFullError, and the client goes to the other peer of those blocks."""
    # the blocker comes from the client's address (all is 127.0.0.1 here): no per-address quota, so that it can
    # take the whole cache as another client would
    _start(
        swarm,
        model_path,
        [(0, 4), (0, 4)],
        extra=dict.fromkeys(range(2), ("--cache-tokens", "64", "--max-cache-share", "1")),
    )
    prefix = prefix_for_model(str(model_path))
    ids = _ids(1, 5, seed=10)
    expected = generate_with_logits(local, ids, max_new_tokens=20, do_sample=False)
    # a long directory refresh: the client keeps believing the peer has room, as it would between two refreshes
    remote = _connect(swarm, model_path, connect_timeout_s=1.0, directory_refresh_s=300.0)
    try:
        with remote.inference_session(max_length=8) as session:
            remote.generate(ids, max_new_tokens=2, do_sample=False)
            (preferred,) = [s.hop.peer_id for s in session.remote.spans]  # routing is deterministic: again next time
        assert remote.sequence.failovers == 0
        endpoint = swarm.snapshot(prefix, NUM_LAYERS).servers[preferred].endpoint

        async def hold_cache_and_generate():
            pool = ChannelPool(1 << 26)
            blocker = InferenceStream(pool, endpoint)
            try:
                await blocker.request(
                    pb.InferenceRequest(
                        open=pb.OpenSession(
                            span=pb.Span(model=prefix, start=0, end=NUM_LAYERS),
                            session_id="blocker",
                            max_length=64,
                            batch_size=1,
                        )
                    ),
                    30,
                )
                with remote.inference_session(max_length=32) as session:
                    got = await asyncio.to_thread(generate_with_logits, remote, ids, max_new_tokens=20, do_sample=False)
                    return got, [s.hop.peer_id for s in session.remote.spans]
            finally:
                await blocker.close()
                await pool.close()

        got, route = asyncio.run(hold_cache_and_generate())
        assert remote.sequence.failovers == 1
        assert len(route) == 1 and route[0] != preferred
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()


def test_forward_and_backward_fail_over(swarm, model_path, local):
    """A peer dies between two hops of a backward, then one dies as a forward is sent to it: both are redone
    elsewhere, with the local model's gradients and logits."""
    peers = _start(swarm, model_path, [(0, 2), (0, 2), (2, 4), (2, 4)])
    ids = _ids(2, 10, seed=11)
    embeds = local.get_input_embeddings()(ids).detach()
    expected_in = embeds.clone().requires_grad_(True)
    local(inputs_embeds=expected_in, labels=ids).loss.backward()
    with torch.no_grad():
        expected_logits = local(ids).logits

    remote = _connect(swarm, model_path, verify_fraction=0.0)  # a spot check's calls would be counted below
    sequence = remote.sequence
    try:
        got_in = embeds.clone().requires_grad_(True)
        loss = remote(inputs_embeds=got_in, labels=ids).loss
        assert [(hop.start, hop.end) for hop in sequence.last_route] == [(0, 2), (2, 4)]

        # backward runs blocks 2:4 first; the peer of 0:2 dies once that hop has answered
        backward_hops, call_backward = [], sequence._call_backward

        async def kill_before_second_hop(hop, *args):
            if len(backward_hops) == 1:
                swarm.kill(_process_of(swarm, peers, hop.peer_id))
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
                swarm.kill(_process_of(swarm, peers, hop.peer_id))
            return await call_forward(hop, *args)

        sequence._call_forward = kill_on_arrival
        with torch.no_grad():
            got_logits = remote(ids).logits
        assert forward_hops and sequence.failovers == 2
        assert forward_hops[0].peer_id not in {hop.peer_id for hop in sequence.last_route}
        torch.testing.assert_close(got_logits, expected_logits, atol=1e-4, rtol=0)
    finally:
        remote.shutdown()


def test_no_peer_left_raises_typed_error_in_bounded_time(swarm, model_path):
    peers = _start(swarm, model_path, [(0, 2), (2, 4)])
    remote = _connect(swarm, model_path, wait_for_peers_s=3.0, request_timeout_s=5.0)
    try:
        ids = _ids(1, 4, seed=12)
        remote.generate(ids, max_new_tokens=2, do_sample=False)
        swarm.kill(peers[1])
        began = time.monotonic()
        with pytest.raises(NoPeersError, match=r"blocks 2-3 .*swarmlm peer .* --blocks 2:4"):
            remote.generate(ids, max_new_tokens=4, do_sample=False)
        assert time.monotonic() - began < 30
    finally:
        remote.shutdown()
