"""Peers die (SIGKILL of the whole process group) in the middle of work; the client's results do not change."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from client import AutoDistributedModelForCausalLM
from protocol.errors import NoPeersError
from protocol.records import prefix_for_model
from tests.helpers.models import make_tiny_llama
from tests.helpers.processes import Swarm

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-failover", num_layers=NUM_LAYERS, seed=1)


@pytest.fixture(scope="module")
def local(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _start(swarm: Swarm, model_path, spans):
    swarm.start_bootstrap()
    peers = [swarm.start_peer(model_path, "--blocks", f"{a}:{b}") for a, b in spans]
    swarm.wait_online(prefix_for_model(str(model_path)), spans)
    return peers


def _process_of(swarm: Swarm, peers, peer_id: str):
    """The peer process that announced `peer_id` (matched by the gRPC port it listens on)."""
    info = swarm.snapshot(prefix_for_model(str(peers[0].model_path)), NUM_LAYERS).servers[peer_id]
    port = int(info.endpoint.rsplit(":", 1)[1])
    for peer in peers:
        listening = {c.laddr.port for c in psutil.Process(peer.popen.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        if port in listening:
            return peer
    raise AssertionError(f"no peer process listens on {info.endpoint}")


class KillAfter(BaseStreamer):
    """Kills a peer once `after` new tokens were streamed: a failure in the middle of generate()."""

    def __init__(self, after: int, kill):
        self.after, self.kill, self.seen, self.killed = after, kill, -1, False

    def put(self, value):
        self.seen += 1  # the first put is the prompt
        if self.seen == self.after and not self.killed:
            self.kill()
            self.killed = True

    def end(self):
        pass


@pytest.mark.parametrize("failing_start, spans", [
    (2, [(0, 2), (2, 4), (2, 4)]),   # a peer of the second half dies
    (0, [(0, 2), (0, 2), (2, 4)]),   # the first span's peer dies
], ids=["second-span", "first-span"])
def test_generation_survives_sigkill(swarm, model_path, local, failing_start, spans):
    peers = _start(swarm, model_path, spans)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(7))
    expected = local.generate(ids, max_new_tokens=64, do_sample=False)
    remote = AutoDistributedModelForCausalLM.from_pretrained(str(model_path), initial_peers=swarm.initial_peers)
    try:
        with remote.inference_session(max_length=80) as session:
            def kill_route_peer():
                (span,) = [s for s in session.remote.spans if s.hop.start == failing_start]
                swarm.kill(_process_of(swarm, peers, span.hop.peer_id))

            streamer = KillAfter(30, kill_route_peer)
            got = remote.generate(ids, max_new_tokens=64, do_sample=False, streamer=streamer)
            assert streamer.killed
            assert session.recoveries >= 1
        assert torch.equal(got, expected)
        # sampling with a seed is unchanged too, on the peers that are left
        torch.manual_seed(5)
        sampled_expected = local.generate(ids, max_new_tokens=16, do_sample=True, top_k=20)
        torch.manual_seed(5)
        assert torch.equal(remote.generate(ids, max_new_tokens=16, do_sample=True, top_k=20), sampled_expected)
    finally:
        remote.shutdown()


def test_backward_survives_sigkill(swarm, model_path, local):
    peers = _start(swarm, model_path, [(0, 2), (2, 4), (2, 4)])
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(8))
    embeds = local.get_input_embeddings()(ids).detach()
    expected_in = embeds.clone().requires_grad_(True)
    local(inputs_embeds=expected_in, labels=ids).loss.backward()

    remote = AutoDistributedModelForCausalLM.from_pretrained(str(model_path), initial_peers=swarm.initial_peers)
    try:
        got_in = embeds.clone().requires_grad_(True)
        loss = remote(inputs_embeds=got_in, labels=ids).loss
        # the forward is done: kill the peer of blocks 2:4 it went through, then run backward
        (used,) = [hop for hop in remote.sequence.last_route if hop.start == 2]
        swarm.kill(_process_of(swarm, peers, used.peer_id))
        loss.backward()
        torch.testing.assert_close(got_in.grad, expected_in.grad, atol=1e-5, rtol=1e-4)
    finally:
        remote.shutdown()


def test_no_peer_left_raises_typed_error_in_bounded_time(swarm, model_path):
    peers = _start(swarm, model_path, [(0, 2), (2, 4)])
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(model_path), initial_peers=swarm.initial_peers, wait_for_peers_s=3.0, request_timeout_s=5.0)
    try:
        ids = torch.randint(3, 128, (1, 4))
        remote.generate(ids, max_new_tokens=2, do_sample=False)
        swarm.kill(peers[1])
        began = time.monotonic()
        with pytest.raises(NoPeersError, match=r"blocks 2-3 .*swarmlm peer .* --blocks 2:4"):
            remote.generate(ids, max_new_tokens=4, do_sample=False)
        assert time.monotonic() - began < 30
    finally:
        remote.shutdown()
