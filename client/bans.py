"""Which peers a client avoids for now: those that failed recently (BanList)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

_MAX_BAN_S = 60.0
_STRIKES_HALF_LIFE_S = 600.0


class BanList:
    """Peers that failed recently.

    A ban lasts `base_s`, doubled with each repeated failure (strike) up to a minute. Strikes halve with each
    `half_life_s` without a new one, so that one slip long after a peer's last failures costs a short ban.
    After its ban a peer is used again only once it has announced itself since it failed: a crashed peer's
    record stays in the DHT until it expires, and without this rule the client would try the dead peer again
    each time its ban ran out.
    """

    def __init__(
        self, base_s: float, clock: Callable[[], float] = time.monotonic, half_life_s: float = _STRIKES_HALF_LIFE_S
    ):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.base_s, self.clock, self.half_life_s = base_s, clock, half_life_s
        self._until: dict[str, float] = {}
        self._strikes: dict[str, tuple[int, float]] = {}  # peer id -> (strikes, when the last one came)
        self._failed_at: dict[str, float] = {}
        # peer id -> expiration of its latest record in the first directory read after it failed
        self._last_record: dict[str, float] = {}

    def strikes(self, peer_id: str) -> int:
        """`peer_id`'s strikes now: its failures, halved (rounding down) per quiet `half_life_s` since the last."""
        count, at = self._strikes.get(peer_id, (0, 0.0))
        halvings = int((self.clock() - at) // self.half_life_s)
        return count >> min(max(halvings, 0), 63)

    def ban(self, peer_id: str, at_least_s: float = 0.0) -> float:
        """Ban `peer_id` for longer than last time, and `at_least_s`; returns the ban's length in seconds."""
        strikes = self.strikes(peer_id) + 1
        now = self.clock()
        self._strikes[peer_id] = (strikes, now)
        length_s = max(min(self.base_s * 2 ** (strikes - 1), _MAX_BAN_S), at_least_s)
        self._until[peer_id] = now + length_s
        self._failed_at[peer_id] = now
        self._last_record.pop(peer_id, None)
        return length_s

    def observe(self, expirations: Mapping[str, float], read_at: float) -> None:
        """Note the records of a directory read begun at `read_at` (clock time): what failed peers had announced."""
        for peer, failed_at in self._failed_at.items():
            if peer not in self._last_record and failed_at <= read_at:
                self._last_record[peer] = expirations.get(peer, -math.inf)

    def banned(self, expirations: Mapping[str, float] | None = None) -> set[str]:
        """Peers not to use: within their ban, or, given the latest records' expirations, silent since they failed."""
        now = self.clock()
        if expirations is None:
            return {peer for peer, until in self._until.items() if until > now}
        return {
            peer
            for peer, until in self._until.items()
            if until > now or expirations.get(peer, -math.inf) <= self._last_record.get(peer, math.inf)
        }
