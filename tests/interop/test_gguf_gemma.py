"""import-gguf of the real Gemma 3 270M (base, Q4_K_M: ../shared/models/zoo.sh assembles it)
against transformers' own GGUF load of the same bytes, float32: its tokenizer (SentencePiece with
byte fallback), logits on a mixed text and greedy ids. Runs with `pytest -m gguf_slow`;
$QUILL_GEMMA3_GGUF names the file (default: /tmp/zoo's)."""

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.interop.gguf_import import import_gguf  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402

MIXED = (
    "def f(x):\n    return x**2  # café, naïve, Ünïcödé 🎉🚀 12345 + 3.14\t\ttabs  and   spaces\n日本語 Привет. The capital of France is"
)


def gemma3_path() -> Path | None:
    path = Path(os.environ.get("QUILL_GEMMA3_GGUF", "/tmp/zoo/gemma3-270m.Q4_K_M.gguf"))
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = gemma3_path()
    if path is None:
        pytest.skip("no Gemma 3 GGUF: bash ../shared/models/zoo.sh /tmp/zoo, or set QUILL_GEMMA3_GGUF")
    out = tmp_path_factory.mktemp("gemma3") / "run"
    import_gguf(path, out, dequantize=True)  # fp32: the conversion itself, against transformers' fp32 load
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return path, load_run(out, which="latest"), hf, tok


@pytest.mark.gguf_slow
def test_gemma3_import_equals_transformers_gguf_load(gemma3):
    """The same ids for a mixed text (code, accents, emoji, CJK, Cyrillic: byte fallback), logits
    within 1e-4 (max abs; Gemma 3 has no final soft cap), and 32 greedy ids."""
    _, run, hf, tok = gemma3
    cfg = run.config.model
    assert (cfg.global_every, cfg.window, cfg.local_rope_theta, cfg.mlp, cfg.sandwich_norm, cfg.embed_scale) == (
        6,
        512,
        10000.0,
        "geglu",
        True,
        True,
    )
    ids = tok(MIXED).input_ids  # <bos> first, as llama.cpp and quill's prompts have it
    assert ids[0] == run.tokenizer.bos_id and ids[1:] == run.tokenizer.encode(MIXED)
    with torch.no_grad():
        got, want = run.model(torch.tensor([ids]), all_logits=True)[0], hf(torch.tensor([ids])).logits
    err = (got - want).abs().max().item()
    print(f"gemma3 270M: {len(ids)} tokens, max |quill - transformers| = {err:.2e} (largest logit {want.abs().max().item():.1f})")
    assert err <= 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    prompt = [run.tokenizer.bos_id, *run.tokenizer.encode("The capital of France is")]
    with torch.no_grad():
        x = torch.tensor([prompt])
        hf_ids = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    quill_ids = torch.stack(list(generate_tokens(run.model, [prompt], len(hf_ids)))).T[0].tolist()
    print("greedy:", repr(run.tokenizer.decode(quill_ids)))
    assert quill_ids == hf_ids
