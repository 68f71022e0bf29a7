import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quillgpt.data.corpus as corpus
from quillgpt.data.corpus import DocumentCutter, count_chars, count_records, find_sources, iter_pieces, read_records
from quillgpt.data.tokenizer import build_tokenizer
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
    assert found == [("a.txt", "txt", None), ("b/1.txt.gz", "txt", "gz"), ("b/2.jsonl", "jsonl", None),
                     ("c.parquet", "parquet", None), ("d.jsonl.zst", "jsonl", "zst")]
    assert [s.path.name for s in find_sources(tmp_path / "b" / "*")] == ["1.txt.gz", "2.jsonl"]
    one = find_sources(tmp_path / "notes.md")  # a single file of any name is text
    assert [(s.kind, s.size) for s in one] == [("txt", 1)] and one[0].manifest()["bytes"] == 1


@pytest.mark.parametrize("spec, message", [
    ("missing.txt", "data file not found"),
    ("empty_dir", "holds no .txt, .jsonl or .parquet files"),
    ("*.nothing", "matches no files"),
    ("x" * 300 + ".txt", "File name too long"),
])
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
        assert [(p.text, p.split, p.starts_document) for p in resumed] == [
            (p.text, p.split, p.starts_document) for p in pieces[i:]]


def test_corrupt_zstd_is_one_line(tmp_path):
    (tmp_path / "x.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"not a zstd frame at all" * 3)
    with pytest.raises(QuillError, match="cannot read data.path .*x.jsonl.zst: not valid zst"):
        texts(find_sources(tmp_path / "x.jsonl.zst")[0])
