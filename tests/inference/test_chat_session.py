"""quill chat: replies through the model's template (imported) or the transcript (quill's own),
multi-turn history, /reset, /quit, Ctrl-C stopping one reply, and the command itself."""

import copy
import io
import subprocess
import sys

import pytest
import torch
from serve_support import tiny_run_dir
from support import ROOT

from quillgpt.cli import main
from quillgpt.config import ModelConfig
from quillgpt.data.chat_template import TRANSCRIPT_STOPS, transcript
from quillgpt.inference.chat_session import COMPILE_NOTED_S, ChatSession, chat_prompt_ids, fitting, repl
from quillgpt.inference.driver import encode_prompt
from quillgpt.inference.generate import generate_tokens
from quillgpt.interop.convert import import_hf
from quillgpt.model.gpt import GPT
from quillgpt.quant import quantize
from quillgpt.runs import load_run
from quillgpt.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def quill_run(tmp_path_factory, shakespeare_path):
    return load_run(tiny_run_dir(tmp_path_factory.mktemp("chat") / "tiny", shakespeare_path))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_support import make_hf_model

    root = tmp_path_factory.mktemp("smollm2")
    import_hf(make_hf_model(root / "hf", "smollm2"), root / "run")
    return load_run(root / "run", which="latest")


def test_a_reply_is_the_engine_continuing_the_rendered_conversation(imported):
    session = ChatSession(imported.model, imported.tokenizer, GREEDY, system="Be brief.")
    reply = "".join(session.reply("Who is Romeo?"))
    ids, stops = chat_prompt_ids(imported.tokenizer, session.messages[:-1])
    prompt_end = imported.tokenizer.encode("<|im_start|>assistant\n")
    assert stops == () and ids[-len(prompt_end) :] == prompt_end  # the template's own generation prompt
    tokens = [t for t in torch.stack(list(generate_tokens(imported.model, [ids], 12, stop_ids=imported.tokenizer.stop_ids))).T[0].tolist()]
    stop = next((i for i, t in enumerate(tokens) if t in imported.tokenizer.stop_ids), len(tokens))
    assert reply == imported.tokenizer.decode_bytes(tokens[:stop]).decode("utf-8", errors="replace")
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"] and session.messages[-1]["content"] == reply
    second = "".join(session.reply("And Juliet?"))  # the whole conversation, rendered again
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[-1]["content"] == second
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]


def test_a_base_model_chats_through_the_transcript_and_stops_at_the_next_turn(quill_run):
    session = ChatSession(quill_run.model, quill_run.tokenizer, SamplingParams(max_new_tokens=40, temperature=0.0))
    reply = "".join(session.reply("Speak, friend."))
    ids, stops = chat_prompt_ids(quill_run.tokenizer, [{"role": "user", "content": "Speak, friend."}])
    assert stops == TRANSCRIPT_STOPS and ids == encode_prompt(quill_run.tokenizer, transcript(session.messages[:1]))
    assert not any(s in reply for s in TRANSCRIPT_STOPS)


def test_a_prefix_lm_reply_fits_its_block():
    model = GPT(ModelConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8, attention="prefix")).eval()
    assert fitting(model, 10, 500) == 6 and fitting(model, 16, 500) == 1
    causal = GPT(ModelConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8)).eval()
    assert fitting(causal, 10, 500) == 500


def test_help_and_unknown_commands_are_answered_by_quill_never_sent_to_the_model(imported):
    session = ChatSession(imported.model, imported.tokenizer, SamplingParams(max_new_tokens=5, temperature=0.0))
    lines = iter(["/help", "/models", " /etc/hosts is a file?", "/quit"])
    out = []
    assert repl(session, lambda prompt: next(lines), out.append) == 1  # only the line starting with a space replied to
    printed = "".join(out)
    assert printed.count("/reset forgets the conversation") == 2 and "(no command /models)" in printed
    assert [m["content"] for m in session.messages if m["role"] == "user"] == [" /etc/hosts is a file?"]


def test_repl_commands_and_ctrl_c_stops_one_reply_not_the_session(quill_run):
    session = ChatSession(quill_run.model, quill_run.tokenizer, SamplingParams(max_new_tokens=30, temperature=0.0))
    lines = iter(["Speak.", "", KeyboardInterrupt, "/reset", "Speak again.", "Once more.", "/quit", "never read"])

    def read(prompt):
        line = next(lines)
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        return line

    out, pieces = [], {"n": 0}

    def write(text):
        out.append(text)
        if text and len(session.messages) >= 1 and session.messages[-1]["content"] == "Once more.":
            pieces["n"] += 1
            if pieces["n"] == 3:  # Ctrl-C during the third reply
                raise KeyboardInterrupt

    assert repl(session, read, write) == 3 and next(lines) == "never read"
    printed = "".join(out)
    assert "(conversation cleared)" in printed and "[stopped]" in printed and "(/quit or Ctrl-D" in printed
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]  # after /reset
    assert session.messages[-1]["content"] and len(session.messages[-1]["content"]) < 30  # the cut reply stays


def test_the_chat_command_over_standard_input(quill_run):
    run_dir = quill_run.path.parent
    done = subprocess.run(
        [sys.executable, "-m", "quillgpt", "chat", "--ckpt", str(run_dir), "-n", "20", "--temperature", "0", "--system", "Be kind."],
        input="Speak, friend.\n/reset\nHello?\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "a base model (step " in done.stderr and "User:/Assistant: transcript" in done.stderr and "(conversation cleared)" in done.stdout
    assert done.stderr.count("tokens/s after the first") == 2  # a speed line after each reply
    assert done.stdout.count("> ") == 4  # three lines, then end of input
    bad = subprocess.run(
        [sys.executable, "-m", "quillgpt", "chat", "--ckpt", str(run_dir), "--top-p", "2"],
        input="",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2 and "--top-p must be in (0, 1]" in bad.stderr


def test_chat_quantize_int8_replies_with_the_int8_model(imported, fixed_int8_kernel, monkeypatch, capsys):
    """quill chat --quantize int8 on an imported (tied-head) model: the reply is the int8 model's
    (the kernel fixed: a tiny model may measure the float linears faster), the start line names
    the kernel; a scheme that does not exist is one line, exit 2."""
    int8 = quantize(copy.deepcopy(imported.model), "int8", kernel=fixed_int8_kernel)
    want = "".join(ChatSession(int8, imported.tokenizer, GREEDY).reply("Who is Romeo?"))
    assert want
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who is Romeo?\n"))
    with pytest.raises(SystemExit) as e:
        main(["chat", "--ckpt", str(imported.path), "-n", "12", "--temperature", "0", "--quantize", "int8"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and f"int8 weights (32 per scale), {fixed_int8_kernel}" in err
    assert out == f"> {want}\n> \n"
    with pytest.raises(SystemExit) as e:
        main(["chat", "--ckpt", str(imported.path), "--quantize", "int3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--quantize must be int8, int8-channel, int5, int4, int4-g64, int4-g128 or none, got 'int3'" in err


def test_a_compiled_chat_replies_as_eager_and_later_replies_reuse_its_graph(imported, monkeypatch, capsys):
    """quill chat --compile: each reply is the eager session's; the cache is sized by
    shared_capacity, so the second (longer) reply runs the first one's graph: only the first
    reply's speed line counts a compile."""
    eager = ChatSession(imported.model, imported.tokenizer, GREEDY)
    compiled = ChatSession(imported.model, imported.tokenizer, GREEDY, compile=True)
    assert "".join(compiled.reply("Who is Romeo?")) == "".join(eager.reply("Who is Romeo?"))
    first = compiled.last
    assert first.compile_s > COMPILE_NOTED_S and "; compiling the decode step" in first.line()
    assert "".join(compiled.reply("And Juliet?")) == "".join(eager.reply("And Juliet?"))
    assert compiled.last.compile_s < COMPILE_NOTED_S and "compiling" not in compiled.last.line()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who is Romeo?\n"))
    with pytest.raises(SystemExit) as e:
        main(["chat", "--ckpt", str(imported.path), "--which", "latest", "-n", "12", "--temperature", "0", "--compile"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and out == f"> {eager.messages[1]['content']}\n> \n"
    assert "compiling the decode step" in err


def test_a_failed_reply_is_one_error_and_a_hostile_top_p_replies_greedily(quill_run, monkeypatch):
    """The engine's row failures reach the chat as one QuillError (not a traceback), whether the
    prefill's logits are not finite or a later step's are; a top_p below float32's smallest value
    keeps the most likely token, so the reply is the greedy one."""
    import copy

    from quillgpt.errors import QuillError
    from quillgpt.inference import engine as engine_mod

    greedy = "".join(ChatSession(quill_run.model, quill_run.tokenizer, GREEDY).reply("Speak."))
    hostile = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1e-46, seed=3)
    assert "".join(ChatSession(quill_run.model, quill_run.tokenizer, hostile).reply("Speak.")) == greedy
    broken = copy.deepcopy(quill_run.model)
    with torch.no_grad():
        broken.transformer.ln_f.weight.fill_(float("nan"))
    with pytest.raises(QuillError, match=r"the reply failed: .*not finite"):
        "".join(ChatSession(broken, quill_run.tokenizer, GREEDY).reply("Speak."))
    step = engine_mod.Engine._step_logits
    monkeypatch.setattr(engine_mod.Engine, "_step_logits", lambda self, active, width: step(self, active, width) * float("nan"))
    session = ChatSession(quill_run.model, quill_run.tokenizer, GREEDY)
    with pytest.raises(QuillError, match=r"the reply failed: .*not finite"):
        "".join(session.reply("Speak."))
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # what was said before stays


def test_a_first_token_that_cannot_become_text_fails_the_reply(quill_run, monkeypatch):
    """The first token's failure comes back as a Piece with an error (not a raise): it is the
    reply's one QuillError too, never an empty reply."""
    from quillgpt.errors import QuillError
    from quillgpt.inference import driver as text_mod

    def undecodable(stream, token, finish):
        raise ValueError(f"no text for id {token}")

    monkeypatch.setattr(text_mod.TextBatch, "_text", staticmethod(undecodable))
    with pytest.raises(QuillError, match=r"the reply failed: .*turning the token into text.*no text for id"):
        "".join(ChatSession(quill_run.model, quill_run.tokenizer, GREEDY).reply("Speak."))


def test_a_reply_cut_by_its_length_drops_a_started_stop_string(quill_run):
    """max_new_tokens ends the reply inside '\\nUser:': a chat reply drops the '\\nUse' it held back
    (it printed ' GLOUCESTER' then a stray 'Use'); a plain continuation keeps it (it may be text)."""
    from quillgpt.inference.driver import TextStream

    tok = quill_run.tokenizer
    for drop, want in ((True, " GLOUCESTER"), (False, " GLOUCESTER\nUse")):
        stream = TextStream(tok, TRANSCRIPT_STOPS, drop_cut_stop=drop)
        shown = "".join(stream.push(i) for i in tok.encode(" GLOUCESTER\nUse")) + stream.finish(cut=True)
        assert shown == want
        stream = TextStream(tok, TRANSCRIPT_STOPS, drop_cut_stop=drop)  # the model's own end: nothing dropped
        assert "".join(stream.push(i) for i in tok.encode("A\nUse")) + stream.finish() == "A\nUse"


def test_the_header_names_the_kind_of_run(quill_run, imported):
    from quillgpt.inference.chat_session import run_kind

    assert run_kind(quill_run.config, quill_run.tokenizer, 2).startswith("a base model (step 2, not trained to chat) through a User:")
    assert run_kind(imported.config, imported.tokenizer, 0) == "a model with its own chat template (imported, step 0)"
    tuned = copy.deepcopy(quill_run.config)
    tuned.data.format, tuned.lora.rank = "chat", 4
    assert run_kind(tuned, quill_run.tokenizer, 500) == (
        "a chat fine-tune (LoRA rank 4 trained on conversations, step 500) through a User:/Assistant: transcript"
    )


def test_each_reply_ends_with_its_speed_and_stats_repeats_it(quill_run):
    session = ChatSession(quill_run.model, quill_run.tokenizer, SamplingParams(max_new_tokens=8, temperature=0.0))
    lines, out, notes = iter(["/stats", "Speak.", "/stats", "/quit"]), [], []
    assert repl(session, lambda prompt: next(lines), out.append, notes.append) == 1
    assert "(no reply yet)" in out[0] and len(notes) == 1
    assert (
        session.last.tokens == 8 and f"(8 token(s) in {session.last.seconds:.2f}s, " in notes[0] and "tokens/s after the first" in notes[0]
    )
    assert notes[0] + "\n" in out  # /stats: the same line


def test_typing_during_a_reply_is_not_echoed_and_is_kept_for_the_next_line():
    import os
    import pty
    import select
    import termios
    import time

    from quillgpt.inference.chat_session import typing_kept

    leader, follower = pty.openpty()
    try:
        before = termios.tcgetattr(follower)
        assert before[3] & termios.ECHO
        with typing_kept(follower):
            assert not termios.tcgetattr(follower)[3] & termios.ECHO and termios.tcgetattr(follower)[3] & termios.ICANON
            os.write(leader, b"next question\n")  # typed while the reply streams
            os.write(leader, b"/quit\n\x03")  # a /quit typed ahead, then Ctrl-C to stop the reply
            time.sleep(0.3)  # the line discipline takes typed input in a worker: the Ctrl-C lands while the reply streams
        assert termios.tcgetattr(follower) == before

        def line():  # the next line typed, or b"" (never a hang: without NOFLSH the Ctrl-C flushed them all)
            return os.read(follower, 100) if select.select([follower], [], [], 2)[0] else b""

        assert line() == b"next question\n"  # kept for the next turn
        assert line() == b"/quit\n"  # not flushed by the interrupt
        with typing_kept(None):  # no terminal (a pipe, a test): nothing to do
            pass
    finally:
        os.close(leader)
        os.close(follower)


def test_a_message_the_model_cannot_read_is_one_error_line_and_the_chat_goes_on(quill_run):
    """A character outside the char vocabulary, or an invalid byte (a lone surrogate, as
    surrogateescape reads it), is an error line; the message is not kept and the next one is answered."""
    session = ChatSession(quill_run.model, quill_run.tokenizer, GREEDY)
    lines = iter(["日本", "bad \udcff byte", "Speak.", "/quit"])
    out: list[str] = []
    assert repl(session, lambda prompt: next(lines), out.append) == 1
    errors = [t for t in out if t.startswith("error: ")]
    assert len(errors) == 2 and "not in the char vocabulary" in errors[0] and "not UTF-8" in errors[1]
    assert all(t.count("\n") == 1 and t.endswith("\n") for t in errors)
    assert [m["content"] for m in session.messages][:1] == ["Speak."] and len(session.messages) == 2


def test_chat_refuses_zero_new_tokens_and_reads_invalid_utf8_as_an_error_line(quill_run):
    run_dir = quill_run.path.parent
    chat = [sys.executable, "-m", "quillgpt", "chat", "--ckpt", str(run_dir), "--temperature", "0"]
    zero = subprocess.run([*chat, "-n", "0"], input=b"", capture_output=True, cwd=ROOT, timeout=120)
    assert zero.returncode == 2 and zero.stderr.decode().strip().splitlines() == [
        "error: --max-new-tokens 0: a reply needs at least 1 token"
    ]
    with pytest.raises(Exception, match="at least 1"):
        ChatSession(quill_run.model, quill_run.tokenizer, SamplingParams(max_new_tokens=0))
    done = subprocess.run([*chat, "-n", "5"], input=b"\xff\xfe\nSpeak.\n", capture_output=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    assert done.stdout.count(b"error: the message is not UTF-8") == 1 and done.stdout.count(b"> ") == 3
