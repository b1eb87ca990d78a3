"""Which peers a client that names an adapter uses (client/adapters.py), how it is configured, and sessions through
an adapter on in-memory peers: failover and speculative decoding stay on the adapter's peers and equal local peft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client.adapters import serving_adapter
from client.config import ClientConfig
from protocol.errors import BadRequestError
from protocol.records import AdapterInfo, ServerInfo, ServerState
from tests.helpers.adapters import local_peft, save_random_adapter
from tests.helpers.fake_swarm import Fault
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE

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


@pytest.fixture(scope="module")
def poems(tiny_llama_path, tmp_path_factory) -> Path:
    return save_random_adapter(tiny_llama_path, tmp_path_factory.mktemp("poems") / "poems", seed=1)


def test_a_session_with_an_adapter_survives_a_crash_and_replays_through_the_same_adapter(
    fake_swarm, tiny_llama_path, poems
):
    """The peer of 2:4 crashes mid-generation: the session replays its history on the other peer serving the
    adapter, never on the plain peer (which is the fastest), and the tokens are local peft's."""
    fake_swarm.add_peer(0, 2, adapters={"poems": poems})
    failing = fake_swarm.add_peer(2, 4, throughput=1000, adapters={"poems": poems}, faults=[Fault("crash", after=20)])
    fake_swarm.add_peer(2, 4, adapters={"poems": poems})
    plain = fake_swarm.add_peer(0, 4, throughput=1e6)
    local = local_peft(tiny_llama_path, poems)
    ids = torch.randint(3, VOCAB_SIZE, (1, 6), generator=torch.Generator().manual_seed(7))
    expected = generate_with_logits(local, ids, max_new_tokens=36, do_sample=False)
    remote = fake_swarm.client(adapter="poems")
    try:
        with remote.inference_session(max_length=64) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=36, do_sample=False)
            assert failing.server.down and session.recoveries >= 1
        assert_same_generation(got, expected)
        assert plain.answered == {}, "the plain peer computed for a session that named an adapter"
        # speculative decoding (n-gram drafts, several tokens checked a step) through the adapter: the same tokens
        drafted = remote.generate(ids, max_new_tokens=20, prompt_lookup_num_tokens=3, pad_token_id=0)
        assert drafted.tolist() == local.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0).tolist()
    finally:
        remote.shutdown()
