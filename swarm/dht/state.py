"""The swarm's state as one JSON document: what `swarmlm status --json` prints and `swarmlm monitor` serves.

`build_state` is a pure function of the model index and the snapshots read from the DHT (already validated by
swarm/dht/directory.py, so every value in it fits protocol/records.py's bounds), plus, where the caller pinged the
peers (the monitor does, through client/), what each ping found, and where it read them (`swarmlm status` and
the monitor do, through swarm/training/recipe.py), the recipes of the training runs. `read_state` does the DHT reads of the rest.

The document (SCHEMA_VERSION 2; a field is only ever added within a version; 2 dropped the peers' "adapters",
which no peer ever wrote):

    {"schema_version": 2, "taken_at": unix time of the DHT read, "rtt_measured": whether peers were pinged,
     "error": null, or why the latest read failed (the monitor then serves the previous one's data),
     "models_not_read": how many models of the index were left unread (read_state's block budget),
     "models": [{"prefix", "repository", "num_blocks",
                 "coverage": [ONLINE peers announcing block i, for each block],
                 "answering": [of those, how many answered the ping] or null (not pinged),
                 "gaps": [[start, end), ...] of blocks no usable peer serves (ONLINE and, when pinged, answering),
                 "complete": no gap,
                 "training": [{"run_id", "peers", "epoch_min", "epoch_max",
                               "recipe": the run's recipe (RunRecipe.to_wire()) or null (none published, or not
                                         read),
                               "other_recipes": how many other recipes were published for the run (a race or a
                                                liar: the recipe shown is the one published first)}],
                 "peers": [{"peer_id", "state" (ONLINE/JOINING/OFFLINE), "live", "start_block", "end_block",
                            "throughput" (tokens/s), "cache_tokens_left", "dtype", "version", "endpoint",
                            "transport" (direct/p2p), "relays", "relay", "reach" (how clients reach it, in words),
                            "run_id" ("" when frozen), "epoch", "samples", "expires_at",
                            "ping": null (not pinged: not ONLINE, or no pings at all), or "answered",
                                    "no answer" or "wrong key",
                            "rtt_s": seconds or null}]}]}
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.records import ModelRecord, ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot

SCHEMA_VERSION = 2
MAX_BLOCKS_READ = 4096
"""Block records read per refresh, over all models: the index is open to every member, and one that floods it
with made-up models (each up to 10,000 blocks) would otherwise make every refresh read all of them."""


@dataclass(frozen=True)
class Ping:
    """What pinging one peer (an Info call whose answer must prove the record owner's key) found."""

    outcome: str
    """"answered", "no answer" (unreachable, or too slow), or "wrong key" (the server there is not that peer)."""
    rtt_s: float | None = None


ANSWERED, NO_ANSWER, WRONG_KEY = "answered", "no answer", "wrong key"


def describe_reach(info: ServerInfo) -> str:
    """How clients reach the peer of a record: its gRPC endpoint, or libp2p (through which relays)."""
    if info.transport == "direct":
        return f"direct {info.endpoint}" + ("  relays for others" if info.relay else "")
    if info.relays:
        return f"behind NAT, via relay {', '.join(relay[:16] + '...' for relay in info.relays)}"
    return "libp2p only"


def block_ranges(blocks: list[int]) -> list[list[int]]:
    """Sorted block numbers as [start, end) ranges of consecutive blocks."""
    ranges: list[list[int]] = []
    for block in blocks:
        if ranges and ranges[-1][1] == block:
            ranges[-1][1] = block + 1
        else:
            ranges.append([block, block + 1])
    return ranges


def _peer(peer_id: str, info: ServerInfo, snapshot: SwarmSnapshot, live: bool, ping: Ping | None) -> dict[str, Any]:
    return {
        "peer_id": peer_id,
        "state": ServerState(info.state).name,
        "live": live,
        "start_block": info.start_block,
        "end_block": info.end_block,
        "throughput": info.throughput,
        "cache_tokens_left": info.cache_tokens_left,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "adapters": [{"name": a.name, "digest": a.digest, "client_modules": a.client_modules} for a in info.adapters],
        "version": info.version,
        "endpoint": info.endpoint,
        "transport": info.transport,
        "relays": list(info.relays),
        "relay": info.relay,
        "reach": describe_reach(info),
        "run_id": info.run_id,
        "epoch": info.epoch,
        "samples": info.samples,
        "expires_at": snapshot.expirations.get(peer_id),
        "ping": None if ping is None else ping.outcome,
        "rtt_s": None if ping is None else ping.rtt_s,
    }


def training_runs(servers: Mapping[str, ServerInfo]) -> list[str]:
    """The run ids the peers of a snapshot train, sorted."""
    return sorted({info.run_id for info in servers.values() if info.run_id})


def _training(servers: Mapping[str, ServerInfo], recipes: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict]:
    runs: dict[str, list[ServerInfo]] = {}
    for info in servers.values():
        if info.run_id:
            runs.setdefault(info.run_id, []).append(info)
    return [
        {
            "run_id": run_id,
            "peers": len(infos),
            "epoch_min": min(i.epoch for i in infos),
            "epoch_max": max(i.epoch for i in infos),
            "recipe": dict(recipes[run_id][0]) if recipes.get(run_id) else None,
            "other_recipes": max(0, len(recipes.get(run_id, ())) - 1),
        }
        for run_id, infos in sorted(runs.items())
    ]


def model_state(
    prefix: str,
    record: ModelRecord,
    snapshot: SwarmSnapshot,
    pings: Mapping[str, Ping] | None = None,
    recipes: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """One model's entry of the document; `pings` (peer id -> Ping) None when the peers were not pinged; `recipes`:
    run id -> the different recipes published for it, the one that counts first (None: not read)."""
    online = snapshot.online()
    coverage = [0] * snapshot.num_blocks
    answering = None if pings is None else [0] * snapshot.num_blocks
    for peer_id, info in online.items():
        for block in range(info.start_block, min(info.end_block, snapshot.num_blocks)):
            coverage[block] += 1
            if answering is not None and (ping := pings.get(peer_id)) is not None and ping.outcome == ANSWERED:
                answering[block] += 1
    usable = coverage if answering is None else answering
    gaps = block_ranges([block for block, count in enumerate(usable) if count == 0])
    servers = sorted(snapshot.servers.items(), key=lambda item: (item[1].start_block, item[1].end_block, item[0]))
    live = snapshot.live()
    return {
        "prefix": prefix,
        "repository": record.repository,
        "num_blocks": snapshot.num_blocks,
        "coverage": coverage,
        "answering": answering,
        "gaps": gaps,
        "complete": not gaps,
        "training": _training(online, recipes or {}),
        "peers": [
            _peer(
                peer_id,
                info,
                snapshot,
                peer_id in live,
                pings.get(peer_id, Ping(NO_ANSWER)) if pings is not None and peer_id in online else None,
            )
            for peer_id, info in servers
        ],
    }


def build_state(
    models: Mapping[str, ModelRecord],
    snapshots: Mapping[str, SwarmSnapshot],
    *,
    pings: Mapping[str, Ping] | None = None,
    taken_at: float | None = None,
    recipes: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]] | None = None,
) -> dict[str, Any]:
    """The whole document (see the module's docstring) for the models that have a snapshot, sorted by prefix.

    Args:
        pings: peer id -> what pinging it found, for every ONLINE peer (one missing counts as no answer); None
            when the peers were not pinged: then "answering", "ping" and "rtt_s" are null and gaps count records.
        taken_at: unix time of the reads; now by default.
        recipes: prefix -> run id -> the different recipes published for the run (wire form), the one that counts
            first; None when they were not read: then every run's "recipe" is null.
    """
    return {
        "schema_version": SCHEMA_VERSION,
        "taken_at": time.time() if taken_at is None else taken_at,
        "rtt_measured": pings is not None,
        "error": None,
        "models_not_read": sum(1 for prefix in models if prefix not in snapshots),
        "models": [
            model_state(prefix, models[prefix], snapshots[prefix], pings, (recipes or {}).get(prefix))
            for prefix in sorted(models)
            if prefix in snapshots
        ],
    }


def read_state(dht, only: str | None = None) -> tuple[dict[str, ModelRecord], dict[str, SwarmSnapshot]]:
    """The model index and the snapshots of its models (`only`: that prefix alone), read from the DHT: the models
    that most peers announce first, as long as their blocks fit in MAX_BLOCKS_READ; a model left out has no snapshot.

    Raises:
        DHTUnavailableError: the DHT did not answer in time.
    """
    from swarm.dht.directory import fetch_models, fetch_snapshot  # hivemind: not for the pure part of this module

    models = fetch_models(dht)
    if only is not None:
        models = {prefix: record for prefix, record in models.items() if prefix == only}
    return models, {prefix: fetch_snapshot(dht, prefix, models[prefix].num_blocks) for prefix in models_to_read(models)}


def models_to_read(models: Mapping[str, ModelRecord], max_blocks: int = MAX_BLOCKS_READ) -> list[str]:
    """The prefixes of `models` (in fetch_models' order: the most announced first) whose blocks, taken in that
    order, fit in `max_blocks`; a model that does not fit is passed over for the smaller ones after it."""
    chosen = []
    for prefix, record in models.items():
        if record.num_blocks <= max_blocks:
            chosen.append(prefix)
            max_blocks -= record.num_blocks
    return chosen
