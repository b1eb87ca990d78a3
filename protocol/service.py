"""The Peer service's method table, derived from swarmlm.proto; handlers and stubs are built from it.

Messages with a `payload` field are received as `packing.Received` (the message and its payload, left in
place) and may be sent as `packing.Packed`; see protocol/packing.py. Unary errors travel as a gRPC status plus the trailing metadata `ERROR_CODE_KEY`; stream errors as an
`Error` message on the stream, so one bad step does not end the session.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from protocol import swarmlm_pb2 as pb
from protocol.packing import unpack
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    MessageTooLargeError,
    OverloadedError,
    PeerUnavailableError,
    SwarmError,
    UnknownSessionError,
    WrongSpanError,
    error_from_code,
)

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
    def request_deserializer(self) -> Callable[[bytes], Any]:
        return _deserializer(self.request)

    @property
    def response_deserializer(self) -> Callable[[bytes], Any]:
        return _deserializer(self.response)


def _deserializer(cls) -> Callable[[bytes], Any]:
    return functools.partial(unpack, cls) if "payload" in cls.DESCRIPTOR.fields_by_name else cls.FromString


def _serialize(message) -> bytes:
    return message.SerializeToString()  # a protobuf message or a packing.Packed


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
    return make(func, request_deserializer=method.request_deserializer, response_serializer=_serialize)


def make_generic_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """Route every Peer method to the servicer's coroutine of the same name in snake case (Forward -> forward)."""
    handlers = {name: _method_handler(method, getattr(servicer, name.lower())) for name, method in METHODS.items()}
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
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return MessageTooLargeError(
            f"peer {endpoint} refused the message: {details}; send fewer tokens or a smaller batch per request "
            f"(a peer's limit is its --max-message-mb, a client's its max_message_bytes)")
    return PeerUnavailableError(f"peer {endpoint} failed: {status.name if status else 'error'}: {details}")
