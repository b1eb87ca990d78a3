"""StreamingBatches: training batches streamed from data files, shuffled in bounded windows, resumable exactly.

The stream: this trainer's documents (documents.py: its data shard of them) in file order, each tokenized
without special tokens and followed by eos, concatenated and cut into seq_len chunks; the last < seq_len tokens
of an epoch are dropped, so every epoch has the same chunks. Chunks are grouped in stream order into windows
of `window_chunks` (WINDOW_TOKENS // seq_len by default); window w of epoch e is handed out in a permutation
drawn from (seed, e, w). A batch that passes the end of a window or of an epoch takes the rest from the next
one: no chunk is skipped, none comes twice in an epoch. A chunk's id is (epoch, document, offset of its first
token among the document's tokens): shards own disjoint documents, so ids never repeat across the trainers
of a run in an epoch.

What it costs: memory for two windows at most (the one handed out, the next one while it is built) and a
batch of pieces being tokenized, whatever the corpus size; the first batch waits for one window to be read
and tokenized. What it does not do: shuffle across windows (a batch mixes chunks of one window of
consecutive text, 4M tokens by default, some 16 MB), or balance the shards (a shard owns every N-th
document, whatever their lengths).

Resuming: the state names the window under way (epoch, index, and where its first chunk is read from: file,
record, piece, the document's tokens before that piece, and tokens of the piece to drop) and how many of its
chunks were handed out. A new loader reads from that piece on, so it tokenizes one window again, not the
corpus; it skips the records before it in that file by reading them, the files before it not at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from client.training.data import encode
from client.training.documents import Kind, Piece, Position, Shard, Source, fingerprint, read_pieces

STATE_VERSION = 2  # 1: TokenBatches' {"epoch", "position"} over an in-memory corpus
WINDOW_TOKENS = 1 << 22  # a shuffle window's tokens by default: 16 MB as int32, a few seconds to tokenize
TOKENIZE_CHARS = 1 << 20  # text tokenized in one call: enough pieces for the Rust tokenizer's threads
TOKENIZE_PIECES = 1024  # and at most this many pieces in one call (records of a few words each)


@dataclass(frozen=True)
class ChunkStart:
    """Where a chunk's first token comes from: reading `position`'s piece again and dropping `skip` tokens."""

    position: Position
    tokens: int
    """The document's tokens before that piece (a chunk's id is its offset in its document)."""
    skip: int
    """Tokens at the start of the piece that belong to earlier chunks."""

    def as_dict(self) -> dict[str, int]:
        p = self.position
        return dict(
            file=p.file, record=p.record, offset=p.offset, document=p.document, tokens=self.tokens, skip=self.skip
        )

    @classmethod
    def from_dict(cls, state: Any) -> ChunkStart:
        names = ("file", "record", "offset", "document", "tokens", "skip")
        if not isinstance(state, dict) or not all(_is_count(state.get(name)) for name in names):
            raise ValueError(f"a data state's 'start' needs ints >= 0 {', '.join(names)}, got {state!r}")
        position = Position(state["file"], state["record"], state["offset"], state["document"])
        return cls(position, state["tokens"], state["skip"])


BEGINNING = ChunkStart(Position(), 0, 0)


@dataclass(frozen=True)
class _Window:
    index: int
    start: ChunkStart
    tokens: np.ndarray  # [n, seq_len] int32, n <= window_chunks
    ids: np.ndarray  # [n, 2] int64: each chunk's (document, offset)
    order: np.ndarray  # the permutation of the n chunks this window is handed out in


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class StreamingBatches:
    """An endless iterator of LongTensor [batch_size, seq_len] batches streamed from data files (module docstring).

    Nothing is read until the first batch, and then one window: the first batch comes after window_chunks *
    seq_len tokens, whatever the corpus size. `state_dict()` after N batches, passed back as `state`, makes a
    new StreamingBatches over the same files, tokenizer, seq_len, seed, shard, text field and window continue
    with batch N+1 (batch_size may differ): it reads again from the piece where the current window began.
    `last_ids` names the rows of the last batch: (epoch, document, offset of the chunk's first token).

    Errors in the data (a record without text, a file that is not UTF-8) are ValueErrors raised by the batch
    that reaches them.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        tokenizer: PreTrainedTokenizerBase,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shard: Shard | None = None,
        text_field: str = "text",
        window_chunks: int | None = None,
        state: dict | None = None,
    ) -> None:
        for name, value, least in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if window_chunks is None:
            window_chunks = max(1, WINDOW_TOKENS // seq_len)
        if isinstance(window_chunks, bool) or not isinstance(window_chunks, int) or window_chunks < 1:
            raise ValueError(f"window_chunks must be an int >= 1, got {window_chunks!r}")
        if not sources:
            raise ValueError("no training files; pass at least one")
        if not text_field:
            raise ValueError("text_field must name the field that holds the text, got ''")
        self.sources, self.shard = list(sources), shard or Shard()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.text_field, self.window_chunks = text_field, window_chunks
        self._tokenizer = tokenizer
        self._eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self._corpus = fingerprint(self.sources, text_field)
        self._check_shard_has_documents()
        self._epoch, self._window_index, self._start, self._position = 0, 0, BEGINNING, 0
        self._window: _Window | None = None  # built on the first batch (or again after load_state_dict)
        self._stream: Iterator[_Window] | None = None  # the windows after it, in this epoch
        self.last_ids: list[tuple[int, int, int]] = []
        if state is not None:
            self.load_state_dict(state)

    def _check_shard_has_documents(self) -> None:
        if all(source.kind is Kind.TEXT for source in self.sources) and len(self.sources) <= self.shard.index:
            # only text files, one document each: the count is known without reading (records are counted by
            # reading, so a shard without records is found at the end of its first epoch)
            raise ValueError(
                f"data shard {self.shard} gets no document: the data is {len(self.sources)} text file(s), one "
                f"document each; split the text into at least {self.shard.count} files, or use fewer shards"
            )

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands, and what it belongs to (JSON-serializable).

        "epoch", "window" (its index in the epoch), "start" (where that window's first chunk is read from) and
        "position" (its chunks handed out), with the corpus fingerprint and the settings a resume must share.
        """
        return {
            "version": STATE_VERSION,
            "corpus": self._corpus,
            "text_field": self.text_field,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shard": str(self.shard),
            "window_chunks": self.window_chunks,
            "epoch": self._epoch,
            "window": self._window_index,
            "start": self._start.as_dict(),
            "position": self._position,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()` of a loader over the same data and settings (batch_size may differ).

        Raises:
            ValueError: a state of another corpus, seq_len, seed, shard, text field or window size, an older
                loader's state, or one that is not a data state.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            older = isinstance(state, dict) and "version" not in state and {"epoch", "position"} <= set(state)
            raise ValueError(
                "this data state was saved by an older swarmlm, which shuffled an in-memory corpus; its position "
                "means nothing to the streaming loader: start the data over (move the saved train_state.json away)"
                if older
                else f"not a data state of version {STATE_VERSION}: {state!r}"
            )
        for name, here, what in (
            ("text_field", self.text_field, "--text-field"),
            ("corpus", self._corpus, "training data: its files' names and sizes"),
            ("seq_len", self.seq_len, "--seq-len"),
            ("seed", self.seed, "--seed"),
            ("shard", str(self.shard), "--data-shard"),
            ("window_chunks", self.window_chunks, "shuffle window"),
        ):
            if state.get(name) != here:
                raise ValueError(
                    f"the data state was saved with {name} {state.get(name)!r}, this run has {here!r} (its "
                    f"{what}); resume with the data, --seq-len, --seed, --data-shard and --text-field it was saved with"
                )
        epoch, window, position = state.get("epoch"), state.get("window"), state.get("position")
        if not all(_is_count(value) for value in (epoch, window, position)):
            raise ValueError(f"a data state needs ints >= 0 'epoch', 'window' and 'position', got {state!r}")
        start = ChunkStart.from_dict(state.get("start"))
        if start.position.file >= len(self.sources) or position > self.window_chunks:
            raise ValueError(
                f"data state {state!r} does not fit these {len(self.sources)} files and windows of "
                f"{self.window_chunks} chunks; resume with the data it was saved with"
            )
        self._epoch, self._window_index, self._start, self._position = epoch, window, start, position
        self._window = self._stream = None

    # --- batches -------------------------------------------------------------------------------------------

    def __iter__(self) -> StreamingBatches:
        return self

    def __next__(self) -> torch.Tensor:
        rows, ids, missing = [], [], self.batch_size
        while missing:
            window = self._current_window()
            taken = window.order[self._position : self._position + missing]
            rows.append(window.tokens[taken])
            ids.extend((self._epoch, int(document), int(offset)) for document, offset in window.ids[taken])
            self._position += len(taken)
            missing -= len(taken)
        self.last_ids = ids
        return torch.from_numpy(np.concatenate(rows)).long()  # fancy indexing copied: a batch never aliases a window

    def _current_window(self) -> _Window:
        """The window with chunks left to hand out, building the next ones (and epochs) as needed."""
        if self._window is None:  # the first batch, or the first after load_state_dict: rebuild the state's window
            self._stream = self._windows(self._epoch, self._window_index, self._start)
            window = next(self._stream, None)
            if window is None:
                self._no_chunks(resumed=self._start != BEGINNING or self._window_index > 0)
            if self._position > len(window.order):
                raise ValueError(
                    f"the data state's position {self._position} is past the {len(window.order)} chunks of window "
                    f"{self._window_index} of epoch {self._epoch}: the data changed; resume with the data it was saved with"
                )
            self._window, self._start = window, window.start
        while self._position == len(self._window.order):
            window = next(self._stream, None)
            if window is None:  # the epoch ended: the next one reads from the beginning
                self._epoch += 1
                self._stream = self._windows(self._epoch, 0, BEGINNING)
                window = next(self._stream, None)
                if window is None:
                    self._no_chunks(resumed=False)
            self._window, self._window_index, self._start, self._position = window, window.index, window.start, 0
        return self._window

    def _no_chunks(self, *, resumed: bool) -> None:
        if resumed:
            raise ValueError(
                f"the data state points past the end of the training data (window {self._window_index} of epoch "
                f"{self._epoch}); the data changed: resume with the data it was saved with"
            )
        raise ValueError(
            f"the training data holds fewer than seq_len={self.seq_len} tokens for data shard {self.shard} "
            f"({len(self.sources)} file(s), field {self.text_field!r} of records); add text, lower --seq-len, "
            f"or use fewer data shards"
        )

    def _windows(self, epoch: int, index: int, start: ChunkStart) -> Iterator[_Window]:
        """The windows of `epoch` from window `index`, whose first chunk starts at `start`, to the epoch's end."""
        tokens = np.empty((self.window_chunks, self.seq_len), dtype=np.int32)
        ids = np.empty((self.window_chunks, 2), dtype=np.int64)
        count, window_start = 0, start
        for chunk_start, row in self._chunks(start):
            if count == 0:
                window_start = chunk_start
            tokens[count] = row
            ids[count] = chunk_start.position.document, chunk_start.tokens + chunk_start.skip
            count += 1
            if count == self.window_chunks:
                yield self._make_window(epoch, index, window_start, tokens, ids)
                # new arrays: the consumer still hands out the yielded ones
                tokens, ids = np.empty_like(tokens), np.empty_like(ids)
                index, count = index + 1, 0
        if count:  # the epoch's last window, shorter
            yield self._make_window(epoch, index, window_start, tokens[:count], ids[:count])

    def _make_window(self, epoch: int, index: int, start: ChunkStart, tokens: np.ndarray, ids: np.ndarray) -> _Window:
        # (seed, epoch, window) as entropy rather than a sum: seed 1's first epoch must not be seed 0's second
        order = np.random.default_rng([self.seed, epoch, index]).permutation(len(tokens))
        return _Window(index, start, tokens, ids, order)

    def _chunks(self, start: ChunkStart) -> Iterator[tuple[ChunkStart, np.ndarray]]:
        """Each seq_len chunk of the shard's token stream from `start` to the end of the data, with its start.

        The stream's tail, fewer than seq_len tokens, is dropped.
        """
        parts: list[np.ndarray] = []
        fill, chunk_start = 0, start
        before, skip = start.tokens, start.skip  # the document's tokens before the piece; the piece's to drop
        pieces = read_pieces(self.sources, self.shard, text_field=self.text_field, start=start.position)
        for piece, ids in self._tokenized(pieces):
            if piece.position.offset == 0:
                before = 0  # a new document
            piece_tokens = np.asarray(ids + self._eos if piece.last else ids, dtype=np.int32)
            at, skip = skip, 0
            while at < len(piece_tokens):
                if fill == 0:
                    chunk_start = ChunkStart(piece.position, before, at)
                taken = piece_tokens[at : at + self.seq_len - fill]
                parts.append(taken)
                fill, at = fill + len(taken), at + len(taken)
                if fill == self.seq_len:
                    yield chunk_start, parts[0] if len(parts) == 1 else np.concatenate(parts)
                    parts, fill = [], 0
            before += len(piece_tokens)

    def _tokenized(self, pieces: Iterator[Piece]) -> Iterator[tuple[Piece, list[int]]]:
        """The pieces with their token ids, tokenized a batch of pieces at a time."""
        batch: list[Piece] = []
        chars = 0
        for piece in pieces:
            batch.append(piece)
            chars += len(piece.text)
            if chars >= TOKENIZE_CHARS or len(batch) >= TOKENIZE_PIECES:
                yield from zip(batch, encode(self._tokenizer, [piece.text for piece in batch]))
                batch, chars = [], 0
        if batch:
            yield from zip(batch, encode(self._tokenizer, [piece.text for piece in batch]))
