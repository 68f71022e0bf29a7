"""`quill import-gguf`: a GGUF file → a quill run, keeping the file's quantization: a quantized run (runs.py), written tensor by
tensor as each is read, so an 8B file imports in a little more memory than its largest tensor.

Each linear of the run (and the embedding table) takes the file's own blocks: Q4_0, Q4_1 and Q4_K
become int4 groups of 32, Q5_0 and Q5_K int5 ones (quant/int5.py), Q8_0, Q5_1 and Q6_K int8 ones
(interop/gguf_blocks.py: which map bit for bit, and which are rounded and how). Parts fused into one
of quill's layers (q, k, v → c_attn; gate, up → c_fc) that differ in type share the wider form
(int4 codes are int8 codes exactly). Other quantized types (Q2_K, Q3_K, ...) are dequantized and
requantized to int8; float tensors stay float in their own dtype. What is not exact is named in the
import line with its measured cost.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from quillgpt import checkpoint as ckpt
from quillgpt import runs
from quillgpt.config import ModelConfig
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.device import available_bytes
from quillgpt.errors import QuillError
from quillgpt.files import made_dir, refuse_onto_inputs, shown
from quillgpt.interop import convert, gguf_blocks, gguf_checks, gguf_read, llama
from quillgpt.interop.gguf_read import GGUFFile, GGUFWeights, gguf_module
from quillgpt.interop.hf_files import check_out_dir
from quillgpt.model.gpt import GPT
from quillgpt.quant import SCHEMES
from quillgpt.quant.stored import EMBEDDING, Spec, layer_specs

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # the types kept as int4
FIVE_BIT = ("Q5_0", "Q5_K")  # kept as int5 (codes in [-16, 15]); the others int8
COST_ROWS = 256  # rows of a large rounded tensor its cost is measured on (ggml's dequantization: ~50M weights/s)
SMALL = 1 << 24  # a rounded tensor up to this many weights is measured whole


@dataclass
class Piece:
    """One tensor (float) or layer (quantized) of the run and the file's tensors it is made of."""

    name: str  # a float tensor's name, or a quantized layer's module path
    parts: list[str]  # its tensors by their Hugging Face names (GGUFWeights'), concatenated along the rows
    shape: tuple[int, ...]
    scheme: str | None = None  # None: float
    dtype: torch.dtype = torch.float32  # a float piece's


@dataclass
class Report:
    """What the import kept exactly and what it rounded, by the file's types."""

    kept: dict[str, int] = field(default_factory=dict)  # ggml type → tensors mapped bit for bit
    rounded: dict[str, float] = field(default_factory=dict)  # ggml type → the largest measured cost

    def note(self, kind: str, cost: float) -> None:
        self.rounded[kind] = max(self.rounded.get(kind, 0.0), cost)

    def line(self) -> str:
        kept = ", ".join(f"{t} ×{n}" for t, n in sorted(self.kept.items()))
        out = f"quantization kept: {kept}" if kept else "float weights"
        for t, cost in sorted(self.rounded.items()):
            why = gguf_blocks.ROUNDED_TYPES.get(t, "requantized to int8 groups of 32")
            out += f"; {t} not exact ({why}: max error {cost:.1e} of the largest weight)"
        return out


def plan(f: GGUFFile, cfg: ModelConfig, hf: dict) -> tuple[GGUFWeights, list[Piece]]:
    """The file's tensors by their Hugging Face names, and the run's tensors in order, each from
    its parts, with the form each is kept in."""
    if "blk.0.attn_output.bias" in f.tensors:
        raise QuillError(f"{shown(f.path)} has attn_output biases; import it with --dequantize")
    names = llama.weight_names(cfg)
    weights = GGUFWeights(f, hf, [n for parts in names.values() for n in parts])
    with torch.device("meta"):
        meta = GPT(cfg).state_dict()
    pieces = []
    for name, parts in names.items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        types = [f.tensors[weights.gguf_name(p)].tensor_type.name for p in parts]
        piece = Piece(name, parts, tuple(meta[name].shape))
        # a linear or the embedding, quantized (one group per row is int8's per-row form, which has no offset: kept float)
        if meta[name].dim() == 2 and not any(t in FLOAT_TYPES for t in types) and piece.shape[1] > gguf_blocks.GROUP:
            tied = name == EMBEDDING + ".weight" and cfg.tie_embeddings
            piece.name, piece.scheme = "lm_head" if tied else name.removesuffix(".weight"), _scheme_for(types, piece.shape)
        else:  # a tied float head is stored as lm_head.weight only (quant/stored.py)
            piece.name = "lm_head.weight" if cfg.tie_embeddings and name == EMBEDDING + ".weight" else name
            kinds = {FLOAT_TYPES.get(t, torch.float32) for t in types}
            piece.dtype = kinds.pop() if len(kinds) == 1 else torch.float32
        pieces.append(piece)
    return weights, pieces


def _scheme_for(types: list[str], shape: tuple[int, ...]) -> str:
    """A quantized piece's scheme from its parts' types: int4 where all are 4-bit blocks (and the
    layout takes the width), int5 where all are 4- or 5-bit ones with codes in [-16, 15], int8
    where any is wider or not mapped."""
    if all(t in FOUR_BIT for t in types) and SCHEMES["int4"].stores(*shape):
        return "int4"
    return "int5" if all(t in FOUR_BIT + FIVE_BIT for t in types) else "int8"


def specs(pieces: list[Piece]) -> list[Spec]:
    """The weights file's layout, known before a tensor is converted."""
    out: list[Spec] = []
    for p in pieces:
        if p.scheme is None:
            out.append((p.name, p.dtype, p.shape))
        else:
            out += layer_specs(p.name, SCHEMES[p.scheme], *p.shape, None)
    return out


def tensors(weights: GGUFWeights, pieces: list[Piece], report: Report) -> Iterator[tuple[str, Tensor]]:
    """Each piece converted in turn (the file read one tensor at a time), in specs' order."""
    for p in pieces:
        if p.scheme is None:
            parts = [weights[n] for n in p.parts]
            yield p.name, (parts[0] if len(parts) == 1 else torch.cat(parts)).to(p.dtype)
            continue
        groups = [_groups(weights, n, p.scheme, report) for n in p.parts]
        packed = {k: groups[0][k] if len(groups) == 1 else torch.cat([g[k] for g in groups]) for k in ("codes", "scale", "offset")}
        del groups
        for key, t in SCHEMES[p.scheme].store(packed).items():
            yield f"{p.name}.{key}", t


def _read(f: GGUFFile, name: str) -> np.ndarray:
    """A tensor's bytes, read (not mapped: a mapped page would stay counted in the process's memory)."""
    t = f.tensors[name]
    buf = np.empty(t.n_bytes, dtype=np.uint8)
    with open(f.path, "rb") as fh:
        fh.seek(t.data_offset)
        if fh.readinto(memoryview(buf)) != t.n_bytes:
            raise QuillError(f"{shown(f.path)} ends inside {name}: the file is truncated; download it again")
    return buf


def _groups(weights: GGUFWeights, hf_name: str, scheme: str, report: Report) -> dict[str, Tensor]:
    """One part as `scheme`'s codes, scales and offsets (rows unpermuted), the rounding noted."""
    f, name = weights.f, weights.gguf_name(hf_name)
    t = f.tensors[name]
    kind, (cols, rows) = t.tensor_type.name, (int(t.shape[0]), math.prod(int(d) for d in t.shape[1:]))
    raw = _read(f, name)
    gguf_checks.check_finite(f.path, name, kind, raw=raw)  # a damaged block named as damage, before it is mapped
    try:
        g = gguf_blocks.to_groups(raw, kind, rows, cols)
        raw = raw if g is not None and not g.exact else None  # kept only to measure the rounding
    except ValueError as e:
        raise QuillError(f"{shown(f.path)}: {name} ({kind}) cannot be kept: {str(e)[:100]}; import it with --dequantize") from None
    if g is None:  # a type with no exact form: dequantized, requantized to int8
        w = torch.from_numpy(f.array(name).copy()).view(rows, cols)
        packed = SCHEMES["int8"].pack(w, SCHEMES["int8"].group)
        codes, scale, offset = packed["codes"], packed["scale"].half(), packed["offset"].half()
        report.note(kind, gguf_blocks.relative_error(SCHEMES["int8"].unpack(packed).numpy(), w.numpy()))
    else:
        codes, scale, offset = (torch.from_numpy(a) for a in (g.codes, g.scale, g.offset))
        if g.exact:
            report.kept[kind] = report.kept.get(kind, 0) + 1
        else:  # measured against ggml's own dequantization: every row of a small tensor, else COST_ROWS spread rows
            at = np.unique(np.linspace(0, rows - 1, min(rows, COST_ROWS if rows * cols > SMALL else rows)).astype(np.int64))
            sample = gguf_blocks.Groups(g.bits, g.codes[at], g.scale[at], g.offset[at], g.exact)
            want = gguf_module().quants.dequantize(raw.reshape(rows, -1)[at], t.tensor_type)
            report.note(kind, gguf_blocks.rounding_cost(sample, want))
        if scheme != "int4" and codes.dtype == torch.uint8:  # 4-bit codes in an int8 layer: the same values
            codes = codes.to(torch.int8)
    return {k: weights.unpermuted(hf_name, v) for k, v in (("codes", codes), ("scale", scale), ("offset", offset))}


def check_room(f: GGUFFile, out_dir: Path, layout: list[Spec]) -> None:
    """Refuse, before any work, an import the disk or the memory cannot take (sizes named)."""
    need = sum(math.prod(s) * dt.itemsize for _, dt, s in layout)
    probe = out_dir if out_dir.exists() else out_dir.parent
    free_disk = shutil.disk_usage(probe if probe.exists() else Path.cwd()).free
    if need > free_disk:
        raise QuillError(f"the run needs {need / 1e9:.1f} GB on disk but {shown(probe)} has {free_disk / 1e9:.1f} GB free")
    largest = max((t.n_elements for t in f.tensors.values()), default=0)
    work = 12 * largest  # a tensor's bytes, its codes and scales, and their concatenation
    free = available_bytes(torch.device("cpu"))
    if free is not None and work > free:
        raise QuillError(f"importing needs about {work / 1e9:.1f} GB of memory but {free / 1e9:.1f} GB is free")


def write_quantized(f: GGUFFile, out_dir: Path, cfg: ModelConfig, hf: dict, tokenizer: Tokenizer, source: str) -> str:
    """The run of a GGUF file with its quantization kept, written to `out_dir`; the report's line."""
    weights, pieces = plan(f, cfg, hf)
    layout = specs(pieces)
    check_room(f, out_dir, layout)
    if out_dir.exists():  # (--force) a damaged tensor found mid-write would leave a half-replaced run: all are read first
        gguf_checks.scan_tensors(f.path, [(n, t.tensor_type.name, t.data_offset, t.n_bytes) for n, t in f.tensors.items()])
    report, config = Report(), convert.imported_config(out_dir, cfg, tokenizer)
    layers = {p.name: p.scheme for p in pieces if p.scheme is not None}
    runs.write_quantized_run(out_dir, config, tokenizer, layers, layout, tensors(weights, pieces, report), imported_from=source)
    return report.line()


def import_gguf(src: str | Path, out_dir: str | Path, force: bool = False, dequantize: bool = False) -> convert.Converted:
    """A GGUF file → a quill run directory at step 0, usable with every quill command: a quantized
    run keeping the file's quantization (interop/gguf_import.py), or with `dequantize` (or a file
    of float tensors, or a gpt2 one) its weights in fp32 in ckpt.pt, usable as train.init_from too."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, runs.RUN_FILES + convert.HF_FILES, force, "a run's or a model's files")
    refuse_onto_inputs([out_dir / n for n in runs.RUN_FILES], [src], "--out")
    f = gguf_read.GGUFFile(src)
    hf = gguf_read.hf_config(f)  # the architecture and its keys, before the tokenizer
    tokenizer = gguf_read.gguf_tokenizer(f)
    quantized = any(t.tensor_type.name not in FLOAT_TYPES for t in f.tensors.values())
    if quantized and not dequantize and f.family.model_type != "gpt2":
        f.drop_vocabulary()
        cfg = _checked_vocab(f, gguf_read.model_config(f, hf), tokenizer)
        gguf_read.check_tensors(f, cfg)
        with made_dir(out_dir):
            note = write_quantized(f, out_dir, cfg, hf, tokenizer, str(src))
        return convert.Converted(out_dir, cfg, tokenizer.name, f"GGUF {f.family.arch}", note)
    fp32 = 4 * sum(t.n_elements for t in f.tensors.values())
    free = available_bytes(torch.device("cpu"))
    if free is not None and 2 * fp32 > free:  # the weights dequantized, and the checkpoint written from them
        raise QuillError(
            f"--dequantize needs about {2 * fp32 / 1e9:.1f} GB of memory (the model in fp32, twice) but {free / 1e9:.1f} GB is free; "
            "import without --dequantize to keep the file's quantization"
        )
    cfg, state = gguf_read.model_of(f)
    _checked_vocab(f, cfg, tokenizer)
    ckpt.check_state({"model": state, "config": {}, "tokenizer": {}, "step": 0}, str(f.path))  # finite weights
    with made_dir(out_dir):  # a failed write leaves no --out it made
        convert.write_imported_run(out_dir, cfg, tokenizer, state, str(src))  # import-hf's run layout
    return convert.Converted(out_dir, cfg, tokenizer.name, f"GGUF {f.family.arch}")


def _checked_vocab(f: GGUFFile, cfg: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    if cfg.vocab_size < tokenizer.vocab_size:
        raise QuillError(f"{shown(f.path)}: vocab_size {cfg.vocab_size} is fewer than its tokenizer's {tokenizer.vocab_size} tokens")
    return cfg
