"""Hostile tokenizer.json files (data/hf_tokenizer_guard.py): a pre-tokenizer regex that makes the
Rust regex engine panic and a normalizer that multiplies text fail where the tokenizer is loaded,
in one line naming the file; one that passes the probe but would explode on a real input is one
line (a 400 in the server) at encode time, never a traceback or memory exhaustion."""

import json

import pytest

pytest.importorskip("tokenizers")

from quillgpt.data import hf_tokenizer_guard as guard  # noqa: E402
from quillgpt.data.hf_tokenizer import HFTokenizer  # noqa: E402
from quillgpt.errors import QuillError  # noqa: E402

CHARS = "\n !',-.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def tokenizer_json(pre_tokenizer=None, normalizer=None, post_processor=None) -> str:
    """A character-level BPE over CHARS with the given pre-tokenizer, normalizer and post-processor (JSON)."""
    from tokenizers import Tokenizer, models

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    data = json.loads(tk.to_str())
    data["pre_tokenizer"], data["normalizer"], data["post_processor"] = pre_tokenizer, normalizer, post_processor
    return json.dumps(data)


A_MISSING_SPECIAL_TOKEN = {  # a template naming a token its special_tokens lack: the library panics
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [],
    "special_tokens": {},
}


def split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def replace(pattern: str, content: str, regex: bool = False) -> dict:
    return {"type": "Replace", "pattern": {"Regex" if regex else "String": pattern}, "content": content}


def chain(*steps: dict) -> dict:
    return {"type": "Sequence", "normalizers": list(steps)}


LOAD_REFUSALS = {
    "a regex the engine gives up on": (tokenizer_json(split("(x+x+)+y")), "failed inside the tokenizers library"),
    "a backtracking regex on words": (tokenizer_json(split("(\\w+\\s?)+$")), "failed inside the tokenizers library"),
    "a chained Replace of a character": (
        tokenizer_json(normalizer=chain(*[replace("a", "a" * 20)] * 8)),
        "its normalizer can multiply a text's length 2.56e+10 times",
    ),
    "a Replace of the empty regex": (
        tokenizer_json(normalizer=chain(*[replace("", "ab", regex=True)] * 6)),
        "multiply a text's length 729",
    ),
    "a post-processor naming a missing token": (
        tokenizer_json(post_processor=A_MISSING_SPECIAL_TOKEN),
        "failed inside the tokenizers library (no entry found for key); its normalizer, pre-tokenizer regex or post-processor",
    ),
    "a Replace of the empty string": (tokenizer_json(normalizer=replace("", "x" * 100)), "multiply a text's length 101"),
}


@pytest.mark.parametrize("case", list(LOAD_REFUSALS))
def test_a_hostile_tokenizer_fails_at_load_in_one_line(case):
    text, message = LOAD_REFUSALS[case]
    with pytest.raises(QuillError) as e:
        HFTokenizer(text, source="/models/x/tokenizer.json")
    assert message in str(e.value) and str(e.value).startswith("/models/x/tokenizer.json: ") and "\n" not in str(e.value)


def test_a_normalizer_that_multiplies_the_probe_text_is_refused_by_its_token_count(monkeypatch):
    monkeypatch.setattr(guard, "MAX_GROWTH", 10**9)  # past the static bound: the probe's count decides
    with pytest.raises(QuillError, match=r"made [\d,]+ tokens of a \d+-character probe text; its normalizer multiplies text"):
        HFTokenizer(tokenizer_json(normalizer=chain(*[replace("a", "aaaaa")] * 4)))


def test_a_probe_that_does_not_finish_is_refused_by_time(monkeypatch):
    import time

    monkeypatch.setattr(guard, "PROBE_SECONDS", 0.2)
    slow = lambda text: time.sleep(5) or []  # noqa: E731
    with pytest.raises(QuillError, match=r"took over 0.2 s on a \d+-character probe text"):
        guard.probe(slow, 1.0, "tok.json")


def test_a_panic_at_encode_time_is_one_line():
    tok = HFTokenizer(tokenizer_json(split("(q+q+)+y")))  # the probe has no run of q's: it loads
    with pytest.raises(QuillError, match="tokenizer.json: the tokenizer failed inside the tokenizers library"):
        tok.encode("q" * 40)
    assert tok.encode("plain text") == [CHARS.index(c) for c in "plain text"]


def test_a_text_the_normalizer_could_grow_too_far_is_refused_before_encoding():
    tok = HFTokenizer(tokenizer_json(normalizer=replace("q", "q" * 50)), source="t.json")  # growth 50: loads
    assert tok.growth == 50 and len(tok.encode("q" * 1000)) == 50_000
    for call in (tok.encode, tok.encode_offsets, lambda t: tok.encode_batch([t]), lambda t: tok.encode_arrays([t])):
        with pytest.raises(QuillError, match=r"a text of 400,000 characters could grow to 20,000,000 under the normalizer of t.json"):
            call("q" * 400_000)


def test_an_ordinary_tokenizer_has_no_text_bound(monkeypatch):
    monkeypatch.setattr(guard, "ENCODE_LIMIT", 1000)
    tok = HFTokenizer(tokenizer_json(split(" ?[a-z]+"), chain(replace(" ", "  "), {"type": "Prepend", "prepend": "a"}, {"type": "NFKC"})))
    assert tok.growth == 4 and len(tok.encode("ab " * 1000)) == 4001  # growth ≤ SAFE_GROWTH: any length


def test_import_hf_of_a_panicking_tokenizer_is_one_line_and_writes_nothing(tmp_path, capsys):
    pytest.importorskip("transformers")
    from hf_support import make_hf_model

    from quillgpt.cli import main

    hf = make_hf_model(tmp_path / "hf", "smollm2")
    data = json.loads((hf / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split("(\\w+\\s?)+$"), data["pre_tokenizer"]]}
    (hf / "tokenizer.json").write_text(json.dumps(data))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["import-hf", str(hf), "-o", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and f"{hf / 'tokenizer.json'}: the tokenizer failed" in err, err
    assert not (tmp_path / "run").exists()


def test_serve_answers_a_prompt_the_normalizer_would_explode_with_a_400(tmp_path):
    httpx = pytest.importorskip("httpx")
    from serve_support import running_server
    from support import random_model

    from quillgpt.config import Config
    from quillgpt.runs import write_run

    model = random_model()  # 37 ids: the first 37 of CHARS
    tok = HFTokenizer(tokenizer_json(normalizer=replace("q", "q" * 50)))
    (tmp_path / "run").mkdir()
    write_run(tmp_path / "run", Config(model=model.config), tok, model.state_dict())
    with running_server(tmp_path / "run") as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "q" * 400_000, "max_tokens": 1})
    assert r.status_code == 400 and "could grow to 20,000,000 under the normalizer" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("pattern", ["(x+x+)+y", "[a-z]+", "\\s+"])
def test_a_bpe_tokenizer_json_whose_split_pattern_drops_text_is_refused(tmp_path, pattern):
    """quill's own bpe tokenizer.json carries its split pattern: one that matches only part of a
    text would silently drop the rest (tiktoken encodes only what the pattern matches)."""
    from quillgpt.data.tokenizer_files import build_tokenizer, load_tokenizer, save_tokenizer

    save_tokenizer(build_tokenizer("bpe", "Hello, world! " * 50, vocab_size=260), tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json").decode(load_tokenizer(tmp_path / "tok.json").encode("wörld 日本")) == "wörld 日本"
    data = json.loads((tmp_path / "tok.json").read_text())
    data["tokenizer"]["pattern"] = pattern
    (tmp_path / "tok.json").write_text(json.dumps(data))
    with pytest.raises(QuillError, match="invalid 'bpe' tokenizer spec: its split pattern drops or changes text"):
        load_tokenizer(tmp_path / "tok.json")
