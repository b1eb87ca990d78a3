"""The API: time to first token and decode tokens/s through `swarmlm api` vs the Python client, same swarm.

The API app (client/api) is served by uvicorn in this process, on 127.0.0.1, over the split's own client, and
asked for streamed greedy completions of the same prompt ids with `ignore_eos`, read as server-sent events with
the standard library's HTTP client (no SDK overhead counted). The reference is the same client's `generate()`
with a streamer, EOS off, so both produce the same tokens. Time to first token is from sending the request (or
calling generate) to the first new token's text; tokens/s is over the tokens after the first. Runs alternate
after one warm-up of each. A model without a tokenizer (the random configs) gets one naming each id, `<id>`.
"""

from __future__ import annotations

import copy
import http.client
import json
import tempfile
import time
from urllib.parse import urlparse

from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.generation.streamers import BaseStreamer

from bench.harness import ModelRun, Split
from bench.scenarios.decode import prompt_ids
from bench.stats import Row, Summary, Target
from client.api.app import create_app
from client.api.config import ApiConfig
from client.api.engine import SwarmBackend
from client.api.server import serving_in_background

TTFT_TARGET = Target("ratio", "<=", 1 / 0.9, "<= 1.11x the client (>= 0.9x its speed)")
RATE_TARGET = Target("ratio", ">=", 0.9, ">= 0.9x the client")


def tokenizer_for(path, vocab_size: int, eos_token_id: int | None):
    """The checkpoint's tokenizer, or one that writes each id as `<id>` (every token then has text)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        from tokenizers import Tokenizer, decoders, models

        tokenizer = Tokenizer(models.WordLevel(vocab={f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
        tokenizer.decoder = decoders.Fuse()
        eos = f"<{eos_token_id}>" if eos_token_id is not None else None
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<0>", eos_token=eos)
        with tempfile.TemporaryDirectory() as folder:  # saved and loaded back, as a checkpoint's would be
            fast.save_pretrained(folder)
            return AutoTokenizer.from_pretrained(folder)


class _Clock(BaseStreamer):
    """Times the tokens `generate()` streams (its first call is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def client_run(client, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
    """(time to first token s, tokens/s after the first, new tokens) of the client's own generate()."""
    import torch

    config = copy.deepcopy(client.generation_config)
    config.eos_token_id = None  # as ignore_eos: the same number of tokens as the API run
    config.max_new_tokens, config.do_sample, config.pad_token_id = steps, False, 0
    clock = _Clock()
    ids = torch.tensor([prompt])
    began = time.perf_counter()
    out = client.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock)
    new = out[0, len(prompt) :].tolist()
    return clock.times[0] - began, (len(new) - 1) / (clock.times[-1] - clock.times[0]), new


def api_run(url: str, model_id: str, prompt: list[int], steps: int) -> tuple[float, float, str]:
    """(time to first token s, tokens/s after the first, text) of one streamed greedy completion."""
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
    body = json.dumps(
        {
            "model": model_id,
            "prompt": prompt,
            "max_tokens": steps,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    )
    try:
        began = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the API answered {response.status}: {response.read()[:500]!r}")
        times, pieces, tokens = [], [], None
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the API stream failed: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                if choice["text"]:
                    times.append(time.perf_counter())
                    pieces.append(choice["text"])
    finally:
        connection.close()
    if tokens != steps or not times:
        raise RuntimeError(f"the API generated {tokens} tokens, {len(times)} with text; asked for {steps}")
    return times[0] - began, (tokens - 1) / (times[-1] - times[0]), "".join(pieces)


def run(model_run: ModelRun, split: Split) -> list[Row]:
    plan, model, client = model_run.plan, model_run.model, split.client
    tokenizer = tokenizer_for(model.path, model.config.vocab_size, model.config.eos_token_id)
    prompt = prompt_ids(model.config.vocab_size, plan.decode_prompt)[0].tolist()
    steps = max(plan.decode_steps, 2)
    app = create_app(SwarmBackend(client, tokenizer, split.prefix), ApiConfig(model_id=split.prefix))
    samples = {"api": ([], []), "client": ([], [])}
    same_text = []
    with serving_in_background(app) as url:
        client_run(client, prompt, min(8, steps))  # warm-up of both paths
        api_run(url, split.prefix, prompt, min(8, steps))
        for _ in range(plan.repeats):
            ttft, rate, new = client_run(client, prompt, steps)
            samples["client"][0].append(ttft)
            samples["client"][1].append(rate)
            ttft, rate, text = api_run(url, split.prefix, prompt, steps)
            samples["api"][0].append(ttft)
            samples["api"][1].append(rate)
            same_text.append(
                text == tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            )
    target = model.name == "default"
    common = dict(
        scenario="api",
        config=model.name,
        variant=f"{split.count} peers, streamed",
        reference_name="Python client generate()",
    )
    extra = {
        "steps_per_run": steps,
        "prompt_tokens": plan.decode_prompt,
        "runs": plan.repeats,
        "same_text_as_client": all(same_text),
    }
    return [
        Row(
            metric="time to first token",
            unit="ms",
            ours=Summary.of(samples["api"][0]).scaled(1e3),
            reference=Summary.of(samples["client"][0]).scaled(1e3),
            target=TTFT_TARGET if target else None,
            extra=extra,
            **common,
        ),
        Row(
            metric="decode",
            unit="tokens/s",
            ours=Summary.of(samples["api"][1]),
            reference=Summary.of(samples["client"][1]),
            target=RATE_TARGET if target else None,
            extra=extra,
            **common,
        ),
    ]
