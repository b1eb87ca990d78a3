"""swarm.net.tunnel, swarm.net.relay and swarm.net.reachability against real hivemind DHT nodes and a real gRPC server.

The gRPC server behind the tunnel runs an echo servicer (Info answers with its peer id, Forward returns its
input), so that these tests need no model; the integration tests (test_generation's p2p peer, test_nat) run
the real Peer service through the same paths.
"""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest
import torch

from client.transport import ChannelPool
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import PeerUnavailableError
from protocol.packing import Packer
from protocol.service import make_generic_handler
from swarm.dht.node import start_dht, stop_dht, visible_maddrs
from swarm.net.reachability import ProbeService, check_endpoint, probe
from swarm.net.relay import REGISTER_PROTOCOL, RelayService, register
from swarm.net.tunnel import (
    MAX_TUNNELS_PER_SOURCE,
    RELAY_PROTOCOL,
    TUNNEL_PROTOCOL,
    TunnelPool,
    TunnelServer,
    open_tunnel,
    read_message,
    tunnel_address,
    write_message,
)

MESSAGE_BYTES = 64 << 20


class EchoServicer:
    """The Peer service as far as these tests need it."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id

    async def info(self, request, context):
        return pb.InfoResponse(peer_id=self.peer_id)

    async def forward(self, request, context):
        hidden = decode_tensor(request.message.hidden_states, "hidden_states", request.payload)
        packer = Packer()
        return packer.pack(pb.ForwardResponse(hidden_states=packer.tensor(hidden.clone())))

    backward = inference = state = None  # not called here


async def serve_grpc(peer_id: str) -> tuple[grpc.aio.Server, str]:
    options = [("grpc.max_receive_message_length", MESSAGE_BYTES), ("grpc.max_send_message_length", MESSAGE_BYTES)]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((make_generic_handler(EchoServicer(peer_id)),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def dhts():
    """start(client_mode=False) -> a DHT node joined to the first one started; all stopped afterwards."""
    started = []

    def start(client_mode: bool = False):
        started.append(start_dht(visible_maddrs(started[0]) if started else (), client_mode=client_mode))
        return started[-1]

    yield start
    for dht in started:
        stop_dht(dht)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def forward(pool: ChannelPool, address: str, hidden: torch.Tensor) -> torch.Tensor:
    packer = Packer()
    request = packer.pack(pb.ForwardRequest(hidden_states=packer.tensor(hidden)))
    response = await pool.unary(address, "forward", request, 30.0)
    return decode_tensor(response.message.hidden_states, "hidden_states", response.payload)


def test_a_tunnel_carries_the_peer_service_and_messages_past_4_mib(dhts):
    peer, client = dhts(), dhts(client_mode=True)

    async def main():
        server, endpoint = await serve_grpc(peer.peer_id.to_base58())
        peer_p2p, client_p2p = await peer.replicate_p2p(), await client.replicate_p2p()
        tunnel = TunnelServer(peer_p2p, endpoint)
        await tunnel.start()
        pool = ChannelPool(MESSAGE_BYTES, TunnelPool(lambda: asyncio.sleep(0, client_p2p)))
        try:
            address = tunnel_address(peer.peer_id.to_base58())
            answer = await pool.unary(address, "info", pb.InfoRequest(), 10.0)
            assert answer.peer_id == peer.peer_id.to_base58()
            hidden = torch.randn(4, 512, 1024)  # 8 MiB: over the daemon's 4 MiB unary limit
            assert torch.equal(await forward(pool, address, hidden), hidden)
        finally:
            await pool.close()
            await tunnel.stop()
            await server.stop(None)
            await peer_p2p.shutdown()
            await client_p2p.shutdown()

    run(main())


def test_a_flood_of_tunnel_streams_from_one_identity_is_capped_and_others_still_get_through(dhts):
    """500 streams from one remote peer: MAX_TUNNELS_PER_SOURCE are spliced, the rest closed at once; a stream that
    says nothing, and one that goes quiet, are closed; another identity's client is served all along."""
    peer, flooder, client = dhts(), dhts(client_mode=True), dhts(client_mode=True)

    async def main():
        server, endpoint = await serve_grpc(peer.peer_id.to_base58())
        peer_p2p, flood_p2p, client_p2p = [await d.replicate_p2p() for d in (peer, flooder, client)]
        tunnel = TunnelServer(peer_p2p, endpoint, idle_s=5.0, first_bytes_s=1.0)
        await tunnel.start()
        pool = ChannelPool(MESSAGE_BYTES, TunnelPool(lambda: asyncio.sleep(0, client_p2p)))
        streams = []
        most = [0]  # the most streams spliced at once, sampled throughout the flood

        async def sample() -> None:
            while True:
                most[0] = max(most[0], tunnel.active)
                await asyncio.sleep(0.005)

        sampler = asyncio.ensure_future(sample())
        try:
            silent = await flood_p2p.call_binary_stream_handler(peer.peer_id, TUNNEL_PROTOCOL)
            for _ in range(500):
                _, reader, writer = await flood_p2p.call_binary_stream_handler(peer.peer_id, TUNNEL_PROTOCOL)
                writer.write(b"PRI * HTTP/2.0\r\n")  # the start of what gRPC sends first, then nothing
                await writer.drain()
                streams.append((reader, writer))
            await asyncio.sleep(0.5)
            sampler.cancel()
            assert 0 < most[0] <= MAX_TUNNELS_PER_SOURCE, most[0]
            # a spliced stream that closes (idle for idle_s, or reset on its way) frees its place for a later one,
            # so over the flood somewhat more than the cap are spliced; the most of it is refused at once
            assert tunnel.refused >= 500 // 2, tunnel.refused
            answer = await pool.unary(tunnel_address(peer.peer_id.to_base58()), "info", pb.InfoRequest(), 10.0)
            assert answer.peer_id == peer.peer_id.to_base58()
            assert await asyncio.wait_for(silent[1].read(), 5) == b"", "a silent stream was kept"
            # the spliced ones carried nothing since (the gRPC server waits for the rest of the preface): closed
            deadline = asyncio.get_running_loop().time() + 15
            while tunnel.active > 1 and asyncio.get_running_loop().time() < deadline:  # the client's channel
                await asyncio.sleep(0.2)
            assert tunnel.active <= 1
        finally:
            sampler.cancel()
            for _, writer in streams:
                writer.close()
            await pool.close()
            await tunnel.stop()
            await server.stop(None)
            for p2p in (peer_p2p, flood_p2p, client_p2p):
                await p2p.shutdown()

    run(main())


def test_a_relay_forwards_to_registered_peers_only(dhts):
    relay, home, client = dhts(), dhts(client_mode=True), dhts(client_mode=True)

    async def main():
        server, endpoint = await serve_grpc(home.peer_id.to_base58())
        relay_p2p, home_p2p, client_p2p = [await d.replicate_p2p() for d in (relay, home, client)]
        now = [0.0]
        service = RelayService(relay_p2p, ttl_s=60.0, clock=lambda: now[0])
        tunnel = TunnelServer(home_p2p, endpoint)
        await service.start()
        await tunnel.start()
        pool = ChannelPool(MESSAGE_BYTES, TunnelPool(lambda: asyncio.sleep(0, client_p2p)))
        relay_id, home_id = relay.peer_id.to_base58(), home.peer_id.to_base58()
        try:
            with pytest.raises(PeerUnavailableError, match="is not registered with this relay"):
                await pool.unary(tunnel_address(home_id, relay_id), "info", pb.InfoRequest(), 10.0)
            assert await register(home_p2p, relay.peer_id) == 60.0
            # from here on new pools: a new local listener each, so that gRPC neither reuses a connection it
            # keeps for a while after its channel closed, nor waits out its reconnect backoff for the old one
            await pool.close()
            pool = ChannelPool(MESSAGE_BYTES, TunnelPool(lambda: asyncio.sleep(0, client_p2p)))
            answer = await pool.unary(tunnel_address(home_id, relay_id), "info", pb.InfoRequest(), 10.0)
            assert answer.peer_id == home_id
            # a client cannot use the relay to reach anyone else, itself included
            for other in (client.peer_id.to_base58(), relay_id):
                with pytest.raises(PeerUnavailableError, match="is not registered"):
                    await pool.unary(tunnel_address(other, relay_id), "info", pb.InfoRequest(), 10.0)
            # a registration that is not renewed runs out
            now[0] = 59.0
            assert service.registered() == [home.peer_id]
            now[0] = 61.0
            assert service.registered() == []
            await pool.close()
            pool = ChannelPool(MESSAGE_BYTES, TunnelPool(lambda: asyncio.sleep(0, client_p2p)))
            with pytest.raises(PeerUnavailableError, match="is not registered"):
                await pool.unary(tunnel_address(home_id, relay_id), "info", pb.InfoRequest(), 10.0)
        finally:
            await pool.close()
            for part in (tunnel, service):
                await part.stop()
            await server.stop(None)
            for p2p in (relay_p2p, home_p2p, client_p2p):
                await p2p.shutdown()

    run(main())


def test_a_relay_carries_a_bounded_number_of_streams_per_client(dhts):
    relay, home, greedy, other = dhts(), dhts(client_mode=True), dhts(client_mode=True), dhts(client_mode=True)

    async def main():
        server, endpoint = await serve_grpc(home.peer_id.to_base58())
        p2ps = [await d.replicate_p2p() for d in (relay, home, greedy, other)]
        relay_p2p, home_p2p, greedy_p2p, other_p2p = p2ps
        service = RelayService(relay_p2p, max_streams_per_source=2)
        tunnel = TunnelServer(home_p2p, endpoint)
        await service.start()
        await tunnel.start()
        held = []

        async def open_via_relay(p2p) -> pb.RelayOpened:
            _, reader, writer = await p2p.call_binary_stream_handler(relay.peer_id, RELAY_PROTOCOL)
            await write_message(writer, pb.RelayOpen(peer_id=home.peer_id.to_base58()))
            held.append(writer)
            return await read_message(reader, pb.RelayOpened)

        try:
            await register(home_p2p, relay.peer_id)
            for _ in range(2):
                assert not (await open_via_relay(greedy_p2p)).HasField("error")
            refused = await open_via_relay(greedy_p2p)
            assert refused.error.code == "peer_unavailable" and "2 streams of yours" in refused.error.message
            assert not (await open_via_relay(other_p2p)).HasField("error"), "another client was refused too"
        finally:
            for writer in held:
                writer.close()
            for part in (tunnel, service):
                await part.stop()
            await server.stop(None)
            for p2p in p2ps:
                await p2p.shutdown()

    run(main())


def test_a_relay_refuses_bad_openings_and_more_peers_than_it_takes(dhts):
    relay, first, second = dhts(), dhts(client_mode=True), dhts(client_mode=True)

    async def main():
        relay_p2p, first_p2p, second_p2p = [await d.replicate_p2p() for d in (relay, first, second)]
        service = RelayService(relay_p2p, max_peers=1)
        await service.start()
        try:
            await register(first_p2p, relay.peer_id)
            with pytest.raises(PeerUnavailableError, match="forwards to 1 peers already"):
                await register(second_p2p, relay.peer_id)
            for junk in [struct.pack(">I", 1 << 31), struct.pack(">I", 5) + b"\xff" * 5, b"\x00"]:
                _, reader, writer = await second_p2p.call_binary_stream_handler(relay.peer_id, RELAY_PROTOCOL)
                writer.write(junk)
                await writer.drain()
                if junk != b"\x00":  # an opening too long or unparseable: the relay says so and hangs up
                    assert b"bad_request" in await asyncio.wait_for(reader.read(), 15)
                writer.close()
            assert await register(first_p2p, relay.peer_id) > 0  # and goes on serving
        finally:
            await service.stop()
            for p2p in (relay_p2p, first_p2p, second_p2p):
                await p2p.shutdown()

    run(main())


def test_a_probe_connects_only_to_the_address_it_comes_from():
    async def main():
        server, endpoint = await serve_grpc("me")
        port = endpoint.rsplit(":", 1)[1]
        try:
            assert (await check_endpoint(endpoint, "me", "127.0.0.1")).reachable
            answer = await check_endpoint(endpoint, "someone-else", "127.0.0.1")
            assert not answer.reachable and "answered as me" in answer.detail
            answer = await check_endpoint(f"10.9.8.7:{port}", "me", "127.0.0.1")
            assert not answer.reachable and "is not the address this request came from" in answer.detail
            assert not (await check_endpoint(endpoint, "me", None)).reachable  # relayed or unknown origin
            for bad in ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999", "a b:1", ""]:
                assert not (await check_endpoint(bad, "me", "127.0.0.1")).reachable, bad
        finally:
            await server.stop(None)
        answer = await check_endpoint(endpoint, "me", "127.0.0.1")  # nothing listens there now
        assert not answer.reachable and "did not answer" in answer.detail

    run(main())


def test_a_peer_asks_its_neighbour_whether_it_can_be_reached(dhts):
    neighbour, peer = dhts(), dhts()

    async def main():
        server, endpoint = await serve_grpc(peer.peer_id.to_base58())
        neighbour_p2p, peer_p2p = await neighbour.replicate_p2p(), await peer.replicate_p2p()
        service = ProbeService(neighbour_p2p)
        await service.start()
        try:
            assert (await probe(peer_p2p, [neighbour.peer_id], endpoint)).reachable is True
            result = await probe(peer_p2p, [neighbour.peer_id], "127.0.0.1:1")
            assert result.reachable is False and "did not answer" in result.details[0]
            # a neighbour that does not probe (no service) gives no answer, not a "no"
            assert (await probe(neighbour_p2p, [peer.peer_id], endpoint)).reachable is None
        finally:
            await service.stop()
            await server.stop(None)
            await neighbour_p2p.shutdown()
            await peer_p2p.shutdown()

    run(main())


def test_a_tunnel_pool_keeps_a_bounded_number_of_listeners_least_recently_used_first():
    """Records may name any number of "p2p:" addresses: the pool keeps at most max_listeners local listeners, closing
    the least recently used, and opens a closed one's again when it is asked for."""
    ids = [
        "QmNV2gwZuDBRLFh4MmTppuscM7tDu55Q4YCVWvpN9o6obC",
        "QmTmdTxbr6oWSJu7PfZuNqmWF7DZXHqoP3QWXscxmxB9Wq",
        "QmNdLDdJ2BEgvmZjNZ5qC9UoP3KujowGTvGDiRCN6r51r1",
    ]

    async def refused(endpoint: str) -> bool:
        host, port = endpoint.rsplit(":", 1)
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return True
        writer.close()
        return False

    async def main():
        pool = TunnelPool(lambda: asyncio.sleep(0, None), max_listeners=2)  # no connection is made: no p2p needed
        try:
            first, second = [await pool.local_endpoint(tunnel_address(i)) for i in ids[:2]]
            assert await pool.local_endpoint(tunnel_address(ids[0])) == first  # used again: now the most recent
            third = await pool.local_endpoint(tunnel_address(ids[2]))
            assert await refused(second) and not await refused(first) and not await refused(third)
            again = await pool.local_endpoint(tunnel_address(ids[1]))
            assert not await refused(again) and await refused(first)
        finally:
            await pool.close()

    run(main())


def test_a_remote_peer_that_closed_its_tunnels_can_open_new_ones(dhts):
    """The cap per remote peer counts the streams open now: a client (or a relay, for all the clients behind it)
    that opened and closed more than the cap over time is still served."""
    peer, client = dhts(), dhts(client_mode=True)

    async def main():
        server, endpoint = await serve_grpc(peer.peer_id.to_base58())
        peer_p2p, client_p2p = await peer.replicate_p2p(), await client.replicate_p2p()
        tunnel = TunnelServer(peer_p2p, endpoint, max_per_source=2)
        await tunnel.start()
        try:
            for _ in range(4):  # a new pool each time: a new connection, so a new tunnel stream
                pool = ChannelPool(MESSAGE_BYTES, TunnelPool(lambda: asyncio.sleep(0, client_p2p)))
                try:
                    answer = await pool.unary(tunnel_address(peer.peer_id.to_base58()), "info", pb.InfoRequest(), 10)
                    assert answer.peer_id == peer.peer_id.to_base58()
                finally:
                    await pool.close()
                deadline = asyncio.get_running_loop().time() + 10
                while tunnel.active and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.1)
                assert tunnel.active == 0, "a closed tunnel stream was kept"
            assert tunnel.refused == 0
        finally:
            await tunnel.stop()
            await server.stop(None)
            await peer_p2p.shutdown()
            await client_p2p.shutdown()

    run(main())


def test_a_relay_stream_that_ends_before_the_relays_answer_is_opened_again_once(dhts):
    """A stream to the relay that breaks before its answer is tried once more; a second that breaks is the relay's
    failure, named as such."""
    relay, client = dhts(), dhts(client_mode=True)

    async def main():
        relay_p2p, client_p2p = await relay.replicate_p2p(), await client.replicate_p2p()
        streams = []

        async def breaks_first(info, reader, writer):  # a relay whose first streams end without a word
            streams.append(info.peer_id)
            await read_message(reader, pb.RelayOpen)
            if len(streams) in breaks:
                writer.close()
                return
            await write_message(
                writer, pb.RelayOpened(error=pb.Error(code=PeerUnavailableError.code, message="is not registered here"))
            )
            writer.close()

        await relay_p2p.add_binary_stream_handler(RELAY_PROTOCOL, breaks_first)
        address = tunnel_address(client.peer_id.to_base58(), relay.peer_id.to_base58())
        try:
            breaks = {1}
            with pytest.raises(PeerUnavailableError, match="is not registered here"):
                await open_tunnel(client_p2p, address)
            assert len(streams) == 2
            breaks = {3, 4}
            with pytest.raises(PeerUnavailableError, match="the relay did not answer: the stream ended"):
                await open_tunnel(client_p2p, address)
            assert len(streams) == 4
        finally:
            await relay_p2p.shutdown()
            await client_p2p.shutdown()

    run(main())


def test_a_registration_whose_stream_ends_before_the_answer_is_sent_again_once(dhts):
    """The same for registering with a relay (a peer behind NAT at its start exits when no relay took it)."""
    relay, home = dhts(), dhts(client_mode=True)

    async def main():
        relay_p2p, home_p2p = await relay.replicate_p2p(), await home.replicate_p2p()
        streams = []

        async def breaks_first(info, reader, writer):
            streams.append(info.peer_id)
            await read_message(reader, pb.RelayRegistration)
            if len(streams) not in breaks:
                await write_message(writer, pb.RelayRegistered(ttl_s=30.0))
            writer.close()

        await relay_p2p.add_binary_stream_handler(REGISTER_PROTOCOL, breaks_first)
        try:
            breaks = {1}
            assert await register(home_p2p, relay.peer_id) == 30.0
            assert len(streams) == 2
            breaks = {3, 4}
            with pytest.raises(PeerUnavailableError, match="did not answer the registration: the stream ended"):
                await register(home_p2p, relay.peer_id)
            assert len(streams) == 4
        finally:
            await relay_p2p.shutdown()
            await home_p2p.shutdown()

    run(main())
