"""Named LoRA adapters on live processes (`swarmlm peer --adapters NAME=DIR`): a client picks one per session.

Two peers (blocks 0:2 and 2:4) serve two peft adapters of a tiny Llama, and a third peer serves the plain model.
A client that names an adapter gets what local peft computes with it, logits and greedy tokens, also for an
adapter that replaces the head and final norm (from the client's copy of the folder). A client that names none
gets the plain model meanwhile; one that names an adapter no peer serves, or one whose head it lacks, is told how
to fix it. `swarmlm api --adapters` serves each adapter as the model MODEL:NAME. How each row computes through its
adapter is tests/peer/test_adapters.py's.
"""

from __future__ import annotations

import concurrent.futures
import re

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client import AutoDistributedModelForCausalLM
from protocol.errors import BadRequestError, NoPeersError
from protocol.records import prefix_for_model
from swarm.models.adapters import folder_digest
from tests.helpers.adapters import local_peft, save_random_adapter
from tests.helpers.generation import ATOL, assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE, make_tiny
from tests.helpers.processes import Swarm
from tests.helpers.tokenizer import save_char_tokenizer


@pytest.fixture(scope="module")
def adapter_swarm(tmp_path_factory):
    """(swarm, model path, adapter folders by name): adapters on 0:2 and 2:4, the plain model on 0:4."""
    root = tmp_path_factory.mktemp("adapters")
    path = make_tiny("llama", root / "tiny-llama", seed=4)
    save_char_tokenizer(path)  # for swarmlm api
    folders = {
        "poems": save_random_adapter(path, root / "poems", seed=1),
        "law": save_random_adapter(
            path, root / "law", seed=2, rank=2, target_modules=("k_proj", "up_proj"), modules_to_save=["lm_head"]
        ),
    }
    served = [f"{name}={folder}" for name, folder in folders.items()]
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        swarm.start_peer(path, "--blocks", "0:2", "--adapters", *served)
        swarm.start_peer(path, "--blocks", "2:4", "--adapters", *served)
        swarm.start_peer(path, "--blocks", "0:4")
        prefix = prefix_for_model(str(path))
        swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == 3, 120, "3 peers ONLINE")
        yield swarm, path, folders


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def _client(swarm, path, **options):
    return AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers, **options)


def test_peers_announce_each_adapter_by_its_folders_digest(adapter_swarm):
    swarm, path, folders = adapter_swarm
    announced = [
        {a.name: (a.digest, a.client_modules) for a in info.adapters}
        for info in swarm.snapshot(prefix_for_model(str(path)), 4).online().values()
    ]
    expected = {"poems": (folder_digest(folders["poems"]), False), "law": (folder_digest(folders["law"]), True)}
    assert sorted(announced, key=len) == [{}, expected, expected]


@pytest.mark.parametrize("name", ["poems", "law"])
def test_a_session_with_an_adapter_computes_what_local_peft_computes(adapter_swarm, name):
    swarm, path, folders = adapter_swarm
    local = local_peft(path, folders[name])
    remote = _client(swarm, path, adapter=name, adapter_path=str(folders[name]))
    try:
        ids = _ids(2, 9, seed=1)
        with torch.no_grad():
            got, expected = remote(ids).logits, local(ids).logits
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (got - plain(ids).logits).abs().max() > 1e-2  # the adapter changes the answer
        prompt = _ids(1, 5, seed=2)
        expected = generate_with_logits(local, prompt, max_new_tokens=10, do_sample=False)
        assert_same_generation(generate_with_logits(remote, prompt, max_new_tokens=10, do_sample=False), expected)
    finally:
        remote.shutdown()


def test_sessions_with_and_without_an_adapter_run_side_by_side(adapter_swarm):
    """The plain client may share the adapters' peers (batched with the adapter's rows) or use the plain one."""
    swarm, path, folders = adapter_swarm
    references = {"poems": local_peft(path, folders["poems"]), None: None}
    references[None] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    clients = {"poems": _client(swarm, path, adapter="poems"), None: _client(swarm, path)}
    try:
        prompt = _ids(1, 6, seed=3)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = {
                name: pool.submit(generate_with_logits, client, prompt, max_new_tokens=12, do_sample=False)
                for name, client in clients.items()
            }
            for name, run in runs.items():
                expected = generate_with_logits(references[name], prompt, max_new_tokens=12, do_sample=False)
                assert_same_generation(run.result(timeout=120), expected)
    finally:
        for client in clients.values():
            client.shutdown()


def test_an_adapter_no_peer_serves_or_whose_head_is_missing_is_refused_saying_how(adapter_swarm):
    swarm, path, _ = adapter_swarm
    remote = _client(swarm, path, adapter="nope", wait_for_peers_s=1.0)
    try:
        with pytest.raises(NoPeersError, match=r"only peers serving adapter 'nope' \(swarmlm peer --adapters nope=DIR"):
            remote(_ids(1, 4, seed=4))
    finally:
        remote.shutdown()
    remote = _client(swarm, path, adapter="law", wait_for_peers_s=1.0)
    try:
        with pytest.raises(BadRequestError, match=r"adapter 'law' also replaces .* pass its folder as adapter_path"):
            remote(_ids(1, 4, seed=4))
    finally:
        remote.shutdown()


def test_the_api_serves_each_adapter_as_a_model_of_its_own(adapter_swarm):
    swarm, path, folders = adapter_swarm
    prefix = prefix_for_model(str(path))
    api = swarm.spawn(
        "api", "api", str(path), "--initial-peers", *swarm.initial_peers, "--port", "0",
        "--adapters", "poems", f"law={folders['law']}",
    )  # fmt: skip
    url = swarm.wait_for(lambda: re.search(r"serving \S+ at (http://\S+)/v1", api.stdout()), 120, "the API").group(1)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [prefix, f"{prefix}:poems", f"{prefix}:law"]
    tokenizer, prompt = AutoTokenizer.from_pretrained(path), "Sing of the swarm: "
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    answers = {}
    for name in ("poems", "law", None):
        local = local_peft(path, folders[name]) if name else AutoModelForCausalLM.from_pretrained(path).eval()
        out = local.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        model = f"{prefix}:{name}" if name else prefix
        done = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert (done.model, done.choices[0].text) == (model, expected)
        answers[name] = expected
    assert len(set(answers.values())) == 3, answers  # each adapter its own text
    with pytest.raises(openai.NotFoundError, match=f"{prefix}:nope"):
        client.completions.create(model=f"{prefix}:nope", prompt=prompt, max_tokens=2)
