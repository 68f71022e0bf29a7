"""`quill finetune`: a small imported model (random weights) learns a synthetic task with the
settings sized from its data, and the plan it prints says what it then does."""

import json
import shutil

import pytest
import torch
from hf_support import make_hf_model

from quillgpt.cli import main
from quillgpt.config import load_config
from quillgpt.inference.chat_session import chat_prompt_ids
from quillgpt.inference.generate import generate_tokens
from quillgpt.interop.convert import import_hf
from quillgpt.runs import load_run
from quillgpt.train.finetune import FULL_LR, finetune, finetune_config

NAMES = ["Romeo", "Juliet", "Tybalt", "Mercutio", "Benvolio", "Paris", "Nurse", "Friar"]
HOUSES = ["Montague", "Capulet", "Capulet", "Prince", "Montague", "Prince", "Capulet", "Prince"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune_cmd")
    import_hf(make_hf_model(root / "hf", "smollm2"), root / "run")
    chats = [chat(n, h) for n, h in zip(NAMES, HOUSES)]
    (root / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats * 5) + "\n")  # the last 10% (4 lines) held out
    return root


def chat(name, house):
    return {"messages": [{"role": "user", "content": f"House of {name}?"}, {"role": "assistant", "content": house}]}


def losses(run_dir):
    """Every loss a run logged, step by step (timings left out)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k == "step" or k.endswith("loss")} for line in lines]


def answer(run, name):
    prompt, _ = chat_prompt_ids(run.tokenizer, [{"role": "user", "content": f"House of {name}?"}])
    ids = torch.stack(list(generate_tokens(run.model, [prompt], 8))).T[0].tolist()
    return run.tokenizer.decode(ids)


def test_finetune_learns_a_synthetic_task_with_its_planned_settings(base, capsys):
    plan, result = finetune(
        base / "run", base / "chat.jsonl", base / "out", full=True, epochs=3, overrides=["train.learning_rate=3e-3"], progress=False
    )
    printed = capsys.readouterr().out
    assert printed.startswith("plan: full fine-tuning of ") and f"= {plan.steps} steps" in printed
    assert (plan.train_conversations, plan.val_conversations) == (36, 4)
    run = load_run(base / "out")
    cfg = run.config
    context = load_run(base / "run", which="latest").config.model.block_size
    assert cfg.model.block_size == load_config(base / "out" / "config.yaml").model.block_size == plan.block_size == context
    assert plan.longest < context and f"the longest {plan.longest}" in printed  # rows: as long as the data's, not the context
    assert cfg.train.max_iters == plan.steps == result.step and cfg.train.warmup_iters == plan.warmup_iters >= 1
    assert cfg.train.batch_tokens == plan.batch_tokens and cfg.train.learning_rate == 3e-3  # the override wins
    before = load_run(base / "run", which="latest")
    assert sum(answer(before, n).startswith(h) for n, h in zip(NAMES, HOUSES)) <= 2
    assert all(answer(run, n).startswith(h) for n, h in zip(NAMES, HOUSES))


def test_finetune_refuses_bad_input_in_one_line(base, capsys):
    for argv, want in [
        (["finetune", str(base / "hf"), "--data", str(base / "chat.jsonl"), "-o", str(base / "x")], "is not a run directory"),
        (["finetune", str(base / "run"), "--data", str(base / "none.jsonl"), "-o", str(base / "x")], "no such file"),
        (["finetune", str(base / "run"), "--data", str(base / "chat.jsonl"), "-o", str(base / "x"), "--epochs", "0"], "--epochs"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and len(err.strip().splitlines()) == 1


def test_finetune_s_epochs_are_bounded_before_anything_is_planned(base, capsys):
    for epochs, want in [("1000000000", "--epochs must be at least 1 and at most 1,000"), ("9223372036854775808", "--epochs")]:
        with pytest.raises(SystemExit) as e:
            main(["finetune", str(base / "run"), "--data", str(base / "chat.jsonl"), "-o", str(base / "x"), "--epochs", epochs])
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and len(err.strip().splitlines()) == 1
        assert not (base / "x").exists()


def test_full_fine_tuning_plans_with_its_own_rate_whatever_the_base_run_s_min_lr(base):
    assert load_run(base / "run", which="latest").config.train.min_lr > FULL_LR  # what used to refuse --full's rate
    cfg = finetune_config(base / "run", base / "chat.jsonl", base / "full", full=True)
    assert cfg.train.learning_rate == FULL_LR and cfg.train.min_lr <= FULL_LR


def test_a_fine_tune_keeps_its_base_s_context_and_trains_as_it_did_with_the_context_cut_to_the_longest(base, tmp_path):
    """Issue 65: the plan set model.block_size to the longest conversation, and that became the
    fine-tune's context in chat, serve and the exports. A row is as long as its conversation
    whatever the context, so keeping the base's changes no step: the same batches and losses."""
    common = ["train.max_iters=4", "train.eval_interval=2", "train.dtype=float32"]  # fp32: no autocast rounding to hide a difference
    plan, kept = finetune(base / "run", base / "chat.jsonl", tmp_path / "kept", epochs=1, overrides=common, progress=False)
    cut_plan, cut = finetune(
        base / "run",
        base / "chat.jsonl",
        tmp_path / "cut",
        epochs=1,
        overrides=[*common, f"model.block_size={plan.longest}"],
        progress=False,
    )
    context = load_run(base / "run", which="latest").config.model.block_size
    assert load_run(tmp_path / "kept").config.model.block_size == context > plan.longest
    assert load_run(tmp_path / "cut").config.model.block_size == cut_plan.block_size == plan.longest  # given: it may shrink
    assert (cut_plan.longest, cut_plan.batch_tokens, cut_plan.steps) == (plan.longest, plan.batch_tokens, plan.steps)
    assert losses(tmp_path / "kept") == losses(tmp_path / "cut")  # every step's train loss, and held-out at 2 and 4
    assert [line["step"] for line in losses(tmp_path / "kept") if "val_loss" in line] == [2, 4]
    assert kept.best_val_loss == cut.best_val_loss


def test_finetune_s_done_line_names_the_weights_chat_merge_and_export_use(base, tmp_path, capsys):
    """Issue 65: the done line gave the last step's held-out loss while best.pt, which chat, merge
    and export load, was an earlier step's. Held-out answers the train split never gives make the
    held-out loss rise once the train split's answers are learned, so best.pt is not the last step."""
    data = tmp_path / "chat.jsonl"
    chats = [chat(n, h) for n, h in zip(NAMES, HOUSES)]
    held_out = [chat(n, "Verona, a fair city in the north of Italy") for n in NAMES[:4]]  # the last 10%
    data.write_text("\n".join(json.dumps(c) for c in chats * 4 + chats[:4] + held_out) + "\n")
    with pytest.raises(SystemExit) as e:
        main(
            ["finetune", str(base / "run"), "--data", str(data), "-o", str(tmp_path / "out"), "--full", "-q"]
            + ["train.learning_rate=2e-2", "train.batch_tokens=400", "train.eval_interval=1"]
        )
    printed = capsys.readouterr().out
    val = {line["step"]: line["val_loss"] for line in losses(tmp_path / "out")}
    best = torch.load(tmp_path / "out" / "best.pt", weights_only=True)
    assert e.value.code == 0 and best["step"] == min(val, key=val.get) < max(val)  # the lowest held-out loss, not the last step's
    assert f"done: step {max(val)}, held-out loss {val[max(val)]:.4f}" in printed
    assert f"best.pt (step {best['step']}, held-out loss {best['val_loss']:.4f}, the lowest) is what chat, merge and export use" in printed
    assert f"step {max(val)}'s weights: --which latest" in printed


def test_finetune_into_a_run_already_there_says_how_to_go_on_in_its_own_flags(base, tmp_path, capsys):
    """Issue 65: a run already in -o was refused with train's words (`--resume`, which finetune
    does not have, and train.out_dir); and only after its data had been prepared over OUT/data."""
    (tmp_path / "out").mkdir()
    for name in ("config.yaml", "ckpt.pt"):
        shutil.copy(base / "run" / name, tmp_path / "out" / name)
    with pytest.raises(SystemExit) as e:
        main(["finetune", str(base / "run"), "--data", str(base / "chat.jsonl"), "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "plan:" not in out
    assert not (tmp_path / "out" / "data").exists()  # refused before its data is prepared there
    assert "already holds a run" in err and "another -o" in err and "train.resume=true" in err and "--overwrite" in err
    assert "--resume" not in err and "train.out_dir" not in err  # train's flags, not finetune's
