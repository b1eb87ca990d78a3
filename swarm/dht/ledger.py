"""A bound on what one DHT node keeps: entries per key and bytes in all, counted by its record validator.

hivemind's storage has no size limit (DHTLocalStorage is created without one, and so is the read cache), so every
record a node accepts stays in its memory until it expires. The validator sees every record the node is about to
keep (a store it serves, its own store, a value it read), so it keeps this ledger of what it let in and still
lives, and refuses what would go past the bounds: a full key takes refreshes of the subkeys it holds, and no new
ones. Expired entries leave the ledger as they leave the storage.
"""

from __future__ import annotations

import heapq

MAX_SUBKEYS_PER_KEY = 1024
"""Entries under one key: a block's peers, a training group's members, the model index's peers (one each)."""
MAX_LEDGER_BYTES = 256 << 20
"""Bytes of keys, subkeys and values a node keeps in all. A record is ~650 bytes with its subkey; a reader keeps what
it read, so a client of a 100-block model whose every block has 1,000 peers holds ~65 MB of them."""


class StorageLedger:
    """key -> subkey -> (expiration, bytes) of the live records a node accepted."""

    def __init__(self, max_per_key: int = MAX_SUBKEYS_PER_KEY, max_bytes: int = MAX_LEDGER_BYTES):
        self.max_per_key, self.max_bytes = max_per_key, max_bytes
        self.entries: dict[bytes, dict[bytes, tuple[float, int]]] = {}
        self.total_bytes = 0
        self.count = 0  # entries
        self._expiring: list[tuple[float, bytes, bytes]] = []  # a heap; entries since refreshed are skipped

    def admit(self, key: bytes, subkey: bytes, expiration: float, size: int, now: float) -> bool:
        """Whether a record fits; if it does, it is counted until `expiration` (or a later one of the same subkey)."""
        self._expire(now)
        under_key = self.entries.get(key, {})
        held = under_key.get(subkey)
        if held is None and len(under_key) >= self.max_per_key:
            return False
        if held is not None and held[0] >= expiration:
            return True  # the node keeps the later record it holds: nothing new to count
        growth = size - (held[1] if held is not None else 0)
        if self.total_bytes + growth > self.max_bytes:
            return False
        self.entries.setdefault(key, under_key)[subkey] = (expiration, size)
        self.total_bytes += growth
        self.count += held is None
        heapq.heappush(self._expiring, (expiration, key, subkey))
        if len(self._expiring) > 4 * self.count + 1024:  # refreshes leave stale heap items behind
            self._expiring = [(exp, k, s) for k, held in self.entries.items() for s, (exp, _) in held.items()]
            heapq.heapify(self._expiring)
        return True

    def _expire(self, now: float) -> None:
        while self._expiring and self._expiring[0][0] < now:
            expiration, key, subkey = heapq.heappop(self._expiring)
            under_key = self.entries.get(key)
            held = under_key.get(subkey) if under_key else None
            if held is None or held[0] != expiration:
                continue  # refreshed since: a later heap item stands for it
            del under_key[subkey]
            self.total_bytes -= held[1]
            self.count -= 1
            if not under_key:
                del self.entries[key]
