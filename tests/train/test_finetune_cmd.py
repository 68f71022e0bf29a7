"""`quill finetune`: a small imported model (random weights) learns a synthetic task with the
settings sized from its data, and the plan it prints says what it then does."""

import json

import pytest
import torch
from hf_support import make_hf_model

from quillgpt.cli import main
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
    chats = [
        {"messages": [{"role": "user", "content": f"House of {n}?"}, {"role": "assistant", "content": h}]} for n, h in zip(NAMES, HOUSES)
    ]
    (root / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats * 5) + "\n")  # the last 10% (4 lines) held out
    return root


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
    assert cfg.model.block_size == plan.longest < 160  # the longest conversation, not the base's context
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


def test_full_fine_tuning_plans_with_its_own_rate_whatever_the_base_run_s_min_lr(base):
    assert load_run(base / "run", which="latest").config.train.min_lr > FULL_LR  # what used to refuse --full's rate
    cfg = finetune_config(base / "run", base / "chat.jsonl", base / "full", full=True)
    assert cfg.train.learning_rate == FULL_LR and cfg.train.min_lr <= FULL_LR
