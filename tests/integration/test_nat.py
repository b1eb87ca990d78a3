"""A peer behind a real NAT (Linux network namespaces built by the test) serves clients through a relay.

The bootstrap node (which relays) and a public peer run in the "public" namespace; the home peer runs behind a
masquerading router that forwards nothing the public side starts (tests/helpers/netns.py). This process is on
the public side too: it watches the DHT and is the client. Nobody tells the peers how they are reached: the
home peer must find out that it cannot be, and serve through the relay; the public peer must announce its
endpoint. Tokens and per-step logits through the relay equal the local model's, also when the home peer is
killed in the middle of a generation and a public peer takes over.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model
from swarm.dht.node import peer_ids_of
from swarm.net.tunnel import tunnel_address
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny_llama
from tests.helpers.netns import HOME_IP, PUBLIC_IP, leftover_namespaces, nat_network, unavailable_reason
from tests.helpers.processes import Swarm

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}"),
    pytest.mark.timeout(300),
]
SPANS = [(0, 2), (2, 4)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-nat", num_layers=4, seed=3)


@pytest.fixture(scope="module")
def nat(tmp_path_factory, model_path):
    """(network, swarm, {"public": peer serving 0:2, "home": peer serving 2:4 from behind the NAT})."""
    try:
        with nat_network() as net, Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
            swarm.start_bootstrap("--host", PUBLIC_IP, netns=net.public)
            peers = {
                "public": swarm.start_peer(model_path, "--blocks", "0:2", "--host", PUBLIC_IP, netns=net.public),
                "home": swarm.start_peer(model_path, "--blocks", "2:4", "--host", HOME_IP, netns=net.home),
            }
            swarm.wait_online(prefix_for_model(str(model_path)), SPANS, timeout_s=120)
            yield net, swarm, peers
    finally:
        assert leftover_namespaces() == [], "network namespaces were left behind"


def record_of(swarm: Swarm, model_path, span: tuple[int, int]):
    (found,) = [
        (pid, info)
        for pid, info in swarm.snapshot(prefix_for_model(str(model_path)), 4).online().items()
        if (info.start_block, info.end_block) == span
    ]
    return found


def connects(host: str, port: int, netns: str | None = None) -> bool:
    """Whether a TCP connection to host:port opens within 2 s, from this process or from inside `netns`."""
    if netns is None:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return True
        except OSError:
            return False
    code = (
        f"import socket\ntry:\n    socket.create_connection(({host!r}, {port}), timeout=2).close()\n"
        f"except OSError:\n    raise SystemExit(1)"
    )
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code], timeout=30).returncode == 0


def test_each_peer_finds_out_how_it_is_reached(nat, model_path):
    _net, swarm, peers = nat
    _, public = record_of(swarm, model_path, (0, 2))
    home_id, home = record_of(swarm, model_path, (2, 4))
    (relay,) = peer_ids_of(swarm.initial_peers)
    assert public.transport == "direct" and public.endpoint.startswith(f"{PUBLIC_IP}:") and not public.relays
    assert home.transport == "p2p" and home.relays == (relay.to_base58(),), home
    assert "is not reachable from the swarm" in peers["home"].stderr(), peers["home"].logs()
    status = swarm.run("status", "--initial-peers", *swarm.initial_peers, timeout_s=60)
    line = next(line for line in status.stdout.splitlines() if home_id in line)
    assert "behind NAT, via relay" in line, status.stdout


def test_the_public_side_cannot_connect_into_home(nat, model_path):
    net, swarm, _peers = nat
    _, home = record_of(swarm, model_path, (2, 4))
    _, public = record_of(swarm, model_path, (0, 2))
    home_port = int(home.endpoint.rsplit(":", 1)[1])
    assert home.endpoint.startswith(f"{HOME_IP}:")
    assert not connects(HOME_IP, home_port), "this (public) process reached the home peer"
    assert not connects(HOME_IP, home_port, net.public), "the public namespace reached the home peer"
    public_port = int(public.endpoint.rsplit(":", 1)[1])
    assert connects(PUBLIC_IP, public_port, net.home), "home cannot reach the public side: the NAT is broken"


def test_generation_through_the_relay_matches_the_local_model(nat, model_path):
    _net, swarm, _peers = nat
    home_id, _ = record_of(swarm, model_path, (2, 4))
    (relay,) = peer_ids_of(swarm.initial_peers)
    local = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(0))
    remote = AutoDistributedModelForCausalLM.from_pretrained(str(model_path), initial_peers=swarm.initial_peers)
    try:
        with remote.inference_session(max_length=40) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=24, do_sample=False)
            route = {(s.hop.start, s.hop.end): s.hop.endpoint for s in session.remote.spans}
        assert route[(2, 4)] == tunnel_address(home_id, relay.to_base58()), route
        assert_same_generation(got, generate_with_logits(local, ids, max_new_tokens=24, do_sample=False))
        with torch.no_grad():  # a stateless forward takes the same path
            torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=1e-4, rtol=0)
    finally:
        remote.shutdown()


class ActAt:
    """A streamer that calls `actions[n]` once n new tokens were streamed: events in the middle of generate()."""

    def __init__(self, actions):
        self.actions, self.seen = dict(actions), -1

    def put(self, value):
        self.seen += 1  # the first put is the prompt
        action = self.actions.pop(self.seen, None)
        if action is not None:
            action()

    def end(self):
        pass


def test_killing_the_home_peer_mid_generation_fails_over_to_a_public_peer(nat, model_path):
    net, swarm, peers = nat
    local = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = generate_with_logits(local, ids, max_new_tokens=32, do_sample=False)

    def start_public_replacement():  # after the route went through the home peer
        peers["replacement"] = swarm.start_peer(model_path, "--blocks", "2:4", "--host", PUBLIC_IP, netns=net.public)
        swarm.wait_for(
            lambda: len(swarm.snapshot(prefix_for_model(str(model_path)), 4).online()) == 3,
            120,
            "the public replacement to be ONLINE",
        )

    remote = AutoDistributedModelForCausalLM.from_pretrained(str(model_path), initial_peers=swarm.initial_peers)
    try:
        with remote.inference_session(max_length=48) as session:
            streamer = ActAt({4: start_public_replacement, 16: lambda: swarm.kill(peers["home"], signal.SIGKILL)})
            got = generate_with_logits(remote, ids, max_new_tokens=32, do_sample=False, streamer=streamer)
            assert not streamer.actions, "the generation ended before both events"
            assert session.recoveries >= 1 and remote.sequence.failovers >= 1
            route = {(s.hop.start, s.hop.end): s.hop.endpoint for s in session.remote.spans}
        assert route[(2, 4)].startswith(f"{PUBLIC_IP}:"), route
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()


def test_without_a_relay_a_home_peer_says_what_to_do_and_a_volunteer_relay_takes_it(nat, model_path):
    net, swarm, _peers = nat
    lonely = Swarm(swarm.workdir / "no-relay")
    try:
        lonely.start_bootstrap("--host", PUBLIC_IP, "--no-relay", netns=net.public)
        stranded = lonely.start_peer(model_path, "--blocks", "2:4", "--host", HOME_IP, netns=net.home)
        assert not stranded.wait_gone(120), stranded.logs()
        stranded.expected_alive = False
        assert stranded.returncode == 1, stranded.logs()
        assert (
            "cannot be reached at" in stranded.stderr()
            and "no relay among its --initial-peers took it" in stranded.stderr()
        ), stranded.logs()
        assert "Traceback" not in stranded.stderr(), stranded.logs()
        # a public peer volunteers with --relay: a home peer finds it in the directory and is served through it
        lonely.start_peer(model_path, "--blocks", "0:2", "--host", PUBLIC_IP, "--relay", netns=net.public)
        lonely.wait_online(prefix_for_model(str(model_path)), [(0, 2)], timeout_s=120)
        lonely.start_peer(model_path, "--blocks", "2:4", "--host", HOME_IP, netns=net.home)
        lonely.wait_online(prefix_for_model(str(model_path)), SPANS, timeout_s=120)
        relay_id, relay = record_of(lonely, model_path, (0, 2))
        _, home = record_of(lonely, model_path, (2, 4))
        assert relay.relay and relay.transport == "direct"
        assert home.transport == "p2p" and home.relays == (relay_id,), home
        local = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        ids = torch.randint(3, VOCAB_SIZE, (1, 7), generator=torch.Generator().manual_seed(2))
        remote = AutoDistributedModelForCausalLM.from_pretrained(str(model_path), initial_peers=lonely.initial_peers)
        try:
            with torch.no_grad():
                torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=1e-4, rtol=0)
        finally:
            remote.shutdown()
    finally:
        lonely.close()
