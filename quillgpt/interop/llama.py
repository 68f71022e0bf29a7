"""The Llama family ⇄ quill: LlamaForCausalLM (Llama 3.x, SmolLM2, TinyLlama), Qwen2ForCausalLM
(Qwen2.5), Qwen3ForCausalLM, MistralForCausalLM and Gemma3ForCausalLM (Gemma 3's text model).

All four are one decoder that quill's GPT already is with model.pos=rope, norm=rmsnorm,
mlp=swiglu, bias=false: grouped-query attention, RoPE on (i, i + d/2) pairs within each head
(as quill rotates), an untied or tied head. What differs is a config key each: Qwen2's biases on
q/k/v (qkv_bias), Qwen3's QK-norm and head_dim, Llama 3's rope scaling, Mistral's sliding window.
Renaming is all the conversion does, plus two concatenations: q, k, v → c_attn ([q | k | v] rows,
head-major, exactly quill's layout) and gate, up → c_fc ([gate | up], quill's SwiGLU order).
Gemma 3 adds its layers' model keys (GeGLU, sandwich norms, the scaled embedding, the score scale
from query_pre_attn_scalar, every k-th layer global with its own RoPE base) and stores RMSNorm
weights w for (1 + w): import adds the 1 (export takes it away), so quill's norms stay plain.
What quill cannot compute exactly (a rope type it lacks, another activation, biases it has no
slot for, windows on some layers only) is refused by name, never loaded approximately.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from quillgpt.config import ModelConfig, config_from_dict, shown_value
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.interop.families import BY_MODEL_TYPE, LLAMA_FAMILY, Family, export_family, gemma_layers
from quillgpt.model.variants import variant_of

ROPE_TYPES = ("default", "linear", "llama3")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")  # Gemma's hidden_activation: the tanh GELU quill's geglu gates with
GEMMA_NORMS = ("ln_1", "ln_2", "ln_attn_out", "ln_mlp_out", "ln_f", "q_norm", "k_norm")  # stored as w for (1 + w)


def _rope(hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """quill's rope keys from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise QuillError(f"rope_parameters must be an object, got {shown_value(params)}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise QuillError(f"rope_type={shown_value(kind)} (quill computes {', '.join(ROPE_TYPES)} RoPE only)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise QuillError("partial_rotary_factor != 1 (quill rotates every dimension of a head)")
    theta = params.get("rope_theta", hf.get("rope_theta", family.rope_theta))
    keys: dict[str, Any] = {"rope_theta": theta}
    if kind != "default":
        keys.update(rope_scaling=kind, rope_factor=params.get("factor", 1.0))
    if kind == "llama3":
        keys.update(
            rope_low_freq_factor=params.get("low_freq_factor", 1.0),
            rope_high_freq_factor=params.get("high_freq_factor", 4.0),
            rope_original_context=params.get("original_max_position_embeddings", 8192),
        )
    return keys


def _window(hf: dict[str, Any], family: Family) -> int | None:
    """The sliding window every layer shares, or None; a window on some layers only is refused."""
    window = hf.get("sliding_window", family.window)
    if family.qwen_windows:
        layers = hf.get("layer_types") or (
            [
                "sliding_attention" if hf.get("use_sliding_window") and i >= hf.get("max_window_layers", 28) else "full_attention"
                for i in range(hf["num_hidden_layers"])
            ]
        )
        if len(set(layers)) > 1:
            raise QuillError("sliding-window attention on some layers only (quill's window is every layer's)")
        return window if layers and layers[0] == "sliding_attention" else None
    if set(hf.get("layer_types") or []) - {"full_attention", "sliding_attention"}:
        raise QuillError(f"layer_types {shown_value(hf['layer_types'])} (quill has full and sliding attention)")
    return window


def _refusals(hf: dict[str, Any], family: Family) -> list[str]:
    problems = []
    if family.gemma:
        return _gemma_refusals(hf)
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={shown_value(hf['hidden_act'])} (quill's SwiGLU gates with silu)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true (quill's SwiGLU has no biases)")
    if family.qkv_bias == "never" and hf.get("attention_bias"):
        problems.append(f"attention_bias=true ({family.name} has none)")
    return problems


def _gemma_refusals(hf: dict[str, Any]) -> list[str]:
    problems = []
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in GELU_TANH:
        problems.append(f"hidden_activation={shown_value(act)} (quill's geglu gates with the tanh GELU)")
    if hf.get("attn_logit_softcapping") is not None:
        problems.append("attn_logit_softcapping is set (quill does not cap attention scores)")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true (quill's Gemma is causal)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true (quill's Gemma has no attention biases)")
    return problems


def _gemma(hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """Gemma 3's model keys: its layers, the score scale, and per-layer windows and RoPE from
    layer_types (each k-th layer global: model.global_every) and rope_parameters per layer kind."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) else "full_attention" for i in range(n)
    ]
    if len(kinds) != n or set(kinds) - {"full_attention", "sliding_attention"}:
        raise QuillError(f"layer_types {shown_value(kinds)} (quill needs one full_attention or sliding_attention per layer)")
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope_parameters per layer kind
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
    else:  # older: rope_theta + rope_scaling for the global layers, rope_local_base_freq for the others
        full = {"rope_theta": hf.get("rope_theta", family.rope_theta), **(hf.get("rope_scaling") or {})}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    sliding = [k == "sliding_attention" for k in kinds]
    every = sliding.index(False) + 1 if False in sliding else None
    if all(sliding) or not any(sliding):  # one kind: its RoPE is every layer's
        keys = _rope({"rope_parameters": local if all(sliding) else full}, family)
        keys["window"] = hf.get("sliding_window", family.window) if all(sliding) else None
    elif every > 1 and sliding == [(i + 1) % every != 0 for i in range(n)]:
        keys = {**_rope({"rope_parameters": full}, family), "window": hf.get("sliding_window", family.window), "global_every": every}
        local_rope = _rope({"rope_parameters": local}, family)
        if set(local_rope) != {"rope_theta"}:
            raise QuillError("rope scaling on the sliding layers (quill scales the global layers' RoPE only)")
        keys["local_rope_theta"] = local_rope["rope_theta"]
    else:
        raise QuillError(f"layer_types {shown_value(kinds)}: quill's pattern is every k-th layer global (model.global_every)")
    scalar = hf.get("query_pre_attn_scalar", 256)
    keys.update(mlp="geglu", embed_scale=True, sandwich_norm=True, attn_scale=scalar**-0.5)
    keys["logit_softcap"] = hf.get("final_logit_softcapping")
    return keys


def llama_to_model_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A Llama-family config.json → quill ModelConfig; anything quill cannot run exactly is refused."""
    family = BY_MODEL_TYPE[hf["model_type"]]
    try:
        problems = _refusals(hf, family)
        if problems:
            raise QuillError("; ".join(problems))
        n_head, n_embd = hf["num_attention_heads"], hf["hidden_size"]
        head_dim = hf.get("head_dim")
        model = {
            "vocab_size": hf["vocab_size"],
            "block_size": hf.get("max_position_embeddings", family.max_positions),
            "n_layer": hf["num_hidden_layers"],
            "n_head": n_head,
            "n_kv_head": hf.get("num_key_value_heads", n_head),
            "n_embd": n_embd,
            "head_dim": None if head_dim in (None, n_embd // n_head) else head_dim,
            "bias": False,
            "qkv_bias": {"always": True, "attention_bias": bool(hf.get("attention_bias")), "never": False}[family.qkv_bias],
            "pos": "rope",
            **({} if family.gemma else _rope(hf, family)),  # Gemma's: per layer kind (_gemma)
            "norm": "rmsnorm",
            "norm_eps": hf.get("rms_norm_eps", family.rms_norm_eps),
            "mlp": "swiglu",
            "mlp_hidden": hf["intermediate_size"],
            "qk_norm": family.qk_norm,
            "window": _window(hf, family),
            "tie_embeddings": hf.get("tie_word_embeddings", family.tie_embeddings),
            "dropout": 0.0,
        }
        if family.gemma:
            model.update(_gemma(hf, family))
        return config_from_dict({"model": model}).model
    except KeyError as e:
        raise QuillError(f"cannot import {source}: it has no {e.args[0]!r}, which a {family.model_type} config needs") from None
    except QuillError as e:
        raise QuillError(f"cannot import {source} ({family.architecture}): {e}") from None


def has_o_bias(hf: dict[str, Any]) -> bool:
    """Llama's and Qwen3's attention_bias puts a bias on o_proj too; quill has no slot for one, so
    only an all-zero one imports (quill's own exports write zeros there)."""
    return BY_MODEL_TYPE[hf["model_type"]].o_bias and bool(hf.get("attention_bias"))


def weight_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """quill name → the HF tensors it is made of, concatenated along the output dimension."""
    names = {"transformer.wte.weight": ["model.embed_tokens.weight"], "transformer.ln_f.weight": ["model.norm.weight"]}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.n_layer):
        q, h = f"transformer.h.{i}.", f"model.layers.{i}."
        names[q + "ln_1.weight"] = [h + "input_layernorm.weight"]
        names[q + "attn.c_attn.weight"] = [h + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if cfg.qkv_bias:
            names[q + "attn.c_attn.bias"] = [h + f"self_attn.{p}_proj.bias" for p in "qkv"]
        names[q + "attn.c_proj.weight"] = [h + "self_attn.o_proj.weight"]
        if cfg.qk_norm:
            names[q + "attn.q_norm.weight"] = [h + "self_attn.q_norm.weight"]
            names[q + "attn.k_norm.weight"] = [h + "self_attn.k_norm.weight"]
        if cfg.sandwich_norm:  # Gemma: post_attention_layernorm is the norm after attention
            names[q + "ln_attn_out.weight"] = [h + "post_attention_layernorm.weight"]
            names[q + "ln_mlp_out.weight"] = [h + "post_feedforward_layernorm.weight"]
        names[q + "ln_2.weight"] = [h + ("pre_feedforward_layernorm.weight" if cfg.sandwich_norm else "post_attention_layernorm.weight")]
        names[q + "mlp.c_fc.weight"] = [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"]
        names[q + "mlp.c_proj.weight"] = [h + "mlp.down_proj.weight"]
    return names


def llama_to_quill_state(
    hf_state: Mapping[str, Tensor], cfg: ModelConfig, o_bias: bool = False, norms_hold_one: bool = False
) -> dict[str, Tensor]:
    """HF tensors (read one at a time from a lazy mapping) → quill's state dict, in their own
    dtype; an extra tensor or a missing one is one clear error, as is a non-zero o_proj bias.
    Gemma's norm weights w become 1 + w, unless they hold it already (norms_hold_one: llama.cpp's files)."""
    names = weight_names(cfg)
    o_biases = [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(cfg.n_layer)] if o_bias else []
    for name in o_biases:
        if name in hf_state and hf_state[name].any():
            raise QuillError(f"{name} is not zero: attention_bias=true puts a bias on o_proj, which quill has no slot for")
    expected = {n for parts in names.values() for n in parts} | set(o_biases)
    extra = [k for k in hf_state if k not in expected and not (cfg.tie_embeddings and k == "lm_head.weight")]
    missing = sorted(n for n in expected if n not in hf_state)
    if extra or missing:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise QuillError(
            f"the weights do not match a {cfg.n_layer}-layer model of this config.json ({what}); is it the model's own config.json?"
        )
    state = {}
    for name, parts in names.items():
        tensors = [hf_state[p] for p in parts]
        if any(not t.is_floating_point() for t in tensors):
            raise QuillError(f"weight {parts[0]} is a {tensors[0].dtype} tensor; model weights are floating point")
        state[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    if gemma_layers(cfg) and not norms_hold_one:
        state.update({k: v + 1 for k, v in state.items() if is_gemma_norm(k)})  # (1 + w), in the weights' dtype
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]  # one tensor under both names, as in the model
    return state


def is_gemma_norm(name: str) -> bool:
    """Whether quill tensor `name` is a norm's gain, which Gemma's files store as w for (1 + w)."""
    return name.endswith(".weight") and name.split(".")[-2] in GEMMA_NORMS


def llama_incompatibilities(cfg: ModelConfig) -> list[str]:
    """What a Llama-family model cannot express of `cfg`, each with the reason (empty: exportable)."""
    gemma = gemma_layers(cfg)
    wants = {"pos": "rope", "norm": "rmsnorm", "mlp": "geglu" if gemma else "swiglu"}
    problems = [f"model.{k}={getattr(cfg, k)}: the Llama family has {v} only" for k, v in wants.items() if getattr(cfg, k) != v]
    gemma_keys = ("sandwich_norm", "embed_scale", "attn_scale", "global_every")
    if not gemma and any(getattr(cfg, k) not in (None, False) for k in gemma_keys):
        problems.append(
            f"model.{next(k for k in gemma_keys if getattr(cfg, k) not in (None, False))}: only Gemma 3 has it, "
            "with model.mlp=geglu, model.sandwich_norm and model.embed_scale together"
        )
    if cfg.bias:
        problems.append("model.bias=true: the Llama family has no biases but q/k/v's (use model.qkv_bias)")
    if not variant_of(cfg).hf_exportable:
        problems.append(f"model.attention={cfg.attention}: the Llama family has causal attention only")
    if cfg.logit_softcap is not None and not gemma:
        problems.append(f"model.logit_softcap={cfg.logit_softcap}: the Llama family's logits are not capped")
    if not problems and export_family(cfg) is None:
        features = " + ".join(f"model.{k}" for k in ("window", "qk_norm", "qkv_bias") if getattr(cfg, k))
        windowed = ", ".join(f.name for f in LLAMA_FAMILY if f.exports_window)
        problems.append(f"{features}: no Llama-family model has them together (a window is {windowed}'s, which has neither)")
    return problems


def zero_o_bias(cfg: ModelConfig, family: Family) -> bool:
    """Whether the export writes attention_bias=true (q/k/v biases) with o_proj's bias all zero."""
    return cfg.qkv_bias and family.qkv_bias == "attention_bias" and family.o_bias


def model_config_to_llama(cfg: ModelConfig, family: Family, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """An exportable ModelConfig → the config.json of `family` (transformers 5 form: rope_parameters)."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_context,
        )
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }
    if family.qkv_bias == "attention_bias":
        out["attention_bias"] = zero_o_bias(cfg, family)
    if family.mlp_bias_key:
        out["mlp_bias"] = False
    if family.qwen_windows:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer)
    if family.exports_window:
        out["sliding_window"] = cfg.window
    if family.gemma:
        del out["hidden_act"]  # Gemma's is hidden_activation
        out.update(_gemma_config(cfg, rope))
    return out


def _gemma_config(cfg: ModelConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma3ForCausalLM's own keys: the activation, the score scale, per-layer windows and RoPE."""
    scalar = cfg.head_size if cfg.attn_scale is None else round(cfg.attn_scale**-2)
    if scalar < 1 or scalar**-0.5 != (cfg.attn_scale or cfg.head_size**-0.5):
        raise QuillError(f"model.attn_scale={cfg.attn_scale}: Gemma states its scale as query_pre_attn_scalar^-0.5, an integer's")
    local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta} if cfg.global_every else rope
    kinds = ["sliding_attention" if cfg.windowed(i) else "full_attention" for i in range(cfg.n_layer)]
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar, "layer_types": kinds}
    out.update(sliding_window=cfg.window, final_logit_softcapping=cfg.logit_softcap, attn_logit_softcapping=None)
    out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    return out


def quill_to_llama_state(state: Mapping[str, Tensor], cfg: ModelConfig, family: Family, norms_hold_one: bool = False) -> dict[str, Tensor]:
    """quill state dict → the tensors of `family` (contiguous, none sharing memory): c_attn
    split into q/k/v, c_fc into gate/up, zero o_proj biases where attention_bias needs them; a tied
    head is left for transformers to tie. Gemma's norm weights go back to w for (1 + w), unless
    the format holds (1 + w) itself (norms_hold_one: llama.cpp's files)."""
    H, KV, hd = cfg.n_head, cfg.kv_heads, cfg.head_size
    sizes = {"attn.c_attn": [H * hd, KV * hd, KV * hd], "mlp.c_fc": [cfg.hidden_dim, cfg.hidden_dim]}
    out = {}
    less_one = gemma_layers(cfg) and not norms_hold_one
    for name, parts in weight_names(cfg).items():
        t = state[name] - 1 if less_one and is_gemma_norm(name) else state[name]
        module = ".".join(name.split(".")[-3:-1])  # e.g. attn.c_attn
        pieces = t.split(sizes[module], dim=0) if len(parts) > 1 else [t]
        out.update({p: piece.contiguous().clone() for p, piece in zip(parts, pieces)})
    if zero_o_bias(cfg, family):
        ref = state["transformer.h.0.attn.c_proj.weight"]
        out.update({f"model.layers.{i}.self_attn.o_proj.bias": ref.new_zeros(cfg.n_embd) for i in range(cfg.n_layer)})
    return out


class LlamaCodec:
    """The Llama family's Codec (interop/families.py): one mapping, each record's features."""

    model_config = staticmethod(llama_to_model_config)
    incompatibilities = staticmethod(llama_incompatibilities)

    @staticmethod
    def quill_state(weights: Mapping[str, Tensor], cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Tensor]:
        return llama_to_quill_state(weights, cfg, has_o_bias(hf))

    @staticmethod
    def hf_files(state: Mapping[str, Tensor], cfg: ModelConfig, family: Family, tok: Tokenizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return quill_to_llama_state(state, cfg, family), model_config_to_llama(cfg, family, tok.bos_id, tok.eot_id)


CODEC = LlamaCodec()


def is_qwen_tokenizer(tokenizer_json: str | None) -> bool:
    """Whether transformers' Qwen2Tokenizer (which overrides a qwen2 model's normalizer and
    pre-tokenizer) leaves this tokenizer.json as it is: NFC and Qwen's own split pattern."""
    if tokenizer_json is None:
        return False
    try:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    except ImportError:
        return False
    data = json.loads(tokenizer_json)
    steps = (data.get("pre_tokenizer") or {}).get("pretokenizers") or []
    patterns = [s.get("pattern", {}).get("Regex") for s in steps if isinstance(s, dict) and s.get("type") == "Split"]
    return (data.get("normalizer") or {}).get("type") == "NFC" and patterns == [PRETOKENIZE_REGEX]
