import json
import os
import re
import stat

import pytest
import requests
import rustbpe
import tiktoken.load

from quillgpt.cli import main
from quillgpt.data.tokenizer import GPT4_SPLIT_PATTERN, TOKENIZER_NAMES, CharTokenizer, find_safe_cut, text_chunks
from quillgpt.data.tokenizer_files import build_tokenizer, load_tokenizer, save_tokenizer, tokenizer_from_spec, train_tokenizer
from quillgpt.errors import QuillError

MIXED = "Héllo, wörld! 日本語 🙂 naïve\n\tend <|endoftext|>"


@pytest.fixture(scope="module")
def text(shakespeare_path):
    return shakespeare_path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def bpe(text):
    return build_tokenizer("bpe", text[:200_000], vocab_size=512)


@pytest.fixture(scope="module")
def gpt2(gpt2_bpe):
    return build_tokenizer("gpt2")


# --- char ------------------------------------------------------------------------------------


def test_char_vocab_is_sorted_unique_chars_and_matches_plain_lookup(text):
    tok = build_tokenizer("char", text)
    chars = sorted(set(text))
    assert tok.vocab_size == len(chars) == 65
    assert tok.eot_id is None
    stoi = {c: i for i, c in enumerate(chars)}
    sample = text[:20_000]
    assert tok.encode(sample) == [stoi[c] for c in sample]  # vectorised path = dict lookup
    assert tok.decode(tok.encode(text)) == text


def test_char_is_deterministic_and_rebuilds_from_spec(text):
    a, b = build_tokenizer("char", text), build_tokenizer("char", text)
    assert a.spec() == b.spec() and a.fingerprint() == b.fingerprint()
    assert a.encode(text[:5000]) == b.encode(text[:5000])
    c = tokenizer_from_spec(json.loads(json.dumps(a.spec())))
    assert c.encode(text[:5000]) == a.encode(text[:5000])


def test_char_unknown_characters_are_a_quill_error_with_positions():
    tok = CharTokenizer.from_text("hello world")
    with pytest.raises(QuillError) as e:
        tok.encode("hellö wörld, Ω")
    msg = str(e.value)
    assert "4 character(s)" in msg and "'ö' at 4, 'ö' at 7, ',' at 11, 'Ω' at 13" in msg
    assert tok.unknown_chars("hellö wörld, Ω") == {"ö": 2, ",": 1, "Ω": 1}
    assert tok.unknown_chars("hello") == {}


def test_char_error_lists_only_the_first_few():
    tok = CharTokenizer.from_text("ab")
    with pytest.raises(QuillError, match=r"10 character\(s\).*and 5 more"):
        tok.encode("c" * 10)


def test_char_decode_never_raises():
    tok = CharTokenizer.from_text("abc")
    assert tok.decode([0, 7, -1, 2]) == "a\ufffd\ufffdc"
    assert tok.decode_bytes([0, 1]) == b"ab"


def test_char_needs_text():
    with pytest.raises(QuillError, match="empty"):
        build_tokenizer("char", "")
    with pytest.raises(QuillError, match="training text"):
        build_tokenizer("char")


# --- tiktoken --------------------------------------------------------------------------------


def test_gpt2_known_ids_and_round_trip(gpt2, text):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.decode(gpt2.encode(MIXED)) == MIXED
    assert gpt2.eot_id not in gpt2.encode(MIXED)  # "<|endoftext|>" in user text is plain text
    assert gpt2.unknown_chars(MIXED) == {}
    assert gpt2.encode_batch([MIXED, "Hello world"]) == [gpt2.encode(MIXED), [15496, 995]]
    assert build_tokenizer("r50k_base").encode(text[:3000]) == gpt2.encode(text[:3000])


def test_decode_of_a_cut_multibyte_sequence_does_not_raise(gpt2, bpe):
    for tok in (gpt2, bpe):
        ids = tok.encode("日本語🙂")
        outs = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
        assert outs[-1] == "日本語🙂"
        assert any("\ufffd" in o for o in outs)  # some prefix ends inside a character
        assert b"".join(tok.decode_bytes([i]) for i in ids) == "日本語🙂".encode()
        assert tok.decode([10**12, -3, ids[0]]).startswith("\ufffd\ufffd")


def test_safe_cuts_do_not_change_the_tokens(gpt2, bpe, text):
    s = "x\n\nCd more.\nEf"
    assert gpt2.encode(s[:3]) + gpt2.encode(s[3:]) != gpt2.encode(s)  # a blind cut after "\n"
    cut = find_safe_cut(s, 3, window=20)
    assert cut == s.index("Ef") and gpt2.encode(s[:cut]) + gpt2.encode(s[cut:]) == gpt2.encode(s)
    sample = text[:60_000]
    for tok in (gpt2, bpe):
        whole = tok.encode(sample)
        for index in (1000, 12_345, 40_000):
            cut = find_safe_cut(sample, index, window=2000)
            assert cut != index and abs(cut - index) <= 2000
            assert tok.encode(sample[:cut]) + tok.encode(sample[cut:]) == whole
        chunks = text_chunks(sample, 4096)
        assert len(chunks) > 10 and "".join(chunks) == sample
        assert sum(tok.encode_batch(chunks), []) == whole


def test_offline_encoding_fetch_is_one_error_naming_the_env_var(monkeypatch, tmp_path):
    def offline(url):
        raise requests.exceptions.ConnectionError(f"cannot reach {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache: tiktoken must fetch
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    with pytest.raises(QuillError) as e:
        build_tokenizer("cl100k_base")
    assert "'cl100k_base'" in str(e.value) and "TIKTOKEN_CACHE_DIR" in str(e.value)


def test_unknown_name_lists_valid_names():
    with pytest.raises(QuillError) as e:
        build_tokenizer("gpt3")
    assert all(name in str(e.value) for name in TOKENIZER_NAMES)


# --- trained BPE -----------------------------------------------------------------------------


def test_bpe_vocab_and_determinism(bpe, text):
    assert bpe.vocab_size == 512 and bpe.eot_id == 511
    again = build_tokenizer("bpe", text[:200_000], vocab_size=512)
    assert again.spec()["ranks"] == bpe.spec()["ranks"]
    assert bpe.decode(bpe.encode(MIXED)) == MIXED  # byte-level: any text round-trips
    assert bpe.unknown_chars(MIXED) == {}
    assert bpe.eot_id not in bpe.encode(MIXED)


def test_bpe_matches_rustbpe_trained_on_the_whole_text(bpe, text):
    """Training on safe-cut chunks must equal training on one string; tiktoken must encode
    exactly as rustbpe does."""
    ref = rustbpe.Tokenizer()
    ref.train_from_iterator(iter([text[:200_000]]), 511, pattern=GPT4_SPLIT_PATTERN)
    assert {bytes(b): r for b, r in ref.get_mergeable_ranks()} == bpe.enc._mergeable_ranks
    held_out = text[200_000:260_000]
    assert bpe.encode(held_out) == ref.encode(held_out)


def test_bpe_save_and_load_gives_identical_ids(bpe, text, tmp_path):
    path = tmp_path / "tok.json"
    save_tokenizer(bpe, path)
    data = json.loads(path.read_text(encoding="utf-8"))  # plain JSON, no pickle
    assert data["tokenizer"]["ranks"][0] == ["AA==", 0] and data["tokenizer"]["special_tokens"] == {"<|endoftext|>": 511}
    for loaded in (load_tokenizer(path), build_tokenizer(str(path)), tokenizer_from_spec(data["tokenizer"])):
        assert loaded.encode(text[200_000:230_000]) == bpe.encode(text[200_000:230_000])
        assert loaded.eot_id == bpe.eot_id and loaded.fingerprint() == bpe.fingerprint()


def test_bpe_rejects_bad_vocab_and_bad_files(tmp_path, bpe):
    with pytest.raises(QuillError, match="at least 257"):
        build_tokenizer("bpe", "some text", vocab_size=100)
    with pytest.raises(QuillError, match="missing.json does not exist .create one with `quill tokenizer train`"):
        build_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(QuillError, match="at most 16,777,216, got 1099511627776"):
        build_tokenizer("bpe", "some text", vocab_size=2**40)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(QuillError, match="not a tokenizer JSON"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(QuillError, match="not a QuillGPT tokenizer"):
        load_tokenizer(tmp_path / "other.json")
    spec = dict(bpe.spec(), ranks=[["AAA=", 0]] + bpe.spec()["ranks"][1:])  # b"\0\0" for b"\0"
    with pytest.raises(QuillError, match="256 single bytes"):
        tokenizer_from_spec(spec)
    with pytest.raises(QuillError, match="spec type"):
        tokenizer_from_spec({"type": "sentencepiece"})


def test_tokenizer_files_that_cannot_be_read_or_written(tmp_path, bpe):
    """Every OSError on a tokenizer path is one QuillError naming the path and the reason."""
    for path, reason in [
        ("/proc/self/mem", "Input/output error"),
        (str(tmp_path / ("t" * 300 + ".json")), "File name too long"),
        (str(tmp_path), "is a directory"),
    ]:
        with pytest.raises(QuillError, match=reason):
            build_tokenizer(path)
    (tmp_path / "deep.json").write_text("[" * 100_000)
    with pytest.raises(QuillError, match="nested too deeply"):
        load_tokenizer(tmp_path / "deep.json")
    with pytest.raises(QuillError, match="cannot .* /proc/x.*No such file or directory"):
        save_tokenizer(bpe, "/proc/x/t.json")
    with pytest.raises(QuillError, match="cannot write tokenizer file .*File name too long"):
        save_tokenizer(bpe, tmp_path / ("t" * 300 + ".json"))


def test_cli_tokenizer_train(tmp_path, text, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text[:50_000], encoding="utf-8")
    out = tmp_path / "tok.json"
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(out)])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert "vocab size 300" in printed and "bytes/token" in printed
    assert load_tokenizer(out).encode(text[:1000]) == build_tokenizer("bpe", text[:50_000], 300).encode(text[:1000])

    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "train", "--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "new.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --input ") and "nope.txt does not exist" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "case, message",
    [
        ("output_is_input", "is also the input; write the output to another file"),
        ("output_exists", "already exists; choose another name or pass --force"),
        ("output_is_a_directory", "is a directory; pass a file name"),
        ("output_under_proc", "is not writable"),
        ("output_is_a_fifo", "is not a regular file (a device, pipe or socket)"),
        ("input_unreadable", "cannot read --input /proc/self/mem: Input/output error"),
        ("input_name_too_long", "File name too long"),
    ],
)
def test_cli_tokenizer_train_refuses_without_touching_files(tmp_path, text, capsys, case, message):
    """`-i corpus.txt -o corpus.txt` once replaced a 1.1 MB corpus by 4.6 KB of JSON."""
    corpus, existing = tmp_path / "corpus.txt", tmp_path / "tok.json"
    corpus.write_text(text[:5_000], encoding="utf-8")
    existing.write_text("mine")
    if case == "output_is_a_fifo":  # as /dev/zero would be: renaming over it would replace it
        existing.unlink()
        os.mkfifo(existing)
    inp, out = {
        "output_is_input": (corpus, corpus),
        "output_exists": (corpus, existing),
        "output_is_a_directory": (corpus, tmp_path),
        "output_under_proc": (corpus, "/proc/x.json"),
        "output_is_a_fifo": (corpus, tmp_path / "tok.json"),
        "input_unreadable": ("/proc/self/mem", tmp_path / "new.json"),
        "input_name_too_long": (tmp_path / ("c" * 300), tmp_path / "new.json"),
    }[case]
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "train", "-i", str(inp), "-o", str(out), "--vocab-size", "300"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert corpus.read_text(encoding="utf-8") == text[:5_000]
    assert existing.read_text() == "mine" if case != "output_is_a_fifo" else stat.S_ISFIFO(existing.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "tok.json"]


def test_cli_tokenizer_train_force_overwrites(tmp_path, text, capsys):
    corpus, out = tmp_path / "corpus.txt", tmp_path / "tok.json"
    corpus.write_text(text[:5_000], encoding="utf-8")
    out.write_text("old")
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "train", "-i", str(corpus), "-o", str(out), "--vocab-size", "300", "--force"])
    assert e.value.code == 0 and load_tokenizer(out).vocab_size == 300


def test_train_tokenizer_saves_a_new_file_and_reports_its_compression(tmp_path):
    src, out = tmp_path / "text.txt", tmp_path / "tok.json"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 40, encoding="utf-8")
    done = train_tokenizer(src, 270, out)
    assert load_tokenizer(out).spec() == done.tokenizer.spec() and done.tokenizer.vocab_size == 270
    tokens = sum(len(ids) for ids in done.tokenizer.encode_arrays(text_chunks(src.read_text(encoding="utf-8"))))
    assert done.bytes_per_token == len(src.read_bytes()) / tokens > 1
    assert re.fullmatch(
        rf"saved {re.escape(str(out))}: vocab size 270, \d+\.\d\d bytes/token on {re.escape(str(src))}, trained in \d+\.\d\ds", done.line()
    )
    with pytest.raises(QuillError, match="--out"):  # a new file unless force
        train_tokenizer(src, 270, out)
    assert train_tokenizer(src, 260, out, force=True).tokenizer.vocab_size == 260
