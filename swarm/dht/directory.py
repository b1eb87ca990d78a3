"""Who serves what: reading and writing block records and the model index in the DHT.

Records are validated on write (built from the schema) and on read (records that do not parse are skipped
and logged, so one misbehaving peer cannot break everyone's routing). A block record counts only under a subkey
that names its owner's key (swarm/trust/identity.py): the DHT's signature check then guarantees that the peer id it is
read under wrote it. It must also describe a span inside the model that covers the block it is stored under.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from protocol.errors import InvalidRecordError
from protocol.records import MODEL_INDEX_KEY, ModelIndexEntry, ModelRecord, ServerInfo, block_key
from swarm.dht.node import dht_result
from swarm.dht.snapshot import SwarmSnapshot
from swarm.trust.identity import parse_record_subkey

logger = logging.getLogger(__name__)


async def _get_many(dht: hivemind.DHT, node: Any, keys: list[str]) -> dict[str, Any]:
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    return {key: (value.value if value is not None else None) for key, value in found.items()}


def _subkey_values(raw: Any) -> dict[Any, tuple[float, Any]]:
    """subkey -> (expiration time, value) of a dictionary record."""
    if not isinstance(raw, dict):
        return {}
    return {
        subkey: (getattr(item, "expiration_time", 0.0), getattr(item, "value", item)) for subkey, item in raw.items()
    }


def fetch_snapshot(dht: hivemind.DHT, prefix: str, num_blocks: int) -> SwarmSnapshot:
    """Read every block record of a model and merge them into one snapshot (one ServerInfo per peer)."""
    keys = [block_key(prefix, block) for block in range(num_blocks)]
    found = dht_result(
        dht, dht.run_coroutine(partial(_get_many, keys=keys), return_future=True), f"reading the records of {prefix}"
    )
    taken_at = get_dht_time()
    # a peer that moved has records of its old span too: its latest announcement wins
    latest: dict[str, tuple[float, ServerInfo]] = {}
    public_keys: dict[str, bytes] = {}
    owners: dict[Any, tuple[str, bytes] | None] = {}  # subkey -> its owner, parsed once per read
    for block, key in enumerate(keys):
        for subkey, (expiration, value) in _subkey_values(found.get(key)).items():
            if subkey not in owners:
                owners[subkey] = parse_record_subkey(subkey)
            if owners[subkey] is None:
                logger.debug("skipping a record under %s: its subkey %.80r names no owner key", key, subkey)
                continue
            peer_id, public_key = owners[subkey]
            if peer_id in latest and latest[peer_id][0] >= expiration:
                continue
            try:
                info = ServerInfo.from_wire(value)
            except InvalidRecordError as exc:
                logger.debug("skipping the record of %s under %s: %s", peer_id, key, exc)
                continue
            if info.end_block > num_blocks:
                logger.debug(
                    "skipping the record of %s under %s: span %d:%d is outside the model's 0:%d",
                    peer_id,
                    key,
                    info.start_block,
                    info.end_block,
                    num_blocks,
                )
                continue
            if not info.start_block <= block < info.end_block:
                logger.debug(
                    "skipping the record of %s under %s: its span %d:%d does not hold block %d",
                    peer_id,
                    key,
                    info.start_block,
                    info.end_block,
                    block,
                )
                continue
            latest[peer_id] = (expiration, info)
            public_keys[peer_id] = public_key
    return SwarmSnapshot(
        num_blocks=num_blocks,
        servers={peer_id: info for peer_id, (_, info) in latest.items()},
        expirations={peer_id: expiration for peer_id, (expiration, _) in latest.items()},
        public_keys=public_keys,
        taken_at=taken_at,
    )


def fetch_models(dht: hivemind.DHT) -> dict[str, ModelRecord]:
    """The model index: DHT prefix -> ModelRecord, as most of the model's peers describe it (ties: the latest)."""
    found = dht_result(
        dht,
        dht.run_coroutine(partial(_get_many, keys=[MODEL_INDEX_KEY]), return_future=True),
        "reading the model index",
    )
    return index_models(found.get(MODEL_INDEX_KEY))


def index_models(raw: Any) -> dict[str, ModelRecord]:
    """What the model index read as `raw` (a DHT dictionary) says: prefix -> the record most entries give, the
    prefixes with the most entries first (ties: by prefix), so that a reader with a budget reads those first."""
    said: dict[str, dict[ModelRecord, tuple[int, float]]] = {}  # prefix -> record -> (peers, latest expiration)
    for subkey, (expiration, value) in _subkey_values(raw).items():
        if parse_record_subkey(subkey) is None:
            logger.debug("skipping a model index entry: its subkey %.80r names no owner key", subkey)
            continue
        try:
            entry = ModelIndexEntry.from_wire(value)
        except InvalidRecordError as exc:
            logger.debug("skipping a model index entry: %s", exc)
            continue
        record = ModelRecord(num_blocks=entry.num_blocks, repository=entry.repository)
        peers, latest = said.setdefault(entry.prefix, {}).get(record, (0, 0.0))
        said[entry.prefix][record] = (peers + 1, max(latest, expiration))
    support = {prefix: sum(peers for peers, _ in records.values()) for prefix, records in said.items()}
    ranked = sorted(said, key=lambda prefix: (-support[prefix], prefix))
    return {prefix: max(said[prefix], key=said[prefix].__getitem__) for prefix in ranked}


def announce(
    dht: hivemind.DHT,
    prefix: str,
    info: ServerInfo,
    model: ModelRecord,
    *,
    expiration_s: float,
    wait: bool = True,
):
    """Store `info` under every block the peer serves, signed by `dht`'s key (one started by swarm.dht.node.start_dht),
    and the model in the index.

    Returns:
        with `wait`, the keys the DHT did not store (also logged as a warning); else a future of what
        `unstored` takes.
    """
    ServerInfo.from_wire(info.to_wire())  # validate on write too
    keys = [block_key(prefix, block) for block in range(info.start_block, info.end_block)]
    store = partial(
        _store_many,
        keys=[*keys, MODEL_INDEX_KEY],
        values=[info.to_wire()] * len(keys) + [ModelIndexEntry(prefix=prefix, **model.to_wire()).to_wire()],
        subkeys=[dht.identity.record_subkey()] * (len(keys) + 1),
        expiration_time=get_dht_time() + expiration_s,
    )
    future = dht.run_coroutine(store, return_future=True)
    if not wait:
        return future
    what = f"announcing {prefix} {info.start_block}:{info.end_block}"
    return unstored(dht_result(dht, future, what), what)


def unstored(stored: dict[str, bool], what: str) -> list[str]:
    """The keys of an announcement (`announce`'s result) that no DHT node accepted, logged as a warning."""
    failed = [key for key, ok in stored.items() if not ok]
    if failed:
        logger.warning(
            "%s: the DHT did not store %s (refused by its nodes, or none answered in time); "
            "clients may not see this peer there until the next announcement",
            what,
            ", ".join(failed),
        )
    return failed


async def _store_many(dht: hivemind.DHT, node: Any, keys, values, subkeys, expiration_time) -> dict[str, bool]:
    stored = await node.store_many(keys, values, expiration_time, subkeys=subkeys)
    return {key: bool(ok) for (key, _), ok in stored.items()}
