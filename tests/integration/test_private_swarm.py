"""A private swarm (`--swarm-key`): its members work as in a public one, and a stranger on every role is refused.

One bootstrap node and one peer, started once for the module with a key that `swarmlm bootstrap --new-swarm-key`
created. Strangers have no key or another one: a DHT node (also one that skips hivemind's bootstrap check, as an
attacker would), a client on the peer's gRPC endpoint and on its libp2p tunnel, a peer, and `swarmlm status`.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
import time

import grpc
import hivemind
import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from client.transport import ChannelPool
from protocol import swarmlm_pb2 as pb
from protocol.errors import PeerUnavailableError, UnauthorizedError
from protocol.records import ServerState, prefix_for_model
from protocol.service import PeerStub, error_from_rpc
from swarm.dht.directory import fetch_models, fetch_snapshot
from swarm.dht.node import dht_result, start_dht, start_plain_dht, stop_dht
from swarm.net.tunnel import TunnelPool, tunnel_address
from swarm.trust.rpcauth import SERVER_NAME
from swarm.trust.swarmkey import SwarmKey, create_key_file
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.processes import Swarm

pytestmark = pytest.mark.timeout(240)

SPAN = (0, 4)


@pytest.fixture(scope="module")
def private(tmp_path_factory, tiny_llama_path):
    """(swarm, key file, key, the peer's ServerInfo, its peer id) of a running private swarm."""
    workdir = tmp_path_factory.mktemp("private")
    key_file = workdir / "swarm.key"
    with Swarm(workdir) as swarm:
        swarm.start_bootstrap("--new-swarm-key", str(key_file))
        key = SwarmKey.load(key_file)
        swarm.swarm_key = key
        swarm.start_peer(tiny_llama_path, "--blocks", f"{SPAN[0]}:{SPAN[1]}", "--swarm-key", str(key_file))
        snapshot = swarm.wait_online(prefix_for_model(str(tiny_llama_path)), [SPAN], timeout_s=120)
        ((peer_id, info),) = snapshot.online().items()
        yield swarm, key_file, key, info, peer_id


def test_the_new_key_file_is_private_and_never_overwritten(private):
    swarm, key_file, key, _, _ = private
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert f"--swarm-key {key_file}" in swarm.bootstrap.stdout() and key.key_id in swarm.bootstrap.stdout()
    before = key_file.read_bytes()
    result = swarm.run("bootstrap", "--new-swarm-key", str(key_file), timeout_s=30)
    assert result.returncode != 0 and "already exists" in result.stderr, result
    assert key_file.read_bytes() == before


def test_a_member_generates_what_the_local_model_does(private, tiny_llama_path):
    swarm, _, key, info, _ = private
    assert info.transport == "direct"  # the bootstrap node's probe reached the peer over TLS with a tag
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=swarm.initial_peers, swarm_key=key
    )
    local = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    try:
        ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(remote(ids).logits, local(ids).logits, atol=1e-4, rtol=0)  # Forward
        assert_same_generation(
            generate_with_logits(remote, ids, max_new_tokens=8, do_sample=False),
            generate_with_logits(local, ids, max_new_tokens=8, do_sample=False),
        )
    finally:
        remote.shutdown()


@pytest.mark.parametrize("stranger_key", [None, "other"])
def test_a_stranger_dht_node_cannot_join(private, stranger_key):
    swarm, _, _key, _, _ = private
    stranger = None if stranger_key is None else SwarmKey(os.urandom(32))
    began = time.monotonic()
    with pytest.raises(UnauthorizedError, match="--swarm-key") as caught:
        start_dht(swarm.initial_peers, client_mode=True, swarm_key=stranger, startup_timeout_s=20)
    assert time.monotonic() - began < 20
    assert ("no swarm key" if stranger is None else stranger.key_id) in str(caught.value)


def _stranger_dht(initial_peers, *, client_mode: bool) -> hivemind.DHT:
    """A DHT node without a key that goes on although nobody answered its pings, as an attacker's would."""
    return start_plain_dht(initial_peers, client_mode=client_mode, ensure_bootstrap_success=False)


def test_a_stranger_that_skips_the_join_check_reads_nothing_and_writes_nothing(private, tiny_llama_path):
    swarm, _, _key, _, _ = private
    prefix = prefix_for_model(str(tiny_llama_path))
    stranger = _stranger_dht(swarm.initial_peers, client_mode=False)
    try:
        assert fetch_models(stranger) == {}
        assert fetch_snapshot(stranger, prefix, SPAN[1]).servers == {}
        # it may keep the record itself (it is a DHT of one), but no member stores it or sees it
        dht_result(
            stranger,
            stranger.store("forged-key", "forged", time.time() + 60, return_future=True),
            "store",
            timeout_s=20,
        )
        member = swarm.dht
        assert dht_result(member, member.get("forged-key", latest=True, return_future=True), "get") is None
        assert prefix in fetch_models(member)  # the members' view is intact
    finally:
        stop_dht(stranger)


def _call_all(open_channel, prefix: str) -> list[grpc.RpcError]:
    """Info, Forward and Inference with no tag on the channel `open_channel()` makes: the errors they end with."""

    async def calls():
        channel = open_channel()
        stub, errors = PeerStub(channel), []
        for call in (
            lambda: stub.info(pb.InfoRequest(), timeout=10),
            lambda: stub.forward(pb.ForwardRequest(span=pb.Span(model=prefix, start=0, end=4)), timeout=10),
        ):
            try:
                await call()
            except grpc.RpcError as exc:
                errors.append(exc)
        stream = stub.inference(timeout=10)  # bounded, should the peer ever serve it
        try:
            # no write first: the peer ends the call as it starts, and a write racing that status fails INTERNAL
            await stream.read()
        except grpc.RpcError as exc:
            errors.append(exc)
        finally:
            stream.cancel()
        await channel.close()
        return errors

    return asyncio.run(calls())


def test_a_stranger_client_is_not_served_even_over_the_peers_own_tls(private, tiny_llama_path):
    _, _, _, info, _ = private
    host, port = info.endpoint.rsplit(":", 1)
    # a stranger that trusts whatever certificate the peer shows: TLS completes, yet no call is served
    shown = ssl.get_server_certificate((host, int(port))).encode()
    errors = _call_all(
        lambda: grpc.aio.secure_channel(
            info.endpoint,
            grpc.ssl_channel_credentials(root_certificates=shown),
            options=[("grpc.ssl_target_name_override", SERVER_NAME)],
        ),
        prefix_for_model(str(tiny_llama_path)),
    )
    assert len(errors) == 3
    for exc in errors:
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
        error = error_from_rpc(exc, info.endpoint)
        assert isinstance(error, UnauthorizedError) and "--swarm-key" in str(error), error
    # in plain text the peer does not even speak gRPC
    errors = _call_all(lambda: grpc.aio.insecure_channel(info.endpoint), prefix_for_model(str(tiny_llama_path)))
    assert len(errors) == 3 and all(exc.code() == grpc.StatusCode.UNAVAILABLE for exc in errors), errors


@pytest.mark.parametrize("through", ["direct", "tunnel"])
def test_a_client_with_another_key_gets_unauthorized_and_a_member_is_served(private, through):
    swarm, _, key, info, peer_id = private
    stranger = SwarmKey(os.urandom(32))
    # the tunnel is opened from a libp2p node of the stranger's own: the bundled p2pd has no private-network key
    node = _stranger_dht(swarm.initial_peers, client_mode=True)
    address = info.endpoint if through == "direct" else tunnel_address(peer_id)

    async def info_with(swarm_key):
        pool = ChannelPool(1 << 26, TunnelPool(node.replicate_p2p), swarm_key=swarm_key)
        try:
            return await pool.unary(address, "info", pb.InfoRequest(), 10.0)
        finally:
            await pool.close()

    try:
        with pytest.raises(UnauthorizedError, match="TLS handshake"):
            asyncio.run(info_with(stranger))
        with pytest.raises(PeerUnavailableError):
            asyncio.run(info_with(None))
        assert asyncio.run(info_with(key)).peer_id == peer_id  # the same path works with the swarm's key
    finally:
        stop_dht(node)


def test_a_stranger_peer_cannot_join_and_says_why(private, tiny_llama_path):
    swarm, _, _, _, _ = private
    peer = swarm.start_peer(tiny_llama_path, "--blocks", "0:4")
    result = swarm.finish(peer, timeout_s=90)
    assert result.returncode == 1, result
    assert "this node has no swarm key" in result.stderr and "--swarm-key FILE" in result.stderr, result.stderr
    snapshot = swarm.snapshot(prefix_for_model(str(tiny_llama_path)))
    assert len(snapshot.servers) == 1  # the member alone


def test_status_needs_the_key(private, tiny_llama_path, tmp_path):
    swarm, key_file, _, _, peer_id = private
    bare = swarm.run("status", "--initial-peers", *swarm.initial_peers)
    assert bare.returncode == 1 and "no swarm key" in bare.stderr and "--swarm-key FILE" in bare.stderr, bare
    other = create_key_file(tmp_path / "other.key")
    refused = swarm.run("status", "--initial-peers", *swarm.initial_peers, "--swarm-key", str(tmp_path / "other.key"))
    assert refused.returncode == 1 and other.key_id in refused.stderr and "--swarm-key" in refused.stderr, refused
    assert peer_id not in refused.stdout + refused.stderr
    shown = swarm.run("status", "--initial-peers", *swarm.initial_peers, "--swarm-key", str(key_file))
    assert shown.returncode == 0, shown
    assert peer_id in shown.stdout and ServerState.ONLINE.name in shown.stdout
