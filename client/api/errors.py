"""Errors as OpenAI's clients expect them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Swarm errors are translated here, at the boundary: nobody serving some blocks is 503 (the message names the
blocks and the command that would serve them), a swarm that kept failing after failover is 503 too, and the
caller's own bad input is 400.
"""

from __future__ import annotations

from protocol.errors import (
    BadRequestError,
    CacheFullError,
    NoPeersError,
    OutputRewoundError,
    OverloadedError,
    SequenceTooLongError,
    SwarmError,
)


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_swarm_error(error: SwarmError) -> ApiError:
    """What a client of the API is told when the swarm could not serve its request."""
    if isinstance(error, NoPeersError):
        return ApiError(503, str(error), type="service_unavailable", code="no_peers")
    if isinstance(error, SequenceTooLongError):
        return ApiError(400, str(error), code="context_length_exceeded")
    if isinstance(error, BadRequestError):
        return ApiError(400, str(error), code="invalid_value")
    if isinstance(error, OutputRewoundError):  # streamed tokens may be wrong (whole answers are generated again)
        return ApiError(
            503,
            "a peer of the route was caught computing wrong results after this request's first tokens were sent, "
            "so those tokens may be wrong: send the request again",
            type="service_unavailable",
            code=error.code,
        )
    if isinstance(error, (CacheFullError, OverloadedError)):
        return ApiError(
            503, f"the swarm is overloaded: {error}; retry later", type="service_unavailable", code="overloaded"
        )
    return ApiError(
        503,
        f"the swarm failed to serve this request after failover ({type(error).__name__}): {error}",
        type="service_unavailable",
        code=error.code,
    )


def internal_error(error: BaseException) -> ApiError:
    return ApiError(
        500, f"internal error of the API server: {type(error).__name__}: {error}", type="server_error", code="internal"
    )
