"""Chat data: which tokens are the assistant's (quill's transcript by hand, templates against
transformers), bad lines refused or skipped by file:line, and `quill prepare` of conversations
(flags beside the shards, up to date, resumed after a kill)."""

import json
import os

import numpy as np
import pytest

from quillgpt.cli import main
from quillgpt.config import DataConfig
from quillgpt.data.chat_data import ASSISTANT, START
from quillgpt.data.chat_template import conversation_tokens
from quillgpt.data.prepare import load_tokens, prepare
from quillgpt.data.tokenizer import CharTokenizer
from quillgpt.data.tokenizer_files import save_tokenizer
from quillgpt.errors import QuillError

CHARS = "".join(sorted(set("\n !',.:?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")))
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who speaks?"},
    {"role": "assistant", "content": "ROMEO"},
    {"role": "user", "content": "And now?"},
    {"role": "assistant", "content": "JULIET, sir."},
]
TAGGED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def line(messages=None, **record):
    return json.dumps({"messages": messages} if messages is not None else record)


def conversation(i):
    speaker = ["ROMEO", "JULIET", "NURSE"][i % 3]
    return line([{"role": "user", "content": f"Who speaks line {'I' * (i % 4 + 1)}?"}, {"role": "assistant", "content": speaker}])


@pytest.fixture
def char_tokenizer(tmp_path):
    save_tokenizer(CharTokenizer(CHARS), tmp_path / "tokenizer.json")
    return tmp_path / "tokenizer.json"


def chat_cfg(tmp_path, tokenizer, lines, name="chat.jsonl", **kw):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return DataConfig(path=str(path), out_dir=str(tmp_path / kw.pop("out", "data")), tokenizer=str(tokenizer), format="chat", **kw)


def test_the_transcript_marks_each_reply_through_the_next_turns_header():
    tok = CharTokenizer(CHARS)
    ids, mine = conversation_tokens(tok, CHAT)
    text = "System: Be brief.\n\nUser: Who speaks?\n\nAssistant: ROMEO\n\nUser: And now?\n\nAssistant: JULIET, sir.\n\nUser:"
    assert tok.decode(ids) == text
    marked = "".join(c if m else "_" for c, m in zip(text, mine))
    want = "".join(
        "_" * len(a) + b
        for a, b in [
            ("System: Be brief.\n\nUser: Who speaks?\n\nAssistant:", " ROMEO\n\nUser:"),
            (" And now?\n\nAssistant:", " JULIET, sir.\n\nUser:"),
        ]
    )
    assert marked == want


@pytest.fixture(scope="module")
def hf_chatml():
    transformers = pytest.importorskip("transformers")
    from hf_support import train_tokenizer

    tk = train_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None)
    return tk, transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")


def test_generation_tags_give_transformers_assistant_tokens_mask(hf_chatml):
    from quillgpt.data.hf_tokenizer import HFTokenizer

    tk, fast = hf_chatml
    tok = HFTokenizer(tk.to_str(), eos_token="<|im_end|>", chat_template=TAGGED)
    for messages in (CHAT, CHAT[1:3], [{"role": "user", "content": "Ça va? 日本"}, {"role": "assistant", "content": "Très bien."}]):
        want = fast.apply_chat_template(messages, chat_template=TAGGED, return_dict=True, return_assistant_tokens_mask=True)
        ids, mine = conversation_tokens(tok, messages)
        assert ids == want["input_ids"] and [int(m) for m in mine] == want["assistant_masks"]


def test_a_template_without_tags_marks_the_same_tokens_through_its_end_of_turn(hf_chatml):
    from hf_support import CHATML

    from quillgpt.data.hf_tokenizer import HFTokenizer

    tk, _ = hf_chatml
    tagged = HFTokenizer(tk.to_str(), eos_token="<|im_end|>", chat_template=TAGGED)
    plain = HFTokenizer(tk.to_str(), eos_token="<|im_end|>", chat_template=CHATML)
    assert conversation_tokens(plain, CHAT) == conversation_tokens(tagged, CHAT)


def test_a_template_that_is_not_prefix_stable_is_refused(hf_chatml):
    from quillgpt.data.hf_tokenizer import HFTokenizer

    tk, _ = hf_chatml  # earlier replies shortened once a later one follows (as reasoning templates do)
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ m['content'][:2] }}{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok = HFTokenizer(tk.to_str(), eos_token="<|im_end|>", chat_template=template)
    assert sum(conversation_tokens(tok, CHAT[:3])[1]) > 0  # one turn: fine
    with pytest.raises(QuillError, match="assistant turn 1 as the start of the whole conversation.*generation"):
        conversation_tokens(tok, CHAT)


BAD_LINES = {
    "not JSON": ("{'messages': oops", "line 2: not a JSON object"),
    "missing role": (line([{"content": "hi"}, {"role": "assistant", "content": "ROMEO"}]), "line 2: message 1 has no 'role'"),
    "list role": (
        line([{"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "x"}]),
        "line 2: message 1 has a list 'role'",
    ),
    "object role": (
        line([{"role": {"a": 1}, "content": "hi"}, {"role": "assistant", "content": "x"}]),
        "line 2: message 1 has a dict 'role'",
    ),
    "unknown role": (line([{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]), "line 2: message 1 has role 'bot'"),
    "empty reply": (
        line([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]),
        "line 2: message 2 (assistant) is empty",
    ),
    "no assistant": (line([{"role": "user", "content": "hi"}]), "line 2: no assistant message"),
    "empty completion": (line(prompt="hi", completion=""), "line 2: an empty 'completion'"),
    "no conversation": (line(text="hi"), "line 2: neither 'messages' nor 'prompt' and 'completion'"),
    "unknown character": (line(prompt="hi", completion="日本"), "line 2: text has 2 character(s) not in the char vocabulary"),
    "not UTF-8": (b"\xff\xfe".decode("latin-1"), None),  # written as raw bytes below
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, char_tokenizer, case, capsys):
    bad, message = BAD_LINES[case]
    cfg = chat_cfg(tmp_path, char_tokenizer, [conversation(0), bad, conversation(1), conversation(2)])
    if case == "not UTF-8":
        path = tmp_path / "chat.jsonl"
        path.write_bytes(path.read_bytes().replace(bad.encode(), b"\xff\xfe"))
        message = "line 2: not UTF-8 text"
    with pytest.raises(QuillError) as e:
        prepare(cfg, progress=False)
    assert f"{tmp_path / 'chat.jsonl'} {message}" in str(e.value) and "data.skip_bad_lines=true" in str(e.value)
    assert "\n" not in str(e.value)
    code = _cli(["prepare", "--config", str(_config_file(tmp_path, cfg))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


def _config_file(tmp_path, cfg):
    path = tmp_path / "chat.yaml"
    path.write_text(json.dumps({"data": {"path": cfg.path, "out_dir": cfg.out_dir, "tokenizer": cfg.tokenizer, "format": "chat"}}))
    return path


def _cli(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_skip_bad_lines_skips_and_counts_them(tmp_path, char_tokenizer, capsys):
    lines = [conversation(i) for i in range(8)]
    lines[2], lines[5] = BAD_LINES["no assistant"][0], BAD_LINES["not JSON"][0]
    cfg = chat_cfg(tmp_path, char_tokenizer, lines, skip_bad_lines=True, val_fraction=0.25)
    meta = prepare(cfg, progress=False).meta
    assert meta["chat"]["train"] == {
        "conversations": 4,
        "skipped": 2,
        "first_skipped": f"{tmp_path / 'chat.jsonl'} line 3: no assistant message, so nothing to train on",
    }
    assert meta["chat"]["val"]["conversations"] == 2
    flags = np.asarray(load_tokens(cfg.out_dir, "train", flags=True))
    assert np.count_nonzero(flags & START) == 4
    path = _config_file(tmp_path, cfg)
    path.write_text(path.read_text()[:-2] + ', "skip_bad_lines": true, "val_fraction": 0.25}}')
    assert _cli(["prepare", "--config", str(path), "--force"]) == 0
    out = capsys.readouterr().out
    assert "4 + 2 conversation(s)" in out and "skipped 2 bad line(s)" in out and "line 3: no assistant message" in out


def test_prepared_conversations_are_their_ids_and_flags_back_to_back(tmp_path, char_tokenizer):
    lines = [conversation(i) for i in range(10)] + [line(prompt="Who?", completion="NURSE")]
    cfg = chat_cfg(tmp_path, char_tokenizer, lines, val_fraction=0.2)
    result = prepare(cfg, progress=False)
    assert result.rebuilt and not prepare(cfg, progress=False).rebuilt  # the same inputs: nothing to do
    tok = CharTokenizer(CHARS)
    for split, want in (("train", lines[:9]), ("val", lines[9:])):
        ids, flags = (np.asarray(load_tokens(cfg.out_dir, split, flags=f)) for f in (False, True))
        expected = [
            conversation_tokens(
                tok, json.loads(w).get("messages") or [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "NURSE"}]
            )
            for w in want
        ]
        assert ids.tolist() == [i for e in expected for i in e[0]]
        assert (flags & ASSISTANT).astype(bool).tolist() == [m for e in expected for m in e[1]]
        assert np.flatnonzero(flags & START).tolist() == np.cumsum([0] + [len(e[0]) for e in expected[:-1]]).tolist()
        assert result.meta["chat"][split]["conversations"] == len(want)


def test_chat_data_needs_the_models_tokenizer_and_jsonl(tmp_path, char_tokenizer):
    for learned in ("char", "bpe"):
        with pytest.raises(QuillError, match="data.format=chat needs the model's own tokenizer.*tokenizer.json"):
            prepare(chat_cfg(tmp_path, learned, [conversation(0), conversation(1)]), progress=False)
    (tmp_path / "chat.txt").write_text("User: hi\n")
    with pytest.raises(QuillError, match="data.format=chat reads .jsonl files.*chat.txt is txt"):
        prepare(
            DataConfig(path=str(tmp_path / "chat.txt"), out_dir=str(tmp_path / "d"), tokenizer=str(char_tokenizer), format="chat"),
            progress=False,
        )
    with pytest.raises(QuillError, match="at least 2 conversations"):
        prepare(chat_cfg(tmp_path, char_tokenizer, [conversation(0)]), progress=False)


def test_a_killed_chat_prepare_resumes_to_the_same_shards(tmp_path, char_tokenizer, monkeypatch):
    import quillgpt.data.prepare as data
    import quillgpt.data.shards as shards

    monkeypatch.setattr(data, "TASK_CHARS", 300)  # a few conversations a task: a resume re-encodes one
    lines = [conversation(i) for i in range(60)]
    lines[7] = BAD_LINES["empty reply"][0]  # skipped, and counted once after the resume
    whole = prepare(chat_cfg(tmp_path, char_tokenizer, lines, out="whole", shard_tokens=1024, skip_bad_lines=True), progress=False)
    real, calls = shards.atomic_write, []

    def dies_in_the_third_shard(path, write):
        calls.append(path.name)
        if len(calls) == 5:  # flags, ids, flags, ids, then the third shard's flags
            raise KeyboardInterrupt
        real(path, write)

    monkeypatch.setattr(shards, "atomic_write", dies_in_the_third_shard)
    cfg = chat_cfg(tmp_path, char_tokenizer, lines, out="killed", shard_tokens=1024, skip_bad_lines=True)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, progress=False)
    monkeypatch.setattr(shards, "atomic_write", real)
    out = tmp_path / "killed"
    before = {n: os.stat(out / n).st_mtime_ns for n in ("train.bin", "train.flags.bin", "train-000001.bin")}
    result = prepare(cfg, progress=False)
    assert {n: os.stat(out / n).st_mtime_ns for n in before} == before  # the finished shards were kept
    for split in ("train", "val"):
        for flags in (False, True):
            assert np.array_equal(np.asarray(load_tokens(out, split, flags)), np.asarray(load_tokens(tmp_path / "whole", split, flags)))
    assert result.meta["chat"] == whole.meta["chat"] and result.meta["shards"] == whole.meta["shards"]
    assert result.meta["chat"]["train"]["skipped"] == 1


@pytest.mark.parametrize("role", [["user"], {"role": "user"}, 3, True])
def test_a_role_that_is_not_text_is_skipped_with_skip_bad_lines(role):
    """An unhashable role (a list, an object) is a bad line like any other, never a TypeError."""
    from quillgpt.data.chat_data import encode_lines

    tok = CharTokenizer.from_text("hi ROMEO User: Assistant:\n")
    bad = json.dumps({"messages": [{"role": role, "content": "hi"}, {"role": "assistant", "content": "ROMEO"}]})
    good = json.dumps({"prompt": "hi", "completion": "ROMEO"})
    (ids, flags), stats = encode_lines(tok, [bad, good], ["f line 1", "f line 2"], np.dtype(np.uint16), skip_bad=True)
    assert stats.conversations == 1 and stats.skipped == 1 and "f line 1: message 1 has a" in stats.first_skipped
    with pytest.raises(QuillError, match="f line 1: message 1 has a"):
        encode_lines(tok, [bad, good], ["f line 1", "f line 2"], np.dtype(np.uint16), skip_bad=False)


def _long_chat(turns):
    says = ["Who speaks?", "ROMEO, sir.", "And now?", "JULIET."]
    return [{"role": ["user", "assistant"][i % 2], "content": f"{says[i % 4]} {'I' * (i % 5)}"} for i in range(turns)]


def _tokenizers(hf_chatml):
    from hf_support import CHATML

    from quillgpt.data.hf_tokenizer import HFTokenizer

    tk, _ = hf_chatml
    return CharTokenizer(CHARS), HFTokenizer(tk.to_str(), eos_token="<|im_end|>", chat_template=CHATML)


def test_flags_found_up_to_a_limit_are_the_whole_conversations_flags_there(hf_chatml):
    """The fast path (turns past the row's end not rendered on their own) against the plain one."""
    for tok in _tokenizers(hf_chatml):
        for messages in (CHAT, _long_chat(24)):
            ids, mine = conversation_tokens(tok, messages)  # the plain computation: every turn
            for limit in (1, 5, len(ids) // 3, len(ids) // 2 + 7, len(ids), len(ids) + 50):
                fast_ids, fast_mine = conversation_tokens(tok, messages, limit)
                assert fast_ids == ids and fast_mine[:limit] == mine[:limit]
                assert all(m for f, m in zip(fast_mine, mine) if f)  # past it, only turns begun before it are marked


def test_a_conversation_of_5000_turns_is_encoded_in_linear_time(hf_chatml):
    import time

    for tok in _tokenizers(hf_chatml):
        messages, encoded = _long_chat(5000), []
        real = tok.encode
        tok.encode = lambda text, real=real, encoded=encoded: encoded.append(len(text)) or real(text)  # what is tokenized (chars)
        t0 = time.perf_counter()
        ids, mine = conversation_tokens(tok, messages, 257)
        seconds = time.perf_counter() - t0
        plain_ids, plain_mine = conversation_tokens(tok, messages[:40])  # the first rows' worth, the plain way
        assert ids[: len(plain_ids) - 8] == plain_ids[:-8] and mine[:257] == plain_mine[:257]
        assert sum(encoded) < 2 * max(encoded)  # the whole conversation once, plus prefixes within the row (quadratic: ~2500×)
        assert seconds < 5, f"{type(tok).__name__}: {seconds:.1f} s for 5,000 turns"


def test_prepared_flags_serve_rows_as_long_as_they_were_found_for(tmp_path, char_tokenizer):
    from quillgpt.data.chat_batches import ChatRows

    lines = [line(_long_chat(60))] + [conversation(i) for i in range(5)]
    cfg = chat_cfg(tmp_path, char_tokenizer, lines, val_fraction=0.3)
    first = prepare(cfg, progress=False, chat_tokens=129)
    assert first.rebuilt and first.meta["chat_tokens"] == 129
    assert not prepare(cfg, progress=False, chat_tokens=65).rebuilt  # shorter rows: the same flags serve
    assert ChatRows.prepared(cfg.out_dir, "train", 128).targets.sum() > 0
    with pytest.raises(QuillError, match="prepared for rows of 129 tokens.*block_size=256.*quill prepare"):
        ChatRows.prepared(cfg.out_dir, "train", 256)
    again = prepare(cfg, progress=False, chat_tokens=257)  # longer rows: found again, that far
    assert again.rebuilt and ChatRows.prepared(cfg.out_dir, "train", 256).targets.sum() > 0
    tok = CharTokenizer(CHARS)
    ids, mine = conversation_tokens(tok, _long_chat(60))
    flags = np.asarray(load_tokens(cfg.out_dir, "train", flags=True))
    assert np.asarray(load_tokens(cfg.out_dir, "train"))[: len(ids)].tolist() == ids  # stored whole
    assert (flags[:257] & ASSISTANT).astype(bool).tolist() == mine[:257]
    assert prepare(cfg, progress=False).rebuilt  # every token's flags asked for: found again, all of them


def test_a_conversation_whose_replies_start_past_the_row_is_kept_and_counted_untrained(tmp_path, char_tokenizer):
    """As with every token's flags found: stored, and training counts it (not a bad line)."""
    from quillgpt.data.chat_batches import ChatRows

    long_prompt = line([{"role": "user", "content": "Who speaks? " * 10}, {"role": "assistant", "content": "ROMEO"}])
    cfg = chat_cfg(tmp_path, char_tokenizer, [long_prompt, conversation(1), conversation(2), conversation(3)], val_fraction=0.25)
    prepare(cfg, progress=False, chat_tokens=65)
    rows = ChatRows.prepared(cfg.out_dir, "train", 64)
    assert rows.untrained == 1 and len(rows) == 2
    whole = chat_cfg(tmp_path, char_tokenizer, [long_prompt, conversation(1), conversation(2), conversation(3)], val_fraction=0.25, out="w")
    prepare(whole, progress=False)
    assert np.array_equal(np.asarray(load_tokens(cfg.out_dir, "train")), np.asarray(load_tokens(whole.out_dir, "train")))
    assert ChatRows.prepared(whole.out_dir, "train", 64).untrained == 1
