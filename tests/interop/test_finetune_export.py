"""An imported chat model fine-tuned with LoRA on conversations in its own template: the LoRA
run, its merged run and its Hugging Face export give the same logits and greedy reply, and
transformers loads the export (merged weights) with the same greedy text."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_support import make_hf_model  # noqa: E402

from quillgpt.cli import main  # noqa: E402
from quillgpt.config import load_config  # noqa: E402
from quillgpt.inference.chat_session import chat_prompt_ids  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.interop.convert import export_hf, import_hf  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402
from quillgpt.train.loop import train  # noqa: E402

QUESTIONS = ["Who is Romeo?", "Who is Juliet?", "Where is the east?", "What light breaks?", "Who refuses a name?"]
ANSWERS = ["A Montague.", "The sun.", "Yonder window.", "Juliet is.", "Romeo, Romeo!"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_export")
    import_hf(make_hf_model(root / "hf", "smollm2"), root / "run")
    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in zip(QUESTIONS * 4, ANSWERS * 4)
    ]
    (root / "chat.jsonl").write_text("\n".join(map(json.dumps, chats)) + "\n")
    cfg = load_config(
        root / "run" / "config.yaml",
        [  # the import's config: its tokenizer, itself as init_from
            f"data.path={root / 'chat.jsonl'}",
            "data.format=chat",
            f"data.out_dir={root / 'data'}",
            f"train.out_dir={root / 'lora'}",
            "lora.rank=4",
            "lora.alpha=8",
            "model.block_size=32",
            "train.batch_size=4",
            "train.max_iters=8",
            "train.eval_interval=8",
            "train.eval_iters=1",
            "train.warmup_iters=0",
            "train.learning_rate=2e-2",
            "train.device=cpu",
            "train.dtype=float32",
        ],
    )
    train(cfg, progress=False)
    return root


def test_the_lora_run_its_merge_and_its_export_are_one_model(tuned, capsys):
    lora = load_run(tuned / "lora")
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    prompt, _ = chat_prompt_ids(lora.tokenizer, messages)
    base = load_run(tuned / "run", which="latest")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want, _ = lora.model(ids, all_logits=True)
        assert not torch.allclose(want, base.model(ids, all_logits=True)[0], atol=1e-3)  # the adapters did something
    export_hf(tuned / "lora", tuned / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tuned / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, want, atol=1e-4, rtol=1e-4)
        hf_reply = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert torch.stack(list(generate_tokens(lora.model, [prompt], 12))).T[0].tolist() == hf_reply
    auto = transformers.AutoTokenizer.from_pretrained(tuned / "export")
    assert auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"] == prompt
    with pytest.raises(SystemExit) as e:
        main(["merge", str(tuned / "lora"), "--out", str(tuned / "merged")])
    assert e.value.code == 0
    merged = load_run(tuned / "merged", which="latest")
    assert torch.equal(merged.model(ids, all_logits=True)[0], want)
