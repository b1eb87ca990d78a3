"""Bytes that cannot be read are typed errors on both sides of a real gRPC call, never UNKNOWN or None.

gRPC reports an exception in a deserializer as UNKNOWN on the server and hands the client None; the service
table (protocol/service.py) turns refused bytes into our errors instead.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protocol import swarmlm_pb2 as pb
from protocol.errors import OverloadedError, PeerUnavailableError
from protocol.service import ERROR_CODE_KEY, METHODS, SERVICE_NAME, PeerStub, error_from_rpc, make_generic_handler

GARBAGE = b"\x7a\x05ab"  # a payload field that runs past the end


class Servicer:
    """Answers readable requests; counts what reached it."""

    def __init__(self):
        self.seen = []

    async def forward(self, received, context):
        self.seen.append(received.message)
        return pb.ForwardResponse()

    async def backward(self, received, context):
        return pb.BackwardResponse()

    async def info(self, request, context):
        self.seen.append(request)
        return pb.InfoResponse(peer_id="p")

    async def state(self, request, context):
        yield pb.StatePart(name="w", last=True)

    async def inference(self, requests, context):
        async for received in requests:
            try:
                received.check()
                yield pb.InferenceResponse(opened=pb.SessionOpened(session_id=received.message.open.session_id))
            except Exception as exc:
                yield pb.InferenceResponse(error=pb.Error(code=exc.code, message=str(exc)))


async def _serve(*handlers, **server_options):
    server = grpc.aio.server(**server_options)
    server.add_generic_rpc_handlers(handlers)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


@pytest.mark.parametrize("name", ["Forward", "Backward", "Info", "State"])
def test_server_answers_unreadable_requests_with_a_typed_status(name):
    async def run():
        servicer = Servicer()
        server, channel = await _serve(make_generic_handler(servicer))
        try:
            method = METHODS[name]
            kind = channel.unary_stream if method.server_streaming else channel.unary_unary
            call = kind(method.path)(GARBAGE if name != "Info" else b"\x0a\x80", timeout=10)
            with pytest.raises(grpc.RpcError) as caught:
                if method.server_streaming:
                    [part async for part in call]
                else:
                    await call
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (ERROR_CODE_KEY, "bad_request") in tuple(caught.value.trailing_metadata())
            assert "malformed" in caught.value.details()
            assert servicer.seen == []
            good = kind(method.path)(b"", timeout=10)  # an empty message is a valid one
            if method.server_streaming:
                assert [part async for part in good]
            else:
                await good
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())


def test_an_unreadable_stream_message_is_an_error_on_the_stream_which_goes_on():
    async def run():
        server, channel = await _serve(make_generic_handler(Servicer()))
        try:
            call = channel.stream_stream(METHODS["Inference"].path)()
            await call.write(GARBAGE)
            answer = pb.InferenceResponse.FromString(await call.read())
            assert answer.error.code == "bad_request" and "malformed" in answer.error.message
            await call.write(pb.InferenceRequest(open=pb.OpenSession(session_id="s")).SerializeToString())
            assert pb.InferenceResponse.FromString(await call.read()).opened.session_id == "s"
            await call.done_writing()
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())


def test_client_gets_a_typed_error_for_an_unreadable_response():
    async def garbage(request, context):
        return GARBAGE

    async def garbage_stream(requests, context):
        async for _ in requests:
            yield GARBAGE

    raw = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Forward": grpc.unary_unary_rpc_method_handler(garbage),
            "Info": grpc.unary_unary_rpc_method_handler(garbage),
            "Inference": grpc.stream_stream_rpc_method_handler(garbage_stream),
        },
    )

    async def run():
        server, channel = await _serve(raw)
        try:
            stub = PeerStub(channel)
            response = await stub.forward(pb.ForwardRequest(), timeout=10)
            with pytest.raises(PeerUnavailableError, match="ForwardResponse could not be read: malformed"):
                _ = response.message.hidden_states
            info = await stub.info(pb.InfoRequest(), timeout=10)
            with pytest.raises(PeerUnavailableError, match="InfoResponse could not be read"):
                _ = info.peer_id
            call = stub.inference()
            await call.write(pb.InferenceRequest())
            answer = await call.read()
            with pytest.raises(PeerUnavailableError, match="InferenceResponse could not be read"):
                answer.message.WhichOneof("kind")
            call.cancel()
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())


def _held_info(release: asyncio.Event) -> type[Servicer]:
    """A servicer whose Info answers once `release` is set: each call holds one of the server's concurrent calls."""

    class Held(Servicer):
        async def info(self, request, context):
            await release.wait()
            return pb.InfoResponse(peer_id="p")

    return Held


def test_calls_beyond_the_concurrent_limit_are_overloaded_not_too_large():
    """A peer serves at most --max-concurrent-rpcs calls at once; gRPC refuses the next with RESOURCE_EXHAUSTED, which
    a client must read as a busy peer (route elsewhere), not as its own message being too large (its own fault)."""
    release = asyncio.Event()
    Held = _held_info(release)

    async def run():
        server, channel = await _serve(make_generic_handler(Held()), maximum_concurrent_rpcs=1)
        try:
            info = channel.unary_unary(METHODS["Info"].path)
            held = asyncio.ensure_future(info(b"", timeout=10))
            await asyncio.sleep(0.2)  # the first call is being served
            with pytest.raises(grpc.RpcError) as caught:
                await info(b"", timeout=10)
            error = error_from_rpc(caught.value, "127.0.0.1:1")
            assert isinstance(error, OverloadedError) and "route elsewhere" in str(error)
            release.set()
            await held
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())


def test_the_peers_own_server_takes_its_concurrent_call_cap_from_its_config():
    """peer/server.py builds its gRPC server with --max-concurrent-rpcs: without it, an unbounded number of held calls
    (inference streams that send nothing) would each cost the peer memory and a task."""
    from peer.config import PeerConfig
    from peer.server import grpc_server

    release = asyncio.Event()
    Held = _held_info(release)

    async def run():
        server = grpc_server(PeerConfig(model="m", max_concurrent_rpcs=2), None)
        server.add_generic_rpc_handlers((make_generic_handler(Held()),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            info = channel.unary_unary(METHODS["Info"].path)
            held = [asyncio.ensure_future(info(b"", timeout=10)) for _ in range(2)]
            await asyncio.sleep(0.2)  # both are being served
            with pytest.raises(grpc.RpcError) as caught:
                await info(b"", timeout=10)
            assert isinstance(error_from_rpc(caught.value, "127.0.0.1:1"), OverloadedError)
            release.set()
            await asyncio.gather(*held)
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())
