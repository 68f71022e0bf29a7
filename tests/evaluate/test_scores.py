"""quill eval: every token scored once, against direct computations and the trainer's val loss."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quillgpt.checkpoint import load_checkpoint, save_checkpoint
from quillgpt.config import ModelConfig, load_config
from quillgpt.data.batches import fixed_windows
from quillgpt.data.prepare import load_tokens
from quillgpt.data.tokenizer_files import build_tokenizer
from quillgpt.errors import QuillError
from quillgpt.evaluate.scores import (
    Scores,
    evaluate_checkpoint,
    evaluate_checkpoints,
    evaluate_text,
    evaluate_tokens,
    evaluate_windows,
    format_table,
)
from quillgpt.metrics_log import read_metrics
from quillgpt.model.gpt import GPT
from quillgpt.model.variants import VARIANTS
from quillgpt.quant import quantize
from quillgpt.runs import load_run
from quillgpt.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 8


class Uniform(nn.Module):
    """Same forward signature and variant as GPT, all-zero logits: every token costs exactly ln(V)."""

    def __init__(self, vocab_size: int, block_size: int):
        super().__init__()
        self.vocab_size, self.config = vocab_size, SimpleNamespace(block_size=block_size)
        self.variant = VARIANTS["causal"]

    def forward(self, idx, targets=None, *, all_logits=False):
        return torch.zeros(*idx.shape, self.vocab_size), None


@pytest.fixture(scope="module")
def tiny_gpt():
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=11, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, bias=True))


def token_nats(model, context, target):
    """Cross-entropy of one target given exactly `context`, in a forward of its own."""
    logits, _ = model(torch.tensor([context]), all_logits=True)
    return F.cross_entropy(logits[0, -1].double(), torch.tensor(target)).item()


def test_uniform_logits_score_ln_vocab():
    tokens = np.random.default_rng(0).integers(0, 13, 50)
    for stride in (1, 3, BLOCK):
        r = evaluate_tokens(Uniform(13, BLOCK), tokens, stride=stride, batch_size=4)
        assert r.tokens == 49
        assert r.loss == pytest.approx(math.log(13), abs=1e-6)  # float32 log-softmax
        assert r.perplexity == pytest.approx(13) and r.bits_per_token == pytest.approx(math.log2(13))


@torch.no_grad()
def test_short_text_matches_one_direct_forward(tiny_gpt):
    tokens = np.random.default_rng(1).integers(0, 11, BLOCK + 1)  # BLOCK predictions: one window
    logits, _ = tiny_gpt(torch.tensor(tokens[None, :-1]), all_logits=True)
    direct = F.cross_entropy(logits[0].double(), torch.tensor(tokens[1:])).item()
    for stride in range(1, BLOCK + 1):
        assert evaluate_tokens(tiny_gpt, tokens, stride=stride).loss == pytest.approx(direct, abs=1e-6)


@torch.no_grad()
def test_sliding_pass_matches_per_token_brute_force(tiny_gpt):
    tokens = np.random.default_rng(2).integers(0, 11, 5 * BLOCK).tolist()
    n = len(tokens)
    # stride 1: every token sees the min(j, block_size) tokens before it
    full = [token_nats(tiny_gpt, tokens[max(0, j - BLOCK) : j], tokens[j]) for j in range(1, n)]
    assert evaluate_tokens(tiny_gpt, tokens, stride=1, batch_size=5).loss == pytest.approx(np.mean(full), abs=1e-6)
    for stride in range(2, BLOCK + 1):
        expected = []
        for j in range(1, n):
            # the window scoring target j ends at the first window end ≥ j: BLOCK, BLOCK+stride, ... (≤ n-1)
            end = BLOCK if j <= BLOCK else min(n - 1, BLOCK + stride * math.ceil((j - BLOCK) / stride))
            expected.append(token_nats(tiny_gpt, tokens[end - BLOCK : j], tokens[j]))
        got = evaluate_tokens(tiny_gpt, tokens, stride=stride, batch_size=3)
        assert got.tokens == n - 1
        assert got.nats == pytest.approx(sum(expected), abs=1e-5)
        assert got.loss == pytest.approx(np.mean(expected), abs=1e-6)


def test_batch_size_does_not_change_the_result_and_mode_is_restored(tiny_gpt):
    tokens = np.random.default_rng(3).integers(0, 11, 101)
    tiny_gpt.train()
    losses = [evaluate_tokens(tiny_gpt, tokens, stride=3, batch_size=b).loss for b in (1, 4, 64)]
    assert tiny_gpt.training
    assert losses[1] == pytest.approx(losses[0], abs=1e-6) and losses[2] == pytest.approx(losses[0], abs=1e-6)


def test_bits_per_byte_by_hand_with_multibyte_chars(tiny_gpt):
    text = "héllo ✓ 日本"
    tok = build_tokenizer("char", text)
    r = evaluate_text(Uniform(tok.vocab_size, BLOCK), tok, text, stride=2)
    # scored text "éllo ✓ 日本" (the first char is context): 9 chars, é 2 + llo 3 + space 1 + ✓ 3
    # + space 1 + 日本 6 = 16 bytes
    assert (r.tokens, r.bytes, r.chars) == (9, 16, 9)
    assert r.nats == pytest.approx(9 * math.log(tok.vocab_size))
    assert r.bits_per_byte == pytest.approx(9 * math.log(tok.vocab_size) / (math.log(2) * 16))
    assert r.bits_per_char == pytest.approx(9 * math.log(tok.vocab_size) / (math.log(2) * 9))
    real = evaluate_text(GPT(ModelConfig(vocab_size=tok.vocab_size, block_size=4, n_layer=1, n_head=2, n_embd=16)), tok, text)
    assert real.bits_per_byte == pytest.approx(real.nats / (math.log(2) * 16))


def test_bytes_and_chars_under_bpe_count_the_scored_text(byte_bpe):
    gpt2 = byte_bpe
    text = "日本 ok"  # a byte-level BPE (as GPT-2's) splits 日 into byte tokens: the first token is part of a character
    ids = gpt2.encode(text)
    r = evaluate_text(Uniform(gpt2.vocab_size, BLOCK), gpt2, text)
    assert r.tokens == len(ids) - 1
    assert r.bytes == len(text.encode()) - len(gpt2.decode_bytes(ids[:1]))
    assert r.chars == len(text) - 1  # 日 counts where its lead byte is: in the unscored first token


def test_unknown_chars_error_or_are_skipped():
    tok = build_tokenizer("char", "abc ")
    with pytest.raises(QuillError, match=r"3 character\(s\).*'x' ×2.*'é' ×1.*--skip-unknown"):
        evaluate_text(Uniform(tok.vocab_size, BLOCK), tok, "ab xcxé a")
    r = evaluate_text(Uniform(tok.vocab_size, BLOCK), tok, "ab xcxé a", skip_unknown=True)
    assert r.unknown_dropped == 3 and (r.tokens, r.bytes, r.chars) == (5, 5, 5)  # "ab c a"


def test_bad_stride_is_a_user_error(tiny_gpt):
    with pytest.raises(QuillError, match="--stride"):
        evaluate_tokens(tiny_gpt, np.arange(20) % 11, stride=BLOCK + 1)


# --- a tiny trained run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(shakespeare_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    cfg = load_config(
        ROOT / "configs" / "shakespeare_char_cpu.yaml",
        [
            f"data.path={shakespeare_path}",
            f"data.out_dir={tmp / 'data'}",
            f"train.out_dir={tmp / 'run'}",
            "model.n_layer=2",
            "model.n_head=2",
            "model.n_embd=32",
            "model.block_size=16",
            "train.batch_size=4",
            "train.max_iters=8",
            "train.eval_interval=4",
            "train.eval_iters=2",
            "train.log_interval=4",
            "train.warmup_iters=2",
            "train.device=cpu",
        ],
    )
    train(cfg, progress=False)
    return tmp / "run"


def test_fixed_windows_reproduce_the_trainers_val_loss(run):
    loaded = load_run(run, which="latest")
    cfg = loaded.config
    logged = [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if r["step"] == loaded.step and "val_loss" in r]
    val = load_tokens(cfg.data.out_dir, "val")
    starts = fixed_windows(val, cfg.model.block_size, cfg.train.eval_iters * cfg.train.batch_size)
    r = evaluate_windows(loaded.model, val, starts, batch_size=3)
    assert r.tokens == len(starts) * cfg.model.block_size
    assert r.loss == pytest.approx(logged[0], abs=1e-6)


def cli(*args):
    from quillgpt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["eval", *args])
    return exit_.value.code


def test_cli_json_scores_every_val_token(run, capsys):
    assert cli("--ckpt", str(run), "--json", "--batch-size", "64") == 0
    row = json.loads(capsys.readouterr().out)
    n_val = len(load_tokens(load_run(run).config.data.out_dir, "val"))
    assert row["tokens"] == n_val - 1 and row["bytes"] == row["chars"] == n_val - 1  # ASCII text
    assert row["data"] == "val" and row["stride"] == 16
    assert row["bits_per_byte"] == pytest.approx(row["loss"] / math.log(2))
    assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))


def test_cli_compares_checkpoints_and_texts(run, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question.\n")
    best, latest = str(run / "best.pt"), str(run / "ckpt.pt")
    assert cli("--ckpt", best, "--ckpt", latest, "--text", str(text), "--text", str(text), "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["checkpoint"], r["data"]) for r in rows] == [(best, str(text))] * 2 + [(latest, str(text))] * 2
    assert rows[0]["loss"] == rows[1]["loss"]
    assert cli("--ckpt", best, "--ckpt", latest, "--text", str(text)) == 0
    table = capsys.readouterr().out.splitlines()
    assert "bits/byte" in table[0] and best in table[1] and latest in table[2]


def test_evaluate_checkpoints_are_each_runs_rows_as_a_table_or_json(run, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question.\n")
    scores = evaluate_checkpoints([run, run / "ckpt.pt"], texts=[text], batch_size=4)
    assert [(r.checkpoint, r.data) for r in scores.results] == [(str(run), str(text)), (str(run / "ckpt.pt"), str(text))]
    assert json.loads(scores.to_json()) == [r.to_dict() for r in scores.results]
    assert json.loads(Scores(scores.results[:1]).to_json()) == scores.results[0].to_dict()  # one row: its object
    assert scores.table() == format_table(scores.results)


def test_cli_int8_eval_scores_the_int8_model(run, capsys, fixed_int8_kernel):
    assert cli("--ckpt", str(run), "--json", "--batch-size", "64", "--quantize", "int8") == 0
    row = json.loads(capsys.readouterr().out)
    loaded = load_run(run)
    val = load_tokens(loaded.config.data.out_dir, "val")
    fp32 = evaluate_tokens(loaded.model, val, batch_size=64)
    int8 = evaluate_tokens(quantize(loaded.model, "int8", kernel=fixed_int8_kernel), val, batch_size=64)
    assert row["quantize"] == "int8" and row["loss"] == pytest.approx(int8.loss, rel=1e-6)
    assert row["loss"] != fp32.loss and row["loss"] == pytest.approx(fp32.loss, rel=0.01)
    assert cli("--ckpt", str(run), "--quantize", "int8") == 0
    assert f"{run} (int8)" in capsys.readouterr().out.splitlines()[1]


def test_cli_unknown_chars_exit_2_unless_skipped(run, tmp_path, capsys):
    text = tmp_path / "u.txt"
    text.write_text("Whither, ô Romeo ✓?\n")
    assert cli("--ckpt", str(run), "--text", str(text)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 character(s)" in err and "--skip-unknown" in err
    assert cli("--ckpt", str(run), "--text", str(text), "--skip-unknown", "--json") == 0
    row = json.loads(capsys.readouterr().out)
    assert row["unknown_dropped"] == 2 and row["bytes"] == len("hither,  Romeo ?\n")


def test_cli_missing_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    assert cli("--ckpt", str(tmp_path / "nope")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint not found") and len(err.strip().splitlines()) == 1


def test_missing_prepared_data_says_run_prepare(run, tmp_path):
    state = load_checkpoint(run / "best.pt")
    state["config"]["data"]["out_dir"] = str(tmp_path / "gone")
    (tmp_path / "moved").mkdir()
    save_checkpoint(state, tmp_path / "moved" / "best.pt")
    with pytest.raises(QuillError, match=r"no prepared val split in .*gone.*quill prepare --config"):
        evaluate_checkpoint(tmp_path / "moved")


def test_chat_rows_that_share_a_system_prompt_score_as_each_conversation_alone():
    """evaluate_rows runs the rows' common prefix once (share_prefix): the summed nats equal each
    conversation's own full forward."""
    from support import random_model

    from quillgpt.data.chat_batches import ChatRows
    from quillgpt.data.chat_data import ASSISTANT, START
    from quillgpt.evaluate.scores import evaluate_rows

    system = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # 9 tokens ≥ MIN_SHARED_PREFIX
    convs = [(system + [7, 8, 10, 11], 3), (system + [12, 13, 14], 2), (system + [15, 16, 17, 18, 19], 4)]
    ids = np.concatenate([np.asarray(c) for c, _ in convs])
    flags = np.concatenate([np.r_[np.zeros(len(c) - n), np.full(n, ASSISTANT)] for c, n in convs]).astype(np.uint8)
    flags[np.cumsum([0] + [len(c) for c, _ in convs[:-1]])] |= START
    model = random_model("rope")
    got = evaluate_rows(model, ChatRows(ids, flags, 16), batch_size=3)
    want = 0.0
    for c, n in convs:
        logits, _ = model(torch.tensor([c[:-1]]), all_logits=True)
        want += F.cross_entropy(logits[0, -n:], torch.tensor(c[-n:]), reduction="sum").item()
    assert got.tokens == sum(n for _, n in convs)
    assert got.nats == pytest.approx(want, rel=1e-5)
