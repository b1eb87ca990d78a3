"""Who is in a training group: each member's signed progress record, and reading back only verified ones.

A member stores its TrainingProgress under `{group key}.progress`, subkey `record_subkey()` of its DHT node's key
(swarm/trust/identity.py): hivemind's RSASignatureValidator lets only the holder of that key write it, our validator
lets it hold only a well-formed record of capped lifetime (swarm/dht/validators.py), and readers take an entry only
when its subkey names a real key whose peer id it carries. So nobody can announce progress, or a higher epoch, in
another member's name, and an entry under a plain subkey (anyone can write those) counts for nothing.

Anyone can still publish a record of their own: a decision taken on a count of records says how it bounds that
(swarm/training/state.py takes a state only when a strict majority vouches for it).
"""

from __future__ import annotations

import logging
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from protocol.errors import InvalidRecordError
from protocol.records import CLOCK_SKEW_S, MAX_RECORD_TTL_S, TrainingProgress
from swarm.dht.node import dht_result
from swarm.trust.identity import parse_record_subkey

logger = logging.getLogger(__name__)

MAX_PROGRESS_TTL_S = MAX_RECORD_TTL_S - CLOCK_SKEW_S  # what the DHT still takes from a node with a skewed clock
_MAX_CACHED_OWNERS = 4096


def progress_key(group_key: str) -> str:
    """The DHT key of a group's progress records."""
    return f"{group_key}.progress"


class OwnerCache:
    """subkey -> the peer id it proves (or None): parsing an RSA key costs more than reading a record."""

    def __init__(self):
        self._owners: dict[Any, str | None] = {}

    def owner(self, subkey: Any) -> str | None:
        if subkey not in self._owners:
            if len(self._owners) >= _MAX_CACHED_OWNERS:  # strangers' keys must not grow it without end
                self._owners.clear()
            parsed = parse_record_subkey(subkey)
            self._owners[subkey] = parsed[0] if parsed is not None else None
        return self._owners[subkey]


def verified_progress(raw: Any, owners: OwnerCache) -> dict[str, TrainingProgress]:
    """Peer id -> progress of the entries of a progress record (`dht.get(...).value`) that their owner signed.

    Entries under subkeys that name no key, and values that do not parse, are skipped.
    """
    found: dict[str, TrainingProgress] = {}
    if not isinstance(raw, dict):
        return found
    for subkey, item in raw.items():
        peer_id = owners.owner(subkey)
        if peer_id is None:
            logger.debug("skipping progress under %.80r: its subkey names no owner key", subkey)
            continue
        try:
            found[peer_id] = TrainingProgress.from_wire(getattr(item, "value", None))
        except InvalidRecordError as exc:
            logger.debug("skipping the progress of %s: %s", peer_id, exc)
    return found


def read_members(dht: hivemind.DHT, key: str, owners: OwnerCache) -> dict[str, TrainingProgress]:
    """Peer id -> progress of every fresh, verified record under progress key `key`, those that left included.

    Raises DHTUnavailableError when `dht`'s node does not answer.
    """
    found = dht_result(dht, dht.get(key, latest=True, return_future=True), f"reading the progress of {key}")
    return verified_progress(found.value if found is not None else None, owners)


class GroupReader:
    """The verified records of a group this process reads but is not a member of (a stage peer reads its run's
    trainers)."""

    def __init__(self, dht: hivemind.DHT, group_key: str):
        self.dht, self.key = dht, progress_key(group_key)
        self._owners = OwnerCache()

    def members(self) -> dict[str, TrainingProgress]:
        """As GroupProgress.members (blocking)."""
        return read_members(self.dht, self.key, self._owners)


class GroupProgress:
    """This member's signed progress record in a group, and the verified records of every member.

    `dht` must be a node started by swarm.dht.node.start_dht: its key signs the records.
    """

    def __init__(self, dht: hivemind.DHT, group_key: str, *, ttl_s: float):
        """`ttl_s`: how long a published record stays valid without renewal (at most MAX_PROGRESS_TTL_S)."""
        if not 0 < ttl_s <= MAX_PROGRESS_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_PROGRESS_TTL_S:g}], got {ttl_s}")
        identity = getattr(dht, "identity", None)
        if identity is None:
            raise ValueError("a training group needs a DHT node started by swarm.dht.node.start_dht (its key signs)")
        self.dht, self.key, self.ttl_s = dht, progress_key(group_key), ttl_s
        self.peer_id = dht.peer_id.to_base58()
        self._subkey = identity.record_subkey()
        self._owners = OwnerCache()
        self._last = TrainingProgress(epoch=0, samples=0)

    def publish(self, progress: TrainingProgress):
        """Store our record; returns the store's future at once (it completes in the background)."""
        self._last = progress
        return self.dht.store(
            self.key, progress.to_wire(), get_dht_time() + self.ttl_s, subkey=self._subkey, return_future=True
        )

    def leave(self, timeout_s: float = 5.0) -> bool:
        """Replace our record by our last one marked `left` (blocking up to `timeout_s`); whether the DHT took it.

        It still says where this member stood (a round it agreed to stays agreed), but it vouches for no state and
        joins no update. Its expiration is later than any record published before, so the DHT keeps it over them
        (hivemind keeps the value that expires last).
        """
        left = self._last.model_copy(update={"left": True}).to_wire()
        future = self.dht.store(
            self.key, left, get_dht_time() + self.ttl_s + 1, subkey=self._subkey, return_future=True
        )
        try:
            return bool(dht_result(self.dht, future, f"marking the progress of {self.key} as left", timeout_s))
        except Exception as exc:  # a stopping process: its record then expires on its own
            logger.debug("could not mark the progress of %s as left: %r", self.key, exc)
            return False

    def members(self) -> dict[str, TrainingProgress]:
        """Peer id -> progress of every fresh, verified record, those that left included (ours too once the DHT holds
        it).

        Raises DHTUnavailableError when this process's DHT node does not answer.
        """
        return read_members(self.dht, self.key, self._owners)
