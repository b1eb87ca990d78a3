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
            assert await asyncio.wait_for(stream._call.code(), 5) == grpc.StatusCode.OK
            with pytest.raises(PeerUnavailableError, match="127.0.0.1"):
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
