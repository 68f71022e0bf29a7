"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2: a 151k vocabulary, q/k/v biases;
a Q5_0/Q4_K/Q6_K/Q8_0 mix) through quill against transformers' load of the same file: logits on a
mixed text, and a chat answer to a coding question, greedy, token for token. Run with
`pytest -m gguf_slow`; $QUILL_QWEN_CODER_GGUF names the file (default: /tmp/zoo's, where
../shared/models/zoo.sh assembles it)."""

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from hf_support import real_gguf_import, transformers_gguf_load  # noqa: E402

from quillgpt.inference.chat_session import chat_prompt_ids  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402

MIXED = "def f(x):\n    return x**2  # café, naïve 🎉 12345 + 3.14\t\ttabs  and   spaces\n日本語 Привет. The capital of France is"
QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = Path(os.environ.get("QUILL_QWEN_CODER_GGUF", "/tmp/zoo/qwen2.5-coder-0.5b.gguf"))
    out = real_gguf_import(path, tmp_path_factory, "Qwen2.5-Coder", "bash ../shared/models/zoo.sh /tmp/zoo, or set QUILL_QWEN_CODER_GGUF")
    return load_run(out, which="latest"), *transformers_gguf_load(path)


@pytest.mark.gguf_slow
def test_qwen_coder_logits_equal_transformers(qwen):
    run, hf, tok = qwen
    cfg = run.config.model
    assert cfg.vocab_size >= 151_000 and cfg.qkv_bias  # (this file stores its head: output.weight, untied)
    ids = tok(MIXED).input_ids
    assert ids == run.tokenizer.encode(MIXED)
    with torch.no_grad():
        got, want = run.model(torch.tensor([ids]), all_logits=True)[0][0], hf(torch.tensor([ids])).logits[0]
    err = (got - want).abs().max().item()
    print(f"qwen2.5-coder 0.5B: {len(ids)} tokens, max |quill - transformers| = {err:.2e} (largest logit {want.abs().max().item():.1f})")
    assert err <= 1e-4
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * err  # where no two logits lie within the difference of each other
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]) and clear.sum() >= len(ids) - 2


@pytest.mark.gguf_slow
def test_qwen_coder_answers_a_coding_question_as_transformers(qwen):
    """quill chat's prompt (the model's own template) = transformers' apply_chat_template; the first
    64 greedy tokens of the answer equal."""
    run, hf, tok = qwen
    prompt, _ = chat_prompt_ids(run.tokenizer, QUESTION)
    assert prompt == tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        x = torch.tensor([prompt])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)[0, len(prompt) :].tolist()
    got = torch.stack(list(generate_tokens(run.model, [prompt], len(want), temperature=0.0))).T[0].tolist()
    print("answer:", repr(run.tokenizer.decode(got)))
    assert got == want
