"""`quill export-gguf`: a quill run → a GGUF file that llama.cpp, Ollama and transformers load.

The run goes through the Hugging Face converters first (interop/llama.py, gpt2.py: what a family
cannot express is refused there, by name), then into llama.cpp's tensor names (gguf.TensorNameMap)
and metadata keys (interop/gguf_family.py's table), written with the `gguf` package's GGUFWriter.
Which llama.cpp architecture: GPT-2 for learned positions + LayerNorm + GELU; for RoPE + RMSNorm +
SwiGLU qwen3 with QK-norm, qwen2 with q/k/v biases, else llama (whose q/k rows are permuted for
llama.cpp's interleaved RoPE, as its own converter does); Gemma's layers as gemma3, with the keys
llama.cpp reads for its windowed layers (window, layer pattern, their RoPE base) and its norms as
(1 + w), as llama.cpp's converter stores them. Matrices are written in --type (q8_0: rows whose
length is not a multiple of 32 stay f16, as llama.cpp's converter does), norms and biases in f32.
The tokenizer is written as llama.cpp's byte-level BPE ("gpt2"): tiktoken and trained BPE with
their split, Hugging Face byte-level tokenizers with theirs, and a char tokenizer of ASCII
characters as a vocabulary of single bytes without merges (same ids); or as its SentencePiece
vocabulary ("llama"): a BPE with byte fallback and spaces written as ▁ (Gemma's, Llama 2's). Any
other is refused in one line.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from quillgpt import quant, runs
from quillgpt.config import ModelConfig
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.files import check_output_file, os_error, refuse_onto_inputs, write_file
from quillgpt.interop import gpt2, llama
from quillgpt.interop.families import export_family
from quillgpt.interop.gguf_family import FAMILIES, PRE_NAMES, WRITE_TYPES, GGUFFamily, gemma3_score_scalar
from quillgpt.interop.gguf_read import gguf_module

SPIECE = "\u2581"  # SentencePiece's space


@dataclass
class Exported:
    """What export-gguf wrote: the file, its llama.cpp architecture and type, and the Modelfile if any."""

    path: Path
    arch: str
    type: str
    modelfile: Path | None = None


def gguf_family_of(cfg: ModelConfig) -> GGUFFamily:
    """The llama.cpp architecture a run is written as; what none of them computes is refused by name."""
    as_gpt2, as_llama = gpt2.gpt2_incompatibilities(cfg), llama.llama_incompatibilities(cfg)
    if not as_gpt2:
        return FAMILIES["gpt2"]
    if as_llama:
        raise QuillError(f"cannot export as GGUF: as GPT-2, {'; '.join(as_gpt2)}; as the Llama family, {'; '.join(as_llama)}")
    family = export_family(cfg, qwen_tokenizer=True)  # the family record: its llama.cpp name
    problems = gemma3_problems(cfg) if family.gemma else []
    if cfg.rope_scaling == "llama3":
        problems.append("model.rope_scaling=llama3 (written as rope_freqs factors, which this export does not write)")
    if cfg.window is not None and not family.gemma:
        problems.append(f"model.window={cfg.window} (llama.cpp's llama, qwen2 and qwen3 attend to the whole context)")
    if cfg.qk_norm and cfg.qkv_bias:
        problems.append("model.qk_norm with model.qkv_bias (llama.cpp's qwen3 has no q/k/v biases)")
    if problems:
        raise QuillError("cannot export as GGUF: " + "; ".join(problems))
    return FAMILIES[family.gguf_arch]


def gemma3_problems(cfg: ModelConfig) -> list[str]:
    """What llama.cpp's gemma3 computes otherwise than a Gemma run, each named."""
    problems = []
    if cfg.window is None or cfg.global_every is None:
        problems.append("model.window or model.global_every unset (llama.cpp's gemma3 alternates windowed layers with global ones)")
    scale, theirs = cfg.attn_scale or cfg.head_size**-0.5, gemma3_score_scalar(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_size) ** -0.5
    if not math.isclose(scale, theirs, rel_tol=1e-6):
        problems.append(f"model.attn_scale={scale:.6g} (llama.cpp's gemma3 scales a {cfg.n_layer}-layer model's scores by {theirs:.6g})")
    return problems


def permute(w: Tensor, heads: int) -> Tensor:
    """llama.cpp's q/k row permutation: (2i, 2i + 1) RoPE pairs from quill's (i, i + d/2) ones."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(state: dict[str, Tensor], cfg: ModelConfig, fam: GGUFFamily) -> dict[str, np.ndarray]:
    """quill state dict → llama.cpp's tensors (fp32 numpy, PyTorch shape order), by llama.cpp's names."""
    gguf = gguf_module()
    if fam.model_type == "gpt2":
        hf = {k: v.t() if k.endswith(gpt2.CONV1D_WEIGHTS) else v for k, v in gpt2.quill_to_hf_state(state, cfg).items()}
    else:
        hf = llama.quill_to_llama_state(state, cfg, fam.family, norms_hold_one=True)  # llama.cpp's Gemma norms hold (1 + w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[fam.arch.upper()], cfg.n_layer)
    out = {}
    for name, t in hf.items():
        if fam.permuted_qk and ".q_proj." in name:
            t = permute(t, cfg.n_head)
        elif fam.permuted_qk and ".k_proj." in name:
            t = permute(t, cfg.kv_heads)
        g = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if g is None:
            raise QuillError(f"cannot export as GGUF: llama.cpp's {fam.arch} has no tensor for {name}")
        out[g] = t.detach().float().contiguous().numpy()
    return out


def _add_tensor(writer: Any, name: str, a: np.ndarray, kind: str) -> None:
    gguf = gguf_module()
    Q = gguf.GGMLQuantizationType
    if a.ndim == 1 or kind == "f32":
        writer.add_tensor(name, a)
    elif kind == "q8_0" and a.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        writer.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
    elif kind == "bf16":
        writer.add_tensor(name, gguf.quants.quantize(a, Q.BF16), raw_dtype=Q.BF16)
    else:
        writer.add_tensor(name, a.astype(np.float16))


def _add_config(writer: Any, cfg: ModelConfig, fam: GGUFFamily, name: str, kind: str) -> None:
    gguf = gguf_module()
    writer.add_name(name)
    types = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
    writer.add_file_type(gguf.LlamaFileType[types[kind]])
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_head_count(cfg.n_head)
    writer.add_vocab_size(cfg.vocab_size)
    if fam.model_type == "gpt2":
        writer.add_layer_norm_eps(cfg.norm_eps)
        return
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.head_size)
    writer.add_key_length(cfg.head_size)
    writer.add_value_length(cfg.head_size)
    if cfg.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_factor)
    if fam.family.gemma:  # the windowed layers: their window, pattern and RoPE base
        writer.add_sliding_window(cfg.window)
        writer.add_uint32(f"{fam.arch}.attention.sliding_window_pattern", cfg.global_every)
        writer.add_float32(f"{fam.arch}.rope.freq_base_swa", cfg.local_rope_theta or cfg.rope_theta)
        if cfg.logit_softcap is not None:
            writer.add_final_logit_softcapping(cfg.logit_softcap)


def _byte_level(text: str) -> str:
    from quillgpt.data.hf_tokenizer import byte_decoder

    to_char = {b: c for c, b in byte_decoder().items()}
    return "".join(to_char[b] for b in text.encode("utf-8"))


def _pre_name(pre: Any) -> str | None:
    """llama.cpp's name for a tokenizer.json pre_tokenizer (see gguf_family.PRE_NAMES), or None."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    shape = []
    for s in steps:
        kind = s.get("type") if isinstance(s, dict) else None
        if kind == "ByteLevel":
            shape += ["bytelevel"] if s.get("use_regex", True) else []
        elif kind == "Digits" and s.get("individual_digits"):
            shape.append("digits")
        elif kind == "Split" and s.get("behavior") == "Isolated" and "Regex" in s.get("pattern", {}):
            shape.append(s["pattern"]["Regex"])
        else:
            return None
    names = {**{(regex,): name for name, regex in reversed(GGUF_PRE_TOKENIZER_SPLITS.items())}, **PRE_NAMES}
    return names.get(tuple(shape))


def tokenizer_fields(tok: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """llama.cpp's vocabulary with the same ids as `tok`: tokens, types, and byte-level BPE's merges
    and split ("gpt2") or SentencePiece's scores ("llama")."""
    spec = tok.spec()
    if spec["type"] == "char":
        wide = [c for c in tok.chars if ord(c) > 127]
        if wide:
            raise QuillError(
                f"cannot export the char tokenizer exactly: {''.join(wide[:5])!r} are not ASCII, and llama.cpp's "
                "byte-level vocabulary has no token for a character of several bytes without its bytes"
            )
        tokens = [_byte_level(c) for c in tok.chars]
        fields = {"model": "gpt2", "tokens": tokens, "types": [1] * len(tokens), "merges": [], "pre": "gpt-2", "added": {}}
    else:
        from quillgpt.data.hf_tokenizer import hf_files_of

        fields = _hf_vocabulary(tok.name, json.loads(hf_files_of(tok)[0]))
    tokens, added, kinds = fields.pop("tokens"), fields.pop("added"), fields.pop("types")
    if vocab_size < len(tokens):
        raise QuillError(f"cannot export: the model has {vocab_size} token rows for a tokenizer of {len(tokens)}")
    types = [(3 if added[i].get("special") else 4) if i in added else kind for i, kind in enumerate(kinds)]  # control, user-defined
    pad = vocab_size - len(tokens)  # rows no token reaches, as llama.cpp pads them: unused, scored lowest
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    if "scores" in fields:
        fields["scores"] += [min(fields["scores"]) - 1] * pad
    stops = [i for i in tok.stop_ids if i != tok.eot_id]
    return fields | {
        "tokens": tokens,
        "types": types + [5] * pad,
        "bos": tok.bos_id,
        "eos": tok.eot_id,
        "eot": stops[0] if stops else None,
        "chat_template": tok.chat_template,
    }


def _hf_vocabulary(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer.json's vocabulary as llama.cpp's: byte-level BPE with a split llama.cpp names,
    or SentencePiece-style BPE (byte fallback, spaces as ▁); any other is refused in one line."""
    model = data.get("model") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _sentencepiece(name, data)
    pre = _pre_name(data.get("pre_tokenizer"))
    if model.get("type") != "BPE" or data.get("normalizer") or pre is None:
        what = "a SentencePiece-style or normalizing" if model.get("type") != "BPE" or data.get("normalizer") else "this split's"
        raise QuillError(f"cannot export {name}'s tokenizer exactly: llama.cpp has no equivalent of {what} tokenizer here")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tokens = _ids_in_order(name, data)
    return {"model": "gpt2", "tokens": tokens, "types": [1] * len(tokens), "merges": merges, "pre": pre, "added": _added(data)}


def _sentencepiece(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """A BPE with byte fallback whose normalizer writes spaces as ▁ (with or without a leading one)
    and no split: llama.cpp's SentencePiece ("llama") vocabulary. llama.cpp merges the adjacent pair
    whose joined piece scores highest, so each piece scores minus the rank of the first merge that
    makes it (the same choices as the merges' order); <0xXX> pieces are its byte tokens."""
    steps = data.get("normalizer") or {}
    steps = steps.get("normalizers", []) if steps.get("type") == "Sequence" else [steps]
    shape = [(s.get("type"), s.get("pattern", {}).get("String"), s.get("content", s.get("prepend"))) for s in steps]
    space, prefix = ("Replace", " ", SPIECE), ("Prepend", None, SPIECE)
    if data.get("pre_tokenizer") is not None or shape not in ([space], [prefix, space]):
        raise QuillError(f"cannot export {name}'s tokenizer exactly: llama.cpp has no equivalent of its normalizer or split here")
    tokens = _ids_in_order(name, data)
    merges = [m.split(" ") if isinstance(m, str) else m for m in data["model"].get("merges", [])]
    rank: dict[str, int] = {}
    for i, (a, b) in enumerate(merges):
        rank.setdefault(a + b, i)
    types = [6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 1 for t in tokens]
    scores = [-float(rank.get(t, len(merges))) if k == 1 else 0.0 for t, k in zip(tokens, types)]
    unk = data["model"].get("unk_token")
    return {
        "model": "llama",
        "tokens": tokens,
        "types": types,
        "scores": scores,
        "space_prefix": shape[0] == prefix,
        "unk": tokens.index(unk) if unk in tokens else None,
        "added": _added(data),
    }


def _added(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {t["id"]: t for t in data.get("added_tokens", [])}


def _ids_in_order(name: str, data: dict[str, Any]) -> list[str]:
    """Every token of a tokenizer.json by id (its vocabulary and added tokens); gaps are refused."""
    by_id = {i: t for t, i in data["model"]["vocab"].items()} | {i: t["content"] for i, t in _added(data).items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise QuillError(f"cannot export {name}'s tokenizer: its ids are not 0..{len(by_id) - 1} without gaps")
    return [by_id[i] for i in range(len(by_id))]


def _add_tokenizer(writer: Any, t: dict[str, Any]) -> None:
    gguf = gguf_module()
    writer.add_tokenizer_model(t["model"])
    writer.add_token_list(t["tokens"])
    writer.add_token_types(t["types"])
    if t["model"] == "llama":
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(t["scores"])
        writer.add_add_space_prefix(t["space_prefix"])
        if t["unk"] is not None:
            writer.add_unk_token_id(t["unk"])
    else:
        writer.add_tokenizer_pre(t["pre"])
        # an empty merge list is written too: llama.cpp needs the key (see _writer)
        writer.add_key_value(gguf.Keys.Tokenizer.MERGES, t["merges"], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    writer.add_add_bos_token(t["bos"] is not None)
    writer.add_add_eos_token(False)
    for key, value in (("bos", t["bos"]), ("eos", t["eos"]), ("eot", t["eot"])):
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(value)
    if t["chat_template"] is not None:
        writer.add_chat_template(t["chat_template"])


def _writer(path: Path, arch: str) -> Any:
    """gguf.GGUFWriter, writing an empty array as GGUF allows (a count of 0; GGUFWriter refuses one):
    a char vocabulary has no merges, and llama.cpp needs the key all the same."""
    gguf = gguf_module()

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if vtype == gguf.GGUFValueType.ARRAY and isinstance(val, list) and not val:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type or gguf.GGUFValueType.STRING) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer(path, arch)


def _write(out: Path, fam: GGUFFamily, cfg: ModelConfig, tensors: dict[str, np.ndarray], tok: dict[str, Any], kind: str, name: str) -> None:
    """The GGUF file, written beside `out` and renamed over it once whole (a failure leaves no file)."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        writer = _writer(tmp, fam.arch)
        _add_config(writer, cfg, fam, name, kind)
        _add_tokenizer(writer, tok)
        for tensor_name, a in tensors.items():
            _add_tensor(writer, tensor_name, a, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except OSError as e:
        raise os_error(e, out, "write", "-o") from None
    finally:
        tmp.unlink(missing_ok=True)


CHATML_OLLAMA = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
# conversations a ChatML template must render as CHATML_OLLAMA does before the Modelfile says so
PROBES: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}],
)


def chatml_as_ollama(messages: list[dict[str, str]], system: str) -> str:
    """What CHATML_OLLAMA renders in Ollama, which puts the Modelfile's SYSTEM first when a
    conversation has no system message."""
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def ollama_system(tok: Tokenizer) -> str | None:
    """The SYSTEM ("" for none) with which Ollama's ChatML writes every probe conversation as the
    run's chat template does (SmolLM2's adds a default system prompt), or None where none does."""
    from quillgpt.data.chat_template import render

    bos, eos = getattr(tok, "bos_token", None), getattr(tok, "eos_token", None)
    try:
        texts = [render(tok.chat_template, list(p), True, bos, eos) for p in PROBES]
    except QuillError:
        return None
    m = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", texts[0], re.S)
    system = m.group(1) if m else ""
    exact = '"""' not in system and all(t == chatml_as_ollama(list(p), system) for p, t in zip(PROBES, texts))
    return system if exact else None


def modelfile_text(gguf_path: Path, tok: Tokenizer) -> str:
    """An Ollama Modelfile for the file: FROM, its stop tokens, and a TEMPLATE where one is exact
    (none: the prompt as it is; a template that writes the probe conversations as Ollama's ChatML
    does: that ChatML, with its default system prompt as SYSTEM); any other chat template is left
    to Ollama, which reads tokenizer.chat_template from the file."""
    lines = [f"FROM ./{gguf_path.name}"]
    system = None if tok.chat_template is None else ollama_system(tok)
    if tok.chat_template is None:
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    elif system is not None:
        lines.append(f'TEMPLATE """{CHATML_OLLAMA}"""')
        lines += [f'SYSTEM """{system}"""'] if system else []
    else:
        lines.append("# TEMPLATE: Ollama takes the chat template from the file's tokenizer.chat_template")
    for i in tok.stop_ids:
        lines.append(f"PARAMETER stop {json.dumps(tok.decode([i]))}")
    lines.append("PARAMETER temperature 0")
    return "\n".join(lines) + "\n"


def export_gguf(
    run: str | Path, out: str | Path, kind: str = "f32", which: str = "best", force: bool = False, ollama: bool = False
) -> Exported:
    """A quill run (or .pt; a LoRA run merged) → one GGUF file of llama.cpp's llama, qwen2, qwen3,
    gemma3 or gpt2, matrices in `kind` (f32, f16, bf16, q8_0); with `ollama`, a Modelfile beside it."""
    if kind not in WRITE_TYPES:
        raise QuillError(f"--type {kind!r} is not a GGUF type export writes; choose one of {', '.join(WRITE_TYPES)}")
    inputs = runs.run_inputs(run, which)
    out = check_output_file(out, "-o", force=force, inputs=inputs)
    modelfile = out.with_name("Modelfile") if ollama else None
    if modelfile is not None:
        check_output_file(modelfile, "the Modelfile", force=force, inputs=inputs)
    loaded = runs.load_run(run, which=which)
    refuse_onto_inputs([out, *([modelfile] if modelfile else [])], runs.run_inputs(loaded.path, config=loaded.config), "-o")
    quant.dequantize(loaded.model)  # a quantized run's weights as the float values its codes hold
    cfg, tok = loaded.config.model, loaded.tokenizer
    fam = gguf_family_of(cfg)
    fields = tokenizer_fields(tok, cfg.vocab_size)
    tensors = gguf_tensors(loaded.model.state_dict(), cfg, fam)
    _write(out, fam, cfg, tensors, fields, kind, Path(loaded.path).name)
    if modelfile is not None:
        text = modelfile_text(out, tok).encode()
        write_file(modelfile, lambda f: f.write(text), "the Modelfile")
    return Exported(out, fam.arch, kind, modelfile)
