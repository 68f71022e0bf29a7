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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quillgpt import checkpoint as ckpt
from quillgpt import quant, runs
from quillgpt.config import Config, ModelConfig, shown_value
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.data.tokenizer_files import build_tokenizer, load_tokenizer, save_tokenizer
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write_bytes, atomic_write_text, input_file, made_dir, os_error, read_json_object, refuse_onto_inputs
from quillgpt.interop import gpt2, llama
from quillgpt.interop.families import GPT2, Family, export_family, family_of_config
from quillgpt.interop.hf_config import check_fields, check_weights
from quillgpt.interop.hf_files import check_out_dir, load_hf_weights, require, resolve_source, write_json

QUILL_TOKENIZER = "quill_tokenizer.json"  # written by export-hf so that import-hf restores it
# What export-hf writes: it and import-hf (which writes runs.RUN_FILES) refuse without --force
# when any file of either kind is already in --out (a run and an HF model never share a directory).
HF_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json", "chat_template.jinja", QUILL_TOKENIZER)


@dataclass
class Converted:
    """Where a conversion wrote its files, and the architecture it converted."""

    path: Path
    model: ModelConfig
    tokenizer: str
    architecture: str = "GPT2LMHeadModel"
    note: str = ""  # what the conversion kept or rounded (import-gguf's quantization)


def read_hf_config(path: Path) -> dict[str, Any]:
    """config.json of an HF model directory, as a dict (one clear error when it is not one, or
    when its model_type, which picks the family, is not a string)."""
    config = read_json_object(path / "config.json", "config.json", limit=1 << 24)
    kind = config.get("model_type")
    if kind is not None and not isinstance(kind, str):
        raise QuillError(f'{path / "config.json"}: model_type must be a string such as "llama", got {shown_value(kind)[:60]}')
    return config


CODECS = {"gpt2": gpt2.CODEC, "llama": llama.CODEC}  # Family.codec → how its weights and config map


def _source_tokenizer(path: Path, family: Family) -> Tokenizer:
    if input_file(path / QUILL_TOKENIZER, QUILL_TOKENIZER):
        return load_tokenizer(path / QUILL_TOKENIZER)
    if family.tiktoken is not None:  # GPT-2 files: tiktoken's gpt2 is their tokenizer
        return build_tokenizer(family.tiktoken)
    from quillgpt.data.hf_tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(path, name=path.resolve().name)


def import_hf(src: str | Path, out_dir: str | Path, force: bool = False) -> Converted:
    """A Hugging Face model (directory or hub name) → a quill run directory at step 0: config.yaml,
    tokenizer.json, ckpt.pt, usable with every quill command and as train.init_from."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, runs.RUN_FILES + HF_FILES, force, "a run's or a model's files")
    path = resolve_source(src)
    refuse_onto_inputs([out_dir / n for n in runs.RUN_FILES], [p for p in path.iterdir() if p.is_file()], "--out")
    hf_config = read_hf_config(path)
    check_fields(hf_config, str(path / "config.json"))  # typed and ranged before any family reads it
    family = family_of_config(hf_config)
    codec = CODECS[family.codec]
    model_cfg = codec.model_config(hf_config, str(path / "config.json"))
    tokenizer = _source_tokenizer(path, family)
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise QuillError(
            f"{path / 'config.json'} has vocab_size={model_cfg.vocab_size}, fewer than the {tokenizer.vocab_size} "
            f"ids of its tokenizer ({tokenizer.name}); is it the model's own tokenizer?"
        )
    state = codec.quill_state(load_hf_weights(path), model_cfg, hf_config)  # read one tensor at a time
    check_weights(state, model_cfg, str(path))  # every shape as the config makes it: the run loads
    ckpt.check_state({"model": state, "config": {}, "tokenizer": {}, "step": 0}, str(path))  # finite weights
    with made_dir(out_dir):  # a failed write leaves no --out it made
        write_imported_run(out_dir, model_cfg, tokenizer, state, str(src))
    return Converted(out_dir, model_cfg, tokenizer.name, family.architecture)


def write_imported_run(out_dir: Path, model_cfg: ModelConfig, tokenizer: Tokenizer, state: dict, source: str) -> None:
    """A run directory at step 0 of an imported model (import-hf, import-gguf): its config.yaml fine-tunes it."""
    runs.write_run(out_dir, imported_config(out_dir, model_cfg, tokenizer), tokenizer, state, imported_from=source)


def imported_config(out_dir: Path, model_cfg: ModelConfig, tokenizer: Tokenizer) -> Config:
    """An import's config.yaml: its model, its tokenizer file, and training that fine-tunes it."""
    cfg = Config(model=model_cfg)
    tiktoken_name = tokenizer.spec().get("type") == "tiktoken"
    cfg.data.tokenizer = tokenizer.name if tiktoken_name else str(out_dir / "tokenizer.json")
    cfg.data.out_dir = f"data/{out_dir.name}_data"
    cfg.data.url = cfg.data.sha256 = None  # no data of its own (not the quickstart's Tiny Shakespeare): the user names it
    # Training with this config.yaml fine-tunes the import into a new directory, never over it.
    cfg.train.out_dir, cfg.train.init_from = f"{out_dir}-finetune", str(out_dir)
    return cfg


def export_hf(run: str | Path, out_dir: str | Path, which: str = "best", force: bool = False) -> Converted:
    """A quill run (or .pt) → a transformers directory of the family its architecture fits:
    GPT2LMHeadModel, or LlamaForCausalLM / Qwen2 / Qwen3 / MistralForCausalLM; with config.json,
    model.safetensors, generation_config.json, tokenizer files and quill_tokenizer.json."""
    st_torch = require("safetensors.torch")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, HF_FILES + runs.RUN_FILES, force, "a model's or a run's files")
    outputs = [out_dir / n for n in (*HF_FILES, "tokenizer.json")]
    refuse_onto_inputs(outputs, runs.run_inputs(run, which), "--out")
    loaded = runs.load_run(run, which=which)
    refuse_onto_inputs(outputs, runs.run_inputs(loaded.path, config=loaded.config), "--out")  # a LoRA run's base too
    quant.dequantize(loaded.model)  # a quantized run's weights as the float values its codes hold
    cfg, tok = loaded.config.model, loaded.tokenizer
    family = export_family_of(loaded.path, cfg, tok)
    tensors, config = CODECS[family.codec].hf_files(loaded.model.state_dict(), cfg, family, tok)
    with made_dir(out_dir):  # a failed write (a full disk...) leaves no --out it made
        try:
            atomic_write_bytes(out_dir / "model.safetensors", st_torch.save(tensors, metadata={"format": "pt"}))
            write_json(out_dir / "config.json", config)
            _write_tokenizer_files(out_dir, tok, hf_tokenizer=family.tiktoken is None)
            write_json(
                out_dir / "generation_config.json", generation_config(tok, loaded.config.sample, hf_tokenizer=family.tiktoken is None)
            )
        except OSError as e:
            raise os_error(e, out_dir, "write", "--out") from None
    return Converted(out_dir, cfg, tok.name, family.architecture)


def export_family_of(source: Path, cfg: ModelConfig, tok: Tokenizer) -> Family:
    """The family a run is exported as: GPT-2 where its architecture is GPT-2's, else the Llama
    family's record that fits; what neither can express is refused with both reasons."""
    as_gpt2, as_llama = CODECS["gpt2"].incompatibilities(cfg), CODECS["llama"].incompatibilities(cfg)
    if as_gpt2 and as_llama:
        raise QuillError(f"cannot export {source}: as GPT-2, {'; '.join(as_gpt2)}; as the Llama family, {'; '.join(as_llama)}")
    if not as_gpt2:
        return GPT2
    family = export_family(cfg, llama.is_qwen_tokenizer(getattr(tok, "_json", None)))
    assert family is not None  # llama_incompatibilities refuses what no record fits
    return family


def generation_config(tok: Tokenizer, sample: Any, hf_tokenizer: bool) -> dict[str, Any]:
    """generation_config.json: bos/eos where the tokenizer has an end-of-text id, and the run's
    `sample:` defaults, so transformers' generate() samples as `quill sample` does."""
    ends = {"bos_token_id": tok.bos_id if hf_tokenizer else tok.eot_id, "eos_token_id": tok.eot_id}
    config: dict[str, Any] = {k: v for k, v in ends.items() if v is not None}
    config.update(max_new_tokens=sample.max_new_tokens, do_sample=sample.temperature > 0)
    if sample.temperature > 0:
        config.update(temperature=sample.temperature, top_k=sample.top_k or 0, top_p=sample.top_p)
        config.update({"min_p": sample.min_p} if sample.min_p > 0 else {})
    if sample.repetition_penalty != 1.0:
        config["repetition_penalty"] = sample.repetition_penalty
    return config


def _write_tokenizer_files(out_dir: Path, tok: Tokenizer, hf_tokenizer: bool) -> None:
    """quill_tokenizer.json and (a family with its own) tokenizer.json + tokenizer_config.json
    (+ chat_template.jinja), so transformers loads the tokenizer too."""
    save_tokenizer(tok, out_dir / QUILL_TOKENIZER)
    if not hf_tokenizer:
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
