"""GPT-2 interop: Hugging Face GPT2LMHeadModel checkpoints ⇄ quill run directories.

Quill's parameter names already mirror HF GPT-2, so nothing is renamed; what differs is:
* HF builds c_attn / c_proj / c_fc from `Conv1D`, which stores its weight as (in, out); quill's
  nn.Linear stores (out, in). Those four weights are transposed, both ways.
* `attn.bias` / `attn.masked_bias` in older HF files are causal-mask buffers, not weights: they
  are skipped on import and never written on export.
* `lm_head` is tied to `wte` (GPT-2 ties them), so only `wte` is stored.
* GPT-2's `gelu_new` is the tanh-approximated GELU that quill's MLP uses.
Whatever one side can say and the other cannot is refused by name, never approximated.

Reading and writing Hugging Face directories is interop/hf_files.py's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from quillgpt import checkpoint as ckpt
from quillgpt import runs
from quillgpt.config import ModelConfig, config_from_dict, shown_value
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.interop.families import GPT2, LLAMA_FAMILY, Family
from quillgpt.model.variants import variant_of

# Weights HF keeps as Conv1D (in, out): transposed to and from nn.Linear's (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")  # causal masks saved by old transformers
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # the same tanh-approximated GELU
# transformers.GPT2Config's defaults, for keys a config.json leaves out
GPT2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}
# What import-hf writes or removes in --out, and what export-hf writes: either refuses without
# --force when any one of these is already there (a run and an HF model never share a directory).


# --- configs ----------------------------------------------------------------------------------


def hf_to_model_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A GPT-2 config.json → quill ModelConfig; anything quill cannot run exactly is refused."""
    if hf.get("model_type", GPT2.model_type) != GPT2.model_type:
        llamas = ", ".join(f.model_type for f in LLAMA_FAMILY)
        raise QuillError(
            f"{source}: model_type is {shown_value(hf['model_type'])}, not 'gpt2'; import-hf reads GPT-2 "
            f"({GPT2.architecture}) and the Llama family ({llamas})"
        )
    c = {**GPT2_DEFAULTS, **{k: v for k, v in hf.items() if k in GPT2_DEFAULTS and (v is not None or k == "n_inner")}}
    problems = []
    if c["activation_function"] not in GELU_TANH:
        problems.append(f"activation_function={shown_value(c['activation_function'])} (quill's MLP is the tanh GELU, gelu_new)")
    if not c["scale_attn_weights"]:
        problems.append("scale_attn_weights=false (quill always scales attention by 1/√head_dim)")
    if c["scale_attn_by_inverse_layer_idx"]:
        problems.append("scale_attn_by_inverse_layer_idx=true (quill does not scale attention by 1/(layer+1))")
    if c["add_cross_attention"]:
        problems.append("add_cross_attention=true (quill is decoder-only, without cross-attention)")
    # reorder_and_upcast_attn only changes rounding (the same formula in fp32), so it imports as is.
    if problems:
        raise QuillError(f"cannot import {source}: quill has no equivalent of " + "; ".join(problems))
    n_inner = c["n_inner"]
    model = {  # quill key ← config.json value, typed, bounded and validated like a config file's
        "vocab_size": c["vocab_size"],
        "block_size": c["n_positions"],
        "n_layer": c["n_layer"],
        "n_head": c["n_head"],
        "n_kv_head": None,
        "n_embd": c["n_embd"],
        "dropout": 0.0,
        "bias": True,
        "pos": "learned",
        "norm": "layernorm",
        "norm_eps": c["layer_norm_epsilon"],
        "mlp": "gelu",
        "mlp_hidden": None if n_inner is None or _is_int(n_inner) and _is_int(c["n_embd"]) and n_inner == 4 * c["n_embd"] else n_inner,
        "window": None,
        "tie_embeddings": c["tie_word_embeddings"],
        "attn_impl": "sdpa",
    }
    try:
        return config_from_dict({"model": model}).model
    except QuillError as e:
        raise QuillError(f"cannot import {source}: {e} (from its GPT-2 keys n_positions, n_embd, n_inner, ...)") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def gpt2_incompatibilities(cfg: ModelConfig) -> list[str]:
    """The options of `cfg` that GPT-2 cannot express, each with the reason (empty: exportable).

    Missing biases are not among them: a zero bias is exactly no bias, so export writes zeros;
    nor is model.zero_init_proj, which only sets where training starts.
    """
    problems = []
    if cfg.pos != "learned":
        problems.append(f"model.pos={cfg.pos}: GPT-2 has learned positions only")
    if cfg.norm != "layernorm":
        problems.append(f"model.norm={cfg.norm}: GPT-2 has LayerNorm only")
    if cfg.mlp != "gelu":
        problems.append(f"model.mlp={cfg.mlp}: GPT-2's MLP is GELU only")
    if cfg.kv_heads != cfg.n_head:
        problems.append(f"model.n_kv_head={cfg.n_kv_head}: GPT-2 has multi-head attention only (n_kv_head null)")
    if cfg.window is not None:
        problems.append(f"model.window={cfg.window}: GPT-2 has full causal attention only (window null)")
    if not variant_of(cfg).hf_exportable:
        problems.append(f"model.attention={cfg.attention}: GPT-2 has causal attention only")
    if cfg.qk_norm:
        problems.append("model.qk_norm=true: GPT-2 has no norm on queries and keys")
    if cfg.logit_softcap is not None:
        problems.append(f"model.logit_softcap={cfg.logit_softcap}: GPT-2's logits are not capped")
    return problems


def model_config_to_hf(cfg: ModelConfig, eot_id: int | None) -> dict[str, Any]:
    """A GPT-2-expressible ModelConfig → the config.json of a transformers GPT2LMHeadModel."""
    return {
        "architectures": [GPT2.architecture],
        "model_type": GPT2.model_type,
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,  # the pre-2020 name of n_positions, still read by some tools
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None if cfg.hidden_dim == 4 * cfg.n_embd else cfg.hidden_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
    }


# --- weights ----------------------------------------------------------------------------------


def hf_to_quill_state(hf_state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF GPT-2 tensors (with or without the `transformer.` prefix) → quill state_dict (fp32).

    Checked against the keys and shapes of GPT(cfg), so a mismatch is a clear error, not a
    half-loaded model.
    """
    state: dict[str, Tensor] = {}
    head = None
    for key, t in hf_state.items():
        name = key.removeprefix("transformer.")
        if MASK_BUFFER.fullmatch(name):
            continue
        if not t.is_floating_point():
            raise QuillError(f"weight {key[:100]} is a {t.dtype} tensor; GPT-2 weights are floating point")
        if name == "lm_head.weight":
            head = t
            continue
        t = t.float()
        state["transformer." + name] = t.t().contiguous() if name.endswith(CONV1D_WEIGHTS) else t
    wte = state.get("transformer.wte.weight")
    if cfg.tie_embeddings:
        if wte is not None:
            state["lm_head.weight"] = wte  # one tensor under both names, as in the tied model
    elif head is not None:
        state["lm_head.weight"] = head.float()
    problems = runs.weight_mismatches(state, cfg)
    if problems:
        raise QuillError(
            f"the weights do not match a GPT-2 of this config.json ({problems}); "
            "is it a GPT2LMHeadModel checkpoint with its own config.json?"
        )
    return state


def quill_to_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """quill state_dict → GPT2LMHeadModel tensors (contiguous, none sharing memory).

    A model trained with model.bias=false gets zero biases: the same function in GPT-2's shape.
    """
    out: dict[str, Tensor] = {}
    for key, t in ckpt.clean_state_dict(state).items():
        if key == "lm_head.weight" and cfg.tie_embeddings:
            continue  # transformers ties it to wte on load
        out[key] = t.t().contiguous() if key.endswith(CONV1D_WEIGHTS) else t.contiguous()
        module = key.removesuffix(".weight")
        if not cfg.bias and module != key and module not in ("transformer.wte", "transformer.wpe", "lm_head"):
            # a LayerNorm or Conv1D weight: its bias has as many entries as it has outputs
            out[module + ".bias"] = torch.zeros(out[key].shape[-1], dtype=t.dtype)
    return out


# --- sources ----------------------------------------------------------------------------------


# --- the two directions -----------------------------------------------------------------------


class GPT2Codec:
    """GPT-2's Codec (interop/families.py)."""

    model_config = staticmethod(hf_to_model_config)
    incompatibilities = staticmethod(gpt2_incompatibilities)

    @staticmethod
    def quill_state(weights: Mapping[str, Tensor], cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Tensor]:
        return hf_to_quill_state(weights, cfg)

    @staticmethod
    def hf_files(state: Mapping[str, Tensor], cfg: ModelConfig, family: Family, tok: Tokenizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return quill_to_hf_state(state, cfg), model_config_to_hf(cfg, tok.eot_id)


CODEC = GPT2Codec()
