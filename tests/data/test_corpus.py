import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import deadline

import quillgpt.data.corpus as corpus
from quillgpt.data.corpus import DocumentCutter, count_chars, count_records, find_sources, iter_pieces, read_records
from quillgpt.data.tokenizer_files import build_tokenizer
from quillgpt.errors import QuillError

DOCS = ["First doc.\nIt has two lines.", "", "Second — with ünïcode 🙂 text", "third\n\nwith a blank line\n"]


def write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 1}) + "\n")


def texts(source, field="text", skip=0):
    """{record index: whole text} from read_records."""
    out = {}
    for index, block, _, _ in read_records(source, field, skip):
        out[index] = out.get(index, "") + block
    return out


# --- sources -------------------------------------------------------------------------------------


def test_file_directory_and_glob_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("b/2.jsonl", "a.txt", "c.parquet", "b/1.txt.gz", ".hidden.txt", "notes.md", "d.jsonl.zst"):
        (tmp_path / name).write_bytes(b"x")
    found = [(s.path.relative_to(tmp_path).as_posix(), s.kind, s.compression) for s in find_sources(tmp_path)]
    assert found == [
        ("a.txt", "txt", None),
        ("b/1.txt.gz", "txt", "gz"),
        ("b/2.jsonl", "jsonl", None),
        ("c.parquet", "parquet", None),
        ("d.jsonl.zst", "jsonl", "zst"),
    ]
    assert [s.path.name for s in find_sources(tmp_path / "b" / "*")] == ["1.txt.gz", "2.jsonl"]
    one = find_sources(tmp_path / "notes.md")  # a single file of any name is text
    assert [(s.kind, s.size) for s in one] == [("txt", 1)] and one[0].manifest()["bytes"] == 1


@pytest.mark.parametrize(
    "spec, message",
    [
        ("missing.txt", "data file not found"),
        ("empty_dir", "holds no .txt, .jsonl or .parquet files"),
        ("*.nothing", "matches no files"),
        ("x" * 300 + ".txt", "File name too long"),
    ],
)
def test_bad_sources_are_one_line(tmp_path, spec, message):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(QuillError, match=message) as e:
        find_sources(tmp_path / spec)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


# --- records -------------------------------------------------------------------------------------


def test_jsonl_plain_gzip_zstd_records(tmp_path):
    import zstandard

    write_jsonl(tmp_path / "a.jsonl", DOCS)
    write_jsonl(tmp_path / "b.jsonl.gz", DOCS, opener=gzip.open)
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress((tmp_path / "a.jsonl").read_bytes()))
    write_jsonl(tmp_path / "d.jsonl", DOCS, field="content")
    expected = {i: d for i, d in enumerate(DOCS) if d}  # the empty record counts but yields nothing
    for source in find_sources(tmp_path / "*.jsonl*")[:3]:
        assert count_records(source) == 4 and texts(source) == expected
    assert texts(find_sources(tmp_path / "d.jsonl")[0], "content") == expected
    assert texts(find_sources(tmp_path / "a.jsonl")[0], skip=2) == {2: DOCS[2], 3: DOCS[3]}
    with pytest.raises(QuillError, match=r"line 1 has no 'text' field; set data.text_field"):
        texts(find_sources(tmp_path / "d.jsonl")[0])


def test_parquet_records_skip_across_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"document {i}" for i in range(10)]
    pq.write_table(pa.table({"text": docs, "n": list(range(10))}), tmp_path / "x.parquet", row_group_size=3)
    source = find_sources(tmp_path / "x.parquet")[0]
    assert count_records(source) == 10 and texts(source) == dict(enumerate(docs))
    assert texts(source, skip=7) == {7: docs[7], 8: docs[8], 9: docs[9]}
    with pytest.raises(QuillError, match=r"has no 'body' column \(columns: text, n\)"):
        texts(source, "body")
    with pytest.raises(QuillError, match=r"column 'n' holds int64, not text"):
        texts(source, "n")
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(QuillError, match="fake.parquet: not a parquet file"):
        count_records(find_sources(tmp_path / "fake.parquet")[0])


def test_txt_streams_in_blocks_and_reports_bad_utf8_offsets(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "BLOCK_BYTES", 7)
    text = "héllo wörld, " * 20
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
    source = find_sources(tmp_path / "a.txt.gz")[0]
    blocks = list(read_records(source, "text"))
    assert len(blocks) > 10 and texts(source) == {0: text} and count_chars(source, "text") == len(text)
    assert [last for _, _, last, _ in blocks] == [False] * (len(blocks) - 1) + [True]
    raw = text.encode()
    (tmp_path / "bad.txt").write_bytes(raw[:20] + b"\xe9" + raw[20:])  # byte 20 sits across a block edge
    with pytest.raises(QuillError, match="byte 0xe9 at byte offset 20"):
        texts(find_sources(tmp_path / "bad.txt")[0])
    (tmp_path / "trunc.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:30])
    with pytest.raises(QuillError, match="cannot read data.path .*trunc.jsonl.gz"):
        texts(find_sources(tmp_path / "trunc.jsonl.gz")[0])


# --- cutting -------------------------------------------------------------------------------------


def cut(text, size, anywhere, split_at=None, feeds=None):
    cutter = DocumentCutter(size, anywhere, split_at)
    feeds = feeds or [len(text)]
    out, pos = [], 0
    for i, n in enumerate(feeds):
        out += cutter.feed(text[pos : pos + n] if i < len(feeds) - 1 else text[pos:], final=i == len(feeds) - 1)
        pos += n
    return out


@pytest.mark.usefixtures("gpt2_bpe")
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_pieces_depend_only_on_the_text_and_keep_every_token(shakespeare_path, data):
    whole = shakespeare_path.read_text(encoding="utf-8")
    start = data.draw(st.integers(0, len(whole) - 3000))
    text = whole[start : start + 3000] + data.draw(st.text(max_size=40))
    size = data.draw(st.integers(1, 400))
    feeds = data.draw(st.lists(st.integers(0, 500), max_size=8))
    split_at = data.draw(st.none() | st.integers(0, len(text)))
    for anywhere in (True, False):
        pieces = cut(text, size, anywhere, split_at)
        assert cut(text, size, anywhere, split_at, feeds + [0]) == pieces  # however the text arrives
        assert "".join(p for p, _ in pieces) == text and all(pieces)
        flags = [val for _, val in pieces]
        assert flags == sorted(flags)  # train pieces, then val pieces
        if split_at is not None and anywhere:
            assert sum(len(p) for p, val in pieces if not val) == split_at
    gpt2 = build_tokenizer("gpt2")
    assert sum((gpt2.encode(p) for p, _ in cut(text, size, False)), []) == gpt2.encode(text)


def test_cuts_keep_tokens_of_the_gpt4_pattern(shakespeare_path):
    text = shakespeare_path.read_text(encoding="utf-8")[:60_000] + " end  of  text\twith 123 numbers's"
    bpe = build_tokenizer("bpe", text[:20_000], 400)  # GPT-4's split pattern
    for size in (37, 500):
        pieces = [p for p, _ in cut(text, size, False)]
        assert len(pieces) > 50 and sum((bpe.encode(p) for p in pieces), []) == bpe.encode(text)


def test_iter_pieces_resumes_at_a_cursor(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["alpha beta gamma delta " * 20, "x", "epsilon zeta eta " * 30])
    (tmp_path / "b.txt").write_text("theta iota kappa lambda " * 40)
    sources = find_sources(tmp_path)
    records = [count_records(s) for s in sources]
    args = (sources, "text", records, 3, None, 50, False)
    pieces = list(iter_pieces(*args))
    assert [p.split for p in pieces] == ["val" if p.cursor["source"] == 1 else "train" for p in pieces]  # b.txt: record 3
    assert len(pieces) > 30 and pieces[-1].split == "val" and pieces[-1].read_bytes == sum(s.size for s in sources)
    assert sum(p.starts_document for p in pieces) == 4 and pieces[0].read_bytes <= pieces[-1].read_bytes
    for i in (1, 7, len(pieces) - 3):
        resumed = list(iter_pieces(*args, start=pieces[i].cursor))
        assert [(p.text, p.split, p.starts_document) for p in resumed] == [(p.text, p.split, p.starts_document) for p in pieces[i:]]


def test_corrupt_zstd_is_one_line(tmp_path):
    (tmp_path / "x.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"not a zstd frame at all" * 3)
    with pytest.raises(QuillError, match="cannot read data.path .*x.jsonl.zst: not valid zst"):
        texts(find_sources(tmp_path / "x.jsonl.zst")[0])


# --- compressed readers end at a frame end --------------------------------------------------------


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(
    docs=st.lists(st.text(max_size=3000), min_size=1, max_size=4),
    compression=st.sampled_from(["zst", "gz"]),
    checksum=st.booleans(),
    frames=st.integers(1, 3),
    cut=st.floats(0, 1),
    kind=st.sampled_from(["txt", "jsonl"]),
)
def test_a_compressed_file_cut_short_is_refused_naming_it(tmp_path_factory, docs, compression, checksum, frames, cut, kind):
    """The issue: 80 % of a .zst read as less text with exit 0, and a cut small frame as an empty
    document. Cut anywhere, a compressed file reads whole (the cut fell at a frame's end: then
    the text is that of the whole frames before it) or is refused naming the file."""
    import zstandard

    tmp = tmp_path_factory.mktemp("cut")
    raw = (json.dumps({"text": "".join(docs)}) + "\n" if kind == "jsonl" else "".join(docs)).encode()
    bounds = [len(raw) * i // frames for i in range(frames + 1)]
    parts = [raw[a:b] for a, b in zip(bounds, bounds[1:])]  # several frames / gzip members, concatenated
    if compression == "zst":
        packed = [zstandard.ZstdCompressor(write_checksum=checksum).compress(p) for p in parts]
    else:
        packed = [gzip.compress(p, mtime=0) for p in parts]
    blob = b"".join(packed)
    at = int(cut * len(blob))
    path = tmp / f"doc.{kind}.{compression}"
    path.write_bytes(blob[:at])
    ends = {sum(len(p) for p in packed[:i]): b"".join(parts[:i]) for i in range(frames + 1)}  # frame ends → text
    source = find_sources(path)[0]
    try:
        got = "".join(texts(source).values()) if kind == "txt" else texts(source)
    except QuillError as e:
        if at in ends and not _is_utf8(ends[at]):  # the frames split a character: its whole frames are not text
            assert str(path) in str(e) and "not UTF-8" in str(e), str(e)
            return
        assert at not in ends and str(path) in str(e) and "not valid" in str(e), str(e)
        return
    assert at in ends, f"{at} of {len(blob)} bytes read quietly"
    if kind == "txt":
        assert got == ends[at].decode("utf-8")


def test_the_issue_cases_of_a_truncated_zst(tmp_path, shakespeare_path):
    import zstandard

    text = shakespeare_path.read_bytes()
    whole = zstandard.ZstdCompressor().compress(text)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "shakespeare.txt.zst").write_bytes(whole[: len(whole) * 8 // 10])  # 80 %
    small = zstandard.ZstdCompressor().compress(b'{"text": "a small document"}\n')
    (tmp_path / "small.jsonl.zst").write_bytes(small[:-3])
    for spec in (tmp_path / "corpus", tmp_path / "small.jsonl.zst"):
        source = find_sources(spec)[0]
        with pytest.raises(QuillError, match=r"cannot read data.path .*\.zst: not valid zst \(.*truncated"):
            texts(source)
    (tmp_path / "two.txt.zst").write_bytes(whole + zstandard.ZstdCompressor().compress(b"THE END"))
    assert "".join(texts(find_sources(tmp_path / "two.txt.zst")[0]).values()) == text.decode() + "THE END"  # every frame


# --- inputs that never end -----------------------------------------------------------------------


def tree(root, spec: dict) -> None:
    for name, value in spec.items():
        if isinstance(value, dict):
            (root / name).mkdir()
            tree(root / name, value)
        else:
            (root / name).write_text(value)


NAMES = st.sampled_from(["a.txt", "b.jsonl", ".h.txt", "c.md", "d", "e.txt.gz", "sub", ".hid"])
TREES = st.recursive(st.just("x"), lambda kids: st.dictionaries(NAMES, kids, max_size=4), max_leaves=10).filter(
    lambda t: isinstance(t, dict)
)
PATTERNS = st.lists(st.sampled_from(["*", "**", "*.txt", "sub", "d", "?.jsonl", ".h*", "[ab].*", "*.t?t"]), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(spec=TREES, pattern=PATTERNS, loop=st.sampled_from([None, ".", "..", "sub"]))
def test_globs_match_what_glob_does_and_symlink_loops_end(tmp_path_factory, spec, pattern, loop):
    """data.path globs against Python's glob on trees without links; with a link to `.` or `..`
    (which glob's `**` follows forever) the walk ends and finds the same files."""
    import glob
    import os

    root = tmp_path_factory.mktemp("tree")
    tree(root, spec)
    joined = str(root / os.path.join(*pattern))
    want = sorted({p for p in glob.glob(joined, recursive=True) if os.path.isfile(p)})  # (glob repeats some)
    if loop == "..":  # deep/up → deep's parent, the root (never outside it: other tests' files are there)
        (root / "deep").mkdir(exist_ok=True)
        os.symlink("..", root / "deep" / "up")
    elif loop is not None:
        os.symlink(loop, root / "link")  # root/link → root, or root/sub (maybe not there: a broken link)
    try:
        got = [str(s.path) for s in find_sources(joined)]
    except QuillError as e:
        assert "matches no files" in str(e) or "data file not found" in str(e), str(e)
        got = []
    real = sorted(os.path.realpath(p) for p in got)
    if loop is None:
        assert got == want
    else:
        assert set(os.path.realpath(p) for p in want) <= set(real) and len(got) < 10_000


@pytest.mark.parametrize("where", ["file", "directory", "glob", "link"])
def test_devices_and_fifos_in_data_path_are_refused_by_name(tmp_path, where):
    import os

    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "ok.txt").write_text("fine")
    spec = {"file": tmp_path / "pipe.txt", "directory": tmp_path, "glob": tmp_path / "*.txt", "link": tmp_path / "z.txt"}
    if where == "link":
        os.symlink("/dev/zero", tmp_path / "z.txt")
    with deadline(30):
        with pytest.raises(QuillError, match=r"data.path .*(pipe|z)\.txt is (a FIFO \(named pipe\)|a device), not a file"):
            texts(find_sources(spec[where])[0])
        with pytest.raises(QuillError, match="is a device, not a file"):
            find_sources("/dev/zero")


@settings(max_examples=20, deadline=None, database=None, derandomize=True)
@given(
    depth=st.one_of(st.integers(1, 50), st.sampled_from([999, 5000, 100_000])),
    line=st.integers(0, 3),
    opener=st.sampled_from(["[", '{"a": ']),
)
def test_a_jsonl_line_nested_any_depth_is_one_error_naming_file_and_line(tmp_path_factory, depth, line, opener):
    """The issue: a line nested 100,000 deep was a RecursionError traceback in prepare."""
    path = tmp_path_factory.mktemp("deep") / "deep.jsonl"
    closer = "]" if opener == "[" else "}"
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(4)]
    lines[line] = opener * depth + "1" + closer * depth
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(QuillError) as e:
        texts(find_sources(path)[0])
    assert f"deep.jsonl line {line + 1} " in str(e.value) and "\n" not in str(e.value)
