"""gRPC channels that reach servicers in this process, like httpx's MockTransport: no sockets, milliseconds a call.

A `Network` maps endpoints ("host:port") to `MemoryServer`s, each a servicer behind protocol/service.py's own
handlers (`make_generic_handler`); `Network.connect` opens a `MemoryChannel`, and fits `ChannelPool(connect=...)`.
A call goes through the same serializers, handlers and deserializers as over the network, so the client's transport
(client/transport.py: ChannelPool, InferenceStream, the translation of gRPC errors) runs unchanged. What a socket
would do becomes explicit: a server that is `kill`ed fails every call in flight with UNAVAILABLE, as a peer whose
process died does; a `stall`ed one takes requests and never answers, as a stopped process does; a closed channel
cancels its calls; a call past its deadline fails with DEADLINE_EXCEEDED. A server's `Script` sees every unary call
as it arrives and every answer, serialized, before it leaves: it may refuse the call, change the answer, or kill or
stall the server (tests/helpers/fake_swarm.py).

Servicers run on the caller's event loop, each call's handler in a task of its own; a unary handler is cancelled when
its caller stops waiting, as gRPC cancels a handler whose call went away. No flow control: a stream buffers whatever
is written to it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc import aio

from protocol.service import make_generic_handler


class Script(Protocol):
    """What a server does besides serving: it may kill or stall `server`, refuse a call, or change an answer."""

    def took(self, server: MemoryServer, method: str) -> None:
        """A unary call of `method` arrives (before its handler runs); raise an AioRpcError to refuse it."""

    def answer(self, server: MemoryServer, method: str, data: bytes) -> bytes:
        """An answer of `method` is about to leave, serialized: the bytes to send instead."""


class _Honest:
    def took(self, server: MemoryServer, method: str) -> None:
        pass

    def answer(self, server: MemoryServer, method: str, data: bytes) -> bytes:
        return data


def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(*trailing), details=details)


class _Aborted(Exception):
    """A handler's `context.abort`: ends its call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple):
        super().__init__(details)
        self.error = rpc_error(code, details, tuple(trailing or ()))


class _Context:
    """What our servicers use of grpc.aio's ServicerContext."""

    def __init__(self, peer: str, write: Callable | None = None):
        self._peer, self._write = peer, write

    def peer(self) -> str:
        return self._peer

    async def write(self, response) -> None:
        await self._write(response)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        raise _Aborted(code, details, trailing_metadata)


@dataclass(frozen=True)
class _Details:
    """grpc.HandlerCallDetails of a call."""

    method: str
    invocation_metadata: tuple


class MemoryServer:
    """A servicer at one endpoint, and what happens to the calls that reach it (its `script`)."""

    def __init__(self, servicer, script: Script | None = None):
        self.handler = make_generic_handler(servicer)
        self.script = script or _Honest()
        self.down = False
        self._stalled: asyncio.Future | None = None  # never set: what a stalled server's calls wait on
        self._calls: set = set()  # calls in flight

    @property
    def stalled(self) -> bool:
        return self._stalled is not None

    def kill(self) -> None:
        """The process died: every call in flight fails, and new ones cannot connect."""
        self.down = True
        for call in list(self._calls):
            call.fail(rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))

    def stall(self) -> None:
        """The process stopped: requests are taken, nothing is answered."""
        if self._stalled is None:
            self._stalled = asyncio.get_running_loop().create_future()

    async def reached(self) -> None:
        """Refused when the server is down, held forever while it is stalled."""
        if self.down:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; Connection refused")
        if self._stalled is not None:
            await asyncio.shield(self._stalled)

    async def take(self, method: str) -> None:
        """A unary call arrives: through the script, unless the server is (or goes) down or stalled."""
        await self.reached()
        self.script.took(self, method)
        await self.reached()

    async def send(self, method: str, data: bytes) -> bytes:
        """An answer leaves: through the script, unless the server is (or goes) down or stalled."""
        await self.reached()
        data = self.script.answer(self, method, data)
        await self.reached()
        return data


class Network:
    """Endpoints -> in-memory servers; `connect` opens channels to them (a `ChannelPool`'s `connect`)."""

    def __init__(self):
        self.servers: dict[str, MemoryServer] = {}
        self._ports = itertools.count(40000)

    def connect(self, target: str, options=(), auth=None) -> MemoryChannel:
        return MemoryChannel(self, target, f"ipv4:127.0.0.1:{next(self._ports)}")


class MemoryChannel:
    """A grpc.aio.Channel to `target` on `network`, whose calls come from `source` (what `context.peer()` says)."""

    def __init__(self, network: Network, target: str, source: str):
        self.network, self.target, self.source = network, target, source
        self._calls: set = set()

    def unary_unary(self, path: str, request_serializer=None, response_deserializer=None):
        return _UnaryCallable(self, path, request_serializer, response_deserializer)

    def stream_stream(self, path: str, request_serializer=None, response_deserializer=None):
        return _StreamCallable(self, path, request_serializer, response_deserializer)

    def unary_stream(self, path: str, request_serializer=None, response_deserializer=None):
        return _Unsupported(path)

    stream_unary = unary_stream

    async def close(self, grace: float | None = None) -> None:
        """Cancel every call in flight, as closing a gRPC channel does."""
        for call in list(self._calls):
            call.cancel()

    def _server(self) -> MemoryServer | None:
        return self.network.servers.get(self.target)

    def _track(self, call, server: MemoryServer | None) -> None:
        self._calls.add(call)
        if server is not None:
            server._calls.add(call)

    def _untrack(self, call, server: MemoryServer | None) -> None:
        self._calls.discard(call)
        if server is not None:
            server._calls.discard(call)


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


class _Unsupported:
    def __init__(self, path: str):
        self.path = path

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.path} is not served in memory")


class _UnaryCallable:
    def __init__(self, channel: MemoryChannel, path: str, serialize, deserialize):
        self.channel, self.path, self.serialize, self.deserialize = channel, path, serialize, deserialize

    async def __call__(self, request, timeout: float | None = None, metadata=None):
        call = _UnaryCall(asyncio.get_running_loop().create_future())
        server = self.channel._server()
        self.channel._track(call, server)
        call.task = asyncio.ensure_future(self._invoke(server, self.serialize(request), metadata, call))
        try:
            return await asyncio.wait_for(call.outcome, timeout)
        except asyncio.TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            call.task.cancel()
            self.channel._untrack(call, server)

    async def _invoke(self, server: MemoryServer | None, data: bytes, metadata, call: _UnaryCall) -> None:
        try:
            if server is None:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to all addresses ({self.path})")
            await server.take(_name(self.path))
            handler = server.handler.service(_Details(self.path, tuple(metadata or ())))
            if handler is None:
                raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            try:
                response = await handler.unary_unary(handler.request_deserializer(data), _Context(self.channel.source))
            except _Aborted as aborted:
                raise aborted.error from None
            answer = await server.send(_name(self.path), handler.response_serializer(response))
            call.settle(result=self.deserialize(answer))
        except aio.AioRpcError as exc:
            call.settle(error=exc)
        except Exception as exc:  # a bug of a handler: gRPC answers UNKNOWN
            call.settle(error=rpc_error(grpc.StatusCode.UNKNOWN, f"Unexpected error in the handler: {exc!r}"))


class _UnaryCall:
    def __init__(self, outcome: asyncio.Future):
        self.outcome, self.task = outcome, None

    def settle(self, result=None, error: BaseException | None = None) -> None:
        if not self.outcome.done():
            self.outcome.set_exception(error) if error is not None else self.outcome.set_result(result)

    def fail(self, error: aio.AioRpcError) -> None:
        self.settle(error=error)
        self.task.cancel()

    def cancel(self) -> None:
        self.outcome.cancel()
        self.task.cancel()


class _StreamCallable:
    def __init__(self, channel: MemoryChannel, path: str, serialize, deserialize):
        self.channel, self.path, self.serialize, self.deserialize = channel, path, serialize, deserialize

    def __call__(self, metadata=None, timeout: float | None = None) -> _StreamCall:
        return _StreamCall(self, tuple(metadata or ()))


class _StreamCall:
    """A bidirectional call: the client writes requests and reads answers; the servicer runs in a task of its own."""

    def __init__(self, callable_: _StreamCallable, metadata: tuple):
        self.channel, self.path, self._callable = callable_.channel, callable_.path, callable_
        self._requests: asyncio.Queue = asyncio.Queue()
        self._answers: asyncio.Queue = asyncio.Queue()
        self._writing_done = False
        self._status: BaseException | None = None  # set when the call ended: an error, or EOF
        self._server = self.channel._server()
        self.channel._track(self, self._server)
        self._task = asyncio.ensure_future(self._serve(metadata))

    async def _serve(self, metadata: tuple) -> None:
        server = self._server
        try:
            if server is None:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to all addresses ({self.path})")
            await server.reached()
            handler = server.handler.service(_Details(self.path, metadata))
            if handler is None:
                raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            self._serialize = handler.response_serializer
            context = _Context(self.channel.source, self._deliver)
            try:
                served = handler.stream_stream(self._incoming(handler.request_deserializer), context)
                if inspect.isasyncgen(served):
                    async for response in served:
                        await self._deliver(response)
                else:
                    await served
            except _Aborted as aborted:
                raise aborted.error from None
            self._end(None)
        except aio.AioRpcError as exc:
            self._end(exc)
        except Exception as exc:
            self._end(rpc_error(grpc.StatusCode.UNKNOWN, f"Unexpected error in the handler: {exc!r}"))
        finally:
            self.channel._untrack(self, server)

    async def _incoming(self, deserialize):
        while (data := await self._requests.get()) is not None:
            yield deserialize(data)

    async def _deliver(self, response) -> None:
        answer = await self._server.send(_name(self.path), self._serialize(response))
        if self._status is None:
            self._answers.put_nowait(self._callable.deserialize(answer))

    def _end(self, error: BaseException | None) -> None:
        if self._status is None:
            self._status = error or aio.EOF
            self._answers.put_nowait(self._status)

    # --- what InferenceStream uses of grpc.aio's StreamStreamCall ---

    async def write(self, request) -> None:
        if self._status is not None:
            if isinstance(self._status, aio.AioRpcError):
                raise self._status
            raise asyncio.InvalidStateError("RPC already finished.")
        if self._writing_done:
            raise aio.UsageError("done_writing() was called before")
        self._requests.put_nowait(self._callable.serialize(request))

    async def read(self):
        item = await self._answers.get()
        if item is aio.EOF or isinstance(item, BaseException):
            self._answers.put_nowait(item)  # and for every later read
        if isinstance(item, BaseException):
            raise item
        return item

    async def done_writing(self) -> None:
        if not self._writing_done and self._status is None:
            self._writing_done = True
            self._requests.put_nowait(None)

    def fail(self, error: aio.AioRpcError) -> None:
        self._end(error)
        self._task.cancel()

    def cancel(self) -> bool:
        self._end(asyncio.CancelledError())
        self._task.cancel()
        return True
