"""KV-cache budget: sessions reserve tokens up front and wait (bounded) when the budget is spent.

No one source (a client's address) may hold more than `max_share` of the budget, so that one client cannot
take all of it and keep it: with several clients behind one address (a NAT, a relay) they share its quota.
Clients tunneled through libp2p come from a loopback address of their own per remote identity
(swarm/net/tunnel.py), and identities are free: together they hold at most one quota too.

A session that must wait for room first asks `reclaim` (set by the inference streams) to close sessions that
sit idle on their reservation, so that an idle squatter does not keep a waiting client out until its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable

from protocol.errors import CacheFullError

TUNNELED = "tunneled"
"""The quota that all clients tunneled through libp2p share."""


def quota_group(source: str) -> str | None:
    """The shared quota `source` also counts against: TUNNELED for a tunnel's loopback address, else None."""
    return TUNNELED if source.startswith("ipv4:127.") and source != "ipv4:127.0.0.1" else None


class CacheBudget:
    """Counts KV-cache tokens (batch x max_length per session) against a fixed budget.

    Reserving up front means a session that started never runs out of cache halfway through a generation.
    """

    def __init__(self, max_tokens: int, max_share: float = 1.0):
        if max_tokens <= 0:
            raise ValueError(f"cache budget must be positive, got {max_tokens} tokens")
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.max_share = max_share
        self.resize(max_tokens)
        self.used_tokens = 0
        self.used_by: Counter[str] = Counter()
        self._freed = asyncio.Condition()
        self._waking: set[asyncio.Task] = set()  # tasks telling waiters about freed tokens
        # closes idle sessions to make room for `tokens`; returns how many it closed (set by peer/inference.py)
        self.reclaim: Callable[[int], int] = lambda tokens: 0

    def resize(self, max_tokens: int) -> None:
        """Budget `max_tokens` from now on (a memory budget sets it once the blocks are known); sessions holding
        more keep it until they close."""
        if max_tokens <= 0:
            raise ValueError(f"cache budget must be positive, got {max_tokens} tokens")
        self.max_tokens = max_tokens
        self.source_quota = max(1, int(max_tokens * self.max_share))

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - self.used_tokens

    @contextlib.asynccontextmanager
    async def reserve(self, tokens: int, timeout_s: float, source: str = "") -> AsyncIterator[None]:
        """Hold `tokens` for the body; wait up to `timeout_s` for them, then raise CacheFullError."""
        if tokens > self.source_quota:
            whole = "whole budget" if self.source_quota == self.max_tokens else "quota per client address"
            raise CacheFullError(
                f"a session needs {tokens} cache tokens but this peer's {whole} is {self.source_quota}; "
                f"ask for a shorter max_length or a smaller batch, or use a peer with more --cache-tokens"
            )

        group = quota_group(source)

        def fits() -> bool:
            return (
                self.tokens_left >= tokens
                and self.used_by[source] + tokens <= self.source_quota
                and (group is None or self.used_by[group] + tokens <= self.source_quota)
            )

        async with self._freed:
            if self.tokens_left < tokens:
                self.reclaim(tokens)
            try:
                await asyncio.wait_for(self._freed.wait_for(fits), timeout_s)
            except asyncio.TimeoutError:
                mine, shared = self.used_by[source], self.used_by[group] if group else 0
                raise CacheFullError(
                    f"no room for {tokens} cache tokens after waiting {timeout_s:.1f}s "
                    f"({self.tokens_left} of {self.max_tokens} left"
                    + (
                        f"; your address holds {mine} of its quota {self.source_quota}"
                        if self.source_quota < self.max_tokens and mine + tokens > self.source_quota
                        else ""
                    )
                    + (
                        f"; clients tunneled through libp2p hold {shared} of the quota {self.source_quota} they share"
                        if group and self.source_quota < self.max_tokens and shared + tokens > self.source_quota
                        else ""
                    )
                    + "); try again later or another peer"
                ) from None
            self.used_tokens += tokens
            self.used_by[source] += tokens
            if group:
                self.used_by[group] += tokens
        try:
            yield
        finally:
            # released at once, without awaiting: a task cancelled again while it waited here for the lock would
            # otherwise never give the tokens back (the soak run found budget leaked with no session open)
            self.used_tokens -= tokens
            for holder in (source, group) if group else (source,):
                self.used_by[holder] -= tokens
                if not self.used_by[holder]:
                    del self.used_by[holder]
            wake = asyncio.ensure_future(self._wake_waiters())
            self._waking.add(wake)
            wake.add_done_callback(self._waking.discard)

    async def _wake_waiters(self) -> None:
        async with self._freed:
            self._freed.notify_all()
