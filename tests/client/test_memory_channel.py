"""The in-memory channels of the client's tests (tests/helpers/memory_channel.py) fail as gRPC's do.

Each case runs the client's own transport (ChannelPool, InferenceStream) against the same servicer twice: behind a
real gRPC server on 127.0.0.1, and behind the in-memory network; the client must see the same answers and the same
errors. Then what only the in-memory network does on purpose: a server killed or stalled under calls in flight.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from client.transport import ChannelPool, InferenceStream
from protocol import swarmlm_pb2 as pb
from protocol.errors import PeerUnavailableError, UnknownSessionError
from protocol.service import abort, make_generic_handler
from tests.helpers.memory_channel import MemoryServer, Network

ENDPOINT = "peer.in-memory:1"


class Peer:
    """Info answers after `delay_s`; Push refuses with a typed error; an inference stream opens a session per request,
    or ends at once when `ends` is set."""

    def __init__(self, delay_s: float = 0.0, ends: bool = False):
        self.delay_s, self.ends = delay_s, ends

    async def info(self, request, context):
        await asyncio.sleep(self.delay_s)
        return pb.InfoResponse(peer_id="peer")

    async def push(self, received, context):
        await abort(context, UnknownSessionError("no such session"))

    async def inference(self, requests, context):
        if self.ends:
            return
        async for received in requests:
            await context.write(
                pb.InferenceResponse(opened=pb.SessionOpened(session_id=received.message.open.session_id))
            )

    async def forward(self, received, context):
        raise NotImplementedError

    backward = state = forward


@contextlib.asynccontextmanager
async def _reached(transport: str, servicer):
    """(a pool, the endpoint where `servicer` answers it, its MemoryServer or None) over `transport`."""
    if transport == "memory":
        network = Network()
        network.servers[ENDPOINT] = server = MemoryServer(servicer)
        pool = ChannelPool(1 << 20, connect=network.connect)
        try:
            yield pool, ENDPOINT, server
        finally:
            await pool.close()
        return
    grpc_server = grpc.aio.server()
    grpc_server.add_generic_rpc_handlers((make_generic_handler(servicer),))
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    pool = ChannelPool(1 << 20)
    try:
        yield pool, f"127.0.0.1:{port}", None
    finally:
        await pool.close()
        await grpc_server.stop(None)


def _open(session_id: str) -> pb.InferenceRequest:
    return pb.InferenceRequest(open=pb.OpenSession(session_id=session_id, max_length=4, batch_size=1))


@pytest.mark.parametrize("transport", ["grpc", "memory"])
def test_answers_typed_errors_and_deadlines_arrive_as_over_grpc(transport):
    async def go():
        async with _reached(transport, Peer(delay_s=0.3)) as (pool, endpoint, _):
            assert (await pool.unary(endpoint, "info", pb.InfoRequest(), 5)).peer_id == "peer"
            with pytest.raises(UnknownSessionError, match="no such session"):
                await pool.unary(endpoint, "push", pb.PushRequest(), 5)
            with pytest.raises(PeerUnavailableError, match="DEADLINE_EXCEEDED"):
                await pool.unary(endpoint, "info", pb.InfoRequest(), 0.05)
            stream = InferenceStream(pool, endpoint)
            try:
                assert (await stream.request(_open("a"), 5)).message.opened.session_id == "a"
                assert (await stream.request(_open("b"), 5)).message.opened.session_id == "b"
            finally:
                await stream.close()

    asyncio.run(go())


@pytest.mark.parametrize("transport", ["grpc", "memory"])
def test_a_stream_the_peer_ended_fails_as_over_grpc(transport):
    async def go():
        async with _reached(transport, Peer(ends=True)) as (pool, endpoint, _):
            stream = InferenceStream(pool, endpoint)
            try:
                with pytest.raises(PeerUnavailableError):
                    await stream.request(_open("s"), 5)  # the stream ends instead of answering
                with pytest.raises(PeerUnavailableError):
                    await stream.request(_open("s"), 5)  # and stays ended
            finally:
                await stream.close()

    asyncio.run(go())


@pytest.mark.parametrize("transport", ["grpc", "memory"])
def test_dropping_a_channel_fails_its_calls_in_flight_as_over_grpc(transport):
    async def go():
        async with _reached(transport, Peer(delay_s=0.5)) as (pool, endpoint, _):
            calls = [asyncio.create_task(pool.unary(endpoint, "info", pb.InfoRequest(), 5)) for _ in range(3)]
            await asyncio.sleep(0.1)
            await pool.drop(endpoint)
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(r, PeerUnavailableError) for r in results), results
            assert (await pool.unary(endpoint, "info", pb.InfoRequest(), 5)).peer_id == "peer"  # reconnects

    asyncio.run(go())


def test_a_killed_server_fails_every_call_and_a_stalled_one_answers_none():
    async def go():
        async with _reached("memory", Peer(delay_s=0.5)) as (pool, endpoint, server):
            stream = InferenceStream(pool, endpoint)
            await stream.request(_open("a"), 5)
            pending = asyncio.create_task(pool.unary(endpoint, "info", pb.InfoRequest(), 5))
            await asyncio.sleep(0.05)
            server.kill()
            with pytest.raises(PeerUnavailableError, match="UNAVAILABLE"):
                await pending
            with pytest.raises(PeerUnavailableError, match="UNAVAILABLE"):
                await stream.request(_open("b"), 5)
            with pytest.raises(PeerUnavailableError, match="UNAVAILABLE"):
                await pool.unary(endpoint, "info", pb.InfoRequest(), 5)
            await stream.close()

            server.down = False  # back up, then stopped
            stream = InferenceStream(pool, endpoint)
            await stream.request(_open("c"), 5)
            server.stall()
            with pytest.raises(PeerUnavailableError, match=r"did not answer within 0\.1s"):
                await stream.request(_open("d"), 0.1)
            with pytest.raises(PeerUnavailableError, match="DEADLINE_EXCEEDED"):
                await pool.unary(endpoint, "info", pb.InfoRequest(), 0.1)
            await stream.close()

    asyncio.run(go())
