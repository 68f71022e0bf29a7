"""Fine-tuning a base run on chat data: LoRA (adapters only change, the base file stays byte for
byte, checkpoints hold adapters + the base's checksum, a changed base is refused, resume is exact,
DDP = one process), full fine-tuning, merging, and scoring conversations as training does."""

import contextlib
import hashlib
import json
import os
import re

import numpy as np
import pytest
import torch
from support import CPU_CONFIG, assert_same_state, interrupt_after, losses, tiny, torchrun

import quillgpt.train.loop as loop_mod
from quillgpt.checkpoint import load_checkpoint, save_checkpoint, weights_checksum
from quillgpt.cli import main
from quillgpt.config import load_config
from quillgpt.errors import QuillError
from quillgpt.evaluate.scores import evaluate_checkpoint
from quillgpt.model.gpt import GPT
from quillgpt.model.lora import adapter_shapes, is_adapter
from quillgpt.runs import load_run
from quillgpt.train.distributed import Dist
from quillgpt.train.loop import setup, train
from quillgpt.train.run_dir import open_run

SPEAKERS = ("ROMEO", "JULIET", "NURSE")


def speaker_lines(text):
    """(speaker, the first line of each of their speeches) for three speakers of Tiny Shakespeare."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^(ROMEO|JULIET|NURSE):\n(.+)$", text, re.M)]


@pytest.fixture(scope="module")
def base(tmp_path_factory, shakespeare_path):
    """A tiny char-level base run (block 48), and chat data from its corpus: a line → its speaker."""
    root = tmp_path_factory.mktemp("finetune")
    train(
        load_config(
            CPU_CONFIG,
            tiny(shakespeare_path, root / "text", root / "base", "model.block_size=48", "train.max_iters=20", "train.eval_interval=20"),
        ),
        progress=False,
    )
    lines = [
        json.dumps({"messages": [{"role": "user", "content": said[:16]}, {"role": "assistant", "content": who}]})
        for who, said in speaker_lines(shakespeare_path.read_text())[:120]
    ]
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return root


def chat_overrides(root, out, *extra):
    return [
        f"data.path={root / 'chat.jsonl'}",
        "data.format=chat",  # data.tokenizer unset: the base's own
        f"data.out_dir={root / 'chatdata'}",
        f"train.out_dir={out}",
        f"train.init_from={root / 'base'}",
        "model.block_size=48",
        "train.batch_size=4",
        "train.max_iters=6",
        "train.eval_interval=3",
        "train.eval_iters=2",
        "train.log_interval=1",
        "train.warmup_iters=1",
        "train.learning_rate=1e-2",
        "train.device=cpu",
        "train.dtype=float32",
        *extra,
    ]


def finetune(root, out, *extra):
    return train(load_config(CPU_CONFIG, chat_overrides(root, out, *extra)), progress=False)


def file_hash(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fresh_adapters_compute_the_base_exactly(base, tmp_path):
    cfg = load_config(CPU_CONFIG, chat_overrides(base, tmp_path / "lora", "lora.rank=4"))
    with contextlib.ExitStack() as stack:
        prepared, _ = open_run(cfg, Dist(), stack, progress=False)
        t = setup(cfg, Dist(), torch.device("cpu"), prepared, state=None)
    x, _ = t.sampler.next()
    want, _ = load_run(base / "base").model(x, all_logits=True)
    got, _ = t.raw_model.eval()(x, all_logits=True)
    assert torch.equal(got, want)
    trained = {n for n, p in t.raw_model.named_parameters() if p.requires_grad}
    assert trained == set(adapter_shapes(t.cfg.model, t.cfg.lora))
    assert sum(len(g["params"]) for g in t.optimizer.param_groups) == len(trained)  # only adapters are optimized


def test_a_lora_run_trains_adapters_only_and_leaves_its_base_byte_for_byte(base, tmp_path, capsys):
    base_file = base / "base" / "best.pt"
    before = file_hash(base_file)
    capsys.readouterr()
    result = finetune(base, tmp_path / "lora", "lora.rank=4", "lora.targets=[q,v,mlp]")
    assert result.step == 6 and file_hash(base_file) == before
    shapes = adapter_shapes(load_run(base / "base").config.model, load_run(tmp_path / "lora").config.lora)
    trained = sum(int(np.prod(s)) for s in shapes.values())
    assert f"LoRA rank 4 on q, v, mlp: {trained:,} trained parameters" in capsys.readouterr().out
    for name in ("ckpt.pt", "best.pt"):
        state = load_checkpoint(tmp_path / "lora" / name)
        assert {k: tuple(v.shape) for k, v in state["model"].items()} == adapter_shapes(
            load_run(base / "base").config.model, load_run(tmp_path / "lora").config.lora
        )
        assert state["lora_base"] == {"path": str(base_file.resolve()), "checksum": weights_checksum(load_checkpoint(base_file)["model"])}
    assert os.path.getsize(tmp_path / "lora" / "best.pt") < 0.5 * os.path.getsize(base_file)
    # merged for use: every weight is the base's but the targeted ones, which moved
    merged, plain = load_run(tmp_path / "lora").model.state_dict(), load_checkpoint(base_file)["model"]
    for name, w in merged.items():
        targeted = re.search(r"attn\.c_attn|mlp\.c_fc|mlp\.c_proj", name) and name.endswith("weight")
        assert torch.equal(w, plain[name]) != bool(targeted), name
    assert not any(is_adapter(n) for n in merged)


def test_kill_and_resume_of_a_lora_run_is_bit_identical(base, tmp_path, monkeypatch):
    extra = ("lora.rank=4", "lora.dropout=0.1")  # dropout: the random stream must resume too
    finetune(base, tmp_path / "straight", *extra)
    interrupt_after(monkeypatch, 4)
    assert finetune(base, tmp_path / "resumed", *extra).stopped == "interrupted"
    monkeypatch.undo()
    finetune(base, tmp_path / "resumed", *extra, "train.resume=true")
    a, b = (load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("straight", "resumed"))
    for key in ("model", "optimizer", "rng", "sampler", "step", "lora_base"):
        assert_same_state(a[key], b[key], key)
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


def test_a_base_that_changed_or_went_away_is_refused_in_one_line(base, tmp_path, capsys):
    root = tmp_path / "copy"
    (root / "base").mkdir(parents=True)
    for name in ("best.pt", "tokenizer.json", "config.yaml"):
        (root / "base" / name).write_bytes((base / "base" / name).read_bytes())
    (root / "chat.jsonl").write_bytes((base / "chat.jsonl").read_bytes())
    finetune(root, root / "lora", "lora.rank=2", "train.max_iters=3")
    state = load_checkpoint(root / "base" / "best.pt")
    state["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] += 1e-3  # the base trained on a little
    save_checkpoint(state, root / "base" / "best.pt")
    with pytest.raises(QuillError, match="whose weights have changed since.*restore that base, or fine-tune again"):
        load_run(root / "lora")
    with pytest.raises(QuillError, match="cannot resume .*its LoRA base .*checksums differ"):
        finetune(root, root / "lora", "lora.rank=2", "train.max_iters=6", "train.resume=true")
    (root / "base" / "best.pt").unlink()
    with pytest.raises(SystemExit) as e:
        main(["sample", "--ckpt", str(root / "lora"), "-p", "ROMEO"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "which is missing; put the base back" in err[0]


def test_full_fine_tuning_on_chat_data_scores_as_eval_does(base, tmp_path, capsys):
    result = finetune(base, tmp_path / "full", "train.eval_iters=4")  # 16 ≥ the 12 val conversations
    state = load_checkpoint(tmp_path / "full" / "ckpt.pt")
    assert "lora_base" not in state and not any(is_adapter(k) for k in state["model"])
    (split,) = evaluate_checkpoint(tmp_path / "full", which="latest", device="cpu")
    assert split.loss == pytest.approx(result.last_val_loss, rel=1e-6)  # every val conversation is in the fixed set
    val_lines = (base / "chat.jsonl").read_text().splitlines()[-12:]  # data.val_fraction 0.1 of 120
    (tmp_path / "val.jsonl").write_text("\n".join(val_lines) + "\n")
    (text,) = evaluate_checkpoint(tmp_path / "full", which="latest", texts=[tmp_path / "val.jsonl"], text_format="chat", device="cpu")
    assert (text.loss, text.tokens) == pytest.approx((split.loss, split.tokens), rel=1e-9)
    assert text.tokens == sum(len(json.loads(v)["messages"][1]["content"]) + len("\n\nUser:") + 1 for v in val_lines)
    with pytest.raises(QuillError, match="--format chat scores the conversations of --text"):
        evaluate_checkpoint(tmp_path / "full", text_format="chat")
    with pytest.raises(QuillError, match="--stride does not apply to chat data"):  # its split is conversations too
        evaluate_checkpoint(tmp_path / "full", which="latest", stride=4, device="cpu")
    capsys.readouterr()
    assert (
        main_code(
            [
                "eval",
                "--ckpt",
                str(tmp_path / "full"),
                "--which",
                "latest",
                "--text",
                str(tmp_path / "val.jsonl"),
                "--format",
                "chat",
                "--json",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(text.loss, rel=1e-9)


def test_quill_merge_writes_the_run_every_command_loads(base, tmp_path, capsys):
    finetune(base, tmp_path / "lora", "lora.rank=4")
    assert main_code(["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 0
    assert "merged" in capsys.readouterr().out
    x = torch.tensor([[5, 9, 11, 30, 7, 1, 2]])
    lora, merged = load_run(tmp_path / "lora"), load_run(tmp_path / "merged")
    assert torch.equal(lora.model(x, all_logits=True)[0], merged.model(x, all_logits=True)[0])
    assert merged.config.lora.rank == 0 and merged.config.train.init_from is None
    assert "lora_base" not in load_checkpoint(tmp_path / "merged" / "ckpt.pt")
    for argv, message in (
        (["merge", str(base / "base"), "--out", str(tmp_path / "m2")], "is not a LoRA run"),
        (["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")], "already holds a run"),
        (["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "lora")], "is where the LoRA run"),
    ):
        assert main_code(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_a_merge_that_fails_to_write_leaves_no_out_behind(base, tmp_path, monkeypatch, capsys):
    import quillgpt.runs as runs_mod

    def full(*args, **kwargs):
        raise QuillError("cannot write ckpt.pt: No space left on device")

    finetune(base, tmp_path / "lora", "lora.rank=2")
    monkeypatch.setattr(runs_mod, "save_checkpoint", full)  # what write_run calls
    assert main_code(["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "m" / "merged")]) == 2
    assert "No space left" in capsys.readouterr().err and not (tmp_path / "m").exists()


def main_code(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_lora_is_refused_where_it_cannot_work(base, tmp_path):
    with pytest.raises(QuillError, match="lora.rank > 0 adapts a trained model: set train.init_from"):
        load_config(CPU_CONFIG, ["lora.rank=4"])
    with pytest.raises(QuillError, match="LoRA adapters train with AdamW"):
        load_config(CPU_CONFIG, ["lora.rank=4", f"train.init_from={base / 'base'}", "train.optimizer=muon"])
    with pytest.raises(QuillError, match="is the run in train.out_dir, which this run would replace"):
        finetune(base, base / "base", "lora.rank=4", "train.overwrite=true")


def test_ddp_lora_two_processes_match_one_process(base, tmp_path):
    finetune(base, tmp_path / "single", "lora.rank=4", "train.max_iters=4")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["-m", "quillgpt", "train", "--config", str(CPU_CONFIG), "-q"]
    overrides = chat_overrides(base, tmp_path / "ddp", "lora.rank=4", "train.max_iters=4", "train.batch_size=2")
    proc = torchrun(2, [*args, *overrides], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    single, multi = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert [s for s, *_ in single] == [s for s, *_ in multi]
    for (_, a, va), (_, b, vb) in zip(single, multi):
        assert a == pytest.approx(b, abs=1e-4) and (va is None or va == pytest.approx(vb, abs=1e-4))
    one, two = (load_checkpoint(tmp_path / name / "ckpt.pt")["model"] for name in ("single", "ddp"))
    for k in one:
        np.testing.assert_allclose(one[k].numpy(), two[k].numpy(), atol=1e-5)


def test_a_chat_step_is_the_mean_over_its_assistant_tokens_however_it_is_split(base, tmp_path):
    """Rows hold different numbers of the assistant's tokens: 2 micro-batches of 2 = 1 batch of 4."""
    finetune(base, tmp_path / "one", "lora.rank=4", "train.max_iters=3")
    finetune(base, tmp_path / "two", "lora.rank=4", "train.max_iters=3", "train.batch_size=2", "train.grad_accum=2")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [a for _, a, _ in one] == pytest.approx([b for _, b, _ in two], abs=1e-5)


def test_a_shared_system_prompt_runs_once_and_trains_the_same(base, tmp_path, monkeypatch):
    """Conversations that open with the same system prompt: their steps run it once per batch
    (GPT.forward's share_prefix), and the run's losses equal those of every row running it."""
    rows = [json.loads(line) for line in (base / "chat.jsonl").read_text().splitlines()]
    system = {"role": "system", "content": "Who?"}  # "System: Who?" and a newline, 13 characters
    short = [[{**m, "content": m["content"][:8]} for m in r["messages"]] for r in rows]  # within block 48
    (tmp_path / "sys.jsonl").write_text("".join(json.dumps({"messages": [system, *m]}) + "\n" for m in short))
    shared = {"n": 0}
    original = GPT._after_shared_prefix

    def counted(self, idx, P):
        shared["n"] += 1
        return original(self, idx, P)

    monkeypatch.setattr(GPT, "_after_shared_prefix", counted)
    common = ["lora.rank=4", "train.max_iters=3", f"data.path={tmp_path / 'sys.jsonl'}", f"data.out_dir={tmp_path / 'data'}"]
    finetune(base, tmp_path / "shared", *common)
    assert shared["n"] >= 3  # every training step (and the evaluations) took the shared prefix
    monkeypatch.setattr(loop_mod, "shares_prefix", lambda t: False)
    finetune(base, tmp_path / "full", *common)
    one, two = losses(tmp_path / "shared"), losses(tmp_path / "full")
    assert [a for _, a, _ in one] == pytest.approx([b for _, b, _ in two], abs=1e-5)
