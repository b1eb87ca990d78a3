"""The streaming loader of `swarmlm train` (client/training/stream.py): packing, bounded shuffle, shards, resume.

The tests read small corpora of text, JSON lines and Parquet files with the character-level test tokenizer,
whose ids are the characters' code points, and compare every chunk with a model of the stream computed here
from the documents' text: each document's characters and eos, the shard's documents in order, cut into
seq_len chunks. A chunk's id is (epoch, document, offset of its first token in the document).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from client.training import documents, stream
from client.training.cli import build_parser, load_batches
from client.training.data import Prefetcher
from client.training.documents import Shard, find_sources
from client.training.stream import StreamingBatches
from tests.helpers.tokenizer import EOS_ID, save_char_tokenizer

REPO = Path(__file__).resolve().parents[3]
SEQ_LEN = 8
WINDOW = 4  # chunks per shuffle window


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(save_char_tokenizer(tmp_path_factory.mktemp("char-tokenizer")))


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 24 bytes: documents span several pieces, and windows start in the middle of them."""
    monkeypatch.setattr(documents, "PIECE_SIZE", 24)
    monkeypatch.setattr(stream, "TOKENIZE_CHARS", 50)


def make_corpus(root: Path, *, seed: int = 0) -> list[str]:
    """Text files, a JSON lines file and a Parquet file under `root`; returns the documents' texts in order."""
    rng = random.Random(seed)

    def text(number: int) -> str:
        words = [
            rng.choice(["to", "be", "or", "not", "that", "is", "the", "question"]) for _ in range(rng.randint(1, 20))
        ]
        return f"<{number}> " + " ".join(words) + rng.choice(["", "\n", ".\n"])

    root.mkdir(parents=True, exist_ok=True)
    docs = [text(i) for i in range(16)]
    for i in range(4):  # a.txt .. d.txt: documents 0-3
        (root / f"{'abcd'[i]}.txt").write_text(docs[i])
    (root / "e.jsonl").write_text(
        "".join(json.dumps({"text": doc, "n": 4 + i}) + "\n" for i, doc in enumerate(docs[4:10]))
    )
    pq.write_table(pa.table({"text": docs[10:16]}), root / "f.parquet", row_group_size=4)
    return docs


def expected_chunks(docs: list[str], shard: Shard | None = None) -> dict[tuple[int, int], list[int]]:
    """(document, offset) -> tokens of every chunk of one epoch of `shard`'s stream, in stream order."""
    shard = shard or Shard()
    stream_tokens = [
        (number, offset, token)
        for number, doc in enumerate(docs)
        if shard.owns(number)
        for offset, token in enumerate([*map(ord, doc), EOS_ID])
    ]
    chunks = {}
    for start in range(0, len(stream_tokens) - SEQ_LEN + 1, SEQ_LEN):
        part = stream_tokens[start : start + SEQ_LEN]
        chunks[part[0][:2]] = [token for _, _, token in part]
    return chunks


def loader(root: Path, tokenizer, **options) -> StreamingBatches:
    options = {"seq_len": SEQ_LEN, "batch_size": 3, "window_chunks": WINDOW, **options}
    return StreamingBatches(find_sources(root), tokenizer, **options)


def samples(batches, count: int) -> list[tuple[tuple[int, int, int], list[int]]]:
    """(id, tokens) of each row of the next `count` batches."""
    got = []
    for _ in range(count):
        batch = next(batches)
        assert batch.dtype.is_floating_point is False and batch.shape == (batches.batch_size, SEQ_LEN)
        assert len(batches.last_ids) == len(batch)
        got += list(zip(batches.last_ids, batch.tolist()))
    return got


def by_epoch(got) -> dict[int, list[tuple[tuple[int, int], list[int]]]]:
    epochs = defaultdict(list)
    for (epoch, document, offset), tokens in got:
        epochs[epoch].append(((document, offset), tokens))
    return epochs


# --- the stream ----------------------------------------------------------------------------------------------


def test_every_epoch_hands_out_every_chunk_of_the_stream_once(tmp_path, char_tokenizer, small_pieces):
    docs = make_corpus(tmp_path / "data")
    expected = expected_chunks(docs)
    assert len(expected) % 3 != 0  # so that batches of 3 straddle epoch boundaries
    got = samples(loader(tmp_path / "data", char_tokenizer), len(expected) + 1)  # 3 epochs and 3 chunks
    epochs = by_epoch(got)
    assert len(epochs) == 4  # epochs 0-2 whole, and the start of epoch 3
    for epoch in (0, 1, 2):
        assert len(epochs[epoch]) == len(expected)
        assert dict(epochs[epoch]) == expected
    orders = [[chunk_id for chunk_id, _ in epochs[epoch]] for epoch in (0, 1, 2)]
    assert len({tuple(order) for order in orders}) == 3  # a new order each epoch


def test_shuffle_is_within_windows_of_consecutive_chunks_and_seeded(tmp_path, char_tokenizer):
    docs = make_corpus(tmp_path / "data")
    stream_order = list(expected_chunks(docs))

    def epoch_order(seed: int, epoch: int = 0) -> list[tuple[int, int]]:
        got = samples(loader(tmp_path / "data", char_tokenizer, seed=seed, batch_size=1), 2 * len(stream_order))
        return [chunk_id for chunk_id, _ in by_epoch(got)[epoch]]

    order = epoch_order(7)
    windows = [stream_order[i : i + WINDOW] for i in range(0, len(stream_order), WINDOW)]
    assert [set(order[i : i + WINDOW]) for i in range(0, len(order), WINDOW)] == [set(w) for w in windows]
    assert order != stream_order  # shuffled at all
    assert order == epoch_order(7)
    assert order != epoch_order(8)
    assert epoch_order(1) != epoch_order(0, epoch=1)  # seed 1's first epoch is not seed 0's second one


def test_shards_are_disjoint_and_together_cover_the_epoch(tmp_path, char_tokenizer, small_pieces):
    docs = make_corpus(tmp_path / "data")
    every = expected_chunks(docs)
    tokens_of = {Shard(): every}
    covered = {}
    for shard in (Shard(0, 2), Shard(1, 2)):
        expected = expected_chunks(docs, shard)
        got = by_epoch(samples(loader(tmp_path / "data", char_tokenizer, shard=shard, batch_size=1), len(expected)))
        assert list(got) == [0] and dict(got[0]) == expected  # one epoch: every chunk of its stream once
        assert all(shard.owns(document) for (document, _), _ in got[0])
        tokens_of[shard] = dict(got[0])
        # the (document, offset) of every token the shard's chunks hold
        positions = [
            (document, offset)
            for document, doc in enumerate(docs)
            if shard.owns(document)
            for offset in range(len(doc) + 1)
        ]
        covered[shard] = set(positions[: len(expected) * SEQ_LEN])
    first, second = (set(tokens_of[Shard(i, 2)]) for i in range(2))
    assert not first & second  # no sample of one trainer is a sample of the other
    assert not covered[Shard(0, 2)] & covered[Shard(1, 2)]
    # every token of the unsharded epoch is in one shard's samples, but for the two shards' tails (< seq_len)
    unsharded = {(d, o) for d, doc in enumerate(docs) for o in range(len(doc) + 1)}
    unsharded = set(sorted(unsharded)[: len(every) * SEQ_LEN])
    left_out = unsharded - covered[Shard(0, 2)] - covered[Shard(1, 2)]
    assert len(left_out) < 2 * SEQ_LEN


# --- resuming ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard", [Shard(), Shard(1, 2)])
def test_resuming_from_any_batch_continues_the_uninterrupted_run(tmp_path, char_tokenizer, small_pieces, shard):
    make_corpus(tmp_path / "data")
    uninterrupted = loader(tmp_path / "data", char_tokenizer, shard=shard)
    states, batches, ids = [uninterrupted.state_dict()], [], []
    while uninterrupted.state_dict()["epoch"] < 2:  # two whole epochs and a bit
        batches.append(next(uninterrupted))
        ids.append(uninterrupted.last_ids)
        states.append(json.loads(json.dumps(uninterrupted.state_dict())))  # as train_state.json keeps it
    # the states cover what must resume: mid-window, a window's end, windows starting mid-document, epochs
    assert any(state["position"] == WINDOW for state in states)
    assert any(0 < state["position"] < WINDOW for state in states)
    assert any(state["start"]["skip"] > 0 for state in states)
    assert any(state["start"]["offset"] > 0 for state in states)
    assert any(epoch_ids[0][0] != epoch_ids[-1][0] for epoch_ids in ids)  # a batch across an epoch's end
    for done, state in enumerate(states[:-1]):
        resumed = loader(tmp_path / "data", char_tokenizer, shard=shard, state=state)
        for i in range(done, min(done + 4, len(batches))):  # past the next window's start
            assert next(resumed).tolist() == batches[i].tolist(), f"resumed after {done} batches: batch {i} differs"
            assert resumed.last_ids == ids[i]
    # batch_size may change on resume: the same chunks come, in the same order
    resumed = loader(tmp_path / "data", char_tokenizer, shard=shard, state=states[2], batch_size=1)
    assert [row for _ in range(6) for row in next(resumed).tolist()] == [
        row for b in batches[2:4] for row in b.tolist()
    ]


class CountingTokenizer:
    """Wraps a fast tokenizer and counts the characters it tokenizes."""

    def __init__(self, tokenizer) -> None:
        self._backend = tokenizer.backend_tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.backend_tokenizer = self
        self.chars = 0

    def encode_batch_fast(self, texts, add_special_tokens):
        self.chars += sum(map(len, texts))
        return self._backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


def test_resuming_tokenizes_one_window_again_not_the_corpus(tmp_path, char_tokenizer, small_pieces):
    for part in range(5):
        make_corpus(tmp_path / "data" / f"part{part}", seed=part)
    counting = CountingTokenizer(char_tokenizer)
    uninterrupted = loader(tmp_path / "data", counting, batch_size=2)
    while uninterrupted.state_dict()["window"] < 40:
        next(uninterrupted)
    read_before, state = counting.chars, uninterrupted.state_dict()
    expected = next(uninterrupted)
    resumer = CountingTokenizer(char_tokenizer)
    resumed = loader(tmp_path / "data", resumer, batch_size=2, state=state)
    assert next(resumed).tolist() == expected.tolist()
    # a window of chunks, plus the pieces around it (one tokenizer call of TOKENIZE_CHARS)
    assert resumer.chars <= WINDOW * SEQ_LEN + documents.PIECE_SIZE + stream.TOKENIZE_CHARS + documents.PIECE_SIZE
    assert read_before > 10 * resumer.chars


def test_a_state_of_other_data_or_settings_is_refused(tmp_path, char_tokenizer):
    make_corpus(tmp_path / "data")
    first = loader(tmp_path / "data", char_tokenizer)
    next(first)
    state = first.state_dict()
    for options, message in [
        ({"seq_len": 16}, "saved with seq_len 8, this run has 16"),
        ({"seed": 3}, "saved with seed 0, this run has 3"),
        ({"shard": Shard(0, 2)}, "saved with shard '0/1', this run has '0/2'"),
        ({"text_field": "body"}, "saved with text_field 'text', this run has 'body'"),
        ({"window_chunks": 8}, "saved with window_chunks 4, this run has 8"),
    ]:
        with pytest.raises(ValueError, match=message + r".*resume with the data, --seq-len, --seed"):
            loader(tmp_path / "data", char_tokenizer, state=state, **options)
    with (tmp_path / "data" / "a.txt").open("a") as file:
        file.write("more text")
    with pytest.raises(ValueError, match=r"saved with corpus '[0-9a-f]+', this run has '[0-9a-f]+'"):
        loader(tmp_path / "data", char_tokenizer, state=state)
    with pytest.raises(ValueError, match="saved by an older swarmlm"):
        loader(tmp_path / "data", char_tokenizer, state={"epoch": 0, "position": 3})
    with pytest.raises(ValueError, match="not a data state"):
        loader(tmp_path / "data", char_tokenizer, state={"version": 99})


def test_too_little_text_is_a_clear_error(tmp_path, char_tokenizer):
    (tmp_path / "one.txt").write_text("short")
    batches = loader(tmp_path / "one.txt", char_tokenizer, seq_len=64)
    with pytest.raises(ValueError, match=r"fewer than seq_len=64 tokens for data shard 0/1.*lower --seq-len"):
        next(batches)
    with pytest.raises(ValueError, match="data shard 1/2 gets no document: the data is 1 text file"):
        loader(tmp_path / "one.txt", char_tokenizer, shard=Shard(1, 2))
    with pytest.raises(ValueError, match="seq_len must be an int >= 1, got 0"):
        loader(tmp_path / "one.txt", char_tokenizer, seq_len=0)


def test_prefetcher_passes_the_ids_and_the_state_of_what_was_received(tmp_path, char_tokenizer):
    make_corpus(tmp_path / "data")
    direct = loader(tmp_path / "data", char_tokenizer)
    expected = [(next(direct).tolist(), direct.last_ids) for _ in range(8)]
    with Prefetcher(loader(tmp_path / "data", char_tokenizer), depth=2) as prefetcher:
        got = [(next(prefetcher).tolist(), prefetcher.last_ids) for _ in range(3)]
        state = prefetcher.state_dict()
    assert got == expected[:3]
    resumed = loader(tmp_path / "data", char_tokenizer, state=state)
    assert [(next(resumed).tolist(), resumed.last_ids) for _ in range(5)] == expected[3:]


def test_swarmlm_train_streams_the_data_its_flags_name(tmp_path, char_tokenizer):
    make_corpus(tmp_path / "data")
    model = save_char_tokenizer(tmp_path / "model")  # load_batches needs the checkpoint's tokenizer only
    flags = ["--data", str(tmp_path / "data"), "--data-shard", "1/2", "--seq-len", "8", "--batch-size", "3"]
    args = build_parser("swarmlm train").parse_args([str(model), *flags, "--seed", "4"])
    with load_batches(model, args, None) as batches:
        batch = next(batches)
        state = batches.state_dict()
        ids = batches.last_ids
    assert all(document % 2 == 1 for _, document, _ in ids)
    assert (state["shard"], state["seed"], state["seq_len"]) == ("1/2", 4, 8)
    direct = StreamingBatches(
        find_sources(tmp_path / "data"), char_tokenizer, seq_len=8, batch_size=3, seed=4, shard=Shard(1, 2)
    )
    assert next(direct).tolist() == batch.tolist() and direct.last_ids == ids
    with load_batches(model, args, state) as resumed:  # what `swarmlm train --save` resumes with
        assert next(resumed).tolist() == next(direct).tolist()


# --- memory --------------------------------------------------------------------------------------------------

RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil
    from transformers import AutoTokenizer
    import datasets.packaged_modules.json.json  # imported before measuring: the library is not the data
    from client.training.documents import find_sources
    from client.training.stream import StreamingBatches

    tokenizer_path, count, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    io = psutil.Process().io_counters
    def peak_mb():  # the process's peak resident memory since clear_refs (VmHWM)
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # reset the peak to the current use: what imports took is left out
    before, read_before = peak_mb(), io().read_chars
    loaders = [
        StreamingBatches(find_sources(path), tokenizer, seq_len=128, batch_size=8, window_chunks=256) for path in paths
    ]
    for batches in loaders:
        next(batches)
    read_first = io().read_chars - read_before
    for _ in range(count - 1):
        for batches in loaders:  # side by side: each one's memory must stay flat
            next(batches)
    print(json.dumps({"growth_mb": peak_mb() - before, "read_first_mb": read_first / 2**20,
                      "read_mb": (io().read_chars - read_before) / 2**20,
                      "epochs": [batches.last_ids[-1][0] for batches in loaders]}))
    """
)


def save_word_tokenizer(path: Path, words: list[str]) -> Path:
    """A word-level fast tokenizer: several times faster than the character one, for megabytes of text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{word: i + 2 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return path


@pytest.mark.skipif(sys.platform != "linux", reason="reads peak memory and I/O from /proc")
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """1 MB and 200 MB of text, as a text file and as JSON lines: the same memory, and no pass over the corpus.

    Each size runs in a process of its own, both loaders side by side, for as many batches as take a few MB.
    """
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "nobler", "in", "mind"]
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(100_000)]
    text = "\n".join(lines).encode()[: 1 << 20]
    text = text[: text.rindex(b"\n") + 1]
    records = b"".join(json.dumps({"text": line}).encode() + b"\n" for line in text.decode().splitlines())
    tokenizer = save_word_tokenizer(tmp_path / "tokenizer", words)
    files = {}
    for size, repeats in [("1 MB", 1), ("200 MB", 200)]:
        files[size] = [tmp_path / f"{repeats}.txt", tmp_path / f"{repeats}.jsonl"]
        for path, block in zip(files[size], (text, records)):
            with path.open("wb") as file:
                for _ in range(repeats):
                    file.write(block)
    try:
        result = {}
        for size, paths in files.items():
            run = subprocess.run(
                [sys.executable, "-c", RSS_SCRIPT, str(tokenizer), "300", *map(str, paths)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
                # one tokenizer thread: the figures compare memory, and the suite's other tests share the cores
                env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"},
            )
            assert run.returncode == 0, run.stderr[-3000:]
            result[size] = json.loads(run.stdout.splitlines()[-1])
    finally:
        for path in files["200 MB"]:
            path.unlink()
    small, large = result["1 MB"], result["200 MB"]
    print(f"peak memory growth: 1 MB {small['growth_mb']:.1f} MB, 200 MB {large['growth_mb']:.1f} MB; {result}")
    assert small["epochs"] == [1, 1] and large["epochs"] == [0, 0]  # the small corpus went round, the large not
    assert large["growth_mb"] < small["growth_mb"] + 20
    # the large corpus is read as far as the batches go: ~1.7 MB of text each for 300 batches, not 200 MB
    assert large["read_first_mb"] < 8 and large["read_mb"] < 20
