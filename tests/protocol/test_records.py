"""protocol.records: DHT records round-trip (also through msgpack, as the DHT stores them) and are validated strictly."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from hivemind.utils.serializer import MSGPackSerializer

from protocol.errors import InvalidRecordError
from protocol.records import (
    MAX_NUM_BLOCKS,
    MAX_THROUGHPUT,
    MODEL_INDEX_KEY,
    ModelRecord,
    ServerInfo,
    ServerState,
    TrainingProgress,
    block_key,
    check_prefix,
    check_run_id,
    prefix_for_model,
)

PEER_A = "QmXbNrDWyN9MdS1KyndsD9WsBGJwEN3xJmddxZ73iC5HGo"
PEER_B = "12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"


def server_wire(**changes: Any) -> dict[str, Any]:
    wire = {
        "state": 2,
        "start_block": 3,
        "end_block": 7,
        "throughput": 1234.5,
        "cache_tokens_left": 8192,
        "dtype": "bfloat16",
        "version": "1",
        "endpoint": "127.0.0.1:50051",
        "run_id": "run-1",
        "epoch": 12,
        "samples": 6,
        "transport": "p2p",
        "relays": ["12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"],
        "relay": False,
        "joined_at": 1700000000.5,
    }
    wire.update(changes)
    return wire


def through_dht(value: Any) -> Any:
    """What a reader gets back: the DHT stores values msgpack-serialized."""
    return MSGPackSerializer.loads(MSGPackSerializer.dumps(value))


# ServerInfo


def test_server_info_roundtrip():
    info = ServerInfo.from_wire(server_wire())
    assert info.state is ServerState.ONLINE
    wire = info.to_wire()
    assert wire == server_wire()
    assert type(wire["state"]) is int  # plain data on the wire, no enum objects
    assert ServerInfo.from_wire(wire) == info


def test_server_info_roundtrip_through_msgpack():
    info = ServerInfo.from_wire(server_wire())
    assert ServerInfo.from_wire(through_dht(info.to_wire())) == info


def test_records_of_older_peers_with_their_empty_retired_fields_are_read():
    # versions up to 2 announced "adapters" and "next_pings", always empty; nothing read them
    info = ServerInfo.from_wire(through_dht(server_wire(adapters=[], next_pings={})))
    assert info == ServerInfo.from_wire(server_wire())
    assert "adapters" not in info.to_wire() and "next_pings" not in info.to_wire()
    for junk in ({"adapters": ["lora-a"]}, {"next_pings": {PEER_A: 0.1}}):
        with pytest.raises(InvalidRecordError, match=next(iter(junk))):
            ServerInfo.from_wire(server_wire(**junk))


def test_server_info_defaults():
    wire = server_wire()
    del wire["transport"], wire["relays"], wire["relay"], wire["joined_at"]
    info = ServerInfo.from_wire(through_dht(wire))
    assert info.transport == "direct" and info.relays == () and info.relay is False  # records of older peers
    assert ServerInfo.from_wire(through_dht(info.to_wire())) == info


@pytest.mark.parametrize("state", list(ServerState), ids=lambda s: s.name)
def test_server_info_every_state(state):
    info = ServerInfo.from_wire(server_wire(state=int(state)))
    assert info.state is state
    assert ServerInfo.from_wire(through_dht(info.to_wire())).state is state


def test_server_info_is_frozen():
    info = ServerInfo.from_wire(server_wire())
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        info.start_block = 0


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"unexpected": 1}, "unexpected"),
        ({"start_block": "3"}, "start_block"),
        ({"end_block": 7.0}, "end_block"),
        ({"cache_tokens_left": "8192"}, "cache_tokens_left"),
        ({"throughput": "fast"}, "throughput"),
        ({"dtype": 16}, "dtype"),
        ({"version": 1}, "version"),
        ({"endpoint": 50051}, "endpoint"),
        ({"state": 3}, "state"),
        ({"state": -1}, "state"),
        ({"state": "ONLINE"}, "state"),
        ({"state": True}, "state"),
        ({"state": 2.0}, "state"),
        ({"start_block": -1}, "start_block"),
        ({"end_block": 0, "start_block": 0}, "end_block"),
        ({"throughput": -0.5}, "throughput"),
        ({"cache_tokens_left": -1}, "cache_tokens_left"),
        ({"endpoint": "127.0.0.1"}, "endpoint"),
        ({"endpoint": "127.0.0.1:"}, "endpoint"),
        ({"endpoint": ":50051"}, "endpoint"),
        ({"endpoint": "127.0.0.1:port"}, "endpoint"),
        ({"endpoint": "127.0.0.1 :50051"}, "endpoint"),
        ({"endpoint": "grpc://127.0.0.1:50051"}, "endpoint"),
        ({"endpoint": "127.0.0.1:123456"}, "endpoint"),
        ({"endpoint": ""}, "endpoint"),
        ({"run_id": "a.b"}, "run_id"),
        ({"run_id": "x" * 65}, "run_id"),
        ({"epoch": -1}, "epoch"),
        ({"samples": 1.5}, "samples"),
        ({"transport": "relay"}, "transport"),
        ({"transport": 1}, "transport"),
        ({"relays": "12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"}, "relays"),
        ({"relays": ["not a peer id"]}, "relays"),
        ({"relays": ["12D3KooW0OIl" + "x" * 40]}, "relays"),  # 0, O, I and l are not base58
        ({"relays": ["12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"] * 5}, "relays"),
        ({"relay": 1}, "relay"),
        # numbers are finite and capped, strings bounded: a record's weight in placement and routing is bounded
        ({"throughput": float("nan")}, "throughput"),
        ({"throughput": float("inf")}, "throughput"),
        ({"throughput": MAX_THROUGHPUT * 1.01}, "throughput"),
        ({"throughput": 1e300}, "throughput"),
        ({"cache_tokens_left": 1 << 60}, "cache_tokens_left"),
        ({"epoch": 1 << 60}, "epoch"),
        ({"samples": 1 << 60}, "samples"),
        ({"dtype": "int8"}, "dtype"),
        ({"dtype": "float64"}, "dtype"),
        ({"version": ""}, "version"),
        ({"version": "1" * 33}, "version"),
        ({"version": "1 beta"}, "version"),
        ({"endpoint": "h" * 254 + ":1"}, "endpoint"),
        ({"joined_at": float("inf")}, "joined_at"),
        ({"joined_at": float("nan")}, "joined_at"),
        ({"joined_at": -1.0}, "joined_at"),
    ],
)
def test_server_info_rejects(changes, field):
    with pytest.raises(InvalidRecordError, match="invalid ServerInfo record") as info:
        ServerInfo.from_wire(server_wire(**changes))
    assert field in str(info.value)


@pytest.mark.parametrize("start, end", [(3, 3), (5, 2)])
def test_server_info_rejects_empty_span(start, end):
    with pytest.raises(InvalidRecordError, match=rf"empty span \[{start}, {end}\)"):
        ServerInfo.from_wire(server_wire(start_block=start, end_block=end))


@pytest.mark.parametrize("field", ["state", "start_block", "end_block", "throughput", "cache_tokens_left", "endpoint"])
def test_server_info_rejects_missing_field(field):
    wire = server_wire()
    del wire[field]
    with pytest.raises(InvalidRecordError, match=field):
        ServerInfo.from_wire(wire)


@pytest.mark.parametrize("raw", [None, [], "record", 42, b"\x00"], ids=repr)
def test_server_info_rejects_non_mappings(raw):
    with pytest.raises(InvalidRecordError):
        ServerInfo.from_wire(raw)


def test_server_info_accepts_an_int_throughput():
    # msgpack keeps 1000.0 a float, but a hand-written record may say 1000; it is still a valid rate
    assert ServerInfo.from_wire(server_wire(throughput=1000)).throughput == 1000.0


def test_server_info_validates_on_construction():
    with pytest.raises(pydantic.ValidationError, match="start_block"):
        ServerInfo(**{**server_wire(), "start_block": "3"})


# ModelRecord


def test_model_record_roundtrip():
    record = ModelRecord(num_blocks=30, repository="HuggingFaceTB/SmolLM2-135M")
    assert record.to_wire() == {"num_blocks": 30, "repository": "HuggingFaceTB/SmolLM2-135M"}
    assert ModelRecord.from_wire(record.to_wire()) == record
    assert ModelRecord.from_wire(through_dht(record.to_wire())) == record


@pytest.mark.parametrize(
    "wire, field",
    [
        ({"num_blocks": 30, "repository": "r", "extra": True}, "extra"),
        ({"num_blocks": "30", "repository": "r"}, "num_blocks"),
        ({"num_blocks": 30.0, "repository": "r"}, "num_blocks"),
        ({"num_blocks": 0, "repository": "r"}, "num_blocks"),
        ({"num_blocks": -4, "repository": "r"}, "num_blocks"),
        ({"num_blocks": 30, "repository": 7}, "repository"),
        ({"num_blocks": 30}, "repository"),
        ({"repository": "r"}, "num_blocks"),
        ({"num_blocks": MAX_NUM_BLOCKS + 1, "repository": "r"}, "num_blocks"),
        ({"num_blocks": 30, "repository": ""}, "repository"),
        ({"num_blocks": 30, "repository": "r" * 513}, "repository"),
        ({"num_blocks": 30, "repository": "r\nfake output"}, "repository"),
    ],
)
def test_model_record_rejects(wire, field):
    with pytest.raises(InvalidRecordError, match="invalid ModelRecord record") as info:
        ModelRecord.from_wire(wire)
    assert field in str(info.value)


@pytest.mark.parametrize("raw", [None, [30, "r"], "r"], ids=repr)
def test_model_record_rejects_non_mappings(raw):
    with pytest.raises(InvalidRecordError):
        ModelRecord.from_wire(raw)


# keys and prefixes


def test_keys():
    assert block_key("SmolLM2-135M", 0) == "SmolLM2-135M.0"
    assert block_key("SmolLM2-135M", 29) == "SmolLM2-135M.29"
    # the model index key can never be a block key: those end in ".<digits>"
    assert not MODEL_INDEX_KEY.rsplit(".", 1)[-1].isdigit()


@pytest.mark.parametrize(
    "model, prefix",
    [
        ("/a/b/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct"),
        ("Qwen/Qwen2.5-0.5B", "Qwen2-5-0-5B"),
        ("HuggingFaceTB/SmolLM2-135M", "SmolLM2-135M"),
        ("./SmolLM2-135M", "SmolLM2-135M"),
        ("SmolLM2-135M", "SmolLM2-135M"),
        ("C:\\models\\tiny_llama\\", "tiny_llama"),
        ("~/models/my model (v2)", "my-model--v2-"),
        ("meta-llama/Llama-3.1-8B", "Llama-3-1-8B"),
    ],
)
def test_prefix_for_model(model, prefix):
    assert prefix_for_model(model) == prefix
    assert check_prefix(prefix) == prefix


def test_prefix_for_model_truncates_long_names():
    prefix = prefix_for_model("/models/" + "x" * 300)
    assert prefix == "x" * 128
    assert check_prefix(prefix) == prefix


@pytest.mark.parametrize("model", ["", "/", "///", "\\"])
def test_prefix_for_model_rejects_names_without_a_last_part(model):
    with pytest.raises(ValueError, match="cannot derive a DHT prefix"):
        prefix_for_model(model)


@pytest.mark.parametrize("prefix", ["tiny-llama", "Qwen2-5-0-5B", "a", "A_b-9", "x" * 128])
def test_check_prefix_accepts(prefix):
    assert check_prefix(prefix) == prefix


@pytest.mark.parametrize("prefix", ["", "a.b", "a/b", "a b", "x" * 129, "ünïcode", "a:b", "\ntiny"])
def test_check_prefix_rejects(prefix):
    with pytest.raises(ValueError, match="DHT prefix"):
        check_prefix(prefix)


def test_check_prefix_rejects_a_trailing_newline():
    with pytest.raises(ValueError, match="DHT prefix"):
        check_prefix("tiny\n")


def test_server_info_endpoint_rejects_a_trailing_newline():
    with pytest.raises(InvalidRecordError, match="endpoint"):
        ServerInfo.from_wire(server_wire(endpoint="127.0.0.1:50051\n"))


def test_training_progress_roundtrip_and_rejects():
    progress = TrainingProgress(epoch=3, samples=8)
    assert TrainingProgress.from_wire(through_dht(progress.to_wire())) == progress
    for bad in ({"epoch": -1, "samples": 0}, {"epoch": 1, "samples": "8"}, {"epoch": 1}, None, [1, 2]):
        with pytest.raises(InvalidRecordError, match="invalid TrainingProgress record"):
            TrainingProgress.from_wire(bad)


def test_a_trainers_decision_roundtrips_and_is_left_off_the_wire_when_there_is_none():
    decided = TrainingProgress(epoch=3, samples=8, decided=("0123456789abcdef", "fedcba9876543210"), clip_scale=0.25)
    assert TrainingProgress.from_wire(through_dht(decided.to_wire())) == decided
    # a record without a decision is what versions before decisions wrote and read
    assert set(TrainingProgress(epoch=3, samples=8).to_wire()) == {
        "epoch", "samples", "param_digest", "round", "round_digest", "left"
    }  # fmt: skip
    wire = decided.to_wire()
    for bad in (
        {"decided": ["0123456789ABCDEF"]},  # not lower-case hex
        {"decided": ["0123456789abcdef0"]},  # not a round's tag
        {"decided": ["0123456789abcdef"] * 257},  # more stages than a record holds
        {"clip_scale": 0.0},  # a decision without its factor
        {"clip_scale": 1.5},
        {"clip_scale": float("nan")},
    ):
        with pytest.raises(InvalidRecordError, match="invalid TrainingProgress record"):
            TrainingProgress.from_wire({**wire, **bad})


@pytest.mark.parametrize("run_id", ["default", "run_1", "A-b-9"])
def test_check_run_id_accepts(run_id):
    assert check_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", ["", "a.b", "a b", "x" * 65, "run\n"])
def test_check_run_id_rejects(run_id):
    with pytest.raises(ValueError, match="run id"):
        check_run_id(run_id)
