"""One generation, as a worker thread runs it: tokens from a backend, text out, stop rules, cancellation.

The backend yields token ids (`Backend.tokens`); this module turns them into text chunks (client/api/text.py),
stops at EOS, at a stop string or at `max_tokens`, and checks the caller's cancel event between tokens: a
generation whose client went away ends after the current step, and closing the token iterator frees its
inference session on every peer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from client.api.schemas import Sampling
from client.api.text import Detokenizer, StopMatcher


class Backend(Protocol):
    """What the HTTP layer needs of a model (client/api/engine.py serves one through the swarm)."""

    model_id: str
    context_length: int
    eos_token_ids: frozenset[int]

    def encode_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def tokens(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> Iterator[int]:
        """Generated token ids, one per step; closing the iterator ends the generation and frees its resources.
        An iterator with a `settle()` is asked to confirm its tokens once the last one is taken."""
        ...

    def uncovered_blocks(self) -> list[int]:
        """Blocks that no usable peer serves now (empty: the model can be served)."""
        ...

    def failovers(self) -> int:
        """Peer failures the client has routed around since it started."""
        ...


@dataclass(frozen=True)
class GenerationParams:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    """Text goes to the client as it comes; else it is held until the end (a rewound generation then starts again)."""


@dataclass(frozen=True)
class Finish:
    reason: str
    """"stop" (EOS or a stop string), "length" (max_tokens), or "cancelled" (the client went away)."""
    completion_tokens: int


def run_generation(
    backend: Backend,
    params: GenerationParams,
    cancel: threading.Event,
    emit: Callable[[str], None],
    on_token: Callable[[], None] = lambda: None,
) -> Finish:
    """Generate until a stop rule or `cancel`; `emit` gets each new piece of text, `on_token` each token.

    Raises whatever the backend raises (swarm errors; OutputRewoundError when a check of the route caught a liar,
    also once the last token is out), after closing its token iterator.
    """
    detokenizer, stops = Detokenizer(backend.decode), StopMatcher(params.stop)
    tokens = backend.tokens(list(params.prompt_ids), params.max_tokens, params.sampling)
    count, reason, stopped = 0, "length", False
    try:
        while count < params.max_tokens and not stopped:
            if cancel.is_set():
                return Finish("cancelled", count)
            token = next(tokens, None)
            if token is None:
                break
            count += 1
            on_token()
            if token in backend.eos_token_ids and not params.ignore_eos:
                reason = "stop"
                break
            text, stopped = stops.feed(detokenizer.add(token))
            if text:
                emit(text)
        settle = getattr(tokens, "settle", None)
        if settle is not None:  # the route's last check: a liar it caught made this output wrong
            settle()
        if stopped:
            return Finish("stop", count)
        text, stopped = stops.feed(detokenizer.flush())
        rest = text if stopped else text + stops.flush()
        if rest:
            emit(rest)
        return Finish("stop" if stopped else reason, count)
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
