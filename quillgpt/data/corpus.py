"""Reading a corpus: which files make it, and the documents in them, streamed in bounded memory.

`data.path` is a file, a directory (every .txt/.jsonl/.parquet file under it, by sorted path) or
a glob. A `.txt` file is one document; a `.jsonl` file holds one document per line (the `text`
field, or `data.text_field`); a `.parquet` file one per row (FineWeb's layout: a `text` column).
`.gz` and `.zst` variants are decompressed on the fly; pyarrow and zstandard come with the `data`
extra. A single file with another suffix is read as UTF-8 text (e.g. Tiny Shakespeare's
input.txt under any name).

Documents are cut into pieces only where the cut leaves a byte-level tokenizer's ids unchanged,
so tokenizing the pieces (in parallel) gives the ids of each whole document.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from quillgpt.errors import QuillError
from quillgpt.files import check_input, os_error, shown

KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
BLOCK_BYTES = 1 << 22  # read size: 4 MB of a file at a time
PARQUET_ROWS = 1024  # rows per parquet batch
WHAT = "data.path"
HOW = "set data.path to a UTF-8 text file, a directory or a glob of .txt/.jsonl/.parquet files"

# Cuts that keep a byte-level tokenizer's ids (GPT-2, cl100k/GPT-4 and o200k split patterns):
# after "<non-space>\n" before a letter (tokenizer.find_safe_cut's rule), or between a letter and
# " <letter>". No piece of those patterns runs across either: a letter run ends at the space,
# and " <letter>" starts the next piece whether or not text precedes it.
SAFE_CUT = re.compile(r"(?<=\S\n)(?=[^\W\d_])|(?<=[^\W\d_])(?= [^\W\d_])")


@dataclass(frozen=True)
class Source:
    """One file of the corpus and how to read it."""

    path: Path
    kind: str  # txt | jsonl | parquet
    compression: str | None  # gz | zst | None
    size: int  # bytes on disk
    mtime_ns: int

    def manifest(self) -> dict[str, Any]:
        """What meta.json records to tell later runs whether the file changed."""
        return {"path": str(self.path), "bytes": self.size, "mtime_ns": self.mtime_ns}


def _kind(path: Path) -> tuple[str | None, str | None]:
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    return (KINDS.get(suffixes[-1]) if suffixes else None), compression


def _source(path: Path, loose: bool) -> Source | None:
    """A Source for `path`; None for a file a directory listing should skip (unknown suffix). A
    device or FIFO is refused by name (reading it would never end)."""
    kind, compression = _kind(path)
    if kind is None and not loose:
        return None
    try:
        st = check_input(path, WHAT)
    except OSError as e:
        raise os_error(e, path, "read", WHAT) from None
    return Source(path, kind or "txt", compression, st.st_size, st.st_mtime_ns)


def find_sources(spec: str | Path) -> list[Source]:
    """The files `data.path` names, in a fixed order (sorted paths), or one QuillError."""
    path = Path(spec)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as e:  # ENAMETOOLONG and friends
        raise os_error(e, path, "read", WHAT) from None
    if is_dir:
        sources = [s for p in sorted(_files(path, ["**"])) if (s := _source(p, loose=False)) is not None]
        if not sources:
            raise QuillError(f"{WHAT} {shown(path)} holds no .txt, .jsonl or .parquet files; {HOW}")
        return sources
    if exists:
        return [_source(path, loose=True)]
    if glob.has_magic(str(spec)):
        parts = path.parts
        literal = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
        root = Path(*parts[:literal]) if literal else Path(".")
        matches = [p for p in sorted(_files(root, list(parts[literal:]))) if os.path.exists(p)]  # not a broken link
        sources = [_source(p, loose=True) for p in matches]
        if not sources:
            raise QuillError(f"{WHAT} {shown(spec)} matches no files; {HOW}")
        return sources
    raise QuillError(f"data file not found: {shown(path)} ({HOW})")


def _files(directory: Path, pattern: list[str], seen: set | None = None) -> Iterator[Path]:
    """The non-directories under `directory` whose path below it matches `pattern`, glob's
    components (`**`: any depth; names starting with "." only when the pattern's do). Symlinks
    are followed, but a directory is entered once per pattern position, so a link to `.` or `..`
    ends instead of looping forever."""
    seen = set() if seen is None else seen
    try:
        st = os.stat(directory)
        key = (st.st_dev, st.st_ino, len(pattern))
        if key in seen or not pattern:
            return
        seen.add(key)
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):  # a glob's literal part that is not there matches nothing
        return
    except OSError as e:
        raise os_error(e, directory, "read", WHAT) from None
    head, rest = pattern[0], pattern[1:]
    if head == "**" and rest:
        yield from _files(directory, rest, seen)
    for entry in entries:
        if entry.name.startswith(".") and not head.startswith("."):
            continue
        path, is_dir = directory / entry.name, entry.is_dir()  # is_dir follows a symlink
        if head == "**":
            yield from _files(path, pattern, seen) if is_dir else ([] if rest else [path])
        elif fnmatch.fnmatchcase(entry.name, head):
            yield from (_files(path, rest, seen) if is_dir else []) if rest else ([] if is_dir else [path])


# ---------------------------------------------------------------------------------------------
# opening and decoding


class _Counting:
    """A raw file that counts the bytes read from disk (progress for compressed files too)."""

    def __init__(self, f: BinaryIO):
        self.f, self.read_bytes = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.read_bytes += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self.f.readinto(buf)
        self.read_bytes += n or 0
        return n

    def readable(self) -> bool:
        return True


@contextmanager
def _open(source: Source) -> Iterator[tuple[Any, _Counting]]:
    """(decompressed binary stream, byte counter of the file on disk)."""
    zstd = _zstandard() if source.compression == "zst" else None
    failures = (OSError, EOFError, zlib.error) + ((zstd.ZstdError,) if zstd else ())
    try:
        with open(source.path, "rb") as raw:
            counter = _Counting(raw)
            if source.compression == "gz":  # gzip raises EOFError itself at a stream cut short
                yield gzip.GzipFile(fileobj=counter, mode="rb"), counter
            elif zstd is not None:
                _check_zstd_frames(raw.fileno())  # zstd's reader would end quietly at a cut
                yield zstd.ZstdDecompressor().stream_reader(counter, read_across_frames=True), counter
            else:
                yield counter, counter
    except failures as e:  # unreadable, or not valid gzip/zstd (truncated, corrupt)
        raise _read_error(e, source) from None


ZSTD_MAGIC, SKIPPABLE = 0xFD2FB528, 0x184D2A50  # a frame's first 4 bytes (skippable: the top 28 bits)


def _check_zstd_frames(fd: int) -> None:
    """Raise EOFError unless the file is whole zstd frames: frame headers and block headers are
    walked (a few bytes each, nothing decompressed) up to the file's end, which must be a
    frame's end (the format: RFC 8878)."""
    size, pos = os.fstat(fd).st_size, 0
    while pos < size:
        magic = int.from_bytes(_exactly(fd, pos, 4), "little")
        if magic & 0xFFFFFFF0 == SKIPPABLE:
            pos += 8 + int.from_bytes(_exactly(fd, pos + 4, 4), "little")
            continue
        if magic != ZSTD_MAGIC:
            raise EOFError(f"no zstd frame at byte {pos}")
        fhd = _exactly(fd, pos + 4, 1)[0]  # the frame header descriptor
        single, checksum = fhd >> 5 & 1, fhd >> 2 & 1
        pos += 5 + (1 - single) + (0, 1, 2, 4)[fhd & 3] + (single, 2, 4, 8)[fhd >> 6]
        last = 0
        while not last:  # block header: last-block bit, type (1 = RLE: one byte), size
            header = int.from_bytes(_exactly(fd, pos, 3), "little")
            last, kind, length = header & 1, header >> 1 & 3, header >> 3
            pos += 3 + (1 if kind == 1 else length)
        pos += 4 * checksum
    if pos > size:
        raise EOFError("the file ends inside a zstd frame (truncated)")


def _exactly(fd: int, pos: int, n: int) -> bytes:
    data = os.pread(fd, n, pos)
    if len(data) < n:
        raise EOFError("the file ends inside a zstd frame (truncated)")
    return data


def _read_error(e: BaseException, source: Source) -> QuillError:
    if isinstance(e, OSError) and e.strerror:
        return os_error(e, source.path, "read", WHAT)
    return QuillError(f"cannot read {WHAT} {shown(source.path)}: not valid {source.compression or 'data'} ({e})")


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:
        raise QuillError("reading .zst files needs zstandard: pip install 'quillgpt[data]'") from None
    return zstandard


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (pyarrow.parquet below)
    except ImportError:
        raise QuillError("reading .parquet files needs pyarrow: pip install 'quillgpt[data]'") from None
    return pyarrow


def _blocks(stream: Any) -> Iterator[bytes]:
    while block := stream.read(BLOCK_BYTES):
        yield block


def _text_blocks(stream: Any, source: Source) -> Iterator[str]:
    """The stream decoded as UTF-8, block by block; a clear error at the first invalid byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    for block in _with_end(_blocks(stream)):
        held = len(decoder.getstate()[0])  # bytes of a character cut by the previous block
        try:
            text = decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:  # e.object is the held bytes + this block
            raise QuillError(
                f"{source.path} is not UTF-8 text: byte 0x{e.object[e.start]:02x} at byte offset "
                f"{offset - held + e.start} is "
                f"invalid ({e.reason}); convert it first, e.g. iconv -f latin1 -t utf-8"
            ) from None
        offset += len(block)
        if text:
            yield text


def _with_end(blocks: Iterator[bytes]) -> Iterator[bytes]:
    yield from blocks
    yield b""  # the decoder's final call: a character cut off at the end of the file is an error


def _lines(stream: Any) -> Iterator[bytes]:
    """The lines of a binary stream (without b"\\n"), including a last line without one."""
    carry = b""
    for block in _blocks(stream):
        parts = (carry + block).split(b"\n")
        carry = parts.pop()
        yield from parts
    if carry:
        yield carry


# ---------------------------------------------------------------------------------------------
# records: a document per txt file, jsonl line or parquet row


def count_records(source: Source) -> int:
    """How many records (documents, empty ones included) the file holds, without parsing them."""
    if source.kind == "txt":
        return 1
    if source.kind == "parquet":
        return _parquet_file(source).metadata.num_rows
    with _open(source) as (stream, _):
        return sum(1 for _ in _lines(stream))


def count_chars(source: Source, text_field: str) -> int:
    """Characters of a one-record file's document (for the train/val cut of a one-document corpus)."""
    return sum(len(block) for _, block, _, _ in read_records(source, text_field))


def _parquet_file(source: Source) -> Any:
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(source.path)
    except OSError as e:
        raise _read_error(e, source) from None
    except pa.ArrowException as e:  # ArrowInvalid: not a parquet file
        raise QuillError(f"cannot read {WHAT} {shown(source.path)}: not a parquet file ({e})") from None


def _json_text(line: bytes, number: int, source: Source, field: str) -> str | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise QuillError(f"{shown(source.path)} line {number + 1} is not a JSON object ({e})") from None
    except RecursionError:  # [[[[... 100,000 deep: more than the parser's stack
        raise QuillError(f"{shown(source.path)} line {number + 1} is nested too deeply to be a JSON record") from None
    if not isinstance(record, dict) or field not in record:
        raise QuillError(
            f"{shown(source.path)} line {number + 1} has no {field!r} field; set data.text_field to the field that holds the text"
        )
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise QuillError(f"{shown(source.path)} line {number + 1}: {field!r} is {type(text).__name__}, not text")
    return text


def _parquet_texts(source: Source, field: str, skip: int) -> Iterator[tuple[int, str | None, int]]:
    pf, pa = _parquet_file(source), _pyarrow()
    names = pf.schema_arrow.names
    if field not in names:
        raise QuillError(f"{shown(source.path)} has no {field!r} column (columns: {', '.join(names[:10])}); set data.text_field")
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise QuillError(f"{shown(source.path)}: column {field!r} holds {kind}, not text; set data.text_field")
    meta, first, start = pf.metadata, 0, 0
    while first < meta.num_row_groups and start + meta.row_group(first).num_rows <= skip:
        start += meta.row_group(first).num_rows
        first += 1
    total, index = max(meta.num_rows, 1), start
    try:
        groups = list(range(first, meta.num_row_groups))
        for batch in pf.iter_batches(batch_size=PARQUET_ROWS, row_groups=groups, columns=[field]) if groups else ():
            for text in batch.column(0).to_pylist():
                if index >= skip:
                    yield index, text, source.size * (index + 1) // total
                index += 1
    except OSError as e:
        raise _read_error(e, source) from None
    except pa.ArrowException as e:  # a corrupt page
        raise QuillError(f"cannot read {WHAT} {shown(source.path)}: corrupt parquet data ({e})") from None


def read_records(source: Source, text_field: str, skip: int = 0) -> Iterator[tuple[int, str, bool, int]]:
    """(record index, text block, is the record's last block, bytes of the file read so far).

    A jsonl/parquet record comes as one block; a txt file's one record as decoded blocks of
    about BLOCK_BYTES, so a file of any size streams. Records without text yield nothing."""
    if source.kind == "parquet":
        for index, text, done in _parquet_texts(source, text_field, skip):
            if text:
                yield index, text, True, done
        return
    with _open(source) as (stream, counter):
        if source.kind == "txt":
            blocks = _text_blocks(stream, source)
            block = next(blocks, None)
            while block is not None:
                following = next(blocks, None)
                yield 0, block, following is None, counter.read_bytes
                block = following
            return
        for index, line in enumerate(_lines(stream)):
            if index >= skip and (text := _json_text(line, index, source, text_field)):
                yield index, text, True, counter.read_bytes


# ---------------------------------------------------------------------------------------------
# cutting a document into pieces


def next_cut(text: str, lo: int, final: bool, anywhere: bool) -> int | None:
    """The first position ≥ lo where `text` can be cut without changing its ids (any position when
    `anywhere`, as for a char tokenizer). None when there is none yet: more text may bring one, or
    with `final`, the document has none after lo."""
    if anywhere:
        return lo if lo <= len(text) else None
    m = SAFE_CUT.search(text, lo)
    if m is not None and (final or m.start() <= len(text) - 2):  # its context is all here
        return m.start()
    return None


class DocumentCutter:
    """Cuts one document, fed block by block, into pieces of at least `size` characters at safe
    cuts; with `split_at` (a one-document corpus), also at the first safe cut at or after that
    character, where the train split ends and val begins. The pieces depend only on the text."""

    def __init__(self, size: int, anywhere: bool, split_at: int | None = None):
        self.size, self.anywhere, self.split_at = size, anywhere, split_at
        self.buf = ""  # the text from `ctx` characters before the current piece's start
        self.ctx = 0  # up to 2 characters of the previous piece, context for the cut rule
        self.base = 0  # document offset of the current piece's start
        self.val = False  # the current piece belongs to the val split

    def feed(self, text: str, final: bool = False) -> Iterator[tuple[str, bool]]:
        """(piece, in val) for every piece the text so far completes; all the rest when final."""
        self.buf += text
        while True:
            pending = self.split_at is not None and not self.val
            lo = min(self.size, max(0, self.split_at - self.base)) if pending else self.size
            cut = next_cut(self.buf, self.ctx + lo, final, self.anywhere)
            if cut is None:
                break
            if cut > self.ctx:
                yield self.buf[self.ctx : cut], self.val
            self.base += cut - self.ctx
            self.ctx = min(cut, 2)
            self.buf = self.buf[cut - self.ctx :]
            self.val = pending and self.base >= self.split_at or self.val
        if final and len(self.buf) > self.ctx:
            yield self.buf[self.ctx :], self.val
            self.buf, self.ctx = "", 0


# ---------------------------------------------------------------------------------------------
# the corpus as one stream of pieces


@dataclass
class Piece:
    text: str
    starts_document: bool
    split: str  # train | val
    cursor: dict[str, int]  # {"source", "record", "piece"}: where to start reading to get it again
    read_bytes: int  # bytes of the corpus on disk read so far
    where: str = ""  # a whole record's place, "path line N", for messages about it (iter_lines)


def iter_pieces(
    sources: list[Source],
    text_field: str,
    records: list[int],
    val_from: int | None,
    split_at: int | None,
    size: int,
    anywhere: bool,
    start: dict[str, int] | None = None,
) -> Iterator[Piece]:
    """Every document of the corpus, in order, cut into pieces of about `size` characters.

    A piece is val when its record's index in the corpus is ≥ `val_from` (the last documents), or,
    in a one-document corpus, when it comes after the cut at character `split_at`. `start` (a
    Piece.cursor) resumes: earlier files are skipped unread, earlier records of its file unparsed,
    and earlier pieces of its record re-cut but not yielded."""
    start = start or {"source": 0, "record": 0, "piece": 0}
    first = [sum(records[:i]) for i in range(len(sources))]  # corpus index of each file's record 0
    done = sum(s.size for s in sources[: start["source"]])
    for si in range(start["source"], len(sources)):
        resuming = si == start["source"]
        current, cutter, number = None, None, 0
        for record, block, last, read in read_records(sources[si], text_field, start["record"] if resuming else 0):
            if record != current:
                current, cutter, number = record, DocumentCutter(size, anywhere, split_at), 0
            in_val_docs = val_from is not None and first[si] + record >= val_from
            for text, in_val in cutter.feed(block, final=last):
                if not (resuming and record == start["record"] and number < start["piece"]):
                    split = "val" if in_val or in_val_docs else "train"
                    yield Piece(text, number == 0, split, {"source": si, "record": record, "piece": number}, done + read)
                number += 1
        done += sources[si].size


def iter_lines(sources: list[Source], records: list[int], val_from: int, start: dict[str, int] | None = None) -> Iterator[Piece]:
    """Every non-blank line of jsonl files, in order, each a whole piece for its reader to parse
    (a conversation, for chat data; bytes that are not UTF-8 stay surrogate escapes, for it to
    refuse), val from corpus record `val_from` on. `start` (a Piece.cursor) resumes: earlier
    files are skipped unread, earlier lines of its file unyielded."""
    start = start or {"source": 0, "record": 0, "piece": 0}
    first = [sum(records[:i]) for i in range(len(sources))]  # corpus index of each file's line 0
    done = sum(s.size for s in sources[: start["source"]])
    for si in range(start["source"], len(sources)):
        skip = start["record"] if si == start["source"] else 0
        with _open(sources[si]) as (stream, counter):
            for index, line in enumerate(_lines(stream)):
                if index >= skip and line.strip():
                    split = "val" if first[si] + index >= val_from else "train"
                    where = f"{shown(sources[si].path)} line {index + 1}"
                    yield Piece(
                        line.decode("utf-8", "surrogateescape"),
                        True,
                        split,
                        {"source": si, "record": index, "piece": 0},
                        done + counter.read_bytes,
                        where,
                    )
        done += sources[si].size
