"""The Peer service's method table, derived from swarmlm.proto; handlers and stubs are built from it.

Messages with a `payload` field are received as `packing.Received` (the message and its payload, left in
place) and may be sent as `packing.Packed`; see protocol/packing.py. Unary errors travel as a gRPC status plus the trailing metadata `ERROR_CODE_KEY`; stream errors as an
`Error` message on the stream, so one bad step does not end the session.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from protocol import swarmlm_pb2 as pb
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    MessageTooLargeError,
    OverloadedError,
    PeerUnavailableError,
    SwarmError,
    UnauthorizedError,
    UnknownSessionError,
    WrongSpanError,
    error_from_code,
)
from protocol.packing import Received, unpack

SERVICE = pb.DESCRIPTOR.services_by_name["Peer"]
SERVICE_NAME = SERVICE.full_name
ERROR_CODE_KEY = "swarmlm-error-code"


@dataclass(frozen=True)
class Method:
    name: str
    path: str
    request: type
    response: type
    client_streaming: bool
    server_streaming: bool

    @property
    def request_deserializer(self) -> Callable[[bytes], Received]:
        """Server side: always a `Received`; refused bytes set its `error` (see `_method_handler`)."""
        return functools.partial(_receive, self.request)

    @property
    def response_deserializer(self) -> Callable[[bytes], Any]:
        """Client side: a `Received` (a plain message where the type has no payload), or a `Refused`."""
        return functools.partial(_read_response, self.response)


def has_payload(cls) -> bool:
    return "payload" in cls.DESCRIPTOR.fields_by_name


# gRPC turns an exception in a deserializer into an untyped UNKNOWN status on the server, and into a None
# response on the client; so refused bytes travel as values, and become typed errors where they are used.


def _receive(cls, data: bytes) -> Received:
    try:
        return unpack(cls, data)
    except SwarmError as exc:
        return Received(cls(), memoryview(b""), exc)


class Refused:
    """A response whose bytes could not be read: touching any attribute raises why."""

    def __init__(self, error: SwarmError):
        object.__setattr__(self, "_error", error)

    def __getattr__(self, name: str):
        error = object.__getattribute__(self, "_error")
        raise type(error)(str(error))


def _read_response(cls, data: bytes):
    received = _receive(cls, data)
    if received.error is not None:  # the peer's fault, not the caller's: another peer may do
        return Refused(PeerUnavailableError(f"a peer's {cls.DESCRIPTOR.name} could not be read: {received.error}"))
    return received if has_payload(cls) else received.message


def _serialize(message) -> bytes:
    return message.SerializeToString()  # a protobuf message or a packing.Packed


# A stream may have this much in flight before its receiver acknowledges it. With HTTP/2's default window
# (64 KiB), a 300 KiB prefill tensor waits for 4-5 round trips, which costs nothing on loopback and 0.5 s at
# 50 ms one-way; gRPC's own window probing grows it only after traffic has flowed.
WINDOW_OPTIONS = [("grpc.http2.lookahead_bytes", 16 * 1024 * 1024)]

METHODS: dict[str, Method] = {
    m.name: Method(
        name=m.name,
        path=f"/{SERVICE_NAME}/{m.name}",
        request=getattr(pb, m.input_type.name),
        response=getattr(pb, m.output_type.name),
        client_streaming=m.client_streaming,
        server_streaming=m.server_streaming,
    )
    for m in SERVICE.methods
}

_STATUS_BY_ERROR: list[tuple[type[SwarmError], grpc.StatusCode]] = [
    (MessageTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BadRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (WrongSpanError, grpc.StatusCode.FAILED_PRECONDITION),
    (CacheFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnauthorizedError, grpc.StatusCode.UNAUTHENTICATED),
]


def status_for(error: SwarmError) -> grpc.StatusCode:
    for cls, status in _STATUS_BY_ERROR:
        if isinstance(error, cls):
            return status
    return grpc.StatusCode.INTERNAL


def _method_handler(method: Method, func: Callable) -> grpc.RpcMethodHandler:
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(method.client_streaming, method.server_streaming)]
    return make(
        _refusing(method, func), request_deserializer=method.request_deserializer, response_serializer=_serialize
    )


async def abort(context: grpc.aio.ServicerContext, error: SwarmError) -> None:
    """End the call with `error`: its status, and its code in the trailing metadata."""
    await context.abort(status_for(error), str(error), trailing_metadata=((ERROR_CODE_KEY, error.code),))


def _refusing(method: Method, func: Callable) -> Callable:
    """`func`, answering a unary request whose bytes were refused with its typed error instead.

    The servicer gets a `Received` where the request type has a payload, else the plain message. Streamed
    requests go to it as they are: it calls `Received.check()` on each, so that one bad message does not
    end the stream.
    """
    if method.client_streaming:
        return func
    plain = not has_payload(method.request)

    if method.server_streaming:

        async def streaming(received: Received, context):
            if received.error is not None:
                await abort(context, received.error)
                return
            served = func(received.message if plain else received, context)
            if inspect.isasyncgen(served):
                async for response in served:
                    await context.write(response)
            else:  # it writes its responses itself (context.write), with a deadline of its own on each
                await served

        return streaming

    async def unary(received: Received, context):
        if received.error is not None:
            await abort(context, received.error)
            return None
        return await func(received.message if plain else received, context)

    return unary


def make_generic_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """Route every Peer method to the servicer's coroutine of the same name in snake case (Forward -> forward);
    a method the servicer lacks is answered UNIMPLEMENTED by gRPC."""
    handlers = {
        name: _method_handler(method, getattr(servicer, name.lower()))
        for name, method in METHODS.items()
        if hasattr(servicer, name.lower())
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class PeerStub:
    """Client side of the Peer service on a grpc.aio channel; attributes named like the servicer's."""

    def __init__(self, channel: grpc.aio.Channel):
        for name, method in METHODS.items():
            kind = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[(method.client_streaming, method.server_streaming)]
            call = kind(
                method.path,
                request_serializer=_serialize,
                response_deserializer=method.response_deserializer,
            )
            setattr(self, name.lower(), call)


def error_from_rpc(exc: grpc.RpcError, endpoint: str) -> SwarmError:
    """Translate a gRPC failure into the swarmlm error it stands for."""
    code = None
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_CODE_KEY:
            code = value
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code is not None:
        return error_from_code(code, details)
    status = exc.code() if hasattr(exc, "code") else None
    if status == grpc.StatusCode.UNAVAILABLE and "handshake failed" in (details or "").lower():
        return UnauthorizedError(
            f"peer {endpoint} did not complete a TLS handshake with this client's swarm key ({details}): it is not "
            f"a member of the private swarm this client's --swarm-key names, or not of a private swarm at all"
        )
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent rpc limit" in (details or "").lower():
        return OverloadedError(f"peer {endpoint} serves as many calls as it takes at once ({details}); route elsewhere")
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return MessageTooLargeError(
            f"peer {endpoint} refused the message: {details}; send fewer tokens or a smaller batch per request "
            f"(a peer's limit is its --max-message-mb, a client's its max_message_bytes)"
        )
    return PeerUnavailableError(f"peer {endpoint} failed: {status.name if status else 'error'}: {details}")
