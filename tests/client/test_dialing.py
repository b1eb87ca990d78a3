"""Dialing (client/dialing.py): each peer's path and round trip, through a fake pool of peers that answer pings; and
a client on in-memory peers (tests/helpers/fake_swarm.py) that dials a restarted peer where it is now.

A peer proves its key by signing the ping's challenge; here a "signature" is the challenge tagged with the signer's
id, which the snapshot accepts only from the record's owner.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from client.bans import BanList
from client.dialing import UNREACHABLE_S, Dialer
from client.routing import RouteHop
from protocol import swarmlm_pb2 as pb
from protocol.errors import PeerUnavailableError
from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot
from swarm.net.tunnel import tunnel_address
from swarm.trust.identity import identity_challenge
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE


def _proof(signer: str, data: bytes) -> bytes:
    return signer.encode() + b"|" + data


class KeyedSnapshot(SwarmSnapshot):
    def verify(self, peer_id: str, data: bytes, signature: bytes) -> bool:
        return signature == _proof(peer_id, data)


class Pool:
    """Addresses -> the peer id whose key the server there holds; an address not listed does not answer."""

    def __init__(self, servers: dict[str, str]):
        self.servers, self.pinged, self.dropped = servers, [], []

    async def unary(self, address: str, method: str, request: pb.InfoRequest, timeout_s: float) -> pb.InfoResponse:
        assert method == "info"
        self.pinged.append(address)
        if address not in self.servers:
            raise PeerUnavailableError(f"peer {address} did not answer")
        signer = self.servers[address]
        return pb.InfoResponse(identity_proof=_proof(signer, identity_challenge(request.nonce, signer)))

    async def drop(self, address: str) -> None:
        self.dropped.append(address)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _info(port: int) -> ServerInfo:
    return ServerInfo(
        state=ServerState.ONLINE,
        start_block=0,
        end_block=2,
        throughput=1.0,
        cache_tokens_left=64,
        dtype="float32",
        version="2",
        endpoint=f"127.0.0.1:{port}",
    )


def _snapshot(**servers: ServerInfo) -> KeyedSnapshot:
    return KeyedSnapshot(num_blocks=2, servers=dict(servers))


def _dialer(servers: dict[str, str]) -> tuple[Dialer, Pool, BanList]:
    clock = Clock()
    pool, bans = Pool(servers), BanList(base_s=1.0, clock=clock)
    return Dialer(pool, bans, clock=clock), pool, bans


def test_a_peer_is_reached_at_its_endpoint_and_measured_once():
    dialer, pool, bans = _dialer({"127.0.0.1:1": "a"})
    snapshot = _snapshot(a=_info(1))
    asyncio.run(dialer.measure_rtts(snapshot))
    assert dialer.paths == {"a": "127.0.0.1:1"} and 0 <= dialer.rtts["a"] < 1.0
    asyncio.run(dialer.measure_rtts(snapshot))
    assert pool.pinged == ["127.0.0.1:1"], "a measured peer was pinged again"
    hop = RouteHop("a", 0, 2, "announced")
    assert dialer.on_paths([hop, RouteHop("b", 0, 2, "b's")]) == [
        RouteHop("a", 0, 2, "127.0.0.1:1"),
        RouteHop("b", 0, 2, "b's"),
    ]
    assert bans.banned() == set()


def test_a_peer_that_does_not_answer_at_its_endpoint_is_reached_over_libp2p(caplog):
    dialer, pool, _ = _dialer({tunnel_address("a"): "a"})
    with caplog.at_level(logging.INFO, logger="client.dialing"):
        asyncio.run(dialer.measure_rtts(_snapshot(a=_info(1))))
    assert dialer.paths == {"a": tunnel_address("a")}
    assert pool.pinged == ["127.0.0.1:1", tunnel_address("a")] and pool.dropped == ["127.0.0.1:1"]
    assert "is reached at" in caplog.text


def test_a_peer_that_answers_nowhere_counts_the_timeout_and_keeps_its_endpoint():
    dialer, pool, bans = _dialer({})
    info = _info(1)
    address = asyncio.run(dialer.address_of("a", info, _snapshot(a=info), timeout_s=0.25))
    assert address == "127.0.0.1:1" and dialer.rtts == {"a": 0.25} and dialer.paths == {}
    assert pool.pinged == pool.dropped == ["127.0.0.1:1", tunnel_address("a")]
    assert bans.banned() == set(), "silence is not a lie"


def test_a_peer_that_answers_nowhere_is_unreachable_until_a_later_ping_answers():
    """A stopped process (SIGSTOP) keeps its record alive: it is left out of routes, and pinged again later."""
    dialer, pool, bans = _dialer({})
    snapshot = _snapshot(a=_info(1))
    asyncio.run(dialer.measure_rtts(snapshot, timeout_s=0.25))
    assert dialer.unreachable() == {"a"} and bans.banned() == set()
    asyncio.run(dialer.measure_rtts(snapshot, timeout_s=0.25))
    assert len(pool.pinged) == 2, "pinged again within UNREACHABLE_S"
    pool.servers["127.0.0.1:1"] = "a"  # it was resumed
    bans.clock.now += UNREACHABLE_S
    assert dialer.unreachable() == set()
    asyncio.run(dialer.measure_rtts(snapshot, timeout_s=0.25))
    assert pool.pinged[-1] == "127.0.0.1:1" and dialer.paths == {"a": "127.0.0.1:1"} and dialer.unreachable() == set()


def test_a_server_without_the_record_owners_key_is_an_impostor_and_banned():
    dialer, pool, bans = _dialer({"127.0.0.1:1": "b", tunnel_address("a"): "b"})
    asyncio.run(dialer.measure_rtts(_snapshot(a=_info(1))))
    assert dialer.paths == {} and dialer.rtts == {"a": 1.0}
    assert bans.banned() == {"a"} and pool.dropped == ["127.0.0.1:1", tunnel_address("a")]


def test_no_answer_is_trusted_without_the_keys_of_a_snapshot():
    dialer, _, bans = _dialer({"127.0.0.1:1": "a"})
    asyncio.run(dialer.address_of("a", _info(1), None))
    assert dialer.paths == {} and bans.banned() == {"a"}


def test_a_peer_that_moved_or_failed_is_measured_afresh():
    dialer, pool, _ = _dialer({"127.0.0.1:1": "a", "127.0.0.1:2": "a"})
    snapshot = _snapshot(a=_info(1))
    assert asyncio.run(dialer.address_of("a", _info(1), snapshot)) == "127.0.0.1:1"
    assert asyncio.run(dialer.address_of("a", _info(1), snapshot)) == "127.0.0.1:1"
    assert pool.pinged == ["127.0.0.1:1"]
    # back under the same id (its key kept) at another endpoint: not dialed at its old address
    assert asyncio.run(dialer.address_of("a", _info(2), _snapshot(a=_info(2)))) == "127.0.0.1:2"
    assert pool.pinged == ["127.0.0.1:1", "127.0.0.1:2"]
    dialer.forget("a")
    assert dialer.paths == {} and dialer.rtts == {}
    asyncio.run(dialer.measure_rtts(_snapshot(a=_info(2))))
    assert pool.pinged[-1] == "127.0.0.1:2" and dialer.paths == {"a": "127.0.0.1:2"}


def test_only_the_peers_asked_for_are_measured():
    dialer, pool, _ = _dialer({"127.0.0.1:1": "a", "127.0.0.1:2": "b"})
    asyncio.run(dialer.measure_rtts(_snapshot(a=_info(1), b=_info(2)), only={"b"}))
    assert pool.pinged == ["127.0.0.1:2"] and set(dialer.paths) == {"b"}


def test_a_peer_back_at_another_endpoint_is_dialed_there(fake_swarm, tiny_llama_local):
    """Through a client on in-memory peers: the peer it generated with crashes and comes back with its key at another
    endpoint; the next generation dials the new endpoint, with no failure on the old one."""
    first = fake_swarm.add_peer(0, 4)
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(31))
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=6, do_sample=False)
    remote = fake_swarm.client(directory_refresh_s=0.01)
    try:
        assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
        back = fake_swarm.restart(first)
        time.sleep(0.02)  # the client's view of the directory goes stale
        assert back.peer_id == first.peer_id and back.endpoint != first.endpoint
        assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
        assert remote.sequence.failovers == 0, "the client dialed the peer's old endpoint"
        assert remote.sequence.paths[back.peer_id] == back.endpoint
    finally:
        remote.shutdown()


def test_five_stopped_fast_peers_get_no_request_and_cost_no_timeout(fake_swarm, tiny_llama_local):
    """Five peers announce 1e7 tokens/s and then stop (SIGSTOP: records alive, calls held forever). Their pings time
    out, so no forward, backward or inference request goes to them: nothing waits out a request timeout, nobody is
    banned, and the results are the local model's."""
    from tests.helpers.fake_swarm import Fault

    honest = fake_swarm.add_peer(0, 4)
    stopped = [fake_swarm.add_peer(0, 4, throughput=1e7, faults=[Fault("stall", method="info")]) for _ in range(5)]
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(35))
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=6, do_sample=False)
    embeds = tiny_llama_local.get_input_embeddings()(ids).detach()
    remote = fake_swarm.client(request_timeout_s=5.0, verify_fraction=0.0, verify_inference=0.0)
    try:
        assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=6, do_sample=False), expected)
        got_in = embeds.clone().requires_grad_(True)
        remote(inputs_embeds=got_in, labels=ids).loss.backward()
        assert got_in.grad is not None and torch.isfinite(got_in.grad).all()
        for peer in stopped:
            assert peer.server.stalled, "the peer was never pinged: the test proves nothing"
            assert set(peer.answered) == {"info"}, peer.answered
        assert remote.sequence.failovers == 0 and remote.sequence.bans.banned() == set()
        assert remote.sequence.dialer.unreachable() == {peer.peer_id for peer in stopped}
        assert honest.answered.get("forward") and honest.answered.get("inference")
    finally:
        remote.shutdown()


def test_a_nonce_flood_from_one_address_is_refused_while_others_get_their_proof(fake_swarm):
    """Identity proofs are metered per client address (peer/proofs.py) and signed off the event loop."""
    import asyncio

    import pytest

    from peer.proofs import ProofMeter
    from protocol import swarmlm_pb2 as pb
    from protocol.errors import OverloadedError
    from protocol.service import ERROR_CODE_KEY
    from tests.helpers.memory_channel import _Aborted, _Context

    peer = fake_swarm.add_peer(0, 4)
    peer.servicer.proofs = ProofMeter(clock=lambda: 0.0)  # no refill while the flood runs, however slow it is

    async def ask(address: str) -> bytes:
        response = await peer.servicer.info(pb.InfoRequest(nonce=b"n" * 16), _Context(f"ipv4:{address}:5000"))
        return response.identity_proof

    async def flood():
        proofs = [await ask("10.0.0.1") for _ in range(40)]  # the burst
        assert all(proofs)
        with pytest.raises(_Aborted) as refused:
            await ask("10.0.0.1")
        assert (ERROR_CODE_KEY, OverloadedError.code) in tuple(refused.value.error.trailing_metadata())
        assert await ask("10.0.0.2")  # another address is served

    asyncio.run(flood())
