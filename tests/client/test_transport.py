"""Transport failures become swarmlm errors the client can fail over on (a real gRPC server on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from client.transport import ChannelPool, InferenceStream
from protocol import swarmlm_pb2 as pb
from protocol.errors import PeerUnavailableError
from protocol.service import make_generic_handler


class EndsStreams:
    """A peer that ends every inference stream at once, as one does when it dies or drops a session."""

    async def inference(self, requests, context):
        return
        yield  # an async generator that yields nothing

    async def forward(self, request, context):
        raise NotImplementedError

    backward = info = state = forward


def test_writing_to_a_finished_stream_is_a_peer_failure():
    async def go():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((make_generic_handler(EndsStreams()),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = ChannelPool(1 << 20)
        stream = InferenceStream(pool, f"127.0.0.1:{port}")
        request = pb.InferenceRequest(open=pb.OpenSession(session_id="s", max_length=4, batch_size=1))
        try:
            with pytest.raises(PeerUnavailableError):
                await stream.request(request, 5)  # the stream ends instead of answering
            # wait for the call itself to end (the server returned), not some time: the next write meets a finished call
            # (its status is OK, or INTERNAL when the request's write raced the server's end: 1 run in ~8)
            assert await asyncio.wait_for(stream._call.code(), 5) in (grpc.StatusCode.OK, grpc.StatusCode.INTERNAL)
            with pytest.raises(PeerUnavailableError, match=r"127\.0\.0\.1"):
                await stream.request(request, 5)  # the call is finished: writing must not escape as InvalidStateError
        finally:
            await stream.close()
            await pool.close()
            await server.stop(None)

    asyncio.run(go())


class SlowEcho:
    """A peer whose Info calls take a while, so that several are in flight on one channel."""

    async def info(self, request, context):
        await asyncio.sleep(0.5)
        return pb.InfoResponse(peer_id="slow")

    async def forward(self, request, context):
        raise NotImplementedError

    backward = inference = state = forward


def test_dropping_a_channel_fails_its_other_calls_as_peer_failures():
    """Concurrent micro-batches share a channel: when one fails and drops it, the others fail, not get cancelled."""

    async def go():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((make_generic_handler(SlowEcho()),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = ChannelPool(1 << 20)
        endpoint = f"127.0.0.1:{port}"
        try:
            calls = [asyncio.create_task(pool.unary(endpoint, "info", pb.InfoRequest(), 5)) for _ in range(3)]
            await asyncio.sleep(0.1)
            await pool.drop(endpoint)
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(r, PeerUnavailableError) for r in results), results
            assert (await pool.unary(endpoint, "info", pb.InfoRequest(), 5)).peer_id == "slow"  # reconnects
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(go())


def test_the_pool_keeps_at_most_max_channels_closing_idle_ones_first():
    """Channels to many peers: beyond the cap the least recently used idle one closes; one an inference stream
    holds stays open, and every endpoint still answers (reconnecting when it was closed)."""

    async def go():
        servers, endpoints = [], []
        for _ in range(4):
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((make_generic_handler(Answers()),))
            endpoints.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        pool = ChannelPool(1 << 20, max_channels=2)
        stream = InferenceStream(pool, endpoints[0])
        try:
            opened = await stream.request(pb.InferenceRequest(open=pb.OpenSession(session_id="s")), 5)
            assert opened.message.opened.session_id == "s"
            for endpoint in endpoints[1:]:
                assert (await pool.unary(endpoint, "info", pb.InfoRequest(), 5)).peer_id == "answers"
                assert len(pool.endpoints) <= 2
            # the stream's channel was the least recently used all along, but it is busy: the idle ones went
            assert pool.endpoints == [endpoints[0], endpoints[3]]
            again = await stream.request(pb.InferenceRequest(open=pb.OpenSession(session_id="t")), 5)
            assert again.message.opened.session_id == "t"  # the stream lived through it
            await stream.close()  # now idle: the next new channel closes it
            assert (await pool.unary(endpoints[1], "info", pb.InfoRequest(), 5)).peer_id == "answers"
            assert pool.endpoints == [endpoints[3], endpoints[1]]
        finally:
            await stream.close()
            await pool.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(go())


def test_a_pool_full_of_busy_channels_opens_one_more():
    async def go():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((make_generic_handler(SlowEcho()),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = ChannelPool(1 << 20, max_channels=1)
        # two names of one server: two channels, both busy at once
        first, second = f"127.0.0.1:{port}", f"localhost:{port}"
        try:
            calls = [pool.unary(endpoint, "info", pb.InfoRequest(), 5) for endpoint in (first, second)]
            assert [answer.peer_id for answer in await asyncio.gather(*calls)] == ["slow", "slow"]
            assert len(pool.endpoints) == 2
            third = f"127.0.0.2:{port}"
            with pytest.raises(PeerUnavailableError):  # nobody listens there; opening it still makes room
                await pool.unary(third, "info", pb.InfoRequest(), 1)
            assert pool.endpoints == [third]
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(go())


class Answers:
    """A peer that opens every session and answers Info at once."""

    async def inference(self, requests, context):
        async for received in requests:
            yield pb.InferenceResponse(opened=pb.SessionOpened(session_id=received.message.open.session_id))

    async def info(self, request, context):
        return pb.InfoResponse(peer_id="answers")

    async def forward(self, request, context):
        raise NotImplementedError

    backward = state = forward
