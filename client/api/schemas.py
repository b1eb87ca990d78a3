"""Request bodies of /v1/completions and /v1/chat/completions: strict validation, and what we refuse to fake.

Types are strict (a string where a number belongs is an error, not a conversion). Fields we do not implement
(`n` > 1, tools, logprobs, penalties, ...) are refused with a 400 that names them rather than silently ignored;
unknown fields are ignored, as OpenAI's own server ignores what it does not know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from client.api.errors import ApiError, bad_request

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 2048
MAX_SEED = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-MAX_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False
    """vLLM's extension: generate max_tokens tokens whatever they are (benchmarks use it)."""
    # accepted at their no-op values only (checked in `unsupported`)
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    top_logprobs: Any = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        for stop in stops:
            if not stop or len(stop) > MAX_STOP_CHARS:
                raise bad_request(
                    f"stop: each stop string must have 1 to {MAX_STOP_CHARS} characters, got {stop!r:.80}", "stop"
                )
        return tuple(stops)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for fields set to something this server does not do."""
        found = []
        if self.n not in (None, 1):
            found.append(("n", f"n={self.n}: one choice per request only; send several requests"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                found.append((name, f"{name} is not supported; leave it at 0"))
        if self.logit_bias:
            found.append(("logit_bias", "logit_bias is not supported"))
        if self.logprobs not in (None, False, 0):
            found.append(("logprobs", "logprobs are not supported"))
        if self.top_logprobs not in (None, 0):
            found.append(("top_logprobs", "top_logprobs are not supported"))
        if self.stream_options is not None and not self.stream:
            found.append(("stream_options", "stream_options is only allowed with stream=true"))
        return found


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        if self.echo:
            found.append(("echo", "echo is not supported"))
        if self.suffix:
            found.append(("suffix", "suffix (insertion) is not supported"))
        if self.best_of not in (None, 1):
            found.append(("best_of", f"best_of={self.best_of}: one candidate per request only"))
        if (
            isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], (str, list))
            and len(self.prompt) != 1
        ):
            found.append(
                ("prompt", f"one prompt per request, got a batch of {len(self.prompt)}; send several requests")
            )
        return found

    def prompt_value(self) -> str | list[int]:
        """The one prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        found = super().unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                found.append((name, f"{name} (function calling) are not supported"))
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                found.append((name, f"{name} is not supported (no tools)"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            found.append(
                ("response_format", f"response_format {self.response_format.get('type')!r} is not supported; only text")
            )
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            found.append(("max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one"))
        return found

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as a chat template takes them ("developer" is the newer name of "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


@dataclass(frozen=True)
class Sampling:
    """How to pick each token: greedy when temperature is 0, else sampled after temperature and top-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_body(raw: bytes, model_cls: type[_Common]) -> _Common:
    """The request body as `model_cls`, or an ApiError (400) naming what is wrong."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body nests too deeply to be read", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        request = model_cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None
    for param, why in request.unsupported():
        raise ApiError(400, why, param=param, code="unsupported_parameter")
    request.stop_strings()
    return request


_UNION_FIELDS = {  # fields of several accepted shapes: pydantic would report the first shape's complaint
    "stop": "must be a string or a list of strings",
    "prompt": "must be a string, a list of token ids, or a list of one of those",
    "content": 'must be a string or a list of {"type": "text", "text": ...} parts',
}


def _validation_error(exc: pydantic.ValidationError) -> ApiError:
    first = exc.errors()[0]
    # pydantic names the union member it tried ("str", "list[int]"): keep only the field path
    loc = [
        str(part)
        for part in first["loc"]
        if not (isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")))
    ]
    param = ".".join(loc) or None
    union = next((name for name in _UNION_FIELDS if loc and loc[-1] == name), None)
    if union is None and len(loc) > 1 and loc[-2] in _UNION_FIELDS and loc[-1].isdigit():
        union = loc[-2]  # an item of a list shape: say what the whole field may be
        param = ".".join(loc[:-1])
    given = first.get("input")
    shown = "" if first["type"] == "missing" else f" (got {json.dumps(given, default=str)[:80]})"
    if union is not None and first["type"] != "missing":
        return bad_request(f"{param}: {_UNION_FIELDS[union]}{shown}", param, code="invalid_type")
    more = f"; and {exc.error_count() - 1} more problem(s)" if exc.error_count() > 1 else ""
    return bad_request(
        f"{param or 'body'}: {first['msg']}{shown}{more}",
        param,
        code="missing_field" if first["type"] == "missing" else "invalid_type",
    )
