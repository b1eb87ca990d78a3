"""protocol.errors and protocol.service: error codes survive the wire; the method table matches the .proto."""

from __future__ import annotations

import grpc
import pytest

from protocol import errors
from protocol import swarmlm_pb2 as pb
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    DHTUnavailableError,
    InternalError,
    InvalidRecordError,
    MessageTooLargeError,
    ModelNotFoundError,
    NoPeersError,
    OutputRewoundError,
    OverloadedError,
    PeerFaultError,
    PeerUnavailableError,
    RecipeMismatchError,
    SequenceTooLongError,
    SessionExpiredError,
    StaleEpochError,
    StateDownloadError,
    SwarmError,
    TrainingFaultError,
    UnauthorizedError,
    UnknownSessionError,
    WrongSpanError,
    error_from_code,
)
from protocol.service import ERROR_CODE_KEY, METHODS, SERVICE_NAME, error_from_rpc, make_generic_handler, status_for


def all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *all_subclasses(sub)]
    return found


SUBCLASSES = all_subclasses(SwarmError)


def test_the_tree_has_the_documented_classes():
    assert set(SUBCLASSES) == {
        BadRequestError,
        MessageTooLargeError,
        SequenceTooLongError,
        StaleEpochError,
        StateDownloadError,
        RecipeMismatchError,
        TrainingFaultError,
        DHTUnavailableError,
        UnknownSessionError,
        SessionExpiredError,
        WrongSpanError,
        CacheFullError,
        OverloadedError,
        PeerUnavailableError,
        PeerFaultError,
        OutputRewoundError,
        NoPeersError,
        ModelNotFoundError,
        InvalidRecordError,
        UnauthorizedError,
        InternalError,
    }
    assert issubclass(MessageTooLargeError, BadRequestError)
    assert issubclass(SequenceTooLongError, BadRequestError)
    assert issubclass(StaleEpochError, BadRequestError)
    assert issubclass(SessionExpiredError, UnknownSessionError)


def test_every_subclass_has_a_unique_code():
    codes = [cls.code for cls in SUBCLASSES]
    assert len(codes) == len(set(codes)), sorted(codes)
    assert all(isinstance(code, str) and code for code in codes)


def test_every_class_is_documented_in_the_module_docstring():
    for cls in SUBCLASSES:
        assert cls.__name__ in errors.__doc__ and cls.code in errors.__doc__, cls


@pytest.mark.parametrize("cls", SUBCLASSES, ids=lambda c: c.__name__)
def test_error_from_code_rebuilds_the_same_type(cls):
    rebuilt = error_from_code(cls.code, "blocks 3:5 are not served here")
    assert type(rebuilt) is cls
    assert str(rebuilt) == "blocks 3:5 are not served here"


@pytest.mark.parametrize("code", ["no_such_code", "", "BAD_REQUEST"])
def test_unknown_code_becomes_internal_error(code):
    rebuilt = error_from_code(code, "something odd")
    assert type(rebuilt) is InternalError
    assert str(rebuilt) == "something odd"


def test_base_code_rebuilds_internal_error():
    assert type(error_from_code(SwarmError.code, "x")) is InternalError


# protocol.service


def test_methods_match_the_proto():
    assert set(METHODS) == {"Forward", "Backward", "Inference", "Info", "State", "Push", "Commit", "Apply"}
    expected = {
        "Forward": (pb.ForwardRequest, pb.ForwardResponse, False, False),
        "Backward": (pb.BackwardRequest, pb.BackwardResponse, False, False),
        "Inference": (pb.InferenceRequest, pb.InferenceResponse, True, True),
        "Info": (pb.InfoRequest, pb.InfoResponse, False, False),
        "State": (pb.StateRequest, pb.StatePart, False, True),
        "Push": (pb.PushRequest, pb.PushResponse, False, False),
        "Commit": (pb.CommitRequest, pb.CommitResponse, False, False),
        "Apply": (pb.ApplyRequest, pb.ApplyResponse, False, False),
    }
    assert SERVICE_NAME == "swarmlm.v1.Peer"
    for name, (request, response, client_streaming, server_streaming) in expected.items():
        method = METHODS[name]
        assert method.name == name
        assert method.path == f"/swarmlm.v1.Peer/{name}"
        assert method.request is request and method.response is response
        assert (method.client_streaming, method.server_streaming) == (client_streaming, server_streaming), name


@pytest.mark.parametrize(
    "error, status",
    [
        (MessageTooLargeError("m"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (SequenceTooLongError("m"), grpc.StatusCode.INVALID_ARGUMENT),
        (BadRequestError("m"), grpc.StatusCode.INVALID_ARGUMENT),
        (UnknownSessionError("m"), grpc.StatusCode.NOT_FOUND),
        (SessionExpiredError("m"), grpc.StatusCode.NOT_FOUND),
        (WrongSpanError("m"), grpc.StatusCode.FAILED_PRECONDITION),
        (CacheFullError("m"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (OverloadedError("m"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (PeerUnavailableError("m"), grpc.StatusCode.INTERNAL),
        (PeerFaultError("m"), grpc.StatusCode.INTERNAL),
        (NoPeersError("m"), grpc.StatusCode.INTERNAL),
        (ModelNotFoundError("m"), grpc.StatusCode.INTERNAL),
        (InvalidRecordError("m"), grpc.StatusCode.INTERNAL),
        (InternalError("m"), grpc.StatusCode.INTERNAL),
        (SwarmError("m"), grpc.StatusCode.INTERNAL),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.name,
)
def test_status_for(error, status):
    assert status_for(error) == status


class FakeRpcError(grpc.RpcError):
    def __init__(self, status: grpc.StatusCode, details: str, metadata=()):
        self._status, self._details, self._metadata = status, details, tuple(metadata)

    def code(self):
        return self._status

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._metadata


@pytest.mark.parametrize("cls", SUBCLASSES, ids=lambda c: c.__name__)
def test_error_from_rpc_uses_the_error_code_metadata(cls):
    exc = FakeRpcError(status_for(cls("x")), "the details", [("other", "v"), (ERROR_CODE_KEY, cls.code)])
    rebuilt = error_from_rpc(exc, "127.0.0.1:1")
    assert type(rebuilt) is cls
    assert str(rebuilt) == "the details"


def test_error_from_rpc_without_code():
    too_large = error_from_rpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "over 4 MiB"), "127.0.0.1:7")
    assert type(too_large) is MessageTooLargeError
    assert "127.0.0.1:7" in str(too_large) and "over 4 MiB" in str(too_large)
    gone = error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), "127.0.0.1:7")
    assert type(gone) is PeerUnavailableError
    assert "UNAVAILABLE" in str(gone) and "127.0.0.1:7" in str(gone)


def test_generic_handler_routes_every_method_to_snake_case():
    class Servicer:
        async def forward(self, request, context): ...
        async def backward(self, request, context): ...
        async def inference(self, requests, context): ...
        async def info(self, request, context): ...
        async def state(self, request, context): ...
        async def push(self, request, context): ...

        async def commit(self, request, context): ...

        async def apply(self, request, context): ...

    handler = make_generic_handler(Servicer())

    class Details:
        def __init__(self, method):
            self.method = method
            self.invocation_metadata = ()

    for name, method in METHODS.items():
        rpc = handler.service(Details(method.path))
        assert rpc is not None, name
        assert (rpc.request_streaming, rpc.response_streaming) == (method.client_streaming, method.server_streaming)
    assert handler.service(Details(f"/{SERVICE_NAME}/Nope")) is None
    del Servicer.push  # a servicer without a method: gRPC answers it UNIMPLEMENTED
    assert make_generic_handler(Servicer()).service(Details(f"/{SERVICE_NAME}/Push")) is None


def test_unauthorized_is_unauthenticated_on_the_wire():
    assert status_for(UnauthorizedError("no key")) == grpc.StatusCode.UNAUTHENTICATED
