"""KV-cache budget: sessions reserve tokens up front and wait (bounded) when the budget is spent."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from protocol.errors import CacheFullError


class CacheBudget:
    """Counts KV-cache tokens (batch x max_length per session) against a fixed budget.

    Reserving up front means a session that started never runs out of cache halfway through a generation.
    """

    def __init__(self, max_tokens: int):
        if max_tokens <= 0:
            raise ValueError(f"cache budget must be positive, got {max_tokens} tokens")
        self.max_tokens = max_tokens
        self.used_tokens = 0
        self._freed = asyncio.Condition()

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - self.used_tokens

    @contextlib.asynccontextmanager
    async def reserve(self, tokens: int, timeout_s: float) -> AsyncIterator[None]:
        """Hold `tokens` for the body; wait up to `timeout_s` for them, then raise CacheFullError."""
        if tokens > self.max_tokens:
            raise CacheFullError(
                f"a session needs {tokens} cache tokens but this peer's whole budget is {self.max_tokens}; "
                f"ask for a shorter max_length or a smaller batch, or use a peer with more --cache-tokens"
            )
        async with self._freed:
            try:
                await asyncio.wait_for(self._freed.wait_for(lambda: self.tokens_left >= tokens), timeout_s)
            except asyncio.TimeoutError:
                raise CacheFullError(
                    f"no room for {tokens} cache tokens after waiting {timeout_s:.1f}s "
                    f"({self.tokens_left} of {self.max_tokens} left); try again later or another peer"
                ) from None
            self.used_tokens += tokens
        try:
            yield
        finally:
            async with self._freed:
                self.used_tokens -= tokens
                self._freed.notify_all()
