"""Who serves what: reading and writing block records and the model index in the DHT.

Records are validated on write (built from the schema) and on read (records that do not parse are skipped
and logged, so one misbehaving peer cannot break everyone's routing).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from protocol.errors import InvalidRecordError
from protocol.records import MODEL_INDEX_KEY, ModelRecord, ServerInfo, block_key
from swarm.dht import dht_result
from swarm.snapshot import SwarmSnapshot

logger = logging.getLogger(__name__)


async def _get_many(dht: hivemind.DHT, node: Any, keys: list[str]) -> dict[str, Any]:
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    return {key: (value.value if value is not None else None) for key, value in found.items()}


def _subkey_values(raw: Any) -> dict[Any, tuple[float, Any]]:
    """subkey -> (expiration time, value) of a dictionary record."""
    if not isinstance(raw, dict):
        return {}
    return {subkey: (getattr(item, "expiration_time", 0.0), getattr(item, "value", item)) for subkey, item in raw.items()}


def fetch_snapshot(dht: hivemind.DHT, prefix: str, num_blocks: int) -> SwarmSnapshot:
    """Read every block record of a model and merge them into one snapshot (one ServerInfo per peer)."""
    keys = [block_key(prefix, block) for block in range(num_blocks)]
    found = dht_result(dht, dht.run_coroutine(partial(_get_many, keys=keys), return_future=True),
                       f"reading the records of {prefix}")
    # a peer that moved has records of its old span too: its latest announcement wins
    latest: dict[str, tuple[float, ServerInfo]] = {}
    for key in keys:
        for peer_id, (expiration, value) in _subkey_values(found.get(key)).items():
            if not isinstance(peer_id, str) or (peer_id in latest and latest[peer_id][0] >= expiration):
                continue
            try:
                latest[peer_id] = (expiration, ServerInfo.from_wire(value))
            except InvalidRecordError as exc:
                logger.debug("skipping record of %s under %s: %s", peer_id, key, exc)
    return SwarmSnapshot(num_blocks=num_blocks, servers={peer_id: info for peer_id, (_, info) in latest.items()},
                         expirations={peer_id: expiration for peer_id, (expiration, _) in latest.items()})


def fetch_models(dht: hivemind.DHT) -> dict[str, ModelRecord]:
    """The model index: DHT prefix -> ModelRecord."""
    found = dht_result(dht, dht.run_coroutine(partial(_get_many, keys=[MODEL_INDEX_KEY]), return_future=True),
                       "reading the model index")
    models = {}
    for prefix, (_, value) in _subkey_values(found.get(MODEL_INDEX_KEY)).items():
        try:
            models[prefix] = ModelRecord.from_wire(value)
        except InvalidRecordError as exc:
            logger.debug("skipping model index entry %r: %s", prefix, exc)
    return models


def announce(
    dht: hivemind.DHT,
    prefix: str,
    peer_id: str,
    info: ServerInfo,
    model: ModelRecord,
    *,
    expiration_s: float,
    wait: bool = True,
):
    """Store `info` under every block the peer serves, and the model in the index."""
    ServerInfo.from_wire(info.to_wire())  # validate on write too
    keys = [block_key(prefix, block) for block in range(info.start_block, info.end_block)]
    store = partial(
        _store_many,
        keys=[*keys, MODEL_INDEX_KEY],
        values=[info.to_wire()] * len(keys) + [model.to_wire()],
        subkeys=[peer_id] * len(keys) + [prefix],
        expiration_time=get_dht_time() + expiration_s,
    )
    future = dht.run_coroutine(store, return_future=True)
    return dht_result(dht, future, f"announcing {prefix} {info.start_block}:{info.end_block}") if wait else future


async def _store_many(dht: hivemind.DHT, node: Any, keys, values, subkeys, expiration_time) -> bool:
    stored = await node.store_many(keys, values, expiration_time, subkeys=subkeys)
    return all(stored.values())
