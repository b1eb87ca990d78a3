"""The HTTP layer of `swarmlm api` against a scripted backend: shapes, streaming, errors, admission, disconnects.

The app is served by uvicorn on 127.0.0.1 and driven with the official `openai` package and raw HTTP (httpx2,
the HTTP client that package is built on). The swarm itself is in tests/integration/test_api.py.
"""

from __future__ import annotations

import json
import threading
import time

import httpx2
import openai
import pytest

from client.api.app import create_app
from client.api.config import ApiConfig
from client.api.errors import bad_request
from client.api.server import serving_in_background as serving
from protocol.errors import NoPeersError, OutputRewoundError, PeerUnavailableError

KEY = "sekret"
REPLY = "Hello, wörld! "  # the scripted backend repeats it, one character per token


class ScriptedBackend:
    """Characters as tokens (id = code point, 0 = EOS); replies REPLY over and over, one token per `step_s`."""

    model_id, context_length, eos_token_ids = "scripted", 64, frozenset({0})

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.step_s = 0.0
        self.fail_after: tuple[int, Exception] | None = None
        self.failures_left: int | None = None  # generations that fail as fail_after says (None: every one)
        self.settle_error: Exception | None = None  # what settle() raises, once
        self.generations = 0
        self.open_sessions = 0
        self.uncovered: list[int] = []
        self.lock = threading.Lock()

    def encode_prompt(self, prompt):
        ids = [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request("prompt: the prompt is empty", "prompt")
        return ids

    def encode_chat(self, messages):
        return self.encode_prompt("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, ids):
        return "".join(map(chr, ids))

    def tokens(self, prompt_ids, max_new_tokens, sampling):
        with self.lock:
            self.open_sessions += 1
            self.generations += 1
        return _Tokens(self._tokens(), self)

    def _tokens(self):
        try:
            i = 0
            while True:
                self.gate.wait()
                if self.fail_after and i == self.fail_after[0] and self.failures_left != 0:
                    self.failures_left = None if self.failures_left is None else self.failures_left - 1
                    raise self.fail_after[1]
                time.sleep(self.step_s)
                yield ord(REPLY[i % len(REPLY)])
                i += 1
        finally:
            with self.lock:
                self.open_sessions -= 1

    def uncovered_blocks(self):
        return self.uncovered

    def failovers(self):
        return 3


class _Tokens:
    """The scripted tokens, with the `settle()` of client/decoding.py's Decoding (the route's last check)."""

    def __init__(self, tokens, backend):
        self.tokens, self.backend = tokens, backend

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.tokens)

    def settle(self):
        error, self.backend.settle_error = self.backend.settle_error, None
        if error is not None:
            raise error

    def close(self):
        self.tokens.close()


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend()
    app = create_app(
        backend,
        ApiConfig(
            model_id="scripted",
            aliases=("/models/scripted",),
            api_key=KEY,
            max_concurrency=1,
            max_queued=1,
            max_body_bytes=64 * 1024,
        ),
    )
    with serving(app) as url:
        yield backend, url, app


@pytest.fixture
def backend(served):
    backend = served[0]
    yield backend
    backend.gate.set()
    backend.step_s, backend.fail_after, backend.uncovered = 0.0, None, []
    backend.failures_left, backend.settle_error = None, None
    _wait(lambda: backend.open_sessions == 0, "every generation to end")


@pytest.fixture
def url(served):
    return served[1]


@pytest.fixture
def api(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)


def _wait(condition, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _post(url, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(
        f"{url}{path}", content=data, headers={**headers, "Content-Type": "application/json"}, timeout=30, **kwargs
    )


def _events(response) -> list:
    """The `data:` payloads of an SSE response, parsed (the final "[DONE]" kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _streamed(url, max_tokens: int) -> list:
    """The events of a streamed completion of "a", whose answer began with status 200."""
    with httpx2.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": "scripted", "prompt": "a", "max_tokens": max_tokens, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        return _events(response)


def _assert_error(response, status, code=None, param=None, words=()):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


# --- answers ---


def test_models_and_completions(backend, api):
    assert [m.id for m in api.models.list().data] == ["scripted"]
    assert api.models.retrieve("scripted").id == "scripted"
    done = api.completions.create(model="scripted", prompt="hey", max_tokens=5)
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("Hello", "length")
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (3, 5, 8)
    stopped = api.completions.create(model="/models/scripted", prompt=[104, 105], max_tokens=20, stop=["ld"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("Hello, wör", "stop")
    assert stopped.usage.completion_tokens == 12  # the stop string's tokens were generated, not emitted


def test_chat_streamed_and_whole(backend, api):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = api.chat.completions.create(model="scripted", messages=messages, max_completion_tokens=8)
    assert whole.choices[0].message.content == REPLY[:8] and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len("<system>be brief<user>hi<assistant>")
    chunks = list(
        api.chat.completions.create(
            model="scripted", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY[:8]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_a_stream_ends_with_done(backend, url):
    with httpx2.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": "scripted", "prompt": "a", "max_tokens": 3, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hel"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


# --- errors ---


def test_api_key(backend, url):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    _assert_error(httpx2.get(f"{url}/v1/models"), 401, "invalid_api_key", words=["Authorization: Bearer"])
    _assert_error(
        _post(url, "/v1/completions", {"model": "scripted", "prompt": "a"}, key="nope"), 401, "invalid_api_key"
    )
    assert httpx2.get(f"{url}/health").status_code == 200  # probes need no key


def test_unknown_model_and_routes(backend, api, url):
    with pytest.raises(openai.NotFoundError, match="scripted"):
        api.completions.create(model="gpt-5", prompt="a")
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-5")
    _assert_error(httpx2.get(f"{url}/v2/anything"), 404, "not_found")
    _assert_error(httpx2.get(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}), 405)


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        (b"{not json", 400, None, "invalid_json"),
        (b"[1, 2]", 400, None, "invalid_json"),
        (b"\xff\xfe", 400, None, "invalid_json"),
        (b"[" * 50_000, 400, None, "invalid_json"),
        (b'{"model": "scripted", "prompt": "a", "temperature": NaN}', 400, "temperature", "invalid_type"),
        ({"prompt": "a"}, 400, "model", "missing_field"),
        ({"model": "scripted"}, 400, "prompt", "missing_field"),
        ({"model": "scripted", "prompt": "a", "max_tokens": -1}, 400, "max_tokens", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "max_tokens": 0}, 400, "max_tokens", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "temperature": 3}, 400, "temperature", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "top_p": 0}, 400, "top_p", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "stop": 5}, 400, "stop", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "stop": [""]}, 400, "stop", "invalid_value"),
        ({"model": "scripted", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({"model": "scripted", "prompt": "a", "stream": "yes"}, 400, "stream", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "seed": 1.5}, 400, "seed", "invalid_type"),
        ({"model": "scripted", "prompt": "a", "n": 2}, 400, "n", "unsupported_parameter"),
        ({"model": "scripted", "prompt": "a", "logprobs": 2}, 400, "logprobs", "unsupported_parameter"),
        ({"model": "scripted", "prompt": "a", "echo": True}, 400, "echo", "unsupported_parameter"),
        ({"model": "scripted", "prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
        (
            {"model": "scripted", "prompt": "a", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
            "unsupported_parameter",
        ),
        ({"model": "scripted", "prompt": "", "max_tokens": 2}, 400, "prompt", "invalid_value"),
        ({"model": "scripted", "prompt": "x" * 64}, 400, "prompt", "context_length_exceeded"),
        ({"model": "scripted", "prompt": "x" * 60, "max_tokens": 5}, 400, "max_tokens", "context_length_exceeded"),
    ],
)
def test_bad_completion_requests(backend, url, api, body, status, param, code):
    _assert_error(_post(url, "/v1/completions", body), status, code, param)
    assert api.completions.create(model="scripted", prompt="ok", max_tokens=2).choices[0].text == "He"


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"model": "scripted", "messages": []}, "messages", "invalid_type"),
        ({"model": "scripted", "messages": "hi"}, "messages", "invalid_type"),
        ({"model": "scripted", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "invalid_type"),
        ({"model": "scripted", "messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_type"),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": "hi"}] * 100},
            "messages",
            "context_length_exceeded",
        ),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            "tools",
            "unsupported_parameter",
        ),
        ({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": 3}, "n", "unsupported_parameter"),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
            "logprobs",
            "unsupported_parameter",
        ),
        (
            {
                "model": "scripted",
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "unsupported_parameter",
        ),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
            "max_completion_tokens",
            "invalid_type",
        ),
    ],
)
def test_bad_chat_requests(backend, url, body, param, code):
    _assert_error(_post(url, "/v1/chat/completions", body), 400, code, param)


def test_openai_client_errors_are_typed(backend, api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], n=2)
    assert caught.value.body["param"] == "n" and "one choice" in caught.value.message
    with pytest.raises(openai.BadRequestError, match="context length"):
        api.completions.create(model="scripted", prompt="x" * 100)


def test_a_huge_body_is_refused_and_the_server_goes_on(backend, url, api):
    huge = json.dumps({"model": "scripted", "prompt": "x" * (256 * 1024)}).encode()
    _assert_error(_post(url, "/v1/completions", huge), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit holds while reading
        yield huge

    chunked = httpx2.post(
        f"{url}/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    _assert_error(chunked, 413, "request_too_large")
    assert api.completions.create(model="scripted", prompt="ok", max_tokens=1).choices[0].text == "H"


def test_errors_before_the_first_token_are_http_errors_and_after_it_an_event(backend, url, api):
    backend.fail_after = (
        0,
        NoPeersError("no peer serves blocks 2:4 of scripted; start one with `swarmlm peer MODEL --blocks 2:4`"),
    )
    response = _post(url, "/v1/completions", {"model": "scripted", "prompt": "a", "stream": True})
    _assert_error(response, 503, "no_peers", words=["2:4"])
    with pytest.raises(openai.InternalServerError, match="2:4"):
        api.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])

    backend.fail_after = (3, PeerUnavailableError("peer X vanished"))
    events = _streamed(url, max_tokens=9)
    assert "".join(e["choices"][0]["text"] for e in events[:3]) == "Hel"
    assert events[3]["error"]["code"] == "peer_unavailable" and "vanished" in events[3]["error"]["message"]
    assert events[4:] == ["[DONE]"]
    with pytest.raises(openai.APIError, match="vanished"):
        for _ in api.completions.create(model="scripted", prompt="a", max_tokens=9, stream=True):
            pass


def _rewound() -> OutputRewoundError:
    return OutputRewoundError("peer X was caught computing wrong results; it is banned", position=3)


def test_a_whole_answer_a_check_rewound_is_generated_again_and_a_streamed_one_ends_in_an_error(backend, url, api):
    # a liar caught (and banned) mid-generation: the whole answer is generated again, and the client sees only that
    backend.fail_after, backend.failures_left = (2, _rewound()), 1
    started = backend.generations
    assert api.completions.create(model="scripted", prompt="a", max_tokens=9).choices[0].text == REPLY[:9]
    assert (backend.generations - started, backend.failures_left) == (2, 0)
    # caught by the route's last check, after the last token: the same
    backend.settle_error, started = _rewound(), backend.generations
    assert api.completions.create(model="scripted", prompt="a", max_tokens=4).choices[0].text == REPLY[:4]
    assert (backend.generations - started, backend.settle_error) == (2, None)
    # liar after liar: after three tries the client is told to send the request again
    backend.fail_after, backend.failures_left, started = (2, _rewound()), None, backend.generations
    response = _post(url, "/v1/completions", {"model": "scripted", "prompt": "a", "max_tokens": 9})
    _assert_error(response, 503, "output_rewound", words=["wrong results", "send the request again"])
    assert backend.generations - started == 3

    # streamed: caught before any text went out, generated again; after, the text sent may be wrong: an error event
    backend.fail_after, backend.failures_left = (0, _rewound()), 1
    chunks = api.completions.create(model="scripted", prompt="a", max_tokens=5, stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks) == REPLY[:5]
    backend.settle_error = _rewound()
    events = _streamed(url, max_tokens=3)
    assert "".join(e["choices"][0]["text"] for e in events[:3]) == "Hel"
    assert events[3]["error"]["code"] == "output_rewound" and "send the request again" in events[3]["error"]["message"]
    assert events[4:] == ["[DONE]"]


# --- admission, disconnects, health, metrics ---


def _metric(url, name: str, labels: str = "") -> float:
    for line in httpx2.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_beyond_the_queue_requests_get_429(backend, url, api):
    backend.gate.clear()  # generations wait before their first token
    results = {}

    def ask(name):
        results[name] = api.completions.create(model="scripted", prompt="a", max_tokens=2).choices[0].text

    running = threading.Thread(target=ask, args=("running",))
    running.start()
    _wait(lambda: backend.open_sessions == 1, "the first generation to start")
    queued = threading.Thread(target=ask, args=("queued",))
    queued.start()
    _wait(lambda: _metric(url, "swarmlm_api_queued_requests") == 1, "the second request to queue")
    with pytest.raises(openai.RateLimitError, match="max-concurrency 1"):
        api.completions.create(model="scripted", prompt="a", max_tokens=2)
    backend.gate.set()
    running.join(30)
    queued.join(30)
    assert results == {"running": "He", "queued": "He"}


def test_a_client_that_disconnects_cancels_its_generation(backend, url):
    backend.step_s = 0.01  # endless output unless stopped
    before = _metric(url, "swarmlm_api_cancelled_generations_total")
    with httpx2.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 40},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert backend.open_sessions == 1
    _wait(lambda: backend.open_sessions == 0, "the generation to be cancelled")
    assert _metric(url, "swarmlm_api_cancelled_generations_total") == before + 1
    assert _metric(url, "swarmlm_api_active_sessions") == 0


def test_health(backend, url):
    assert httpx2.get(f"{url}/health").json() == {"status": "ok", "model": "scripted"}
    backend.uncovered = [2, 3, 7]
    response = httpx2.get(f"{url}/health")
    assert response.status_code == 503
    assert response.json()["uncovered_blocks"] == ["2:4", "7:8"] and "--blocks 2:4" in response.json()["message"]


def test_metrics(backend, url, api):
    api.completions.create(model="scripted", prompt="abc", max_tokens=4)
    text = httpx2.get(f"{url}/metrics").text
    for name in (
        "swarmlm_api_requests_total",
        "swarmlm_api_time_to_first_token_seconds_bucket",
        "swarmlm_api_time_per_output_token_seconds_count",
        "swarmlm_api_prompt_tokens_total",
        "swarmlm_api_completion_tokens_total",
        "swarmlm_api_failovers_total 3.0",
        "swarmlm_api_active_sessions",
        'endpoint="/v1/completions",status="200"',
        'endpoint="/v1/completions",status="400"',
    ):
        assert name in text, name


def test_two_apps_in_one_process_keep_their_own_metrics():
    first, second = (create_app(ScriptedBackend(), ApiConfig(model_id=name)) for name in ("a", "b"))
    assert first.state.metrics.registry is not second.state.metrics.registry
