"""`quill import-hf` and `quill export-hf`: Hugging Face model directories ⇄ quill run directories.

Import reads config.json to pick the converter (GPT-2, or the Llama family: Llama, Qwen2, Qwen3,
Mistral), the weights one tensor at a time (kept in their own dtype: a bf16 model stays bf16 on
disk), and the tokenizer: the directory's tokenizer.json with its special tokens and chat
template (the Llama family), tiktoken's gpt2 (GPT-2), or the quill tokenizer an export saved
beside the weights. Export writes the family a run's architecture fits (GPT-2 for learned
positions + LayerNorm + GELU, the Llama family for RoPE + RMSNorm + SwiGLU) with tokenizer files
transformers reads, and quill_tokenizer.json so that a re-import restores quill's own tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quillgpt import checkpoint as ckpt
from quillgpt.config import Config, ModelConfig
from quillgpt.data.tokenizer import Tokenizer, build_tokenizer, load_tokenizer, save_tokenizer
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write_bytes, atomic_write_text, input_file, made_dir, os_error, read_text, shown
from quillgpt.interop import gpt2, llama
from quillgpt.interop.hf_files import check_out_dir, load_hf_weights, require, resolve_source, write_json

QUILL_TOKENIZER = "quill_tokenizer.json"  # written by export-hf so that import-hf restores it
# What import-hf writes or removes in --out, and what export-hf writes: either refuses without
# --force when any one of these is already there (a run and an HF model never share a directory).
RUN_FILES = (ckpt.LATEST, ckpt.BEST, "config.yaml", "tokenizer.json", "metrics.jsonl")
HF_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json", "chat_template.jinja", QUILL_TOKENIZER)


@dataclass
class Converted:
    """Where a conversion wrote its files, and the architecture it converted."""

    path: Path
    model: ModelConfig
    tokenizer: str
    architecture: str = "GPT2LMHeadModel"


def read_hf_config(path: Path) -> dict[str, Any]:
    """config.json of an HF model directory, as a dict (one clear error when it is not one)."""
    try:
        hf_config = json.loads(read_text(path / "config.json", "config.json", limit=1 << 24))
    except (json.JSONDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:100]
        raise QuillError(f"{shown(path / 'config.json')} is not valid JSON ({why})") from None
    if not isinstance(hf_config, dict):
        raise QuillError(f"{shown(path / 'config.json')} must be a JSON object")
    return hf_config


def _source_tokenizer(path: Path, llama_family: bool) -> Tokenizer:
    if input_file(path / QUILL_TOKENIZER, QUILL_TOKENIZER):
        return load_tokenizer(path / QUILL_TOKENIZER)
    if llama_family:
        from quillgpt.data.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(path, name=path.resolve().name)
    return build_tokenizer("gpt2")


def _model_config(path: Path, hf_config: dict[str, Any]) -> tuple[ModelConfig, str]:
    """(model config, architecture) of an HF directory's config.json."""
    source = str(path / "config.json")
    if llama.is_llama_family(hf_config):
        return llama.llama_to_model_config(hf_config, source), llama.ARCHITECTURES[hf_config["model_type"]]
    return gpt2.hf_to_model_config(hf_config, source), "GPT2LMHeadModel"


def _state(path: Path, cfg: ModelConfig, architecture: str, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The quill state dict of an HF directory's weights (read one tensor at a time)."""
    if architecture == "GPT2LMHeadModel":
        return gpt2.hf_to_quill_state(load_hf_weights(path), cfg)
    return llama.llama_to_quill_state(load_hf_weights(path), cfg, llama.has_o_bias(hf_config))


def import_hf(src: str | Path, out_dir: str | Path, force: bool = False) -> Converted:
    """A Hugging Face model (directory or hub name) → a quill run directory at step 0: config.yaml,
    tokenizer.json, ckpt.pt, usable with every quill command and as train.init_from."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, RUN_FILES + HF_FILES, force, "a run's or a model's files")
    path = resolve_source(src)
    hf_config = read_hf_config(path)
    model_cfg, architecture = _model_config(path, hf_config)
    tokenizer = _source_tokenizer(path, llama.is_llama_family(hf_config))
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise QuillError(
            f"{path / 'config.json'} has vocab_size={model_cfg.vocab_size}, fewer than the {tokenizer.vocab_size} "
            f"ids of its tokenizer ({tokenizer.name}); is it the model's own tokenizer?"
        )
    state = _state(path, model_cfg, architecture, hf_config)
    ckpt.check_state({"model": state, "config": {}, "tokenizer": {}, "step": 0}, str(path))  # finite weights
    with made_dir(out_dir):  # a failed write leaves no --out it made
        _write_run(out_dir, model_cfg, tokenizer, state, str(src))
    return Converted(out_dir, model_cfg, tokenizer.name, architecture)


def _write_run(out_dir: Path, model_cfg: ModelConfig, tokenizer: Tokenizer, state: dict, source: str) -> None:
    cfg = Config(model=model_cfg)
    tiktoken_name = tokenizer.spec().get("type") == "tiktoken"
    cfg.data.tokenizer = tokenizer.name if tiktoken_name else str(out_dir / "tokenizer.json")
    cfg.data.out_dir = f"data/{out_dir.name}_data"
    # Training with this config.yaml fine-tunes the import into a new directory, never over it.
    cfg.train.out_dir, cfg.train.init_from = f"{out_dir}-finetune", str(out_dir)
    ckpt.write_run(out_dir, cfg, tokenizer, state, imported_from=source)


def export_hf(run: str | Path, out_dir: str | Path, which: str = "best", force: bool = False) -> Converted:
    """A quill run (or .pt) → a transformers directory of the family its architecture fits:
    GPT2LMHeadModel, or LlamaForCausalLM / Qwen2 / Qwen3 / MistralForCausalLM; with config.json,
    model.safetensors, generation_config.json, tokenizer files and quill_tokenizer.json."""
    st_torch = require("safetensors.torch")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, HF_FILES + RUN_FILES, force, "a model's or a run's files")
    loaded = ckpt.load_run(run, which=which)
    cfg, tok = loaded.config.model, loaded.tokenizer
    as_gpt2, as_llama = gpt2.gpt2_incompatibilities(cfg), llama.llama_incompatibilities(cfg)
    if as_gpt2 and as_llama:
        raise QuillError(f"cannot export {loaded.path}: as GPT-2, {'; '.join(as_gpt2)}; as the Llama family, {'; '.join(as_llama)}")
    state = loaded.model.state_dict()
    if not as_gpt2:
        tensors, config, architecture = gpt2.quill_to_hf_state(state, cfg), gpt2.model_config_to_hf(cfg, tok.eot_id), "GPT2LMHeadModel"
    else:
        kind = llama.family_of(cfg, llama.is_qwen_tokenizer(getattr(tok, "_json", None)))
        tensors, config = llama.quill_to_llama_state(state, cfg, kind), llama.model_config_to_llama(cfg, kind, tok.bos_id, tok.eot_id)
        architecture = config["architectures"][0]
    with made_dir(out_dir):  # a failed write (a full disk...) leaves no --out it made
        try:
            atomic_write_bytes(out_dir / "model.safetensors", st_torch.save(tensors, metadata={"format": "pt"}))
            write_json(out_dir / "config.json", config)
            _write_tokenizer_files(out_dir, tok, llama_family=bool(as_gpt2))
            write_json(out_dir / "generation_config.json", generation_config(tok, loaded.config.sample, llama_family=bool(as_gpt2)))
        except OSError as e:
            raise os_error(e, out_dir, "write", "--out") from None
    return Converted(out_dir, cfg, tok.name, architecture)


def generation_config(tok: Tokenizer, sample: Any, llama_family: bool) -> dict[str, Any]:
    """generation_config.json: bos/eos where the tokenizer has an end-of-text id, and the run's
    `sample:` defaults, so transformers' generate() samples as `quill sample` does."""
    ends = {"bos_token_id": tok.bos_id if llama_family else tok.eot_id, "eos_token_id": tok.eot_id}
    config: dict[str, Any] = {k: v for k, v in ends.items() if v is not None}
    config.update(max_new_tokens=sample.max_new_tokens, do_sample=sample.temperature > 0)
    if sample.temperature > 0:
        config.update(temperature=sample.temperature, top_k=sample.top_k or 0, top_p=sample.top_p)
        config.update({"min_p": sample.min_p} if sample.min_p > 0 else {})
    if sample.repetition_penalty != 1.0:
        config["repetition_penalty"] = sample.repetition_penalty
    return config


def _write_tokenizer_files(out_dir: Path, tok: Tokenizer, llama_family: bool) -> None:
    """quill_tokenizer.json and (Llama family) tokenizer.json + tokenizer_config.json
    (+ chat_template.jinja), so transformers loads the tokenizer too."""
    save_tokenizer(tok, out_dir / QUILL_TOKENIZER)
    if not llama_family:
        return
    from quillgpt.data.hf_tokenizer import hf_files_of

    tokenizer_json, config = hf_files_of(tok)
    atomic_write_text(out_dir / "tokenizer.json", tokenizer_json)
    write_json(out_dir / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **config})
    template = out_dir / "chat_template.jinja"
    if tok.chat_template is not None:
        atomic_write_text(template, tok.chat_template)
    else:
        template.unlink(missing_ok=True)
