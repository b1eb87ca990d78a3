"""`swarmlm api` on a real swarm, driven with the official `openai` package, against the local HF model.

One swarm for the module: a random 4-block Llama (with the character tokenizer and a chat template of its own)
served by two peers (0:2, 2:4) behind a real `swarmlm api` process. Text is compared with what the local
Hugging Face model generates from the same prompt ids: greedy, and sampled with the same seed and processing
(temperature, top-p). The last two tests take the swarm down (a peer killed, then the server stopped), so they
come last.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading

import httpx2
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.transport import ChannelPool
from protocol import swarmlm_pb2 as pb
from tests.helpers.models import make_tiny_llama
from tests.helpers.processes import Swarm
from tests.helpers.tokenizer import save_char_tokenizer

pytestmark = pytest.mark.timeout(240)

PREFIX = "tiny-api"
KEY = "test-key"
CACHE_TOKENS = 8192  # the peers' default --cache-tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _model_with_tokenizer(folder):
    path = make_tiny_llama(folder, num_layers=4, seed=0)
    save_char_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE  # random test models have none
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(swarm, server URL, server process, model path, {span: peer process})."""
    path = _model_with_tokenizer(tmp_path_factory.mktemp("models") / PREFIX)
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        peers = {span: swarm.start_peer(path, "--blocks", span) for span in ("0:2", "2:4")}
        api = swarm.spawn(
            "api",
            "api",
            str(path),
            "--initial-peers",
            *swarm.initial_peers,
            "--port",
            "0",
            "--api-key",
            KEY,
            "--max-concurrency",
            "4",
            "--max-queued",
            "8",
            "--wait-for-peers-s",
            "2",
        )
        swarm.wait_online(PREFIX, [(0, 2), (2, 4)], timeout_s=120)
        url = swarm.wait_for(
            lambda: re.search(r"serving \S+ at (http://\S+)/v1", api.stdout()), 120, "the API server to listen"
        ).group(1)
        yield swarm, url, api, path, peers


@pytest.fixture(scope="module")
def local(served):
    path = served[3]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def api(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key=KEY, max_retries=0, timeout=60)


def _reference(local, ids: list[int], max_new_tokens: int, seed: int | None = None, **sampling) -> tuple[str, int]:
    """(text, new tokens) of the local model's generate() from `ids`: greedy, or sampled after manual_seed(seed)."""
    model, tokenizer = local
    if seed is not None:
        torch.manual_seed(seed)
    options = dict(do_sample=True, top_k=0, **sampling) if seed is not None else dict(do_sample=False)
    prompt = torch.tensor([ids])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: more threads only spin against the peers on a loaded machine
    try:
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, pad_token_id=0, **options
        )
    finally:
        torch.set_num_threads(threads)
    new = out[0, len(ids) :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def _chat_ids(local, messages) -> list[int]:
    tokenizer = local[1]
    return tokenizer(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )["input_ids"]


def _prompt_ids(local, prompt: str) -> list[int]:
    return local[1](prompt)["input_ids"]


# --- exact generation ---


def test_greedy_completion_equals_the_local_model(api, local):
    prompt = "The swarm says: "
    expected, new = _reference(local, _prompt_ids(local, prompt), 24)
    assert len(set(expected)) >= 8, expected  # an informative reference (tests/helpers/models.py)
    done = api.completions.create(model=PREFIX, prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == expected
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), new)
    assert done.choices[0].finish_reason == ("length" if new == 24 else "stop")
    streamed = api.completions.create(model=PREFIX, prompt=prompt, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected


def test_greedy_chat_equals_the_local_model_streamed_and_whole(api, local):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    expected, new = _reference(local, _chat_ids(local, messages), 20)
    whole = api.chat.completions.create(model=PREFIX, messages=messages, max_completion_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(_chat_ids(local, messages)) and whole.usage.completion_tokens == new
    chunks = list(
        api.chat.completions.create(
            model=PREFIX,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == new


def test_seeded_sampling_is_reproducible_and_equals_the_local_model(api, local):
    prompt, options = "Once upon a time", dict(temperature=0.8, top_p=0.9)
    expected, _ = _reference(local, _prompt_ids(local, prompt), 20, seed=1234, **options)
    first, second, other = (
        api.completions.create(model=PREFIX, prompt=prompt, max_tokens=20, seed=seed, **options).choices[0].text
        for seed in (1234, 1234, 99)
    )
    assert first == second == expected
    assert other != expected  # the seed matters: sampling really happened


def test_a_stop_string_ends_the_text_before_it(api, local):
    prompt = "The swarm says: "
    expected, _ = _reference(local, _prompt_ids(local, prompt), 24)
    stop = expected[8:10]
    done = api.completions.create(model=PREFIX, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert done.choices[0].text == expected[: expected.index(stop)]
    assert done.choices[0].finish_reason == "stop"


def test_eight_concurrent_streams_are_each_exact(api, local):
    prompts = [f"Request number {i}: " for i in range(8)]
    expected = [_reference(local, _prompt_ids(local, p), 12)[0] for p in prompts]
    got: dict[int, str] = {}
    errors = []

    def ask(i):
        try:
            stream = api.completions.create(model=PREFIX, prompt=prompts[i], max_tokens=12, temperature=0, stream=True)
            got[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        except Exception as exc:  # reported below with the others
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert [got.get(i) for i in range(8)] == expected


# --- errors ---


def test_errors_in_openai_shape(api, served, local):
    url = served[1]
    with pytest.raises(openai.NotFoundError, match=PREFIX):
        api.completions.create(model="gpt-4o", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256") as caught:
        api.completions.create(model=PREFIX, prompt="x" * 300)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    missing = httpx2.post(f"{url}/v1/completions", json={"model": PREFIX, "prompt": "a"}, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    bad = httpx2.post(
        f"{url}/v1/chat/completions",
        content=b'{"model": "tiny-api", "messages": [',
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json", bad.text
    assert [m.id for m in api.models.list().data] == [PREFIX]


# --- the swarm's side: sessions freed, peers lost ---


def _peer_states(swarm: Swarm, prefix: str) -> list[tuple[int, int]]:
    """(open sessions, cache tokens left) of each peer serving `prefix`, asked directly (Info)."""
    endpoints = [info.endpoint for info in swarm.snapshot(prefix).online().values()]

    async def ask():
        pool = ChannelPool(1 << 26)
        try:
            answers = [await pool.unary(endpoint, "info", pb.InfoRequest(), 10.0) for endpoint in endpoints]
            return [(a.open_sessions, a.cache_tokens_left) for a in answers]
        finally:
            await pool.close()

    return asyncio.run(ask())


def _metric(url: str, name: str) -> float:
    for line in httpx2.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_disconnects_frees_its_session_on_every_peer(served):
    swarm, url = served[0], served[1]
    assert _peer_states(swarm, PREFIX) == [(0, CACHE_TOKENS)] * 2
    with httpx2.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": PREFIX, "prompt": "Tell me everything: ", "max_tokens": 200, "stream": True, "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events), next(events)
        states = _peer_states(swarm, PREFIX)
        assert all(sessions == 1 and left < CACHE_TOKENS for sessions, left in states), states
    # the stream is closed mid-generation: its session ends on both peers and their cache is whole again
    swarm.wait_for(lambda: _peer_states(swarm, PREFIX) == [(0, CACHE_TOKENS)] * 2, 30, "the peers to free the cache")
    assert _metric(url, "swarmlm_api_cancelled_generations_total") == 1
    assert _metric(url, "swarmlm_api_active_sessions") == 0


def test_metrics_count_requests_tokens_and_latency(served):
    text = httpx2.get(f"{served[1]}/metrics").text
    for line in (
        'swarmlm_api_requests_total{endpoint="/v1/completions",status="200"}',
        'swarmlm_api_requests_total{endpoint="/v1/completions",status="404"}',
        'swarmlm_api_requests_total{endpoint="/v1/completions",status="499"}',
        "swarmlm_api_time_to_first_token_seconds_count",
        "swarmlm_api_time_per_output_token_seconds_count",
        "swarmlm_api_prompt_tokens_total",
        "swarmlm_api_completion_tokens_total",
        "swarmlm_api_failovers_total",
        "swarmlm_api_active_sessions",
        "swarmlm_api_queued_requests",
    ):
        assert line in text, line
    assert _metric(served[1], "swarmlm_api_completion_tokens_total") > 100


def test_losing_the_only_peer_of_some_blocks_mid_stream_is_an_error_event_then_503(served, api):
    swarm, url, peers = served[0], served[1], served[4]
    assert httpx2.get(f"{url}/health").status_code == 200
    with httpx2.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": PREFIX, "prompt": "Go on: ", "max_tokens": 200, "stream": True, "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[len("data: ") :])
        assert first["choices"][0]["finish_reason"] is None
        swarm.kill(peers["2:4"], signal.SIGKILL)
        rest = [line[len("data: ") :] for line in lines]
    assert rest[-1] == "[DONE]"
    errors = [json.loads(data)["error"] for data in rest[:-1] if "error" in json.loads(data)]
    assert len(errors) == 1 and rest[-2].startswith('{"error"'), rest[-3:]
    assert errors[0]["code"] == "no_peers" and "2:4" in errors[0]["message"], errors

    health = httpx2.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["uncovered_blocks"] == ["2:4"], health.text
    with pytest.raises(openai.InternalServerError, match="2:4") as caught:
        api.completions.create(model=PREFIX, prompt="anyone?", max_tokens=4)
    assert caught.value.status_code == 503 and caught.value.code == "no_peers"
    assert _metric(url, "swarmlm_api_failovers_total") >= 1


def test_sigterm_stops_the_server_and_everything_it_started(served):
    swarm, api_process = served[0], served[2]
    assert swarm.terminate(api_process, timeout_s=30) in (0, 130), api_process.logs()
    assert "Traceback" not in api_process.stderr(), api_process.logs()
