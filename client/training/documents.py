"""Training documents from files: which files, in which order, read in bounded pieces, one trainer's share.

- find_sources / sources_of: the files of the training data (text, JSON lines, Parquet), in a fixed order
- Shard: a trainer's share of the documents (`swarmlm train --data-shard I/N`)
- read_pieces: the text of a shard's documents from a position on, in pieces of at most PIECE_SIZE

A document is a whole text file, or one record of a JSON lines or Parquet file (its `text_field`). Documents
are numbered in file order, records in file order, from 0; shard I of N owns the documents whose number % N
== I, so trainers of one run never read the same text, and a folder of text files is sharded by file.

Nothing here holds more than a piece and the reader's buffer (JSONL_CHUNK_BYTES of a JSON lines file, a row
group's text column of a Parquet file): a text file is read in pieces cut after a line break, a long record
is cut the same way, and reading can start at any piece (`Position`), which is how a resumed loader skips
what it had read. JSON lines and Parquet files are read by the `datasets` library's builders in streaming
mode, one file at a time: local files only, nothing asked of the hub, no cache left behind (its lock files
go to a temporary folder).
"""

from __future__ import annotations

import enum
import glob
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
# 64 KiB of text tokenizes in a few ms and stays small as token lists (Python ints, ~36 bytes a token)
PIECE_SIZE = 1 << 16
# JSON lines are parsed this many bytes at a time (datasets' default, 10 MB, holds ~70 MB more while parsing)
JSONL_CHUNK_BYTES = 1 << 20


class Kind(enum.Enum):
    TEXT = "text"
    JSONL = "jsonl"
    PARQUET = "parquet"


KINDS_BY_SUFFIX = {
    **dict.fromkeys(TEXT_SUFFIXES, Kind.TEXT),
    **dict.fromkeys(JSONL_SUFFIXES, Kind.JSONL),
    **dict.fromkeys(PARQUET_SUFFIXES, Kind.PARQUET),
}
ALL_SUFFIXES = ", ".join(KINDS_BY_SUFFIX)


@dataclass(frozen=True)
class Source:
    """One file of the training data."""

    path: Path
    """Where it is read from."""
    kind: Kind
    """How it is read: whole as one document (text), or a document per record."""
    name: str
    """The path relative to the data's root (the file's own name for a single file): the corpus fingerprint
    uses it, so that a copy of the data elsewhere resumes the same."""


def _kind_of(file: Path, *, named: bool) -> Kind | None:
    kind = KINDS_BY_SUFFIX.get(file.suffix.lower())
    if kind is None and named and not file.suffix:
        return Kind.TEXT  # a file named explicitly without a suffix ("corpus", "input"): its owner knows it is text
    return kind


def find_sources(path: str | Path) -> list[Source]:
    """`path` itself if it is a file, else the non-empty data files under it (recursively, sorted, hidden skipped).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: `path` is an empty file or one of an unknown suffix, or a folder without non-empty data files.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"training data {root} does not exist; pass a text, .jsonl or .parquet file, or a folder of them"
        )
    if root.is_file():
        kind = _kind_of(root, named=True)
        if kind is None:
            raise ValueError(
                f"training data {root}: the suffix {root.suffix!r} is none of {ALL_SUFFIXES}; rename a text file "
                f"to .txt, or convert the data to JSON lines or Parquet"
            )
        if root.stat().st_size == 0:
            raise ValueError(f"training data {root} is an empty file; point it at a file with text in it")
        return [Source(root, kind, root.name)]
    found = sorted(
        (file.relative_to(root).as_posix(), file)
        for file in root.rglob("*")
        if file.suffix.lower() in KINDS_BY_SUFFIX
        and file.is_file()
        # skip .git, .venv and the like, which hold nobody's training text
        and not any(part.startswith(".") for part in file.relative_to(root).parts)
        and file.stat().st_size > 0
    )
    if not found:
        raise ValueError(
            f"training data {root} holds no text: no non-empty file with a suffix in {ALL_SUFFIXES}; "
            f"point it at a data file or a folder of them"
        )
    return [Source(file, KINDS_BY_SUFFIX[file.suffix.lower()], name) for name, file in found]


def sources_of(files: Sequence[Path]) -> list[Source]:
    """Text files given as a list (the default corpus), named relative to their common folder."""
    files = [Path(file) for file in files]
    if not files:
        raise ValueError("no training files; pass at least one")
    root = Path(os.path.commonpath([file.parent for file in files]))
    return [Source(file, Kind.TEXT, file.relative_to(root).as_posix()) for file in files]


def fingerprint(sources: Sequence[Source], text_field: str) -> str:
    """A short digest of the files' names, kinds and sizes, and of the field read: what a data state belongs to.

    Sizes rather than contents: reading every byte is what a streaming loader must not do up front.
    """
    digest = hashlib.sha256(text_field.encode())
    for source in sources:
        digest.update(f"\0{source.name}\0{source.kind.value}\0{source.path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Shard:
    """Trainer `index` of `count` takes the documents whose number % count == index."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        for name, value, least in (("index", self.index, 0), ("count", self.count, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"a data shard's {name} must be an int >= {least}, got {value!r}")
        if self.index >= self.count:
            raise ValueError(
                f"data shard {self} does not exist: I of I/N must be in 0..N-1 ({self.count - 1} here); give "
                f"the trainers of a run 0/{self.count} to {self.count - 1}/{self.count}"
            )

    @classmethod
    def parse(cls, text: str) -> Shard:
        """ "I/N" (as `swarmlm train --data-shard` takes it) -> Shard(I, N); a ValueError says what is wrong."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if match is None:
            raise ValueError(
                f"a data shard is I/N, this trainer's index and the number of trainers (0/2), not {text!r}"
            )
        return cls(int(match[1]), int(match[2]))

    def owns(self, document: int) -> bool:
        return document % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class Position:
    """Where a piece starts: reading can begin at any piece, and goes on exactly as it would have."""

    file: int = 0
    """Index into the sources."""
    record: int = 0
    """Record in that file (0 for a text file, its only document)."""
    offset: int = 0
    """Where the piece starts in its document: bytes into a text file, characters into a record's text."""
    document: int = 0
    """The document's number over all files: what the shard is decided by."""


@dataclass(frozen=True)
class Piece:
    position: Position
    text: str
    last: bool
    """The document's last piece: an end-of-sequence token follows it."""


def read_pieces(
    sources: Sequence[Source], shard: Shard, *, text_field: str = "text", start: Position | None = None
) -> Iterator[Piece]:
    """The pieces of the documents `shard` owns, from the piece at `start` to the end of the data.

    Documents of other shards are skipped: a text file is not opened, a record is read (the format allows no
    less) and checked, so that every trainer stops at the same bad record, but not cut or tokenized.

    Raises (when reading reaches the file):
        ValueError: a text file that is not UTF-8, a JSON lines or Parquet file that cannot be read, or a record
            without a string in `text_field`.
    """
    start = start or Position()
    document = start.document
    for file in range(start.file, len(sources)):
        source = sources[file]
        first = file == start.file
        if source.kind is Kind.TEXT:
            if shard.owns(document):
                begin = start.offset if first else 0
                for offset, text, last in _text_file_pieces(source, begin):
                    yield Piece(Position(file, 0, offset, document), text, last)
            document += 1
            continue
        for record, text in _records(source, text_field, skip=start.record if first else 0):
            if shard.owns(document):
                begin = start.offset if first and record == start.record else 0
                for offset, piece, last in _string_pieces(text, begin):
                    yield Piece(Position(file, record, offset, document), piece, last)
            document += 1


def _text_file_pieces(source: Source, offset: int) -> Iterator[tuple[int, str, bool]]:
    """(offset, text, last) of a text file from byte `offset`, each piece cut after its last line break.

    The cut depends only on where the piece starts, so reading from any piece's offset finds the same pieces.
    """
    with open(source.path, "rb") as file:
        size = file.seek(0, 2)
        file.seek(offset)
        while offset < size:
            block = file.read(PIECE_SIZE)
            if not block:  # the file shrank under us: what was read is the document
                return
            end = offset + len(block)
            if end < size:
                cut = block.rfind(b"\n") + 1 or _utf8_boundary(block)
                block = block[:cut]
                file.seek(offset + cut)
            try:
                text = block.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"training file {source.path} is not UTF-8 text (byte {offset + exc.start}: {exc.reason}); "
                    f"convert it or leave it out"
                ) from exc
            yield offset, text, offset + len(block) >= size
            offset += len(block)


def _utf8_boundary(block: bytes) -> int:
    """The longest prefix of `block` that does not end inside a UTF-8 character (a line longer than a piece)."""
    # a character is at most 4 bytes: its lead byte (not 10xxxxxx) is among the last 4
    for i in range(len(block) - 1, max(len(block) - 4, 0) - 1, -1):
        byte = block[i]
        if byte & 0xC0 != 0x80:
            length = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(block) if i + length <= len(block) else i or len(block)
    return len(block)  # not UTF-8 at all: decoding says so, naming the byte


def _string_pieces(text: str, offset: int) -> Iterator[tuple[int, str, bool]]:
    """(offset, text, last) of a record's text from character `offset`, cut like a text file's."""
    while offset < len(text):
        end = min(offset + PIECE_SIZE, len(text))
        if end < len(text):
            end = text.rfind("\n", offset, end) + 1 or end
        yield offset, text[offset:end], end == len(text)
        offset = end


def _records(source: Source, text_field: str, *, skip: int) -> Iterator[tuple[int, str]]:
    """(record number, text) of a JSON lines or Parquet file from record `skip` on, streamed by `datasets`."""
    import pyarrow
    import pyarrow.parquet
    from datasets.packaged_modules.json.json import Json
    from datasets.packaged_modules.parquet.parquet import Parquet

    what = "JSON lines" if source.kind is Kind.JSONL else "Parquet"
    try:
        with tempfile.TemporaryDirectory(prefix="swarmlm-data-") as cache:
            options = {}
            if source.kind is Kind.PARQUET:
                # only the text's column is read; a missing one is named here, as the read would not name it
                fields = pyarrow.parquet.read_schema(source.path).names
                if text_field not in fields:
                    raise ValueError(
                        f"training file {source.path} has no column {text_field!r} (its columns: "
                        f"{', '.join(fields)}); pass the one that holds the text with --text-field"
                    )
                options["columns"] = [text_field]
            else:
                options["chunksize"] = JSONL_CHUNK_BYTES
            # The builder itself, not load_dataset: that one asks the hub to count a download on every call
            # (unless HF_HUB_OFFLINE is set). data_files are glob patterns: the path is escaped.
            builder = (Json if source.kind is Kind.JSONL else Parquet)(
                cache_dir=cache, data_files=[glob.escape(str(source.path))], **options
            )
            records = builder.as_streaming_dataset(split="train")
            if skip:
                records = records.skip(skip)
            for number, record in enumerate(records, start=skip):
                text = record.get(text_field)
                if not isinstance(text, str):
                    problem = (
                        f"has no {text_field!r} (missing or null; its fields: {', '.join(record) or 'none'})"
                        if text is None
                        else f"holds a {type(text).__name__}, not a string, in {text_field!r}"
                    )
                    raise ValueError(
                        f"record {number} of training file {source.path} {problem}; pass the field that holds "
                        f"the text with --text-field, or fix the record"
                    )
                yield number, text
    except pyarrow.ArrowException as exc:
        raise ValueError(f"cannot read training file {source.path} as {what}: {exc}; fix or remove it") from exc
