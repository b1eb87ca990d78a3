"""The one exception tree of swarmlm; remote errors cross the wire as codes.

    SwarmError
    ├── BadRequestError            bad_request        malformed message, wrong shape/dtype, NaN/inf
    │   ├── MessageTooLargeError   message_too_large  a tensor or message over the configured limit
    │   ├── SequenceTooLongError   sequence_too_long  more tokens than the session's max_length
    │   └── StaleEpochError        stale_epoch        a training gradient for an update the peer has applied
    ├── UnknownSessionError        unknown_session    no such (or an expired) inference session
    │   └── SessionExpiredError    session_expired    the session reached the peer's --session-lifetime-s
    ├── WrongSpanError             wrong_span         the peer does not serve the requested blocks
    ├── CacheFullError             cache_full         no KV-cache space within the allocation timeout
    ├── OverloadedError            overloaded         the peer's queue is full: route elsewhere or retry later
    ├── PeerUnavailableError       peer_unavailable   a peer could not be reached or vanished mid-request
    ├── PeerFaultError             peer_fault         a peer answered wrongly, or refused input the client checked
    ├── OutputRewoundError         output_rewound     a check caught a liar: resend the tokens from `position`
    ├── NoPeersError               no_peers           nobody serves some blocks of a model
    ├── ModelNotFoundError         model_not_found    a model could not be found or loaded
    ├── InvalidRecordError         invalid_record     a DHT record does not match its schema
    ├── StateDownloadError         state_download     a joining training peer found no member to copy
    ├── RecipeMismatchError        recipe_mismatch    a training setting differs from the run's published recipe
    ├── TrainingFaultError         training_fault     a training step could not be completed exactly (it says why)
    ├── DHTUnavailableError        dht_unavailable    this process's DHT node did not answer in time
    ├── UnauthorizedError          unauthorized       no valid swarm key: a private swarm refused the call
    └── InternalError              internal           a bug on the remote side (its message is passed on)

Each class has a wire `code`; `error_from_code` rebuilds the same type on the client.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error swarmlm raises on purpose."""

    code = "internal"


class BadRequestError(SwarmError):
    code = "bad_request"


class MessageTooLargeError(BadRequestError):
    code = "message_too_large"


class SequenceTooLongError(BadRequestError):
    code = "sequence_too_long"


class StaleEpochError(BadRequestError):
    code = "stale_epoch"


class UnknownSessionError(SwarmError):
    code = "unknown_session"


class SessionExpiredError(UnknownSessionError):
    """The peer ended the session at its lifetime (`--session-lifetime-s`): not a fault, open a new one."""

    code = "session_expired"


class WrongSpanError(SwarmError):
    code = "wrong_span"


class CacheFullError(SwarmError):
    code = "cache_full"


class OverloadedError(SwarmError):
    code = "overloaded"


class PeerUnavailableError(SwarmError):
    code = "peer_unavailable"


class PeerFaultError(SwarmError):
    """A peer's answer was not what was asked for (kind, shape, dtype, NaN/inf, position, step id), or it refused
    a request that passed the client's own checks. Raised on the client only: the peer is banned and its blocks
    are routed to others, so a caller sees it only once every retry met a faulty peer."""

    code = "peer_fault"


class OutputRewoundError(SwarmError):
    """A check of an inference session found that a peer of its route computed wrong results (client/
    inference_checks.py): that peer is banned and the session's caches are rewound to `position`, the tokens before
    it verified. Raised on the client only, to a caller that must send the tokens from `position` on again
    (`generate()` does so itself)."""

    code = "output_rewound"

    def __init__(self, message: str, position: int = 0):
        super().__init__(message)
        self.position = position


class NoPeersError(SwarmError):
    code = "no_peers"


class ModelNotFoundError(SwarmError):
    code = "model_not_found"


class InvalidRecordError(SwarmError):
    code = "invalid_record"


class StateDownloadError(SwarmError):
    code = "state_download"


class RecipeMismatchError(SwarmError):
    """A peer's or trainer's training settings differ from the recipe its run published (swarm/training/recipe.py):
    the message names each differing setting with both values."""

    code = "recipe_mismatch"


class TrainingFaultError(SwarmError):
    """A training step could not be completed exactly (a round that kept failing, a stage that lost every member):
    nothing was applied for it, and the message says what failed."""

    code = "training_fault"


class DHTUnavailableError(SwarmError):
    code = "dht_unavailable"


class UnauthorizedError(SwarmError):
    """A private swarm refused this process: it holds no swarm key, or another swarm's (`--swarm-key FILE`)."""

    code = "unauthorized"


class InternalError(SwarmError):
    code = "internal"


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


ERROR_BY_CODE: dict[str, type[SwarmError]] = {cls.code: cls for cls in [SwarmError, *_all_subclasses(SwarmError)]}
ERROR_BY_CODE["internal"] = InternalError


def error_from_code(code: str, message: str) -> SwarmError:
    """Rebuild a remote error as the same type; an unknown code becomes InternalError."""
    return ERROR_BY_CODE.get(code, InternalError)(message)
