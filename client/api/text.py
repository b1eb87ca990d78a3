"""Text out of tokens, one token at a time: incremental detokenizing and stop strings (pure, no model).

`Detokenizer` decodes the growing sequence and hands out only what is new, holding back a piece that ends in an
incomplete character (U+FFFD while the rest of its bytes are still to come), so that a multi-byte character is
never split across two chunks. `StopMatcher` finds the first occurrence of any stop string in the text so far;
text that could still become the start of one is held back until it is known not to, so that a stop string is
never emitted, not even in part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """`add(token)` returns the text that token completes ("" while a character is still incomplete)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        # text is decoded from `prefix` on, and `read` marks the tokens already handed out: decoding a few tokens
        # of context keeps joins (leading spaces of SentencePiece pieces, byte fallbacks) as in the whole text
        self._prefix = 0
        self._read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left at the end, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_INCOMPLETE) and not final):
            return ""
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        return new


class StopMatcher:
    """`feed(text)` returns (text safe to emit now, whether a stop string was reached); `flush()` the held rest."""

    def __init__(self, stops: Sequence[str]):
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._held = ""  # received, not emitted: it may be the beginning of a stop string
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buffer = self._held + text
        found = [index for index in (buffer.find(stop) for stop in self.stops) if index >= 0]
        if found:
            self.stopped, self._held = True, ""
            return buffer[: min(found)], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that begins some stop string (and is shorter than it)."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
