"""Requests cut to fit the peers' caps on one request (`swarmlm peer --max-request-tokens`, `--max-attention-cost`,
announced in their records): a forward or backward by rows, a step of an inference session by tokens. Rows are
computed independently and a session's tokens build on its cache, so the pieces compute exactly what the whole
would have.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.errors import MessageTooLargeError
from protocol.records import DEFAULT_MAX_ATTENTION_COST, DEFAULT_MAX_REQUEST_TOKENS, ServerInfo

MIN_CAP_TOKENS = 16
"""Caps below this are not honoured (a peer that announces them refuses what a client then sends, and is treated as
failing): a peer announcing tiny caps could otherwise make every client routed through it send one token a call."""
MIN_CAP_COST = MIN_CAP_TOKENS * MIN_CAP_TOKENS


def route_caps(records: Iterable[ServerInfo | None]) -> tuple[int, int]:
    """(tokens, attention cost) that every peer of a route takes in one request (a peer of no record: the defaults),
    never below MIN_CAP_TOKENS and MIN_CAP_COST."""
    tokens, cost = DEFAULT_MAX_REQUEST_TOKENS, DEFAULT_MAX_ATTENTION_COST
    for info in records:
        if info is not None:
            tokens = min(tokens, max(info.max_request_tokens, MIN_CAP_TOKENS))
            cost = min(cost, max(info.max_attention_cost, MIN_CAP_COST))
    return tokens, cost


def row_chunks(batch: int, length: int, caps: tuple[int, int]) -> list[tuple[int, int]]:
    """Rows [begin, end) of a forward of `batch` x `length` tokens, each piece within `caps`.

    Raises:
        MessageTooLargeError: one row alone exceeds them (a forward cannot be cut along its tokens).
    """
    tokens, cost = caps
    rows = min(tokens // length, cost // (length * length))
    if rows < 1:
        raise MessageTooLargeError(
            f"one sequence of {length} tokens exceeds the peers' caps on a request ({tokens} tokens, {cost} token "
            f"pairs of attention; swarmlm peer --max-request-tokens, --max-attention-cost): send shorter sequences, "
            f"or generate, whose sessions cut a prompt into steps"
        )
    return [(begin, min(batch, begin + rows)) for begin in range(0, batch, rows)]


def step_chunks(batch: int, new: int, prefix: int, caps: tuple[int, int]) -> list[tuple[int, int]]:
    """New tokens [begin, end) of an inference step of `batch` x `new` on `prefix` cached ones, each piece within
    `caps` (a later piece attends to more tokens, so it may be shorter).

    Raises:
        MessageTooLargeError: not even one token fits.
    """
    tokens, cost = caps
    pieces, begin = [], 0
    while begin < new:
        size = min(new - begin, tokens // batch)
        while size > 0 and batch * size * (prefix + begin + size) > cost:
            size -= 1 if size < 64 else size // 8
        if size < 1:
            raise MessageTooLargeError(
                f"a step of batch {batch} on {prefix + begin} cached tokens exceeds the peers' caps on a request "
                f"({tokens} tokens, {cost} token pairs of attention; swarmlm peer --max-request-tokens, "
                f"--max-attention-cost): use a smaller batch or a shorter context"
            )
        pieces.append((begin, begin + size))
        begin += size
    return pieces
