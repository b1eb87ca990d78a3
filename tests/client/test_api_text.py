"""Incremental detokenizing and stop strings (client/api/text.py), and a generation's stop rules, on plain data."""

from __future__ import annotations

import threading

import pytest

from client.api.generation import GenerationParams, run_generation
from client.api.schemas import Sampling
from client.api.text import Detokenizer, StopMatcher


def _utf8_decode(ids: list[int]) -> str:
    """A byte-level "tokenizer": each id is one byte of UTF-8, as byte-fallback tokenizers decode them."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_are_never_split():
    text = "añ€😀b"
    detokenizer = Detokenizer(_utf8_decode)
    pieces = [detokenizer.add(byte) for byte in text.encode()]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces), pieces
    assert [p for p in pieces if p] == ["a", "ñ", "€", "😀", "b"]


def test_an_incomplete_character_at_the_end_is_flushed():
    detokenizer = Detokenizer(_utf8_decode)
    assert detokenizer.add(ord("x")) == "x"
    assert detokenizer.add(0xE2) == ""
    assert detokenizer.flush() == "\ufffd"


def _feed(stops, pieces):
    matcher, out = StopMatcher(stops), []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    "stops, pieces, expected",
    [
        (["END"], ["ab", "cE", "N", "Dx"], ("abc", True)),  # split over three pieces
        (["END"], ["abEN", "x"], ("abENx", False)),  # a false start is emitted once it cannot match
        (["\n\n", "b"], ["a", "\n", "\nb"], ("a", True)),  # the earliest occurrence wins
        (["xx", "x"], ["ax"], ("a", True)),
        (["stop"], ["no stop here"], ("no ", True)),
        (["zz"], ["ab", "cz"], ("abcz", False)),  # held back until the end, then flushed
    ],
)
def test_stop_strings(stops, pieces, expected):
    assert _feed(stops, pieces) == expected


def test_held_text_is_never_emitted_early():
    matcher = StopMatcher(["<|end|>"])
    assert matcher.feed("hello <|") == ("hello ", False)
    assert matcher.feed("en") == ("", False)
    assert matcher.feed("d|> more") == ("", True)


class ScriptedBackend:
    """Yields the ids of `script`; records how many steps ran and whether the iterator was closed."""

    eos_token_ids = frozenset({0})

    def __init__(self, script: list[int]):
        self.script, self.steps, self.closed = script, 0, False

    def decode(self, ids):
        return "".join(map(chr, ids))

    def tokens(self, prompt_ids, max_new_tokens, sampling):
        try:
            for token in self.script:
                self.steps += 1
                yield token
        finally:
            self.closed = True


def _run(script, max_tokens=10, stop=(), cancel=None, ignore_eos=False):
    backend, out = ScriptedBackend(script), []
    finish = run_generation(
        backend,
        GenerationParams((1,), max_tokens, Sampling(), tuple(stop), ignore_eos),
        cancel or threading.Event(),
        out.append,
    )
    assert backend.closed or backend.steps == 0  # an iterator never started opened nothing
    return "".join(out), finish, backend


def test_generation_stops_at_eos_at_max_tokens_and_at_a_stop_string():
    text, finish, _ = _run([ord(c) for c in "hi"] + [0, ord("x")])
    assert (text, finish.reason, finish.completion_tokens) == ("hi", "stop", 3)
    text, finish, _ = _run([ord(c) for c in "hi"] + [0, ord("x")], ignore_eos=True, max_tokens=4)
    assert (text, finish.reason, finish.completion_tokens) == ("hi\x00x", "length", 4)
    text, finish, backend = _run([ord(c) for c in "abcdef"], max_tokens=4)
    assert (text, finish.reason, finish.completion_tokens, backend.steps) == ("abcd", "length", 4, 4)
    text, finish, backend = _run([ord(c) for c in "abcSTOPdef"], stop=["STOP"])
    assert (text, finish.reason, finish.completion_tokens, backend.steps) == ("abc", "stop", 7, 7)


def test_a_cancelled_generation_takes_no_further_step():
    cancel = threading.Event()
    cancel.set()
    text, finish, backend = _run([ord("a")] * 5, cancel=cancel)
    assert (text, finish.reason, backend.steps) == ("", "cancelled", 0)
