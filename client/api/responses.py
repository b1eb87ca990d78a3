"""OpenAI's response shapes for completions and chat completions, whole or as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Shape:
    """The objects of one response: `chat` (chat.completion) or not (text_completion)."""

    chat: bool
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None = None, *, finish_reason: str | None = None, first: bool = False) -> dict:
        """A streamed piece: new text, or (with finish_reason) the last piece of the choice."""
        if self.chat:
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
