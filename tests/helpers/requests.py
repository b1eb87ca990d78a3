"""Raw data-plane requests for tests that talk to a peer below the client (limits, priority, attacks)."""

from __future__ import annotations

import contextlib
import time

import torch

from client.transport import InferenceStream
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor, encode_tensor
from protocol.errors import SessionExpiredError, SwarmError, UnknownSessionError
from tests.helpers.models import HIDDEN_SIZE


def hidden(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def open_request(prefix: str, end: int, session_id: str, max_length: int) -> pb.InferenceRequest:
    return pb.InferenceRequest(
        open=pb.OpenSession(
            span=pb.Span(model=prefix, start=0, end=end), session_id=session_id, max_length=max_length, batch_size=1
        )
    )


def step_request(session_id: str, hidden_states: torch.Tensor, prefix_length: int) -> pb.InferenceRequest:
    positions = torch.arange(prefix_length, prefix_length + hidden_states.shape[1]).unsqueeze(0)
    return pb.InferenceRequest(
        step=pb.InferenceStep(
            session_id=session_id,
            prefix_length=prefix_length,
            hidden_states=encode_tensor(hidden_states),
            position_ids=encode_tensor(positions),
        )
    )


def forward_request(prefix: str, end: int, hidden_states: torch.Tensor) -> pb.ForwardRequest:
    return pb.ForwardRequest(span=pb.Span(model=prefix, start=0, end=end), hidden_states=encode_tensor(hidden_states))


def backward_request(prefix: str, end: int, hidden_states: torch.Tensor) -> pb.BackwardRequest:
    encoded = encode_tensor(hidden_states)
    return pb.BackwardRequest(span=pb.Span(model=prefix, start=0, end=end), hidden_states=encoded, grad_outputs=encoded)


async def end_stream(stream: InferenceStream, timeout_s: float) -> None:
    with contextlib.suppress(SwarmError):
        await stream.request(pb.InferenceRequest(close=pb.CloseSession()), timeout_s)
    await stream.close()


class Witness:
    """An honest session stepping through a fixed sequence of `length` tokens over `span` (a peer.blocks.BlockSpan
    from block 0, loaded locally from the same checkpoint); every output must match the local span's.

    With `lifetime_s` (the peer's --session-lifetime-s), a session the peer ends at its lifetime is opened anew,
    as a client's would be: how long an attack takes depends on the machine, and reaching the lifetime is no harm.
    """

    def __init__(
        self,
        stream: InferenceStream,
        prefix: str,
        span,
        *,
        length: int = 16,
        timeout_s: float = 30.0,
        atol: float = 1e-5,
        lifetime_s: float | None = None,
    ):
        self.stream, self.prefix, self.end = stream, prefix, span.end
        self.lifetime_s, self.opened_at = lifetime_s, time.monotonic()
        self.length, self.timeout_s, self.atol = length, timeout_s, atol
        self.tokens = hidden(1, length, HIDDEN_SIZE, seed=1)
        torch.set_num_threads(1)  # as the peer computes: alike rounding
        cache = span.new_cache()
        with torch.inference_mode():
            self.expected = torch.cat(
                [span(self.tokens[:, i : i + 1], None, torch.tensor([[i]]), cache, i) for i in range(length)], dim=1
            )
        self.position = 0

    async def open(self) -> Witness:
        await self.stream.request(open_request(self.prefix, self.end, "witness", self.length), self.timeout_s)
        self.opened_at = time.monotonic()
        return self

    async def step(self) -> None:
        try:
            await self._step()
        except (SessionExpiredError, UnknownSessionError) as exc:
            lived = time.monotonic() - self.opened_at
            if self.lifetime_s is None or lived < self.lifetime_s or "--session-lifetime-s" not in str(exc):
                raise
            await end_stream(self.stream, self.timeout_s)
            self.stream, self.position = InferenceStream(self.stream.pool, self.stream.endpoint), 0
            await (await self.open())._step()

    async def _step(self) -> None:
        p = self.position
        response = await self.stream.request(step_request("witness", self.tokens[:, p : p + 1], p), self.timeout_s)
        out = decode_tensor(response.message.step.hidden_states, "hidden_states", response.payload)
        torch.testing.assert_close(out, self.expected[:, p : p + 1], atol=self.atol, rtol=0)
        self.position = (p + 1) % self.length
