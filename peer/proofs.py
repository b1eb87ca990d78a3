"""Identity proofs as a metered service: a client's Info call may carry a nonce, which the peer signs with its key
(swarm/trust/identity.py) so that the client knows who answers at this address. An RSA signature costs about a
millisecond of CPU; unmetered, and on the event loop, a flood of nonces would take the peer's loop from the
sessions it serves. So proofs are rate-limited per client address and in all, and signed on a worker thread.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

PROOFS_PER_S = 20.0  # per client address; a client asks once per peer it dials
PROOF_BURST = 40
ALL_PROOFS_PER_S = 200.0  # in all: a fifth of a core at most
MAX_SOURCES = 4096  # addresses whose buckets are kept; the least recently seen is forgotten first


class _Bucket:
    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ProofMeter:
    """Whether a proof may be signed now for a client at `source` (its address without the port)."""

    def __init__(
        self,
        per_source_s: float = PROOFS_PER_S,
        burst: float = PROOF_BURST,
        all_s: float = ALL_PROOFS_PER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.per_source_s, self.burst, self.clock = per_source_s, burst, clock
        self._all = _Bucket(all_s, all_s, clock())
        self._sources: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        self.refused = 0

    def take(self, source: str) -> bool:
        now = self.clock()
        bucket = self._sources.pop(source, None) or _Bucket(self.per_source_s, self.burst, now)
        self._sources[source] = bucket  # most recently seen last
        while len(self._sources) > MAX_SOURCES:
            self._sources.popitem(last=False)
        if bucket.take(now) and self._all.take(now):
            return True
        self.refused += 1
        return False
