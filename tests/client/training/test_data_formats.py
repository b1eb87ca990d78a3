"""Training documents from files (client/training/documents.py): text, JSON lines and Parquet, files and folders.

Which files a path names, in which order; documents read in pieces that can be read again from any one of
them; each shard's documents; the errors for bad data; and the `swarmlm train` flags that name them.
"""

from __future__ import annotations

import json
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from client.training import documents
from client.training.cli import build_parser, run
from client.training.documents import Kind, Position, Shard, find_sources, read_pieces, sources_of


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def texts(pieces) -> list[str]:
    return [piece.text for piece in pieces]


def documents_of(pieces) -> dict[int, str]:
    """document number -> its text, joined from its pieces (which must come in order and end with `last`)."""
    joined: dict[int, str] = {}
    ended: set[int] = set()
    for piece in pieces:
        number = piece.position.document
        assert number not in ended, f"a piece of document {number} after its last one"
        joined[number] = joined.get(number, "") + piece.text
        if piece.last:
            ended.add(number)
    assert ended == set(joined), "a document without its last piece"
    return joined


@pytest.fixture
def no_network(monkeypatch):
    """Fails the test if anything looks up a host name or connects (libraries swallow the errors they get)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield
    assert not attempts, f"the data loader tried the network: {attempts}"


# --- which files ---------------------------------------------------------------------------------------------


def test_a_folder_gives_its_nonempty_data_files_recursively_in_order(tmp_path):
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    for name in ["b/deep/two.md", "a.txt", "b/one.TXT", ".git/notes.txt", "model.safetensors", ".hidden.md"]:
        (tmp_path / name).write_text("some text\n")
    write_jsonl(tmp_path / "b" / "c.jsonl", [{"text": "x"}])
    pq.write_table(pa.table({"text": ["y"]}), tmp_path / "b" / "d.parquet")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "notes.json").write_text("{}")  # not JSON lines: left out of a folder
    sources = find_sources(tmp_path)
    assert [(s.name, s.kind) for s in sources] == [
        ("a.txt", Kind.TEXT),
        ("b/c.jsonl", Kind.JSONL),
        ("b/d.parquet", Kind.PARQUET),
        ("b/deep/two.md", Kind.TEXT),
        ("b/one.TXT", Kind.TEXT),
    ]
    assert all(s.path == tmp_path / s.name for s in sources)


def test_a_file_named_explicitly(tmp_path):
    for name in ["corpus", "data.jsonl", "data.parquet", "play.md"]:
        (tmp_path / name).write_text("x\n")
    assert [(s.name, s.kind) for s in find_sources(tmp_path / "corpus")] == [("corpus", Kind.TEXT)]
    assert find_sources(tmp_path / "data.jsonl")[0].kind is Kind.JSONL
    assert find_sources(tmp_path / "data.parquet")[0].kind is Kind.PARQUET
    assert find_sources(tmp_path / "play.md")[0].kind is Kind.TEXT


def test_errors_name_the_path_and_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist; pass a text, \.jsonl or \.parquet"):
        find_sources(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="holds no text"):
        find_sources(tmp_path)  # an empty folder
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=str(tmp_path)):
        find_sources(tmp_path)
    with pytest.raises(ValueError, match=r"empty\.txt is an empty file"):
        find_sources(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match=r"weights\.bin: the suffix '\.bin' is none of .*\.jsonl, \.parquet"):
        find_sources(tmp_path / "weights.bin")
    (tmp_path / "records.json").write_text('[{"text": "x"}]')
    with pytest.raises(ValueError, match=r"'\.json' is none of .*convert the data to JSON lines"):
        find_sources(tmp_path / "records.json")


def test_sources_of_a_list_are_named_from_their_common_folder(tmp_path):
    (tmp_path / "plays" / "comedies").mkdir(parents=True)
    files = [tmp_path / "plays" / "comedies" / "a.md", tmp_path / "plays" / "b.md"]
    assert [s.name for s in sources_of(files)] == ["comedies/a.md", "b.md"]


# --- documents and pieces ------------------------------------------------------------------------------------


def test_documents_are_files_and_records_numbered_in_order(tmp_path, no_network):
    (tmp_path / "a.txt").write_text("first file\nof text\n")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "record one", "id": 1}, {"text": "record two", "id": 2}])
    pq.write_table(pa.table({"text": ["row one", "row two", "row three"], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    (tmp_path / "d.md").write_text("# last")
    sources = find_sources(tmp_path)
    got = documents_of(read_pieces(sources, Shard()))
    assert got == {
        0: "first file\nof text\n",
        1: "record one",
        2: "record two",
        3: "row one",
        4: "row two",
        5: "row three",
        6: "# last",
    }
    # where each document's piece is: its file, its record there, its offset
    positions = [piece.position for piece in read_pieces(sources, Shard())]
    assert positions == [
        Position(0, 0, 0, 0),
        Position(1, 0, 0, 1),
        Position(1, 1, 0, 2),
        Position(2, 0, 0, 3),
        Position(2, 1, 0, 4),
        Position(2, 2, 0, 5),
        Position(3, 0, 0, 6),
    ]


def test_shards_own_every_nth_document_and_together_all(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"file {i}")
    write_jsonl(tmp_path / "r.jsonl", [{"text": f"record {i}"} for i in range(4)])
    sources = find_sources(tmp_path)
    every = documents_of(read_pieces(sources, Shard()))
    assert len(every) == 7
    shards = [documents_of(read_pieces(sources, Shard(i, 3))) for i in range(3)]
    for i, shard in enumerate(shards):
        assert sorted(shard) == [n for n in range(7) if n % 3 == i]
        assert all(every[n] == text for n, text in shard.items())
    assert sorted(n for shard in shards for n in shard) == list(range(7))


def test_a_text_file_is_read_in_pieces_cut_after_a_line_break(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "PIECE_SIZE", 16)
    text = "short\nline number two\n" + "x" * 40 + "\nend"
    (tmp_path / "a.txt").write_text(text)
    sources = find_sources(tmp_path)
    pieces = list(read_pieces(sources, Shard()))
    assert "".join(texts(pieces)) == text
    assert texts(pieces)[:2] == ["short\n", "line number two\n"]
    assert all(len(piece.text.encode()) <= 16 for piece in pieces)
    assert [piece.last for piece in pieces] == [False] * (len(pieces) - 1) + [True]
    # each piece says where it starts: reading from there gives the same pieces, and that is how a loader resumes
    for i, piece in enumerate(pieces):
        assert piece.position.offset == len("".join(texts(pieces[:i])).encode())
        assert list(read_pieces(sources, Shard(), start=piece.position)) == pieces[i:]


def test_a_line_longer_than_a_piece_is_cut_between_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "PIECE_SIZE", 7)
    text = "ab\u00e9\u20ac\U0001f600cd\u00e9\u00e9\u00e9\u20ac\u20acxyz" * 3  # characters of 1 to 4 bytes, no newline
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": text}) + "\n")
    for source in find_sources(tmp_path):
        pieces = list(read_pieces([source], Shard()))
        assert "".join(texts(pieces)) == text and len(pieces) > 3
        for i, piece in enumerate(pieces):
            assert list(read_pieces([source], Shard(), start=piece.position)) == pieces[i:]


def test_a_long_record_is_cut_like_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "PIECE_SIZE", 10)
    write_jsonl(tmp_path / "r.jsonl", [{"text": "one\ntwo three\nfour"}, {"text": "five"}])
    pieces = list(read_pieces(find_sources(tmp_path), Shard()))
    assert [(p.position.record, p.position.offset, p.text, p.last) for p in pieces] == [
        (0, 0, "one\n", False),
        (0, 4, "two three\n", False),
        (0, 14, "four", True),
        (1, 0, "five", True),
    ]
    # resuming in the middle of the first record: the records before it are skipped, not returned
    assert list(read_pieces(find_sources(tmp_path), Shard(), start=pieces[1].position)) == pieces[1:]


def test_file_names_are_not_patterns(tmp_path, no_network):
    # `datasets` takes data files as glob patterns: this name, unescaped, would also match the other file
    write_jsonl(tmp_path / "part[1] *.jsonl", [{"text": "mine"}])
    write_jsonl(tmp_path / "part1 x.jsonl", [{"text": "other"}])
    sources = find_sources(tmp_path)
    assert [s.name for s in sources] == ["part1 x.jsonl", "part[1] *.jsonl"]
    assert documents_of(read_pieces(sources, Shard())) == {0: "other", 1: "mine"}


def test_parquet_reads_the_text_column_of_a_folder_of_files(tmp_path, no_network):
    for i in range(2):
        table = pa.table({"id": [10 * i, 10 * i + 1], "body": [f"file {i} row 0", f"file {i} row 1"]})
        pq.write_table(table, tmp_path / f"part-{i}.parquet", row_group_size=1)
    got = documents_of(read_pieces(find_sources(tmp_path), Shard(), text_field="body"))
    assert got == {0: "file 0 row 0", 1: "file 0 row 1", 2: "file 1 row 0", 3: "file 1 row 1"}


# --- bad data ------------------------------------------------------------------------------------------------


def read_all(path, **options) -> list:
    return list(read_pieces(find_sources(path), Shard(), **options))


def test_a_record_without_the_text_field_is_named(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", [{"content": "a"}, {"content": "b"}])
    with pytest.raises(
        ValueError, match=r"record 0 of training file .*r\.jsonl has no 'text' .*its fields: content.*--text-field"
    ):
        read_all(tmp_path)
    assert texts(read_all(tmp_path, text_field="content")) == ["a", "b"]
    write_jsonl(tmp_path / "r.jsonl", [{"text": "a"}, {"other": 1}, {"text": "c"}])
    with pytest.raises(ValueError, match=r"record 1 of training file .*r\.jsonl has no 'text' \(missing or null"):
        read_all(tmp_path)


def test_a_record_whose_text_is_not_a_string_is_named(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", [{"text": "a"}, {"text": 5}])
    with pytest.raises(ValueError, match=r"record 1 of training file .*r\.jsonl holds a int, not a string, in 'text'"):
        read_all(tmp_path)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"record 0 of training file .*n\.parquet holds a int"):
        read_all(tmp_path / "n.parquet")


def test_a_parquet_file_without_the_column_is_named(tmp_path):
    pq.write_table(pa.table({"content": ["a"], "id": [1]}), tmp_path / "t.parquet")
    with pytest.raises(
        ValueError, match=r"t\.parquet has no column 'text' \(its columns: content, id\); pass .* --text-field"
    ):
        read_all(tmp_path)


def test_unreadable_files_are_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"cannot read training file .*bad\.jsonl as JSON lines"):
        read_all(tmp_path / "bad.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"cannot read training file .*bad\.parquet as Parquet"):
        read_all(tmp_path / "bad.parquet")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text \(byte 3"):
        read_all(tmp_path / "latin1.txt")


# --- shards and flags ----------------------------------------------------------------------------------------


def test_shard_parse_and_its_errors():
    assert Shard.parse("0/1") == Shard() and Shard.parse(" 2 / 3 ") == Shard(2, 3)
    assert Shard(1, 2).owns(3) and not Shard(1, 2).owns(4) and str(Shard(1, 2)) == "1/2"
    with pytest.raises(ValueError, match="0/2 to 1/2"):
        Shard.parse("2/2")
    with pytest.raises(ValueError, match="count must be an int >= 1, got 0"):
        Shard.parse("0/0")
    for bad in ["x", "1", "-1/2", "1/2/3", "a/b"]:
        with pytest.raises(ValueError, match="a data shard is I/N"):
            Shard.parse(bad)


def test_train_flags_for_data(capsys):
    parser = build_parser("swarmlm train")
    args = parser.parse_args(["model", "--data", "d.jsonl", "--text-field", "body", "--data-shard", "1/4"])
    assert (args.data, args.text_field, args.data_shard) == ("d.jsonl", "body", Shard(1, 4))
    defaults = parser.parse_args(["model"])
    assert (defaults.data, defaults.text_field, defaults.data_shard) == (None, "text", Shard())
    for bad, message in [("2/2", "data shard 2/2 does not exist"), ("x", "a data shard is I/N")]:
        with pytest.raises(SystemExit):
            parser.parse_args(["model", "--data-shard", bad])
        assert f"error: argument --data-shard: {message}" in capsys.readouterr().err
    parser.print_help()
    help_text = " ".join(capsys.readouterr().out.split())
    for words in [".jsonl", ".parquet", "--text-field NAME", "--data-shard I/N", "number % N == I"]:
        assert words in help_text


def test_train_exits_with_a_clear_error_for_missing_data(tmp_path):
    args = build_parser("swarmlm train").parse_args([str(tmp_path), "--local", "--data", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"^error: training data .*nowhere does not exist"):
        run(args)  # before the model or anything else is loaded
