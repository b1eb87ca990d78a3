"""Which peers a client that names an adapter uses (client/adapters.py), and how it is configured."""

from __future__ import annotations

import pytest

from client.adapters import serving_adapter
from client.config import ClientConfig
from protocol.errors import BadRequestError
from protocol.records import AdapterInfo, ServerInfo, ServerState

ONE, TWO = "1111111111111111", "2222222222222222"


def _info(*adapters: AdapterInfo, state: ServerState = ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(state=state, start_block=0, end_block=2, throughput=1.0, cache_tokens_left=8, dtype="float32",
                      version="3", endpoint="127.0.0.1:1", adapters=adapters)  # fmt: skip


def test_only_peers_of_the_digest_most_peers_announce_are_used():
    servers = {
        "a": _info(AdapterInfo(name="poems", digest=ONE)),
        "b": _info(AdapterInfo(name="poems", digest=ONE), AdapterInfo(name="law", digest=TWO)),
        "c": _info(AdapterInfo(name="poems", digest=TWO)),  # another folder under the same name
        "d": _info(),
        "e": _info(AdapterInfo(name="poems", digest=TWO), state=ServerState.JOINING),  # does not count yet
    }
    assert sorted(serving_adapter(servers, "poems", None)) == ["a", "b"]
    assert sorted(serving_adapter(servers, "poems", TWO)) == ["c", "e"]  # the client's own folder's
    assert sorted(serving_adapter(servers, "law", None)) == ["b"]
    assert serving_adapter(servers, "nope", None) == {}


def test_an_adapter_that_replaces_the_head_needs_its_folder():
    servers = {"a": _info(AdapterInfo(name="law", digest=ONE, client_modules=True))}
    with pytest.raises(BadRequestError, match="pass its folder as adapter_path"):
        serving_adapter(servers, "law", None)
    assert list(serving_adapter(servers, "law", ONE)) == ["a"]


def test_adapter_settings_are_checked():
    peers = ("/ip4/127.0.0.1/tcp/1/p2p/Qm",)
    assert ClientConfig(initial_peers=peers, adapter="poems").adapter == "poems"
    with pytest.raises(ValueError, match="adapter must be"):
        ClientConfig(initial_peers=peers, adapter="no/slash")
    with pytest.raises(ValueError, match="give adapter=NAME too"):
        ClientConfig(initial_peers=peers, adapter_path="dir")
