"""Peers die or hang in the middle of generation, as real processes: the client's results do not change.

A failure happens at a chosen point of real work (SIGKILL of a peer's process group, SIGSTOP of its process); the
test asserts that the client noticed it (failovers and recoveries counted) and compares everything it computed with
the local model: tokens and per-step logits. The client's logic around failures (replays of padded batches, spans
re-routed to two peers, full caches, forward and backward, NoPeersError, retries and bans) is tested in milliseconds
on in-memory peers in tests/client/test_failover.py and test_giving_up.py; here the process is the point.

One swarm for the module, three peers of blocks 2:4 among its four: the second test runs on what the first left (a
killed peer, whose record stays in the DHT until it expires).
"""

from __future__ import annotations

import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol import swarmlm_pb2 as pb
from protocol.records import prefix_for_model
from tests.helpers.generation import ActAfter, assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny_llama
from tests.helpers.peers import process_serving
from tests.helpers.processes import Swarm

NUM_LAYERS = 4
SPANS = [(0, 2), (2, 4), (2, 4), (2, 4)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-failover", num_layers=NUM_LAYERS, seed=1)


@pytest.fixture(scope="module")
def local(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """The module's swarm (named as the conftest's fixture, so that a failing test gets its logs)."""
    with Swarm(tmp_path_factory.mktemp("swarm")) as running:
        yield running


@pytest.fixture(scope="module")
def peers(swarm, model_path):
    """The peer processes serving SPANS, once all are ONLINE."""
    swarm.start_bootstrap()
    started = [swarm.start_peer(model_path, "--blocks", f"{a}:{b}") for a, b in SPANS]
    prefix = prefix_for_model(str(model_path))
    swarm.wait_for(
        lambda: len(swarm.snapshot(prefix, NUM_LAYERS).online()) == len(SPANS), 120, f"{len(SPANS)} peers to be ONLINE"
    )
    return started


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


def test_generation_survives_sigkill(swarm, peers, model_path, local):
    """A peer of the second half dies mid-generation, while steps are pushed peer to peer."""
    ids = _ids(1, 6, seed=7)
    expected = generate_with_logits(local, ids, max_new_tokens=48, do_sample=False)
    remote = _connect(swarm, model_path, forward_steps=True)
    try:
        with remote.inference_session(max_length=80) as session:
            streamer = ActAfter(30, lambda: swarm.kill(_process_of(swarm, peers, _route_peer(session, 2))))
            got = generate_with_logits(remote, ids, max_new_tokens=48, do_sample=False, streamer=streamer)
            assert streamer.acted
            assert session.recoveries >= 1 and remote.sequence.failovers >= 1
            assert _pushed(remote, session) > 0
        assert_same_generation(got, expected)
        # sampling with a seed is unchanged too, on the peers that are left
        sampling = dict(max_new_tokens=16, do_sample=True, top_k=20)
        torch.manual_seed(5)
        sampled_expected = generate_with_logits(local, ids, **sampling)
        torch.manual_seed(5)
        assert_same_generation(generate_with_logits(remote, ids, **sampling), sampled_expected)
    finally:
        remote.shutdown()


def test_hung_peer_times_out_and_is_replaced(swarm, peers, model_path, local):
    """A peer whose process stops answering (SIGSTOP: still announced ONLINE) is timed out and replaced."""
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
