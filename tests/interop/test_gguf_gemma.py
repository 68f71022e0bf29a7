"""export-gguf of Gemma 3 (llama.cpp's gemma3) and import-gguf back: a random tiny Gemma 3 (made
with transformers' config, tests/hf_support.py) in the default suite, both ways and, where
llama-cpp-python is installed, in llama.cpp; and the real Gemma 3 270M (base, Q4_K_M:
../shared/models/zoo.sh assembles it) against transformers' own GGUF load of the same bytes,
float32 (its tokenizer: SentencePiece with byte fallback, logits on a mixed text, greedy ids), and
exported with --type f32 into llama.cpp. The real file's tests run with `pytest -m gguf_slow`;
$QUILL_GEMMA3_GGUF names the file (default: /tmp/zoo's)."""

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from hf_support import CORPUS, make_hf_model, real_gguf_import, transformers_gguf_load  # noqa: E402

from quillgpt.checkpoint import load_checkpoint  # noqa: E402
from quillgpt.errors import QuillError  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.interop import gguf_read, gguf_write  # noqa: E402
from quillgpt.interop.convert import import_hf  # noqa: E402
from quillgpt.interop.gguf_import import import_gguf  # noqa: E402
from quillgpt.interop.gguf_write import export_gguf  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402

MIXED = (
    "def f(x):\n    return x**2  # café, naïve, Ünïcödé 🎉🚀 12345 + 3.14\t\ttabs  and   spaces\n日本語 Привет. The capital of France is"
)
# every key llama.cpp's gemma3 reads set off its default: every 3rd layer global, the windowed layers' RoPE
# base, the global ones' linear scaling, a final soft cap; scores by 1/√head_dim, as llama.cpp computes them
TINY = dict(
    num_hidden_layers=7,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
    query_pre_attn_scalar=16,
    final_logit_softcapping=30.0,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
    },
)


def llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's n greedy tokens after `prompt` and its logits of the prompt (an f32 KV cache)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=True, type_k=f32, type_v=f32)
    try:
        llm.eval(prompt)
        logits, out = np.array(llm.scores[: len(prompt)]), []
        for _ in range(n):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(out[-1:])
        return out, logits
    finally:
        llm.close()


def quill_greedy(run, prompt: list[int], n: int) -> list[int]:
    return torch.stack(list(generate_tokens(run.model, [prompt], n))).T[0].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(quill run directory of a random tiny Gemma 3, its export-gguf --type f32 file)."""
    root = tmp_path_factory.mktemp("gemma3_gguf")
    import_hf(make_hf_model(root / "hf", "gemma3", **TINY), root / "run")
    return root / "run", export_gguf(root / "run", root / "tiny.gguf", which="latest").path


def test_export_gguf_writes_llama_cpps_gemma3_keys_and_norms(tiny):
    run_dir, path = tiny
    run, f = load_run(run_dir, which="latest"), gguf_read.GGUFFile(path)
    cfg = run.config.model
    assert (cfg.global_every, cfg.local_rope_theta, cfg.rope_scaling, cfg.logit_softcap) == (3, 20000.0, "linear", 30.0)
    want = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 7,
        "gemma3.attention.head_count_kv": 2,
        "gemma3.attention.key_length": 16,
        "gemma3.attention.sliding_window": 8,
        "gemma3.attention.sliding_window_pattern": 3,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.rope.freq_base_swa": 20000.0,
        "gemma3.rope.scaling.factor": 2.0,
        "gemma3.final_logit_softcapping": 30.0,
        "tokenizer.ggml.model": "gpt2",  # the tiny model's byte-level BPE
    }
    assert {k: f.get(k) for k in want} == want
    assert "output.weight" not in f.tensors  # the tied head
    norm = torch.from_numpy(f.array("blk.0.post_attention_norm.weight").copy())
    assert torch.equal(norm, run.model.state_dict()["transformer.h.0.ln_attn_out.weight"])  # (1 + w), as llama.cpp's converter writes


def test_export_gguf_imports_back_bit_for_bit(tiny, tmp_path):
    run_dir, path = tiny
    again = import_gguf(path, tmp_path / "again")
    cfg = load_run(run_dir, which="latest").config.model
    assert np.float32(again.model.norm_eps) == np.float32(cfg.norm_eps)  # GGUF holds it in float32
    assert dataclasses.replace(again.model, norm_eps=cfg.norm_eps) == cfg
    a, b = (load_checkpoint(d / "ckpt.pt")["model"] for d in (run_dir, again.path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before, after = load_run(run_dir, which="latest").tokenizer, load_run(again.path, which="latest").tokenizer
    assert before.encode(MIXED) == after.encode(MIXED) and (before.bos_id, before.eot_id) == (after.bos_id, after.eot_id)
    assert after.chat_template == before.chat_template is not None


def test_llama_cpp_computes_the_export_as_quill(tiny):
    """Greedy ids equal past several windows, logits within 1% of the largest (ggml's GELU is an fp16 table)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    run_dir, path = tiny
    run = load_run(run_dir, which="latest")
    prompt = [run.tokenizer.bos_id, *run.tokenizer.encode(CORPUS[0])]
    assert len(prompt) > 3 * 8  # several windows
    got, logits = llama_cpp_greedy(path, prompt, 40)
    assert got == quill_greedy(run, prompt, 40)
    with torch.no_grad():
        want = run.model(torch.tensor([prompt]), all_logits=True)[0][0].numpy()
    assert np.abs(logits - want).max() <= 0.01 * np.abs(want).max()


@pytest.mark.parametrize(
    "change, message",
    [
        ({}, r"model.attn_scale=0.204124 \(llama.cpp's gemma3 scales a 4-layer model's scores by 0.25\)"),  # scalar 24, head_dim 16
        (dict(layer_types=["sliding_attention"] * 4, query_pre_attn_scalar=16), "model.window or model.global_every unset"),
    ],
)
def test_export_gguf_refuses_what_llama_cpps_gemma3_computes_otherwise(tmp_path, change, message):
    """llama.cpp scales scores by 1/√head_dim and alternates windowed layers with global ones: a
    run of another scale, or windowed in every layer, is refused in one line, nothing written."""
    import_hf(make_hf_model(tmp_path / "hf", "gemma3", **change), tmp_path / "run")
    with pytest.raises(QuillError, match=message) as e:
        export_gguf(tmp_path / "run", tmp_path / "m.gguf", which="latest")
    assert "\n" not in str(e.value) and not (tmp_path / "m.gguf").exists()


# --- a SentencePiece vocabulary, as Gemma's files have ------------------------------------------


def gemma_like_sentencepiece(size: int):
    """A SentencePiece BPE of `size` pieces with byte fallback, as llama.cpp's converter lists one
    (piece, score, type: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte), with Gemma's kinds
    of pieces: <pad> <eos> <bos> <unk>, turn markers as control tokens, newlines and runs of spaces
    user-defined."""
    import io

    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    user = ["\n", "\n\n", "  ", "   ", "<start_of_turn>", "<end_of_turn>"]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((CORPUS + [MIXED]) * 20), model_writer=model, vocab_size=size, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, user_defined_symbols=user, pad_id=0, eos_id=1, bos_id=2, unk_id=3, add_dummy_prefix=False,
        remove_extra_whitespaces=False, num_threads=1, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = range(sp.get_piece_size())
    control = {"<start_of_turn>", "<end_of_turn>"}

    def kind(i: int) -> int:
        piece = sp.id_to_piece(i)
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) or piece in control else 6 if sp.is_byte(i) else 4 if piece in user else 1

    return [sp.id_to_piece(i) for i in ids], [sp.get_score(i) for i in ids], [kind(i) for i in ids]


def test_a_sentencepiece_vocabulary_exports_as_it_imported(tiny, tmp_path, monkeypatch):
    """A gemma3 file with a SentencePiece vocabulary, imported (transformers' Gemma conversion) and
    exported again: the same pieces and kinds, scores in the same order, and llama.cpp tokenizes
    the export as quill does. The one change is the import's:
    transformers spells a user-defined run of spaces as ▁s, a piece its merges make, and the
    export writes the vocabulary quill tokenizes with."""
    run_dir, _ = tiny
    cfg = load_run(run_dir, which="latest").config.model
    tokens, scores, types = gemma_like_sentencepiece(cfg.vocab_size)
    assert types[3] == 2  # <unk>
    fields = {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "space_prefix": False, "unk": 3}
    fields |= {"bos": 2, "eos": 1, "eot": None, "chat_template": None}
    with monkeypatch.context() as m:
        m.setattr(gguf_write, "tokenizer_fields", lambda tok, vocab_size: fields)
        original = export_gguf(run_dir, tmp_path / "sp.gguf", which="latest").path
    import_gguf(original, tmp_path / "run")
    again = export_gguf(tmp_path / "run", tmp_path / "again.gguf", which="latest").path
    a, b = gguf_read.GGUFFile(original), gguf_read.GGUFFile(again)
    assert b.get("tokenizer.ggml.model") == "llama" and b.get("tokenizer.ggml.add_space_prefix") is False
    spaces = {i for i, t in enumerate(tokens) if len(t) > 1 and set(t) == {" "}}
    assert spaces and b.get("tokenizer.ggml.tokens") == ["\u2581" * len(t) if i in spaces else t for i, t in enumerate(tokens)]
    # transformers adds <unk> as a special token: a control one, as Gemma's own files have it
    assert b.get("tokenizer.ggml.token_type") == [1 if i in spaces else 3 if i == 3 else t for i, t in enumerate(types)]
    assert [b.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown")] == [2, 1, 3]
    normal = [i for i, t in enumerate(types) if t == 1 and len(tokens[i]) > 1]  # the pieces merges make
    order = lambda f: sorted(normal, key=lambda i: -f.get("tokenizer.ggml.scores")[i])  # noqa: E731
    assert order(a) == order(b)
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    tok = load_run(tmp_path / "run", which="latest").tokenizer
    texts = [MIXED, " a leading space", "  two  spaces\n\nand newlines", "<start_of_turn>user\nhi<end_of_turn>\n", "caf\u00e9 \U0001f389"]
    vocab = llama_cpp.Llama(model_path=str(again), verbose=False, vocab_only=True)
    for text in texts:
        assert vocab.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text), text
    vocab.close()


# --- the real Gemma 3 270M --------------------------------------------------------------------


def gemma3_path() -> Path | None:
    path = Path(os.environ.get("QUILL_GEMMA3_GGUF", "/tmp/zoo/gemma3-270m.Q4_K_M.gguf"))
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gemma3_run(tmp_path_factory):
    """(the file, its import in fp32)."""
    path = gemma3_path()
    return path, real_gguf_import(path, tmp_path_factory, "gemma3", "bash ../shared/models/zoo.sh /tmp/zoo, or set QUILL_GEMMA3_GGUF")


@pytest.fixture(scope="module")
def gemma3(gemma3_run):
    path, out = gemma3_run
    return path, load_run(out, which="latest"), *transformers_gguf_load(path)


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


@pytest.mark.gguf_slow
def test_the_real_270m_exported_f32_runs_in_llama_cpp_as_quill(gemma3_run, tmp_path):
    """export-gguf --type f32 of the import: llama.cpp tokenizes as quill, and its 32 greedy
    tokens are quill's on three prompts."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    _, out = gemma3_run
    run = load_run(out, which="latest")
    path = export_gguf(out, tmp_path / "gemma3.gguf", which="latest").path
    vocab = llama_cpp.Llama(model_path=str(path), verbose=False, vocab_only=True)
    for text in (MIXED, "  two  spaces\n\n\tand a tab", "<start_of_turn>user\nHi<end_of_turn>\n"):
        assert vocab.tokenize(text.encode(), add_bos=False, special=True) == run.tokenizer.encode(text), text
    vocab.close()
    for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time"):
        prompt = [run.tokenizer.bos_id, *run.tokenizer.encode(text)]
        want = quill_greedy(run, prompt, 32)
        print(f"{text!r} → {run.tokenizer.decode(want)!r}")
        assert llama_cpp_greedy(path, prompt, 32)[0] == want
