"""What a client checks: its own input before sending it, and every peer's answer before using it.

An answer is used only if it is what was asked for: the expected kind, the shape sent, the dtype the hop computes
in, only finite values, and for an inference step the session's new position and the request's step id.
Anything else is a PeerFaultError: that peer is banned and its blocks are routed to others.

The client checks its input as a peer would (shapes, dtypes, NaN/inf, lengths, message size), and raises
BadRequestError to its caller before any network call. What a peer then answers cannot blame the caller, so its
error code does not decide between retry and abort (`blame`):

| a peer's code                  | whose fault, given input that passed the checks here                | the client        |
|--------------------------------|---------------------------------------------------------------------|-------------------|
| bad_request, message_too_large | the peer's: the same checks passed here                             | re-routes         |
| sequence_too_long              | the peer's: lengths are checked here against the session's length  | re-routes         |
| stale_epoch, in training       | the caller's: the stage updated; the trainer drops or redoes it     | raises            |
| stale_epoch, elsewhere         | the peer's: nothing was asked of an update                          | re-routes         |
| unknown_session                | the peer's: it lost a session the client opened                     | re-routes         |
| wrong_span                     | the peer's: it no longer serves the blocks its record claims        | re-routes         |
| cache_full                     | the peer's: no room now                                             | re-routes         |
| peer_unavailable, internal,    | the peer's                                                          | re-routes         |
| no_peers, any other code       |                                                                     |                   |

To re-route is to ban the peer for a while (client/bans.py BanList) and send its blocks to others (an
inference session replays its history into them). Raised by the client itself, and not retried:
BadRequestError (and its subclasses) for the caller's input, NoPeersError once nobody is left.
"""

from __future__ import annotations

import torch

from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import (
    BadRequestError,
    MessageTooLargeError,
    NoPeersError,
    PeerFaultError,
    SequenceTooLongError,
    StaleEpochError,
    SwarmError,
)
from protocol.finite import all_finite
from protocol.packing import Packed, Received
from swarm.models.routers import MoeLayout, check_stats

# --- the caller's input ---


def check_hidden(hidden: torch.Tensor, *, hidden_size: int | None, name: str = "hidden_states") -> None:
    """`hidden` must be [batch >= 1, seq >= 1, hidden_size] of finite floats."""
    if hidden.ndim != 3:
        raise BadRequestError(f"{name} must be [batch, seq, hidden], got shape {list(hidden.shape)}")
    if hidden.shape[0] < 1 or hidden.shape[1] < 1:
        raise BadRequestError(f"{name} must have at least one sequence and one token, got shape {list(hidden.shape)}")
    if hidden_size is not None and hidden.shape[2] != hidden_size:
        raise BadRequestError(f"{name} has hidden size {hidden.shape[2]}, this model's is {hidden_size}")
    if not hidden.is_floating_point():
        raise BadRequestError(f"{name} must be a floating point tensor, got {hidden.dtype}")
    if not all_finite(hidden.detach().cpu()):
        raise BadRequestError(f"{name} contains NaN or inf")


def check_mask(mask: torch.Tensor | None, *, batch: int, length: int) -> None:
    """`mask` must be None or [batch, length] of 0/1 integers or bools."""
    if mask is None:
        return
    if tuple(mask.shape) != (batch, length):
        raise BadRequestError(f"attention_mask must have shape [{batch}, {length}], got {list(mask.shape)}")
    if mask.is_floating_point() or mask.is_complex():
        raise BadRequestError(f"attention_mask must be an integer or bool tensor, got {mask.dtype}")
    if ((mask != 0) & (mask != 1)).any():
        raise BadRequestError("attention_mask values must be 0 or 1")


def check_positions(positions: torch.Tensor | None, *, batch: int, seq: int, max_positions: int | None) -> None:
    """`positions` must be None or [batch or 1, seq] integers in [0, max_positions)."""
    if positions is None:
        return
    if positions.ndim != 2 or positions.shape[0] not in (1, batch) or positions.shape[1] != seq:
        raise BadRequestError(f"position_ids must have shape [{batch} or 1, {seq}], got {list(positions.shape)}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise BadRequestError(f"position_ids must be integers, got {positions.dtype}")
    if positions.numel() and positions.min() < 0:
        raise BadRequestError(f"position_ids must be >= 0, got {int(positions.min())}")
    if max_positions is not None and positions.numel() and positions.max() >= max_positions:
        raise BadRequestError(
            f"position_ids must lie in [0, {max_positions}) (the model's positions), got up to {int(positions.max())}"
        )


def check_inputs(
    hidden: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    *,
    hidden_size: int | None,
    max_positions: int | None,
    prefix_length: int = 0,
) -> None:
    """What a peer checks of a forward, backward or inference step's inputs; `mask` covers the prefix too."""
    check_hidden(hidden, hidden_size=hidden_size)
    batch, seq = hidden.shape[:2]
    if max_positions is not None and prefix_length + seq > max_positions:
        raise SequenceTooLongError(
            f"{prefix_length + seq} tokens exceed the model's {max_positions} positions; send a shorter sequence"
        )
    check_mask(mask, batch=batch, length=prefix_length + seq)
    check_positions(positions, batch=batch, seq=seq, max_positions=max_positions)


def check_grad(grad: torch.Tensor, outputs_shape: tuple[int, ...]) -> None:
    """A gradient w.r.t. the outputs must have their shape and be finite."""
    if tuple(grad.shape) != tuple(outputs_shape):
        raise BadRequestError(f"the gradient has shape {list(grad.shape)}, the outputs {list(outputs_shape)}")
    if not all_finite(grad.detach().cpu()):
        raise BadRequestError("the gradient w.r.t. the remote blocks' outputs contains NaN or inf; check the loss")


def message_bytes(message) -> int:
    """The serialized size of a message or of a `Packed` one, without serializing it."""
    if isinstance(message, Packed):
        return sum(memoryview(chunk).nbytes for chunk in message.chunks) + message.message.ByteSize()
    return message.ByteSize()


def check_size(message, max_bytes: int) -> None:
    """A request over this client's message limit would be refused by its own gRPC channel."""
    size = message_bytes(message)
    if size > max_bytes:
        raise MessageTooLargeError(
            f"a request of {size} bytes exceeds this client's max_message_bytes "
            f"{max_bytes}; send fewer tokens or a smaller batch per request"
        )


# --- a peer's answers ---


def blame(error: BaseException, peer: str, *, training: bool = False) -> BaseException:
    """What a peer's failure means for this client, given input that passed the checks above (see the table).

    Errors that would stop the client (bad request, no peers) become PeerFaultError, so the peer is banned and
    re-routed around (with the peer's error as its cause); the rest, and what is not a SwarmError (a bug of ours),
    are returned unchanged.
    """
    if isinstance(error, StaleEpochError) and training:
        return error
    if isinstance(error, (BadRequestError, NoPeersError)):
        fault = PeerFaultError(
            f"peer {peer} refused a request that passed this client's checks ({error.code}: {error})"
        )
        fault.__cause__ = error
        return fault
    return error


def tensor_answer(
    message, field: str, payload: memoryview, *, peer: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """`message.field` decoded, if it is a finite `dtype` tensor of `shape`; else PeerFaultError."""
    if not message.HasField(field):
        raise PeerFaultError(f"peer {peer} answered without {field}")
    try:
        tensor = decode_tensor(getattr(message, field), field, payload)
    except SwarmError as exc:
        raise PeerFaultError(f"peer {peer} sent a malformed {field}: {exc}") from exc
    if tuple(tensor.shape) != tuple(shape):
        raise PeerFaultError(f"peer {peer} sent {field} of shape {list(tensor.shape)}, expected {list(shape)}")
    if tensor.dtype != dtype:
        raise PeerFaultError(f"peer {peer} sent {field} of dtype {tensor.dtype}, expected {dtype}")
    if not all_finite(tensor):
        raise PeerFaultError(f"peer {peer} sent {field} with NaN or inf")
    return tensor


def unary_answer(
    received: Received, field: str, *, peer: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The one tensor of a Forward or Backward answer, checked."""
    return tensor_answer(received.message, field, received.payload, peer=peer, shape=shape, dtype=dtype)


def router_answer(
    received: Received, *, peer: str, moe: MoeLayout, rows: float
) -> tuple[list[float], list[float], float]:
    """The router sums of a Forward answer, checked as a forward of `rows` rows through its routed layers gives them."""
    try:
        return check_stats(received.message.router, moe.experts, moe.top_k, peer, rows)
    except ValueError as exc:
        raise PeerFaultError(str(exc)) from None


def opened_answer(received: Received, *, peer: str, session_id: str, max_length: int) -> None:
    """An OpenSession must be answered by `opened`, for the same session and length."""
    response: pb.InferenceResponse = received.message
    kind = response.WhichOneof("kind")
    if kind != "opened":
        raise PeerFaultError(f"peer {peer} answered an open with {kind or 'an empty message'}, expected opened")
    opened = response.opened
    if opened.session_id != session_id or opened.max_length != max_length:
        raise PeerFaultError(
            f"peer {peer} opened session {opened.session_id!r} of max_length {opened.max_length}, "
            f"asked for {session_id!r} of {max_length}"
        )


def step_answer(
    received: Received, *, peer: str, shape: tuple[int, ...], dtype: torch.dtype, step_id: int, position: int
) -> torch.Tensor:
    """An inference step must be answered by `step` with this step's id, the cache at `position`, and the
    hidden states checked as `tensor_answer` does."""
    response: pb.InferenceResponse = received.message
    kind = response.WhichOneof("kind")
    if kind != "step":
        raise PeerFaultError(f"peer {peer} answered a step with {kind or 'an empty message'}, expected step")
    step = response.step
    if step.step_id != step_id:
        raise PeerFaultError(f"peer {peer} answered step {step.step_id}, expected step {step_id}")
    if step.position != position:
        raise PeerFaultError(
            f"peer {peer} says its cache holds {step.position} tokens after this step, expected {position}"
        )
    return tensor_answer(step, "hidden_states", received.payload, peer=peer, shape=shape, dtype=dtype)
