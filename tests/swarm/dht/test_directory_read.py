"""Reading the model index as a reader gets it (a DHT dictionary), whatever its own DHT node let through."""

from __future__ import annotations

from hivemind.utils import ValueWithExpiration

from protocol.records import ModelRecord
from swarm.dht.directory import index_models
from swarm.trust.identity import fresh_identity

WRITERS = [fresh_identity() for _ in range(3)]


def entry(prefix: str = "m", num_blocks: int = 4, repository: str = "org/model") -> dict:
    return {"prefix": prefix, "num_blocks": num_blocks, "repository": repository}


def test_each_prefix_gets_what_most_of_its_signed_writers_say():
    raw = {
        WRITERS[0].record_subkey(): ValueWithExpiration(entry(), 10.0),
        WRITERS[1].record_subkey(): ValueWithExpiration(entry(), 11.0),
        WRITERS[2].record_subkey(): ValueWithExpiration(entry(num_blocks=2, repository="liar/x"), 99.0),
    }
    assert index_models(raw) == {"m": ModelRecord(num_blocks=4, repository="org/model")}


def test_a_tie_goes_to_the_latest_and_prefixes_are_apart():
    raw = {
        WRITERS[0].record_subkey(): ValueWithExpiration(entry(repository="old/x"), 10.0),
        WRITERS[1].record_subkey(): ValueWithExpiration(entry(repository="new/x"), 20.0),
        WRITERS[2].record_subkey(): ValueWithExpiration(entry(prefix="other", num_blocks=6), 5.0),
    }
    assert index_models(raw) == {
        "m": ModelRecord(num_blocks=4, repository="new/x"),
        "other": ModelRecord(num_blocks=6, repository="org/model"),
    }


def test_unsigned_and_malformed_entries_count_for_nothing():
    raw = {
        "m": ValueWithExpiration({"num_blocks": 2, "repository": "r"}, 50.0),  # the old unsigned form
        WRITERS[0].peer_id: ValueWithExpiration(entry(num_blocks=2), 50.0),  # no key: anyone could write it
        f"{WRITERS[0].peer_id}[owner:{WRITERS[1].public_key.decode()}]": ValueWithExpiration(entry(num_blocks=2), 50.0),
        WRITERS[1].record_subkey(): ValueWithExpiration(entry(prefix="bad/prefix"), 50.0),
        WRITERS[2].record_subkey(): ValueWithExpiration(entry(), 1.0),
    }
    assert index_models(raw) == {"m": ModelRecord(num_blocks=4, repository="org/model")}
    assert index_models(None) == {} and index_models(b"plain") == {}
