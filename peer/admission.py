"""Admission control: what one request may ask of a peer, and how much work may wait for its compute thread.

Every check runs before any compute, on sizes read from the request's shapes. A request over a hard cap is the
caller's to split (MessageTooLargeError); a full queue is the peer's state, not the caller's fault
(OverloadedError, answered at once, so the client routes elsewhere instead of waiting behind the queue).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from protocol.errors import MessageTooLargeError, OverloadedError, SequenceTooLongError
from protocol.records import DEFAULT_MAX_ATTENTION_COST, DEFAULT_MAX_REQUEST_TOKENS


@dataclass(frozen=True)
class WorkLimits:
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    """Tokens (batch x new tokens) in one forward, backward or inference step."""
    max_attention_cost: int = DEFAULT_MAX_ATTENTION_COST
    """Attention work of one request: batch x new tokens x attended tokens (one 8192-token sequence)."""
    max_queued_tokens: int = 1 << 16
    """Tokens of all requests admitted and not yet answered."""
    max_queued_bytes: int = 1 << 30
    """Input bytes of all requests admitted and not yet answered."""

    def __post_init__(self) -> None:
        for name in ("max_request_tokens", "max_attention_cost", "max_queued_tokens", "max_queued_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Admission:
    """Checks requests against `limits` and counts the work admitted and not yet done."""

    def __init__(self, limits: WorkLimits, max_positions: int):
        self.limits, self.max_positions = limits, max_positions
        self.queued_tokens = self.queued_bytes = self.queued_requests = 0

    def check(self, batch: int, new_tokens: int, prefix_length: int = 0) -> None:
        """Hard caps of one request, whatever the queue holds."""
        limits = self.limits
        if prefix_length + new_tokens > self.max_positions:
            raise SequenceTooLongError(
                f"{prefix_length} cached + {new_tokens} new tokens exceed the model's {self.max_positions} positions"
            )
        tokens = batch * new_tokens
        if tokens > limits.max_request_tokens:
            raise MessageTooLargeError(
                f"a request of {batch} x {new_tokens} = {tokens} tokens exceeds this peer's limit of "
                f"{limits.max_request_tokens} (--max-request-tokens); split it into smaller requests"
            )
        cost = tokens * (prefix_length + new_tokens)
        if cost > limits.max_attention_cost:
            raise MessageTooLargeError(
                f"a request of {batch} x {new_tokens} new tokens attending to {prefix_length + new_tokens} costs "
                f"{cost} token pairs of attention, over this peer's limit of {limits.max_attention_cost} "
                f"(--max-attention-cost); send shorter sequences or smaller batches"
            )

    def hold(self, nbytes: int, *, check: bool = True) -> int:
        """Count `nbytes` of a message that waits in a session's inbox (a pushed step, a request read ahead) as
        queued until `release(nbytes)`; with `check`, OverloadedError if the queue is full (never when it is empty).
        Returns `nbytes`."""
        if check and self.queued_bytes and self.queued_bytes + nbytes > self.limits.max_queued_bytes:
            raise OverloadedError(
                f"this peer is busy: {self.queued_bytes / 2**20:.1f} MiB are queued (limit "
                f"{self.limits.max_queued_bytes / 2**20:.0f} MiB); use another peer or retry later"
            )
        self.queued_bytes += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        self.queued_bytes -= nbytes

    @contextlib.contextmanager
    def admit(self, tokens: int, nbytes: int) -> Iterator[None]:
        """Count a request as queued for the body; OverloadedError if the queue is full (never when it is empty)."""
        limits = self.limits
        if self.queued_requests and (
            self.queued_tokens + tokens > limits.max_queued_tokens
            or self.queued_bytes + nbytes > limits.max_queued_bytes
        ):
            raise OverloadedError(
                f"this peer is busy: {self.queued_requests} requests of {self.queued_tokens} tokens and "
                f"{self.queued_bytes / 2**20:.1f} MiB are queued (limits {limits.max_queued_tokens} tokens, "
                f"{limits.max_queued_bytes / 2**20:.0f} MiB); use another peer or retry later"
            )
        self.queued_tokens += tokens
        self.queued_bytes += nbytes
        self.queued_requests += 1
        try:
            yield
        finally:
            self.queued_tokens -= tokens
            self.queued_bytes -= nbytes
            self.queued_requests -= 1
