import dataclasses
import hashlib
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from quillgpt.cli import main
from quillgpt.config import load_config
from quillgpt.data.batches import BatchSampler, batch_from_starts, fixed_windows
from quillgpt.data.download import download
from quillgpt.data.prepare import Manifest, load_prepared, load_tokens, prepare, token_dtype
from quillgpt.data.tokenizer_files import build_tokenizer, load_tokenizer, save_tokenizer
from quillgpt.errors import QuillError


def write_config(tmp_path, name="cfg.yaml", **data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"data": data}), encoding="utf-8")
    return path


def data_cfg(tmp_path, **data):
    return load_config(write_config(tmp_path, **data)).data


def bins_mtime(out_dir):
    return [os.stat(out_dir / f).st_mtime_ns for f in ("train.bin", "val.bin", "meta.json")]


@pytest.fixture
def small_text(tmp_path, shakespeare_path):
    path = tmp_path / "small.txt"
    path.write_text(shakespeare_path.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    return path


# --- prepare ---------------------------------------------------------------------------------


def test_the_manifest_is_meta_json_key_for_key_and_reports_what_prepare_did(tmp_path, small_text):
    cfg = data_cfg(tmp_path, path=str(small_text), tokenizer="char", out_dir=str(tmp_path / "char"))
    result = prepare(cfg, progress=False)
    on_disk = json.loads((result.out_dir / "meta.json").read_text(encoding="utf-8"))
    assert list(result.manifest.to_dict().items()) == list(on_disk.items())
    assert Manifest.from_dict(on_disk) == result.manifest and result.manifest.chat is None
    m = result.manifest
    assert (m.train_tokens + m.val_tokens, m.shard_count, m.made_from(), m.skipped()) == (30_000, 2, "1 document(s)", (0, None))
    assert re.fullmatch(
        rf"prepared {re.escape(str(result.out_dir))}: 27,000 train \+ 3,000 val tokens in 2 shard\(s\) from 1 document\(s\), "
        rf"char vocab {m.vocab_size} \(uint16\), 0\.03 MB in \d+\.\d\ds \(\d+\.\d MB/s\)",
        result.report(),
    )
    again = prepare(cfg, progress=False)
    assert not again.rebuilt and again.manifest == m
    assert again.report() == f"up to date: {result.out_dir} (27,000 train + 3,000 val tokens; --force rebuilds)"


def test_prepare_char_from_config(tmp_path, shakespeare_path):
    text = shakespeare_path.read_text(encoding="utf-8")
    cfg = data_cfg(tmp_path, path=str(shakespeare_path), tokenizer="char", out_dir=str(tmp_path / "char"))
    result = prepare(cfg, progress=False)
    meta, tok = load_prepared(result.out_dir)
    assert result.rebuilt and meta == result.meta
    assert meta["vocab_size"] == 65 and meta["dtype"] == "uint16" and meta["tokenizer"]["type"] == "char"
    assert meta["sources"] == [
        {"path": str(shakespeare_path), "bytes": len(shakespeare_path.read_bytes()), "mtime_ns": os.stat(shakespeare_path).st_mtime_ns}
    ]
    assert meta["shards"] == {
        "train": [{"file": "train.bin", "tokens": len(text) - round(0.1 * len(text))}],
        "val": [{"file": "val.bin", "tokens": round(0.1 * len(text))}],
    }
    train, val = load_tokens(result.out_dir, "train"), load_tokens(result.out_dir, "val")
    assert train.dtype == np.uint16 and len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    assert len(val) == round(0.1 * len(text))  # char: the split is exactly the last val_fraction
    assert tok.decode(train) + tok.decode(val) == text


@pytest.mark.usefixtures("gpt2_bpe")
def test_prepare_gpt2_from_config_matches_plain_encoding(tmp_path, shakespeare_path):
    text = shakespeare_path.read_text(encoding="utf-8")
    cfg = data_cfg(tmp_path, path=str(shakespeare_path), tokenizer="gpt2", out_dir=str(tmp_path / "gpt2"))
    meta = prepare(cfg, progress=False).meta
    assert meta["vocab_size"] == 50257 and meta["eot_id"] == 50256 and meta["dtype"] == "uint16"
    train, val = load_tokens(cfg.out_dir, "train"), load_tokens(cfg.out_dir, "val")
    # the document starts with end-of-text; pieces + the split at a newline = one plain encode
    tok = build_tokenizer("gpt2")
    assert np.concatenate([train, val]).tolist() == [50256] + tok.encode(text)
    val_text = tok.decode(val)
    assert abs(len(val_text) - 0.1 * len(text)) <= 1000 and tok.decode(train).endswith("\n")


def test_prepare_bpe_rebuilds_its_tokenizer_from_meta(tmp_path, small_text):
    cfg = data_cfg(tmp_path, path=str(small_text), tokenizer="bpe", bpe_vocab_size=300, out_dir=str(tmp_path / "bpe"))
    meta = prepare(cfg, progress=False).meta
    _, tok = load_prepared(cfg.out_dir)
    assert tok.vocab_size == meta["vocab_size"] == 300 and tok.fingerprint() == meta["tokenizer_fingerprint"]
    text = small_text.read_text(encoding="utf-8")
    train = load_tokens(cfg.out_dir, "train")
    assert train[0] == tok.eot_id == 299  # the empty prompt's start token is in the training data
    assert tok.decode(train[1:]) + tok.decode(load_tokens(cfg.out_dir, "val")) == text


@pytest.mark.usefixtures("gpt2_bpe")
def test_prepare_is_idempotent_and_rebuilds_on_any_change(tmp_path, small_text):
    out = tmp_path / "out"
    cfg_file = write_config(tmp_path, path=str(small_text), tokenizer="char", out_dir=str(out))
    assert prepare(load_config(cfg_file).data, progress=False).rebuilt
    before = bins_mtime(out)
    again = prepare(load_config(cfg_file).data, progress=False)
    assert not again.rebuilt and bins_mtime(out) == before  # nothing rewritten

    assert prepare(load_config(cfg_file).data, force=True, progress=False).rebuilt
    for override in (["data.val_fraction=0.2"], ["data.tokenizer=gpt2"]):  # other data: only on purpose (--force)
        with pytest.raises(QuillError, match="would replace it: give it a directory of its own with data.out_dir="):
            prepare(load_config(cfg_file, override).data, progress=False)
        assert prepare(load_config(cfg_file, override).data, force=True, progress=False).rebuilt
    with open(small_text, "a", encoding="utf-8") as f:  # the same file, edited: rebuilt
        f.write("\nA new line of text.\n")
    result = prepare(load_config(cfg_file, ["data.tokenizer=gpt2"]).data, progress=False)
    assert result.rebuilt and result.meta["sources"][0]["bytes"] == small_text.stat().st_size
    (out / "val.bin").unlink()  # a damaged output is rebuilt, not trusted
    assert prepare(load_config(cfg_file, ["data.tokenizer=gpt2"]).data, progress=False).rebuilt
    assert not list(out.glob("*.tmp"))


def test_prepare_bpe_tokenizer_changes_are_detected(tmp_path, small_text):
    cfg_file = write_config(tmp_path, path=str(small_text), tokenizer="bpe", bpe_vocab_size=300, out_dir=str(tmp_path / "o"))
    assert prepare(load_config(cfg_file).data, progress=False).rebuilt
    assert not prepare(load_config(cfg_file).data, progress=False).rebuilt
    assert prepare(load_config(cfg_file, ["data.bpe_vocab_size=320"]).data, force=True, progress=False).rebuilt
    with pytest.raises(QuillError, match="would replace it"):
        prepare(load_config(cfg_file).data, progress=False)


# --- download --------------------------------------------------------------------------------


def test_download_file_url_once_then_reuse(tmp_path, small_text, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "remote.txt"
    src.write_bytes(small_text.read_bytes())
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    cfg = data_cfg(tmp_path, url=src.as_uri(), sha256=sha, out_dir="data/remote_char")
    result = prepare(cfg, progress=False)
    dest = tmp_path / "data" / "downloads" / "remote.txt"
    assert dest.read_bytes() == src.read_bytes() and result.meta["sources"][0]["path"] == str(Path("data/downloads/remote.txt"))
    src.unlink()  # the second run must not need the "network"
    assert not prepare(cfg, progress=False).rebuilt
    assert not list(dest.parent.glob("*.part"))
    dest.unlink()  # nor the download itself, once its data are prepared
    assert not prepare(cfg, progress=False).rebuilt and not dest.exists()
    with pytest.raises(QuillError, match=r"could not download .*remote.txt .*, or point data.path= at a copy you have"):
        prepare(dataclasses.replace(cfg, val_fraction=0.2), force=True, progress=False)


def test_download_checksum_mismatch_names_url_path_and_both_hashes(tmp_path, small_text):
    dest = tmp_path / "downloads" / "input.txt"
    with pytest.raises(QuillError) as e:
        download(small_text.as_uri(), "0" * 64, dest, progress=False)
    msg, actual = str(e.value), hashlib.sha256(small_text.read_bytes()).hexdigest()
    assert small_text.as_uri() in msg and str(dest.resolve()) in msg and "0" * 64 in msg and actual in msg
    assert not dest.exists() and not list(dest.parent.glob("*"))  # nothing half-written


def test_download_offline_names_url_and_where_to_place_the_file(tmp_path):
    url = (tmp_path / "not-there.txt").as_uri()
    dest = tmp_path / "downloads" / "input.txt"
    with pytest.raises(QuillError) as e:
        download(url, None, dest, progress=False)
    assert f"could not download {url}" in str(e.value) and f"place it at {dest.resolve()}" in str(e.value)


def test_existing_download_with_wrong_checksum_is_reported(tmp_path):
    dest = tmp_path / "input.txt"
    dest.write_text("not Shakespeare")
    with pytest.raises(QuillError, match="expected 1111"):
        download("https://example.invalid/input.txt", "1" * 64, dest, progress=False)


# --- bad input -------------------------------------------------------------------------------


def test_bad_text_files_are_one_clear_error(tmp_path):
    def read_text(path):  # what quill prepare reads data.path with
        prepare(data_cfg(tmp_path, path=str(path), out_dir=str(tmp_path / "o")), progress=False)

    with pytest.raises(QuillError, match="data file not found"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(QuillError, match="is empty"):
        read_text(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("héllo".encode() + b" caf\xe9")
    with pytest.raises(QuillError, match=r"not UTF-8 text: byte 0xe9 at byte offset 10"):
        read_text(tmp_path / "latin1.txt")
    cfg = data_cfg(tmp_path, path=str(tmp_path / "latin1.txt"), out_dir=str(tmp_path / "o"))
    with pytest.raises(QuillError, match="byte offset 10"):
        prepare(cfg, progress=False)


def test_file_smaller_than_a_block_fails_when_the_sampler_is_built(tmp_path):
    (tmp_path / "tiny.txt").write_text("To be, or not to be: that is the question.\n")
    cfg = data_cfg(tmp_path, path=str(tmp_path / "tiny.txt"), out_dir=str(tmp_path / "o"))
    prepare(cfg, progress=False)
    val = load_tokens(cfg.out_dir, "val")
    with pytest.raises(QuillError, match=rf"val split has {len(val)} tokens, fewer than block_size \+ 1 = 33"):
        BatchSampler(val, block_size=32, batch_size=4, seed=0, split="val")
    with pytest.raises(QuillError, match="fewer than block_size"):
        fixed_windows(val, 32, 4)


def test_vocab_too_big_for_the_dtype(tmp_path, small_text):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    with pytest.raises(QuillError, match="does not fit uint32"):
        token_dtype(2**32 + 1)
    cfg = data_cfg(tmp_path, path=str(small_text), out_dir=str(tmp_path / "o"))
    prepare(cfg, progress=False)
    meta_path = tmp_path / "o" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, vocab_size=70_000)))  # uint16 cannot hold these ids
    with pytest.raises(QuillError, match="too small for vocab_size 70000"):
        load_tokens(tmp_path / "o", "train")


def test_saved_tokenizer_file_is_used_and_its_gaps_reported(tmp_path, small_text):
    text = small_text.read_text(encoding="utf-8")
    save_tokenizer(build_tokenizer("bpe", text, 300), tmp_path / "bpe.json")
    cfg_file = write_config(tmp_path, path=str(small_text), tokenizer=str(tmp_path / "bpe.json"), out_dir=str(tmp_path / "o"))
    meta = prepare(load_config(cfg_file).data, progress=False).meta
    assert meta["tokenizer"] == load_tokenizer(tmp_path / "bpe.json").spec()
    assert not prepare(load_config(cfg_file).data, progress=False).rebuilt
    save_tokenizer(build_tokenizer("bpe", text, 280), tmp_path / "bpe.json")  # same path, new content: other ids
    with pytest.raises(QuillError, match=r"tokenizer file [0-9a-f]{8}.* data.out_dir=.*small_bpe"):
        prepare(load_config(cfg_file).data, progress=False)
    assert prepare(load_config(cfg_file).data, force=True, progress=False).rebuilt

    save_tokenizer(build_tokenizer("char", "abcdefghijklmnopqrstuvwxyz \n"), tmp_path / "char.json")
    cfg = data_cfg(tmp_path, path=str(small_text), tokenizer=str(tmp_path / "char.json"), out_dir=str(tmp_path / "c"))
    with pytest.raises(QuillError, match=r"distinct character\(s\) the tokenizer .*char.json cannot encode \('!' ×"):
        prepare(cfg, progress=False)


def test_missing_prepared_data_and_unknown_tokenizer(tmp_path, small_text):
    with pytest.raises(QuillError, match="run `quill prepare"):
        load_tokens(tmp_path / "nothing", "train")
    cfg = data_cfg(tmp_path, path=str(small_text), tokenizer="sentencepiece", out_dir=str(tmp_path / "o"))
    with pytest.raises(QuillError, match="unknown tokenizer 'sentencepiece'.*char, gpt2"):
        prepare(cfg, progress=False)


# --- batches ---------------------------------------------------------------------------------


@pytest.fixture
def tokens(tmp_path, small_text):
    cfg = data_cfg(tmp_path, path=str(small_text), out_dir=str(tmp_path / "o"))
    prepare(cfg, progress=False)
    return load_tokens(cfg.out_dir, "train")


def test_windows_are_slices_and_y_is_x_shifted(tokens):
    starts = np.array([0, 5, len(tokens) - 17])
    x, y = batch_from_starts(tokens, starts, block_size=16)
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    for row, s in enumerate(starts):
        assert x[row].tolist() == tokens[s : s + 16].tolist()
        assert y[row].tolist() == tokens[s + 1 : s + 17].tolist()


def test_sampler_draws_seeded_windows(tokens):
    sampler = BatchSampler(tokens, block_size=16, batch_size=8, seed=3)
    x, y = sampler.next()
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    ref = torch.randint(len(tokens) - 16, (8,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(x, batch_from_starts(tokens, ref.numpy(), 16)[0])
    assert not torch.equal(x, BatchSampler(tokens, 16, 8, seed=4).next()[0])


def test_sampler_state_round_trip_continues_the_stream(tokens):
    a = BatchSampler(tokens, block_size=16, batch_size=4, seed=7)
    for _ in range(3):
        a.next()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    expected = [a.next() for _ in range(3)]
    b = BatchSampler(tokens, block_size=16, batch_size=4, seed=999)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for (xe, ye), (xb, yb) in zip(expected, (b.next() for _ in range(3))):
        assert torch.equal(xe, xb) and torch.equal(ye, yb)


def test_fixed_windows_are_deterministic_and_in_range(tokens):
    starts = fixed_windows(tokens, 16, 10)
    assert np.array_equal(starts, fixed_windows(tokens, 16, 10)) and starts.shape == (10,)
    assert starts[0] == 0 and starts[-1] == len(tokens) - 17 and np.all(np.diff(starts) > 0)


# --- CLI -------------------------------------------------------------------------------------


def run_cli(args):
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code


@pytest.mark.usefixtures("gpt2_bpe")
def test_cli_prepare(tmp_path, small_text, capsys):
    cfg_file = write_config(tmp_path, path=str(small_text), out_dir=str(tmp_path / "o"))
    assert run_cli(["prepare", "--config", str(cfg_file)]) == 0
    assert "train +" in capsys.readouterr().out
    assert run_cli(["prepare", "--config", str(cfg_file)]) == 0
    assert capsys.readouterr().out.startswith("up to date")
    assert run_cli(["prepare", "--config", str(cfg_file), "--force", "data.tokenizer=gpt2"]) == 0
    assert "gpt2 vocab 50,257" in capsys.readouterr().out

    assert run_cli(["prepare", "--config", str(cfg_file), f"data.path={tmp_path / 'gone.txt'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data file not found") and err.count("\n") == 1


# --- corpora of many files, shards, resume ---------------------------------------------------


def make_corpus(root, text):
    """Documents cut from `text` in four files: jsonl, jsonl.gz, parquet (2 row groups), txt.zst."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = [text[i : i + 900 + 37 * (i % 11)] for i in range(0, 24_000, 1000)]
    root.mkdir()
    with open(root / "a.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[:8])
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d, "url": "x"}) + "\n" for d in docs[8:16])
    pq.write_table(pa.table({"text": docs[16:23]}), root / "c.parquet", row_group_size=4)
    (root / "d.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(docs[23].encode()))
    return docs


def split_stream(out_dir):
    return load_tokens(out_dir, "train"), load_tokens(out_dir, "val")


@pytest.mark.usefixtures("gpt2_bpe")
def test_many_files_give_the_stream_of_each_document_whole(tmp_path, small_text):
    docs = make_corpus(tmp_path / "corpus", small_text.read_text(encoding="utf-8"))
    gpt2 = build_tokenizer("gpt2")
    expected = [[gpt2.eot_id] + gpt2.encode(d) for d in docs]  # end-of-text before every document
    n_val = round(0.1 * len(docs))
    cfg = data_cfg(tmp_path, path=str(tmp_path / "corpus"), tokenizer="gpt2", out_dir=str(tmp_path / "o"), shard_tokens=1024, workers=2)
    meta = prepare(cfg, progress=False).meta
    train, val = split_stream(cfg.out_dir)
    assert np.asarray(train).tolist() == sum(expected[:-n_val], []) and val.tolist() == sum(expected[-n_val:], [])
    assert meta["documents"] == 24 and meta["val_documents"] == n_val and len(meta["sources"]) == 4
    assert [s["tokens"] for s in meta["shards"]["train"]][:-1] == [1024] * (len(meta["shards"]["train"]) - 1)
    assert meta["shards"]["train"][1]["file"] == "train-000001.bin" and type(train).__name__ == "ShardedTokens"
    # one process, one shard per split: the same ids
    cfg1 = data_cfg(tmp_path, path=str(tmp_path / "corpus"), tokenizer="gpt2", out_dir=str(tmp_path / "one"), workers=1)
    meta1 = prepare(cfg1, progress=False).meta
    assert [s["file"] for s in meta1["shards"]["train"]] == ["train.bin"]
    assert np.array_equal(load_tokens(cfg1.out_dir, "train"), np.asarray(train))
    # char: no end-of-text id, documents follow each other as they are
    cfgc = data_cfg(tmp_path, path=str(tmp_path / "corpus" / "*.jsonl*"), out_dir=str(tmp_path / "c"), shard_tokens=1024)
    metac, tok = prepare(cfgc, progress=False).meta, None
    _, tok = load_prepared(cfgc.out_dir)
    assert tok.eot_id is None and metac["documents"] == 16
    assert tok.decode(np.concatenate(split_stream(cfgc.out_dir))) == "".join(docs[:16])


@pytest.mark.usefixtures("gpt2_bpe")
def test_sharded_tokens_index_like_one_array(tmp_path, small_text):
    cfg = data_cfg(tmp_path, path=str(small_text), tokenizer="gpt2", out_dir=str(tmp_path / "o"), shard_tokens=1024)
    prepare(cfg, progress=False)
    train = load_tokens(cfg.out_dir, "train")
    whole = np.asarray(train)
    assert len(train.parts) > 4 and len(train) == len(whole)
    starts = np.array([0, 1000, 1020, 3000, len(whole) - 17])  # some windows cross shard boundaries
    for a, b in zip(batch_from_starts(train, starts, 16), batch_from_starts(whole, starts, 16)):
        assert torch.equal(a, b)
    assert train[1020:1030].tolist() == whole[1020:1030].tolist() and train[-1] == whole[-1]
    x1, _ = BatchSampler(train, 32, 8, seed=5).next()
    assert torch.equal(x1, BatchSampler(whole, 32, 8, seed=5).next()[0])


@pytest.mark.usefixtures("gpt2_bpe")
def test_killed_prepare_resumes_at_its_last_shard(tmp_path, small_text, monkeypatch):
    import quillgpt.data.prepare as data
    import quillgpt.data.shards as shards

    monkeypatch.setattr(data, "PIECE_CHARS", 1000)
    monkeypatch.setattr(data, "TASK_CHARS", 2000)  # ~500 ids a task: a resume re-tokenizes one

    def cfg(out):
        return data_cfg(tmp_path, path=str(small_text), tokenizer="gpt2", out_dir=str(tmp_path / out), shard_tokens=1024)

    prepare(cfg("whole"), progress=False)
    out = tmp_path / "killed"
    real, calls = shards.atomic_write, []

    def dies_in_the_fourth_shard(path, write):
        calls.append(path.name)
        if len(calls) == 4:
            raise KeyboardInterrupt  # what a kill looks like to the files: 3 shards done, 1 half written
        real(path, write)

    monkeypatch.setattr(shards, "atomic_write", dies_in_the_fourth_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg("killed"), progress=False)
    monkeypatch.setattr(shards, "atomic_write", real)
    (out / ".train-000003.bin.k1ll3d.tmp").write_bytes(b"\0" * 999)  # what kill -9 leaves behind
    (out / ".train.bin.old.tmp").write_bytes(b"\0" * 9)
    (out / "..prepare-state.json.k1ll3d.tmp").write_bytes(b"{")  # atomic_write's temp of .prepare-state.json
    (out / ".notes.tmp").write_bytes(b"the user's")
    before = {n: os.stat(out / n).st_mtime_ns for n in ("train.bin", "train-000001.bin", "train-000002.bin")}
    assert not (out / "meta.json").exists()
    monkeypatch.setattr(shards, "encode_task", counting := CountingEncode(shards.encode_task))
    result = prepare(cfg("killed"), progress=False)
    assert result.rebuilt and {n: os.stat(out / n).st_mtime_ns for n in before} == before  # not rewritten
    assert counting.chars < 0.95 * len(small_text.read_text())  # the finished shards were not tokenized again
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(load_tokens(out, split)), np.asarray(load_tokens(tmp_path / "whole", split)))
    assert result.meta == json.loads((tmp_path / "whole" / "meta.json").read_text()) | {"sources": result.meta["sources"]}
    assert sorted(p.name for p in out.glob(".*")) == [".notes.tmp", ".prepare.lock"]  # stale temps gone, not the user's


class CountingEncode:
    def __init__(self, encode):
        self.encode, self.chars = encode, 0

    def __call__(self, tok, pieces, *args, **kwargs):
        self.chars += sum(map(len, pieces))
        return self.encode(tok, pieces, *args, **kwargs)


def test_old_meta_without_shards_still_loads(tmp_path, small_text):
    cfg = data_cfg(tmp_path, path=str(small_text), out_dir=str(tmp_path / "o"))
    meta = prepare(cfg, progress=False).meta
    old = {k: v for k, v in meta.items() if k not in ("shards", "format")}
    (tmp_path / "o" / "meta.json").write_text(json.dumps(old))
    assert len(load_tokens(tmp_path / "o", "val")) == meta["val_tokens"]
    assert prepare(cfg, progress=False).rebuilt  # an old layout is rebuilt once


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.path=/proc/self/mem", "cannot read data.path /proc/self/mem: Input/output error"),
        ("data.path={tmp}/" + "n" * 300, "cannot read data.path .*File name too long"),
        ("data.path={tmp}/empty_dir", "holds no .txt, .jsonl or .parquet files"),
        ("data.out_dir=/proc/x", "data.out_dir /proc/x is not writable"),
        ("data.path={tmp}/bad.jsonl", r"bad.jsonl line 2 is not a JSON object"),
        ("data.path={tmp}/nofield.jsonl", r"nofield.jsonl line 1 has no 'text' field"),
        ("data.path={tmp}/blank.jsonl", "blank.jsonl holds no text"),
        ("data.path={tmp}/blank.jsonl data.tokenizer=gpt2", "blank.jsonl gives an empty train split"),
    ],
)
def test_unreadable_corpus_or_unwritable_out_dir_is_one_line(tmp_path, small_text, capsys, request, override, message):
    if "gpt2" in override:
        request.getfixturevalue("gpt2_bpe")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n\n{"text": ""}\n')
    cfg_file = write_config(tmp_path, path=str(small_text), out_dir=str(tmp_path / "o"))
    assert run_cli(["prepare", "--config", str(cfg_file), *override.format(tmp=tmp_path).split()]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), err


@pytest.mark.usefixtures("gpt2_bpe")
def test_gpt2_124m_recipe_prepares_a_parquet_corpus(tmp_path, small_text):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "fw").mkdir()
    text = small_text.read_text(encoding="utf-8")
    pq.write_table(pa.table({"text": [text[i : i + 3000] for i in range(0, 30_000, 3000)]}), tmp_path / "fw" / "000_00000.parquet")
    cfg = load_config(
        root / "configs" / "gpt2_124m.yaml", [f"data.path={tmp_path}/fw/*.parquet", f"data.out_dir={tmp_path}/o", "data.val_fraction=0.2"]
    )
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (12, 12, 768, 1024)
    meta = prepare(cfg.data, progress=False).meta
    assert meta["tokenizer_name"] == "gpt2" and meta["documents"] == 10 and meta["val_documents"] == 2
    m, c = cfg.model, cfg.model.n_embd  # GPT-2's parameter count: tied embeddings, biases
    params = (meta["vocab_size"] + m.block_size) * c + m.n_layer * (12 * c * c + 13 * c) + 2 * c
    assert m.bias and m.tie_embeddings and params == 124_439_808


@pytest.mark.usefixtures("gpt2_bpe")
def test_kill_9_mid_prepare_then_resume_gives_the_same_shards(tmp_path, shakespeare_path):
    import signal
    import subprocess
    import sys
    import time

    text = shakespeare_path.read_text(encoding="utf-8")[:400_000]
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "killed"
    code = (
        "import sys; from quillgpt.config import DataConfig; from quillgpt.data.prepare import prepare; "
        "prepare(DataConfig(path=sys.argv[1], tokenizer='gpt2', out_dir=sys.argv[2], shard_tokens=4096), progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "text.txt"), str(out)])
    deadline = time.monotonic() + 60
    while not (out / ".prepare-state.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # at least one shard is finished, and meta.json not yet written
    proc.wait()
    assert not (out / "meta.json").exists(), "prepare finished before it could be killed"
    done = json.loads((out / ".prepare-state.json").read_text())["shards"]["train"]
    cfg = data_cfg(tmp_path, path=str(tmp_path / "text.txt"), tokenizer="gpt2", out_dir=str(out), shard_tokens=4096)
    meta = prepare(cfg, progress=False).meta
    assert meta["shards"]["train"][: len(done)] == done
    assert [s["tokens"] for s in meta["shards"]["train"][:-1]] == [4096] * (len(meta["shards"]["train"]) - 1)
    ids = np.concatenate([np.asarray(load_tokens(out, "train")), np.asarray(load_tokens(out, "val"))])
    assert ids.tolist() == [50256] + build_tokenizer("gpt2").encode(text)
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("room", [0, 1000], ids=["first_write", "mid_shard"])
def test_a_full_disk_during_prepare_names_the_file_system(tmp_path, small_text, monkeypatch, capsys, room):
    """The issue: a full disk said only `OSError` (numpy's tofile raises one without an errno)."""
    import errno

    import quillgpt.data.shards as shards_mod

    real = shards_mod.atomic_write

    class Full(io.RawIOBase):
        def __init__(self, f):
            self.f, self.room = f, room

        def writable(self):
            return True

        def write(self, b):
            if len(memoryview(b).cast("B")) > self.room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= len(memoryview(b).cast("B"))
            return self.f.write(b)

        def fileno(self):
            return self.f.fileno()

    monkeypatch.setattr(shards_mod, "atomic_write", lambda path, write: real(path, lambda f: write(Full(f))))
    cfg = write_config(tmp_path, path=str(small_text), out_dir=str(tmp_path / "out"))
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--config", str(cfg)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "OSError" not in err
    assert f"cannot write token shards to data.out_dir {tmp_path / 'out'}: no space left on /" in err
    assert not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.usefixtures("gpt2_bpe")
def test_a_tokenizer_given_by_file_that_is_the_datas_own_neither_rebuilds_nor_is_refused(tmp_path, small_text):
    """A fine-tune names its base's tokenizer.json over data the base prepared with `char`: the same
    vocabulary, so the data stand as they are, for it and for `char` again."""
    cfg = data_cfg(tmp_path, path=str(small_text), tokenizer="char", out_dir=str(tmp_path / "o"))
    meta = prepare(cfg, progress=False).meta
    save_tokenizer(load_prepared(tmp_path / "o")[1], tmp_path / "tokenizer.json")
    as_file = prepare(dataclasses.replace(cfg, tokenizer=str(tmp_path / "tokenizer.json")), progress=False)
    assert not as_file.rebuilt and as_file.meta == meta
    assert not prepare(cfg, progress=False).rebuilt
    save_tokenizer(build_tokenizer("char", "abcdefghijklmnopqrstuvwxyz \n!?.,;:'-ABCDEFGHIJKLMNOPQRSTUVWXYZ&$3"), tmp_path / "other.json")
    with pytest.raises(QuillError, match="would replace it"):
        prepare(dataclasses.replace(cfg, tokenizer=str(tmp_path / "other.json")), progress=False)
