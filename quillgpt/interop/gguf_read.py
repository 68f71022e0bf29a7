"""`quill import-gguf`: a GGUF file (llama.cpp's format) → a quill run directory.

The file is untrusted: its header is walked and bounded, and every tensor checked against the
model its metadata describes, by interop/gguf_checks.py before anything is allocated. It is then
read with the `gguf` package (ggml's own reader, memory-mapped) and its tensors dequantized with
gguf.quants, ggml's reference code, one at a time, to fp32. The metadata becomes a config.json-like
dict through interop/gguf_family.py's table, and the Hugging Face converters (interop/llama.py,
gpt2.py) build and check the model from it, so a GGUF imports exactly as the same model's
Hugging Face directory does, and what quill cannot compute is refused by the same names. Tensor
names go through gguf.TensorNameMap; q/k rows that llama.cpp's converter permuted for its
interleaved RoPE are permuted back. The tokenizer is transformers' GGUF converter (a `tokenizers`
pipeline from tokenizer.ggml.*), with the pre-tokenizer llama.cpp names in tokenizer.ggml.pre.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quillgpt.config import ModelConfig, shown_value
from quillgpt.data.chat_template import end_of_turn
from quillgpt.data.hf_tokenizer import HFTokenizer
from quillgpt.errors import QuillError
from quillgpt.files import input_file, shown
from quillgpt.interop import gguf_checks, gpt2, llama
from quillgpt.interop.gguf_family import FAMILIES, PRE_TOKENIZERS, READ_TYPES, GGUFFamily, gemma3_score_scalar
from quillgpt.interop.hf_files import require

GGUF_INSTALL = 'pip install -e ".[gguf]"'
BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def gguf_module() -> Any:
    """The gguf package, or one line saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise QuillError(f"GGUF files need the gguf package (the gguf extra): {GGUF_INSTALL}") from None
    return gguf


class GGUFFile:
    """A GGUF file's metadata (key → value) and tensors (name → ggml tensor), checked as it opens."""

    def __init__(self, path: str | Path) -> None:
        gguf, self.path = gguf_module(), Path(path)
        if not input_file(self.path, "GGUF file"):
            raise QuillError(f"{shown(self.path)} not found: pass a .gguf file")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError:
            magic = b"GGUF"  # the reader says what is wrong
        if magic != b"GGUF":
            raise QuillError(f"{shown(self.path)} is not a GGUF file (it does not start with GGUF's magic bytes): pass a llama.cpp model")
        try:
            gguf_checks.check_layout(self.path)  # every count, length and tensor range bounded before the reader maps them
        except OSError as e:
            raise QuillError(f"{shown(self.path)} cannot be read ({e.strerror}); check the path and its permissions") from None
        try:
            self.reader = gguf.GGUFReader(self.path)
            self.meta = {k: f.contents() for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        except Exception as e:  # noqa: BLE001 — a damaged header fails in numpy or the reader with many types
            raise QuillError(
                f"{shown(self.path)} is not a readable GGUF file ({type(e).__name__}: {str(e)[:100]}); is it whole? download it again"
            ) from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        unknown = sorted({t.tensor_type.name for t in self.tensors.values()} - set(READ_TYPES))
        if unknown:
            first = next(t.name for t in self.tensors.values() if t.tensor_type.name in unknown)
            raise QuillError(
                f"{shown(self.path)} has {', '.join(unknown)} tensors (e.g. {first}); quill dequantizes {', '.join(READ_TYPES)}"
            )

    def drop_vocabulary(self) -> None:
        """Forget the tokenizer's arrays (a 151k vocabulary's strings and the reader's views of them:
        hundreds of MB) once the tokenizer is built, before the tensors are read."""
        for key in BIG_ARRAYS:
            self.meta.pop(key, None)
            self.reader.fields.pop(key, None)

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    @cached_property
    def family(self) -> GGUFFamily:
        arch = self.get("general.architecture")
        if arch not in FAMILIES:
            raise QuillError(
                f"{shown(self.path)}: general.architecture is {shown_value(arch)}; quill imports {', '.join(FAMILIES)} GGUF files"
            )
        return FAMILIES[arch]

    def array(self, name: str) -> np.ndarray:
        """One tensor dequantized to fp32, in PyTorch's shape order (ggml lists dimensions innermost first)."""
        t, kind = self.tensors[name], self.tensors[name].tensor_type.name
        gguf_checks.check_finite(self.path, name, kind, raw=t.data)
        try:
            values = np.asarray(gguf_module().quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (ValueError, NotImplementedError) as e:
            raise QuillError(f"{shown(self.path)}: cannot dequantize {name} ({kind}: {str(e)[:100]})") from None
        gguf_checks.check_finite(self.path, name, kind, values=values)
        return values


# metadata keys that hold a positive real; the others a count or a length
REAL_KEYS = ("epsilon", "freq_base", "freq_base_swa", "softcapping")
MAX_METADATA_INT = 2**24  # a count or length beyond this is no model quill can hold (block_size's own bound)


def _checked(f: GGUFFile, key: str, value: Any) -> int | float:
    """A shape or norm value of the metadata, typed and ranged before any arithmetic uses it."""
    real = key.endswith(REAL_KEYS)
    ok = isinstance(value, (int, float) if real else int) and not isinstance(value, bool)
    if ok and real:
        ok = math.isfinite(value) and value > 0
    elif ok:
        ok = 1 <= value <= MAX_METADATA_INT
    if not ok:
        want = "a positive finite number" if real else f"an integer from 1 to {MAX_METADATA_INT:,}"
        raise QuillError(f"{shown(f.path)}: {key} must be {want}, got {shown_value(value)[:60]}: the file's metadata is damaged")
    return value


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The config.json the file's metadata describes (the keys llama.py / gpt2.py read)."""
    fam, arch = f.family, f.family.arch
    hf: dict[str, Any] = {"model_type": fam.model_type}
    for key, hf_key in fam.keys.items():
        value = f.get(f"{arch}.{key}")
        if isinstance(value, list):
            raise QuillError(f"{shown(f.path)}: {arch}.{key} differs per layer ({shown_value(value)[:60]}); quill's layers share one shape")
        if value is not None:
            hf[hf_key] = _checked(f, f"{arch}.{key}", value)
    hf.setdefault("vocab_size", len(f.get("tokenizer.ggml.tokens") or []) or None)
    hf["tie_word_embeddings"] = "output.weight" not in f.tensors
    if fam.model_type == "gpt2":
        return hf
    head_dim = hf.get("head_dim") or hf.get("hidden_size", 0) // max(1, hf.get("num_attention_heads", 1))
    if f.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise QuillError(
            f"{shown(f.path)}: RoPE on {f.get(f'{arch}.rope.dimension_count')} of {head_dim} dimensions per head (quill rotates all)"
        )
    if "rope_freqs.weight" in f.tensors:
        raise QuillError(f"{shown(f.path)} has rope_freqs (Llama 3.1-style RoPE scaling as factors), which quill does not import")
    scaling = f.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise QuillError(f"{shown(f.path)}: {arch}.rope.scaling.type={shown_value(scaling)} (quill imports linear RoPE scaling only)")
    if scaling == "linear":  # config.json's older form (read with rope_theta), which Gemma's reads as its global layers'
        hf["rope_scaling"] = {"rope_type": "linear", "factor": f.get(f"{arch}.rope.scaling.factor", 1.0)}
    hf["attention_bias"] = fam.model_type != "qwen2" and "blk.0.attn_q.bias" in f.tensors
    if fam.family.gemma:  # llama.cpp computes Gemma 3's score scale
        shape = (hf.get("num_hidden_layers", 0), hf.get("hidden_size", 0), hf.get("num_attention_heads", 1))
        hf["query_pre_attn_scalar"] = gemma3_score_scalar(*shape, head_dim)
    return hf


def unpermute(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation: (i, i + d/2) RoPE pairs from its (2i, 2i + 1) ones."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFWeights(Mapping[str, Tensor]):
    """A GGUF file's tensors under their Hugging Face names, dequantized one at a time when read
    (the file's tensors checked against `hf_names`' model first: check_tensors)."""

    def __init__(self, f: GGUFFile, hf: dict[str, Any], hf_names: list[str]) -> None:
        gguf = gguf_module()
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[f.family.arch.upper()], hf.get("num_hidden_layers", hf.get("n_layer", 0)))
        self.f, self.hf, self._gguf_of = f, hf, {}
        for hf_name in hf_names:
            g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if g in f.tensors:
                self._gguf_of[hf_name] = g

    def __getitem__(self, name: str) -> Tensor:
        return self.unpermuted(name, torch.from_numpy(self.f.array(self._gguf_of[name]).copy()))

    def unpermuted(self, name: str, t: Tensor) -> Tensor:
        """Rows of the tensor HF calls `name` (or anything row-aligned with them: codes, scales) with
        llama.cpp's q/k permutation undone, where the family's converter permuted them."""
        if not self.f.family.permuted_qk or not name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            return t
        heads = self.hf["num_attention_heads"] if ".q_proj." in name else self.hf.get("num_key_value_heads", self.hf["num_attention_heads"])
        if t.shape[0] % (2 * heads):
            raise QuillError(f"{shown(self.f.path)}: {self._gguf_of[name]} has {t.shape[0]} rows, not a multiple of 2 × {heads} heads")
        return unpermute(t, heads)

    def gguf_name(self, hf_name: str) -> str:
        """The file's name of a tensor, or one QuillError saying it is missing."""
        if hf_name not in self._gguf_of:
            raise QuillError(f"{shown(self.f.path)} has no tensor for {hf_name} that a model of its metadata needs")
        return self._gguf_of[hf_name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._gguf_of)

    def __len__(self) -> int:
        return len(self._gguf_of)


def model_config(f: GGUFFile, hf: dict[str, Any]) -> ModelConfig:
    """The quill config of the file's metadata (hf_config's dict), as its family's converter makes it."""
    if f.family.model_type == "gpt2":
        return gpt2.hf_to_model_config(hf, str(f.path))
    return llama.llama_to_model_config(hf, str(f.path))


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor of the file against the model its metadata describes, before any is read:
    none missing, none extra, each of the shape the model needs (gguf_checks.check_shapes)."""
    gguf = gguf_module()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[f.family.arch.upper()], cfg.n_layer)
    with torch.device("meta"):
        from quillgpt.model.gpt import GPT

        meta = GPT(cfg).state_dict()
    o_biases = {f"model.layers.{i}.self_attn.o_proj.bias": (cfg.n_embd,) for i in range(cfg.n_layer)}
    if f.family.model_type == "gpt2":
        bias_of = lambda n: (meta[n.removesuffix(".bias") + ".weight"].shape[0],)  # noqa: E731
        shapes = {n: tuple(meta[n].shape) if n in meta else bias_of(n) for n in _gpt2_names(cfg)}
    else:
        names_of = llama.weight_names(cfg)
        split = llama.quill_to_llama_state(meta, cfg, f.family.family)
        shapes = {n: tuple(split[n].shape) for parts in names_of.values() for n in parts} | o_biases
    want = {names.get_name(n, try_suffixes=(".weight", ".bias")): s for n, s in shapes.items()}
    optional = {names.get_name(n, try_suffixes=(".weight", ".bias")) for n in o_biases}
    have = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in f.tensors.items()}
    gguf_checks.check_shapes(f.path, have, want, optional, f"{cfg.n_layer}-layer model of its {f.family.arch} metadata")


def _gpt2_names(cfg: ModelConfig) -> list[str]:
    """The HF GPT-2 tensor names of a model of `cfg` (quill's own names are GPT-2's)."""
    with torch.device("meta"):
        from quillgpt.model.gpt import GPT

        return [k for k in GPT(cfg).state_dict() if k != "lm_head.weight" or not cfg.tie_embeddings] + [
            f"transformer.h.{i}.{m}.bias"
            for i in range(cfg.n_layer)
            for m in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
        ]


def model_of(f: GGUFFile) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(model config, quill state dict in fp32) of a GGUF file, checked as import-hf checks a directory."""
    hf = hf_config(f)
    cfg = model_config(f, hf)
    check_tensors(f, cfg)
    if f.family.model_type == "gpt2":
        return cfg, gpt2.hf_to_quill_state(_gpt2_state(f, hf, cfg), cfg)
    o_bias = "blk.0.attn_output.bias" in f.tensors
    names = [n for parts in llama.weight_names(cfg).values() for n in parts]
    names += [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(cfg.n_layer)] if o_bias else []
    # Gemma's norms: llama.cpp's converter stored (1 + w) already
    return cfg, llama.llama_to_quill_state(GGUFWeights(f, hf, names), cfg, o_bias, norms_hold_one=f.family.family.gemma)


def _gpt2_state(f: GGUFFile, hf: dict[str, Any], cfg: ModelConfig) -> dict[str, Tensor]:
    """GPT-2 tensors as transformers stores them (Conv1D weights (in, out)); llama.cpp's are (out, in)."""
    weights = GGUFWeights(f, hf, _gpt2_names(cfg))
    state = {k: weights[k] for k in weights}
    return {k: v.t() if k.endswith(gpt2.CONV1D_WEIGHTS) else v for k, v in state.items()}


def _pre_tokenizer(steps: tuple[str, ...]) -> Any:
    """A `tokenizers` pre-tokenizer of gguf_family.PRE_TOKENIZERS' steps."""
    from tokenizers import Regex, pre_tokenizers

    made = []
    for step in steps:
        if step == "digits":
            made.append(pre_tokenizers.Digits(individual_digits=True))
        elif step == "bytelevel":
            made.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            made += [
                pre_tokenizers.Split(Regex(step), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
    return pre_tokenizers.Sequence(made)


def _tokenizer_dict(f: GGUFFile) -> dict[str, Any]:
    """tokenizer.ggml.* as transformers' GGUF tokenizer converter takes it; a vocabulary it cannot
    rebuild exactly is refused here, by name."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS, GGUF_TOKENIZER_MAPPING

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    d = {name: f.get(f"tokenizer.{key}") for key, name in renames.items() if f.get(f"tokenizer.{key}") is not None}
    kind, pre = d.get("tokenizer_type"), d.get("pre_tokenizer_type")
    tokens = d.get("tokens")
    if kind not in ("gpt2", "llama") or not isinstance(tokens, list) or not tokens:
        what = "no tokenizer.ggml.tokens" if kind in ("gpt2", "llama") else f"tokenizer.ggml.model={shown_value(kind)}"
        raise QuillError(f"{shown(f.path)}: {what}; quill imports byte-level BPE (gpt2) and SentencePiece (llama) vocabularies")
    if kind == "gpt2" and "merges" not in d:
        raise QuillError(f"{shown(f.path)}: its BPE vocabulary has no tokenizer.ggml.merges, so its tokenization cannot be rebuilt")
    if kind == "llama" and "merges" not in d and len(d.get("scores") or []) != len(tokens):
        raise QuillError(f"{shown(f.path)}: its SentencePiece vocabulary has neither merges nor a score per token")
    if kind == "llama" and not {f"<0x{b:02X}>" for b in range(256)} <= set(tokens):
        raise QuillError(
            f"{shown(f.path)}: its SentencePiece vocabulary lacks byte tokens <0x00>..<0xFF>; without byte fallback llama.cpp's "
            "tokenization of a character outside the vocabulary is not one quill can rebuild"
        )
    if kind == "gpt2" and pre not in PRE_TOKENIZERS and pre not in GGUF_PRE_TOKENIZER_SPLITS:
        known = sorted(set(PRE_TOKENIZERS) | set(GGUF_PRE_TOKENIZER_SPLITS))
        raise QuillError(f"{shown(f.path)}: tokenizer.ggml.pre={shown_value(pre)} is a split quill does not know ({', '.join(known)})")
    for key in ("token_type", "scores"):
        if key in d and len(d[key]) != len(tokens):
            raise QuillError(f"{shown(f.path)}: tokenizer.ggml.{key} has {len(d[key])} entries for {len(tokens)} tokens")
    return d


def _as_llama_cpp_spm(backend: Any, d: dict[str, Any]) -> None:
    """A SentencePiece vocabulary split as llama.cpp splits it: with tokenizer.ggml.add_space_prefix
    (default true) a "▁" before the text and after each added token (a normalizer: `tokenizers`
    normalizes each piece between added tokens apart), every space a "▁", and <unk> where the file
    names one. transformers' Metaspace adds no "▁" to a text that starts with a space, and llama.cpp
    does."""
    from tokenizers import decoders, normalizers

    prefix = d.get("add_prefix_space", True)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * prefix + [normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * prefix)
    unk = d.get("unk_token_id")
    if isinstance(unk, int) and 0 <= unk < len(d["tokens"]):
        backend.model.unk_token = d["tokens"][unk]


def gguf_tokenizer(f: GGUFFile) -> HFTokenizer:
    """The file's tokenizer: transformers' GGUF converter, the split llama.cpp names (tokenizer.ggml.pre),
    BOS before a text when tokenizer.ggml.add_bos_token (default: SentencePiece yes, BPE no, as llama.cpp),
    and its chat template, EOS and end-of-turn tokens."""
    require("transformers")
    from tokenizers import processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    d, arch = _tokenizer_dict(f), f.family.arch
    try:
        backend, _ = convert_gguf_tokenizer(arch, d)
    except Exception as e:  # noqa: BLE001 — the converter and the Rust tokenizer raise their own types
        raise QuillError(f"{shown(f.path)}: its tokenizer cannot be rebuilt ({type(e).__name__}: {str(e)[:100]})") from None
    if d["tokenizer_type"] == "llama":
        _as_llama_cpp_spm(backend, d)
    elif d.get("pre_tokenizer_type") in PRE_TOKENIZERS:
        backend.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[d["pre_tokenizer_type"]])
    tokens = d["tokens"]
    data = json.loads(backend.to_str())  # transformers' GPT2Tokenizer adds an <|endoftext|> the file may lack: only the file's ids stay
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["id"] < len(tokens)]
    backend = type(backend).from_str(json.dumps(data))
    token = lambda key: tokens[i] if isinstance(i := f.get(f"tokenizer.ggml.{key}"), int) and 0 <= i < len(tokens) else None  # noqa: E731
    bos, eos, eot = token("bos_token_id"), token("eos_token_id"), token("eot_token_id")
    if f.get("tokenizer.ggml.add_bos_token", d["tokenizer_type"] == "llama") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokens.index(bos))]
        )
    else:
        backend.post_processor = None
    template = f.get("tokenizer.chat_template")
    template = template if isinstance(template, str) and template.strip() else None
    tok = HFTokenizer(backend.to_str(), f.path.stem, bos, eos, chat_template=template, source=str(f.path))
    stops = [eot]
    if template is not None:
        stops.append(end_of_turn(template, [t.content for t in tok.tk.get_added_tokens_decoder().values()], bos, eos))
    tok.stop_tokens = tuple(dict.fromkeys(s for s in stops if s is not None and s != eos))
    return tok
