"""The state document of `swarmlm status --json` and `swarmlm monitor` (swarm/dht/state.py), from plain snapshots."""

from __future__ import annotations

import json

from hivemind.utils import ValueWithExpiration

from protocol.records import ModelRecord, ServerInfo, ServerState
from swarm.dht.directory import index_models
from swarm.dht.snapshot import SwarmSnapshot
from swarm.dht.state import (
    ANSWERED,
    MAX_BLOCKS_READ,
    NO_ANSWER,
    SCHEMA_VERSION,
    WRONG_KEY,
    Ping,
    block_ranges,
    build_state,
    models_to_read,
)
from swarm.trust.identity import fresh_identity


def info(start: int, end: int, **changes) -> ServerInfo:
    fields = dict(
        state=ServerState.ONLINE,
        start_block=start,
        end_block=end,
        throughput=100.0,
        cache_tokens_left=64,
        dtype="float32",
        version="1",
        endpoint="127.0.0.1:5000",
    )
    return ServerInfo(**(fields | changes))


MODELS = {
    "llama": ModelRecord(num_blocks=6, repository="/models/llama"),
    "qwen": ModelRecord(num_blocks=2, repository="<script>alert(1)</script>"),
}
SNAPSHOTS = {
    "llama": SwarmSnapshot(
        num_blocks=6,
        servers={
            "a": info(0, 3),
            "b": info(2, 4, run_id="shakespeare", epoch=7, samples=3),
            "c": info(2, 4, run_id="shakespeare", epoch=8),
            "gone": info(4, 6, state=ServerState.OFFLINE),
        },
        expirations={"a": 1000.0},
    ),
    "qwen": SwarmSnapshot(num_blocks=2, servers={"q": info(0, 2, dtype="bfloat16")}),
}


def test_the_document_counts_online_peers_per_block_and_names_the_gaps():
    state = build_state(MODELS, SNAPSHOTS, taken_at=123.0)
    assert state["schema_version"] == SCHEMA_VERSION == 2
    assert state["taken_at"] == 123.0 and state["rtt_measured"] is False and state["error"] is None
    assert [model["prefix"] for model in state["models"]] == ["llama", "qwen"]
    llama, qwen = state["models"]
    assert llama["num_blocks"] == 6 and llama["repository"] == "/models/llama"
    assert llama["coverage"] == [1, 1, 3, 2, 0, 0]  # the OFFLINE peer covers nothing
    assert llama["answering"] is None
    assert llama["gaps"] == [[4, 6]] and llama["complete"] is False
    assert qwen["coverage"] == [1, 1] and qwen["gaps"] == [] and qwen["complete"] is True
    assert qwen["repository"] == "<script>alert(1)</script>"  # data, verbatim: escaping is the page's job
    json.dumps(state)  # plain JSON all the way down


def test_peers_are_listed_by_span_with_every_announced_field():
    llama = build_state(MODELS, SNAPSHOTS)["models"][0]
    assert [peer["peer_id"] for peer in llama["peers"]] == ["a", "b", "c", "gone"]
    a, b, _, gone = llama["peers"]
    assert a == {
        "peer_id": "a",
        "state": "ONLINE",
        "live": True,
        "start_block": 0,
        "end_block": 3,
        "throughput": 100.0,
        "cache_tokens_left": 64,
        "dtype": "float32",
        "quantization": "none",
        "adapters": [],
        "version": "1",
        "endpoint": "127.0.0.1:5000",
        "transport": "direct",
        "relays": [],
        "relay": False,
        "reach": "direct 127.0.0.1:5000",
        "run_id": "",
        "epoch": 0,
        "samples": 0,
        "expires_at": 1000.0,
        "ping": None,
        "rtt_s": None,
    }
    assert (b["run_id"], b["epoch"], b["samples"]) == ("shakespeare", 7, 3)
    assert gone["state"] == "OFFLINE" and gone["live"] is False
    assert llama["training"] == [
        {"run_id": "shakespeare", "peers": 2, "epoch_min": 7, "epoch_max": 8, "recipe": None, "other_recipes": 0}
    ]


def test_each_run_shows_the_recipe_that_counts_and_how_many_others_were_published():
    counts, other = {"lr": 3e-4, "optimizer": "adamw"}, {"lr": 1.0, "optimizer": "sgd"}
    recipes = {"llama": {"shakespeare": [counts, other], "gone": [counts]}}
    state = build_state(MODELS, SNAPSHOTS, recipes=recipes)
    [run] = state["models"][0]["training"]
    assert run["recipe"] == counts and run["other_recipes"] == 1
    assert state["schema_version"] == 2
    json.dumps(state)
    alone = build_state(MODELS, SNAPSHOTS, recipes={"llama": {"shakespeare": [counts]}})
    assert alone["models"][0]["training"][0]["other_recipes"] == 0
    unread = build_state(MODELS, SNAPSHOTS, recipes={"llama": {"shakespeare": []}})
    assert unread["models"][0]["training"][0]["recipe"] is None


def test_with_pings_only_peers_that_answered_count_and_each_peer_says_what_its_ping_found():
    pings = {"a": Ping(ANSWERED, 0.002), "b": Ping(WRONG_KEY), "q": Ping(ANSWERED, 0.001)}  # c: not in pings
    state = build_state(MODELS, SNAPSHOTS, pings=pings)
    llama, qwen = state["models"]
    assert state["rtt_measured"] is True
    assert llama["coverage"] == [1, 1, 3, 2, 0, 0] and llama["answering"] == [1, 1, 1, 0, 0, 0]
    assert llama["gaps"] == [[3, 6]]  # block 3 is announced by b and c, but neither answered
    by_id = {peer["peer_id"]: peer for peer in llama["peers"]}
    assert (by_id["a"]["ping"], by_id["a"]["rtt_s"]) == (ANSWERED, 0.002)
    assert (by_id["b"]["ping"], by_id["b"]["rtt_s"]) == (WRONG_KEY, None)
    assert by_id["c"]["ping"] == NO_ANSWER  # an ONLINE peer with no ping result did not answer
    assert by_id["gone"]["ping"] is None  # OFFLINE peers are not pinged
    assert qwen["answering"] == [1, 1] and qwen["complete"]


def test_a_joining_peer_is_listed_but_covers_nothing():
    snapshot = SwarmSnapshot(
        num_blocks=2, servers={"j": info(0, 2, state=ServerState.JOINING, joined_at=0.0)}, taken_at=10_000.0
    )  # joined long ago: no longer counted as joining
    (model,) = build_state({"m": ModelRecord(num_blocks=2, repository="r")}, {"m": snapshot})["models"]
    assert model["coverage"] == [0, 0] and model["gaps"] == [[0, 2]]
    assert model["peers"][0]["state"] == "JOINING" and model["peers"][0]["live"] is False


def test_models_without_a_snapshot_are_left_out_counted_and_no_models_is_an_empty_list():
    state = build_state(MODELS, {"qwen": SNAPSHOTS["qwen"]})
    assert [m["prefix"] for m in state["models"]] == ["qwen"] and state["models_not_read"] == 1
    assert build_state({}, {})["models"] == [] and build_state({}, {})["models_not_read"] == 0


def test_a_flood_of_made_up_models_costs_a_bounded_read_and_leaves_the_announced_model_in():
    """40 identities (free; the index takes 1,024) each announce a made-up model of up to 10,000 blocks; a real
    model has 3 peers. Reading every one would fetch 200,000 block records a refresh."""
    writers = [fresh_identity() for _ in range(43)]
    raw = {}
    for i, writer in enumerate(writers[:40]):
        entry = {"prefix": f"junk{i:04d}", "num_blocks": 10_000 if i % 2 else 400, "repository": "x/y"}
        raw[writer.record_subkey()] = ValueWithExpiration(entry, 50.0)
    for writer in writers[40:]:
        raw[writer.record_subkey()] = ValueWithExpiration({"prefix": "llama", "num_blocks": 32, "repository": "r"}, 9.0)
    models = index_models(raw)
    assert next(iter(models)) == "llama"  # the most announced first
    chosen = models_to_read(models, MAX_BLOCKS_READ)
    assert chosen[0] == "llama" and sum(models[p].num_blocks for p in chosen) <= MAX_BLOCKS_READ
    assert len(chosen) == 1 + (MAX_BLOCKS_READ - 32) // 400  # smaller models still fill what is left
    assert models_to_read(models, 31) == []
    assert models_to_read({"m": ModelRecord(num_blocks=4, repository="r")}) == ["m"]


def test_block_ranges():
    assert block_ranges([]) == []
    assert block_ranges([0, 1, 2, 5, 7, 8]) == [[0, 3], [5, 6], [7, 9]]
