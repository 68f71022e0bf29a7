"""A run loaded for use or written: checkpoint → model + tokenizer + config, and back.

`load_run` builds what every command needs from a run directory or checkpoint file (the model in
the dtype asked, int8 if asked, the tokenizer, the config); `write_run` writes a run directory that
every command can load (import-hf, export-hf's inverse, merge). A LoRA run (lora.rank > 0) saves
its adapters only, with `lora_base`: the base checkpoint's path and a checksum of its weights.
Loading it for use (`load_state`, `load_run`) loads the base, refuses one whose weights changed
since, and merges the adapters into it: every command gets a plain GPT, as fast as the base.
`merge_run` writes that merged model as a run of its own (a quantized base: its dequantized weights
with the adapters merged in, a float run). `check_fits` refuses a model that the
machine's free memory cannot hold before it is built.

A quantized run (quill quantize, quill import-gguf of a quantized file) keeps its weights in
weights.safetensors beside a ckpt.pt without them (its "weights_file" names the file): each quantized
layer in its scheme's stored form, read one tensor at a time straight into the layers
(quant/stored.py), so loading never builds the float model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from quillgpt import quant
from quillgpt.checkpoint import BEST, LATEST, clean_state_dict, load_checkpoint, resolve_checkpoint, save_checkpoint, weights_checksum
from quillgpt.config import Config, LoraConfig, ModelConfig, config_from_dict, save_config
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.data.tokenizer_files import save_tokenizer, tokenizer_from_spec
from quillgpt.device import available_bytes, parse_dtype, resolve_device
from quillgpt.errors import QuillError
from quillgpt.files import made_dir, output_path, refuse_onto_inputs, shown
from quillgpt.model.gpt import GPT
from quillgpt.model.lora import adapter_shapes, merge_adapters
from quillgpt.quant import stored
from quillgpt.tensor_file import TensorFile, TensorWriter


@dataclass
class LoadedRun:
    """A model ready for inference, with everything needed to use it."""

    model: GPT
    tokenizer: Tokenizer
    config: Config
    step: int
    path: Path


WEIGHTS_FILE = "weights.safetensors"  # a quantized run's weights, beside its ckpt.pt
RUN_FILES = (LATEST, BEST, "config.yaml", "tokenizer.json", "metrics.jsonl", WEIGHTS_FILE)  # what a run directory holds


def run_inputs(path: str | Path, which: str = "best", config: Config | None = None) -> tuple[Path, ...]:
    """The files loading a run reads (its checkpoint, a quantized run's weights file beside it, and
    with the loaded run's `config`, a LoRA run's base: its train.init_from): what no output of the
    same command may replace (files.refuse_onto_inputs)."""
    ckpt = resolve_checkpoint(path, which)
    files = [ckpt, ckpt.parent / WEIGHTS_FILE]
    if config is not None and config.lora.rank > 0 and config.train.init_from:
        base = Path(config.train.init_from).expanduser()
        files += [base / n for n in (LATEST, BEST, WEIGHTS_FILE)] if base.is_dir() else [base, base.parent / WEIGHTS_FILE]
    return tuple(files)


def refuse_a_run_in(out_dir: Path, force: bool) -> None:
    """Refuse to write a run over one already in --out, unless --force (merge, quantize)."""
    taken = [n for n in RUN_FILES if (out_dir / n).exists()]
    if taken and not force:
        raise QuillError(f"--out {shown(out_dir)} already holds a run ({', '.join(taken)}); choose another or pass --force")


def is_quantized_run(state: dict[str, Any]) -> bool:
    """Whether a checkpoint is a quantized run's: its weights live in the weights file beside it."""
    return "weights_file" in state


def model_from_state(state: dict[str, Any], device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> tuple[GPT, Config]:
    """The GPT a checked state describes, its weights in `dtype` (None: as saved). Its weights are
    compared with the config's shapes before anything is built, and then become the model's own
    (built on the meta device, assigned). The weights are taken out of `state` and converted one
    tensor at a time, each source dropped once converted: loading bf16 weights as fp32 peaks at
    about the fp32 bytes, not fp32 + bf16."""
    try:
        config = config_from_dict(state["config"])
    except QuillError as e:
        raise QuillError(
            f"the checkpoint's config is not valid for this version of quill ({e}); was it written by a newer version?"
        ) from None
    if config.model.vocab_size is None:  # a trained or imported model always knows its vocabulary
        raise QuillError("the checkpoint's config has no model.vocab_size; the file is damaged")
    if is_quantized_run(state):
        return _quantized_model(state, config, torch.device(device), dtype), config
    weights = clean_state_dict(state["model"])
    state["model"] = {}  # the caller's references go, so each converted source can be freed
    problems = weight_mismatches(weights, config.model)
    if problems:
        raise QuillError(f"checkpoint weights do not match its own config ({problems}); the file is damaged")
    check_fits(weights, dtype, torch.device(device))
    converted: dict[int, torch.Tensor] = {}  # one conversion per storage: tied weights stay one tensor
    for name in list(weights):
        t = weights.pop(name)
        key = storage_key(t)
        if dtype is not None and t.dtype != dtype and key not in converted:
            converted[key] = t.to(dtype)
        weights[name] = converted.get(key, t)
        del t
    with torch.device("meta"):
        model = GPT(config.model)
    model.load_state_dict(weights, assign=True)
    model.materialize()
    return model.to(device), config


def _quantized_model(state: dict[str, Any], config: Config, device: torch.device, dtype: torch.dtype | None) -> GPT:
    """The model of a quantized run: its weights file checked, its size against free memory, then
    read into the layers one tensor at a time (quant/stored.py)."""
    where = state["weights_file"].get("path")
    if not isinstance(where, Path) or state["weights_file"].get("file") != WEIGHTS_FILE:
        raise QuillError(f"its 'weights_file' must name {WEIGHTS_FILE} beside it; the file is damaged")
    if not where.is_file():
        raise QuillError(f"its weights file {shown(where)} is missing; the run is incomplete: import or quantize it again")
    f = TensorFile(where)
    need = sum(e.end - e.start for e in f.entries.values())
    refuse_beyond_free(need, device, f"its weights need {need / 1e9:.1f} GB", "close other programs")
    try:
        layers = stored.parse_layers(f.metadata.get("quantized"))
        model = stored.build_model(config.model, layers, f.read, set(f.entries), dtype)
    except QuillError as e:
        raise QuillError(f"{shown(where)}: {e}") from None
    return model.to(device)


def base_identity(state: dict[str, Any]) -> str:
    """What a LoRA run's base must keep: the checksum of its weights (of a quantized run: of its
    weights file's per-tensor CRCs and layer table, no tensor read)."""
    if not is_quantized_run(state):
        return weights_checksum(state["model"])
    f = TensorFile(state["weights_file"]["path"])
    return hashlib.sha256(json.dumps([f.metadata.get("crc32"), f.metadata.get("quantized")]).encode()).hexdigest()


def float_weights(state: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A checked state's weights as float tensors: a quantized run's built and dequantized (the
    float values its codes hold, fp32 memory: what a LoRA fine-tune of it trains on)."""
    if not is_quantized_run(state):
        return clean_state_dict(state["model"])
    model, _ = model_from_state(state, dtype=dtype or torch.float32)
    return quant.dequantize(model).state_dict()


def storage_key(t: torch.Tensor) -> int:
    """Where a tensor's data starts: equal for tied weights (one tensor under two names)."""
    return t.untyped_storage().data_ptr() + t.storage_offset()


def check_fits(weights: dict[str, torch.Tensor], dtype: torch.dtype | None, device: torch.device) -> None:
    """Refuse, in one line naming the sizes, weights that cannot fit in the device's free memory."""
    seen: set[int] = set()
    nbytes = 0
    for t in weights.values():
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            nbytes += t.numel() * (dtype or t.dtype).itemsize
    what = f"the model's weights need {nbytes / 1e9:.1f} GB in {str(dtype or 'their dtype').replace('torch.', '')}"
    refuse_beyond_free(nbytes, device, what, "load it in a smaller dtype (--dtype bfloat16) or on another device")


def refuse_beyond_free(nbytes: int, device: torch.device, what: str, fix: str) -> None:
    """Refuse work whose `nbytes` the device's free memory cannot hold, in one line: `what` needs
    them, how much is free, and `fix`."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise QuillError(f"{what} but {device.type} has {free / 1e9:.1f} GB free; {fix}")


def weight_mismatches(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> str:
    """Missing, unexpected and wrongly shaped weights for GPT(cfg), in a few words ('' if none)."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        expected = GPT(cfg).state_dict()
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    wrong = [
        f"{k} {tuple(weights[k].shape)} ≠ {tuple(v.shape)}" for k, v in expected.items() if k in weights and weights[k].shape != v.shape
    ]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            more = f" and {len(items) - 4} more" if len(items) > 4 else ""
            problems.append(f"{label}: {', '.join(str(i)[:100] for i in items[:4])}{more}")
    return "; ".join(problems)


@dataclass(frozen=True)
class LoadOptions:
    """How a run is loaded for use, once parsed: where, in what dtype (None: as saved), with which
    weights (a --quantize scheme, None: the float ones), which checkpoint, the decode rows its int8
    kernels are measured at, and whether the decode step is compiled (read by what runs the model)."""

    device: torch.device | str = "cpu"
    dtype: torch.dtype | None = torch.float32
    quantize: str | None = None
    which: str = "best"
    rows: int = 1
    compile: bool = False

    @classmethod
    def parse(
        cls,
        *,
        device: str = "auto",
        dtype: str | None = "float32",
        quantize: str | None = "none",
        which: str = "best",
        rows: int = 1,
        compile: bool = False,
    ) -> LoadOptions:
        """The user's --dtype, --quantize and --device, checked in that order (each a QuillError
        naming its flag) before anything loads; dtype=None: the weights as saved."""
        torch_dtype = None if dtype is None else parse_dtype(dtype)
        scheme = quant.parse_quantize(quantize)
        return cls(resolve_device(device), torch_dtype, scheme, which, rows, compile)

    @property
    def dtype_name(self) -> str:
        """The dtype as a user names it (float32, bfloat16, float16; "saved": as saved)."""
        return "saved" if self.dtype is None else str(self.dtype).removeprefix("torch.")

    @property
    def quantize_name(self) -> str:
        """The scheme as a user names it: none for the float weights."""
        return self.quantize or "none"


def load_run(path: str | Path, options: LoadOptions | None = None, **keywords: Any) -> LoadedRun:
    """Load model (eval mode, its weights in options.dtype; None: as saved), tokenizer and config
    from a run directory or checkpoint file (a LoRA run: its base with the adapters merged in);
    options.quantize="int8": its linears in int8 once loaded, the kernels measured at a decode
    batch of options.rows (quillgpt.quant). Without `options`, LoadOptions' fields as keywords
    (which=, device=, dtype=, quantize=, rows=), as scripts and lm-eval's model_args pass them."""
    if options is None:
        options = LoadOptions(**keywords)
    elif keywords:
        raise TypeError(f"load_run takes LoadOptions or keywords, not both (got {', '.join(keywords)})")
    state, ckpt = load_state(path, options.which, options.dtype)
    try:
        model, config = model_from_state(state, options.device, options.dtype)
        tokenizer = tokenizer_from_spec(state["tokenizer"])
    except QuillError as e:
        raise QuillError(f"{shown(ckpt)}: {e}") from None
    model.eval()
    if is_quantized_run(state) and options.quantize is not None:
        raise QuillError(f"{shown(ckpt)} holds quantized weights already (a quantized run); drop --quantize")
    quant.quantize(model, options.quantize, rows=options.rows, cache=True)  # the kernel plan measured once per machine and shape
    return LoadedRun(model, tokenizer, config, state["step"], ckpt)


def load_state(path: str | Path, which: str = "best", dtype: torch.dtype | None = None) -> tuple[dict[str, Any], Path]:
    """(checked state, its file) of a run directory or checkpoint file, with plain weights: a
    LoRA run's adapters are merged into its base (in `dtype`; None: the base's own)."""
    ckpt = resolve_checkpoint(path, which)
    state = load_checkpoint(ckpt, map_location="cpu")
    if is_quantized_run(state) and isinstance(state["weights_file"], dict):
        state["weights_file"]["path"] = ckpt.parent / WEIGHTS_FILE
    return (with_base(state, ckpt, dtype) if "lora_base" in state else state), ckpt


def crop_positions(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A base's weights for a fine-tuned copy with a smaller block_size: learned positions cut to it."""
    if cfg.pos == "learned" and "transformer.wpe.weight" in weights:
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][: cfg.block_size]
    return weights


def with_base(state: dict[str, Any], ckpt: Path, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A LoRA run's state with its base's weights and the adapters merged in (see the module
    docstring); a missing or changed base, or adapters that do not fit it, is one QuillError."""
    base = state["lora_base"]
    if not isinstance(base.get("path"), str) or not isinstance(base.get("checksum"), str):
        raise QuillError(f"{shown(ckpt)}: 'lora_base' must hold the base's path and checksum; the file is damaged")
    if Path(base["path"]).resolve() == ckpt.resolve():
        raise QuillError(f"{shown(ckpt)} names itself as its LoRA base; the file is damaged")
    if not os.path.isfile(base["path"]):
        raise QuillError(
            f"{shown(ckpt)} holds LoRA adapters for the base {base['path']}, which is missing; put the "
            "base back there (adapters only work on the weights they were trained on)"
        )
    base_state, _ = load_state(base["path"])
    if base_identity(base_state) != base["checksum"]:
        raise QuillError(
            f"{shown(ckpt)} holds LoRA adapters for the base {base['path']}, whose weights have changed "
            f"since (checksum {base['checksum'][:12]}…); adapters only work on the weights they were "
            "trained on: restore that base, or fine-tune again"
        )
    try:
        config = config_from_dict(state["config"])
    except QuillError as e:
        raise QuillError(f"{shown(ckpt)}: its config is not valid for this version of quill ({e})") from None
    adapters = clean_state_dict(state["model"])
    expected = adapter_shapes(config.model, config.lora)
    if {k: tuple(v.shape) for k, v in adapters.items()} != expected:
        raise QuillError(
            f"{shown(ckpt)}: its adapters do not match its lora config (lora.rank={config.lora.rank}, "
            f"lora.targets={config.lora.targets}); the file is damaged"
        )
    weights = crop_positions(float_weights(base_state), config.model)
    merged = merge_adapters(weights, adapters, config.model, config.lora, dtype)
    return {**{k: v for k, v in state.items() if k != "lora_base"}, "model": merged}


def merge_run(path: str | Path, out_dir: str | Path, which: str = "best", force: bool = False) -> Path:
    """A LoRA run → a plain quill run in `out_dir` (config.yaml with lora off, tokenizer.json and
    ckpt.pt holding the merged weights in the base's dtype), usable like any imported model."""
    ckpt, out_dir = resolve_checkpoint(path, which), output_path(out_dir, "--out")
    state = load_checkpoint(ckpt)
    if "lora_base" not in state:
        raise QuillError(f"{shown(ckpt)} is not a LoRA run (its lora.rank is 0): its weights are plain already, use it as it is")
    base = Path(state["lora_base"].get("path", ""))
    inputs = {ckpt.parent.resolve(), base.resolve().parent}
    if out_dir.resolve() in inputs:
        raise QuillError(f"--out {shown(out_dir)} is where the LoRA run or its base lives; choose a new directory")
    refuse_onto_inputs([out_dir / n for n in RUN_FILES], (*run_inputs(ckpt), base, base.parent / WEIGHTS_FILE), "--out")
    refuse_a_run_in(out_dir, force)
    state = with_base(state, ckpt)
    cfg = config_from_dict(state["config"])
    cfg.lora, cfg.train.init_from, cfg.train.out_dir = LoraConfig(), None, str(out_dir)
    with made_dir(out_dir):  # a failed write leaves no --out it made
        write_run(
            out_dir,
            cfg,
            tokenizer_from_spec(state["tokenizer"]),
            state["model"],
            state["step"],
            state.get("tokens_seen", 0),
            merged_from=str(ckpt),
        )
    return out_dir / LATEST


def write_run(
    out_dir: Path,
    cfg: Config,
    tokenizer: Tokenizer,
    weights: dict[str, torch.Tensor],
    step: int = 0,
    tokens_seen: int = 0,
    **provenance: Any,
) -> None:
    """A run directory of given weights (an import, a merge): config.yaml, tokenizer.json and
    ckpt.pt with `provenance` (e.g. imported_from=...; weights_file= for a quantized run's); an
    earlier best.pt, metrics.jsonl and weights file, there only with --force, are not this model's and go."""
    save_config(cfg, out_dir / "config.yaml")
    save_tokenizer(tokenizer, out_dir / "tokenizer.json")
    for stale in (BEST, "metrics.jsonl", *([] if "weights_file" in provenance else [WEIGHTS_FILE])):
        (out_dir / stale).unlink(missing_ok=True)
    save_checkpoint(
        {"model": weights, "config": cfg.to_dict(), "tokenizer": tokenizer.spec(), "step": step, "tokens_seen": tokens_seen, **provenance},
        out_dir / LATEST,
    )


def config_differences(old: ModelConfig, new: ModelConfig, ignore: tuple[str, ...] = ("dropout",)) -> list[str]:
    """Model keys whose values differ, as 'model.key: old → new' strings."""
    return [
        f"model.{f.name}: {getattr(old, f.name)!r} → {getattr(new, f.name)!r}"
        for f in fields(ModelConfig)
        if f.name not in ignore and getattr(old, f.name) != getattr(new, f.name)
    ]


def write_quantized_run(
    out_dir: Path,
    cfg: Config,
    tokenizer: Tokenizer,
    layers: dict[str, str],
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    **provenance: str,
) -> None:
    """A quantized run directory: weights.safetensors written one tensor at a time as `tensors`
    yields them (in `specs`' order), then config.yaml, tokenizer.json and a ckpt.pt naming the file."""
    with TensorWriter(out_dir / WEIGHTS_FILE, specs, {"quantized": stored.layers_json(layers)}) as w:
        for name, t in tensors:
            w.write(name, t)
    write_run(out_dir, cfg, tokenizer, {}, **provenance, weights_file={"file": WEIGHTS_FILE})


def quantize_run(path: str | Path, out_dir: str | Path, scheme: str, which: str = "best", force: bool = False) -> Path:
    """`quill quantize`: a float run → a quantized run in `out_dir` holding exactly the weights
    `--quantize scheme` makes at load (the same codes; its layers' kernels chosen by rule at load,
    not measured), so it loads in seconds, at a fraction of the size."""
    name = quant.parse_quantize(scheme, "--quantize")
    out_dir = output_path(out_dir, "--out")
    if name is None:
        raise QuillError("--quantize must name a scheme (int4, int8, ...): none would copy the run")
    loaded = load_run(path, which=which, dtype=None)
    if out_dir.resolve() == loaded.path.parent.resolve():
        raise QuillError(f"--out {shown(out_dir)} is the run being quantized; choose a new directory")
    refuse_onto_inputs([out_dir / n for n in RUN_FILES], run_inputs(loaded.path, config=loaded.config), "--out")
    refuse_a_run_in(out_dir, force)
    # int8's kernel plan is not stored (a quantized run's layers take a rule's): none is measured here
    quant.quantize(loaded.model, name, kernel="dequant/model" if quant.SCHEMES[name].bits == 8 else None)
    layers, tensors = stored.model_tensors(loaded.model)
    tensors = list(tensors)
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    cfg = loaded.config
    cfg.train.init_from, cfg.train.out_dir = None, str(out_dir)
    with made_dir(out_dir):
        write_quantized_run(out_dir, cfg, loaded.tokenizer, layers, specs, tensors, quantized_from=str(loaded.path))
    return out_dir
