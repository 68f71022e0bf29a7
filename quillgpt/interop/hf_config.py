"""config.json (and generation_config.json) fields read as untrusted input: each one typed and
ranged before use, the same way for every family, and the converted weights checked against the
config they are imported with, so `import-hf` either writes a run every command loads or stops
with one QuillError naming the file and the field."""

from __future__ import annotations

import math
from typing import Any

from quillgpt.errors import QuillError

MAX_INT = 2**31  # no dimension, layer count or vocabulary a quill model holds comes near it
# field → (kind, lowest, highest); a field absent here is read (or refused) by its family's codec
INT_FIELDS = {
    "hidden_size": (1, MAX_INT),
    "n_embd": (1, MAX_INT),
    "num_attention_heads": (1, 1 << 16),
    "n_head": (1, 1 << 16),
    "num_key_value_heads": (1, 1 << 16),
    "num_hidden_layers": (1, 1 << 16),
    "n_layer": (1, 1 << 16),
    "vocab_size": (1, MAX_INT),
    "intermediate_size": (1, MAX_INT),
    "n_inner": (1, MAX_INT),
    "head_dim": (1, 1 << 16),
    "max_position_embeddings": (1, 2**24),
    "n_positions": (1, 2**24),
    "max_window_layers": (0, 1 << 16),
    "sliding_window": (1, 2**24),
    "query_pre_attn_scalar": (1, 2**24),  # Gemma: the attention scores' scale is its ^-0.5
}
# field → the largest value (each must be finite and above 0): a norm's epsilon is a small fraction,
# RoPE's base and scaling factors are at most a few million and a few hundred in any real model
FLOAT_FIELDS = {
    "rms_norm_eps": 1.0,
    "layer_norm_epsilon": 1.0,
    "rope_theta": 1e12,
    "rope_local_base_freq": 1e12,  # Gemma 3's windowed layers
    "final_logit_softcapping": 1e4,  # Gemma: tens
}
ROPE_FIELDS = {"rope_theta": 1e12, "factor": 1e4, "low_freq_factor": 1e4, "high_freq_factor": 1e4}
ROPE_INT_FIELDS = {"original_max_position_embeddings": 2**24}
NOT_NULL = frozenset({"rope_theta"})  # null here is no value at all (leave the field out for the default)
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
NULLABLE = frozenset({"n_inner", "head_dim", "sliding_window", "num_key_value_heads"})


def check_fields(hf: dict[str, Any], source: str = "config.json") -> None:
    """Every known field of config.json that is present: an integer in its range, a finite
    positive number, or a boolean; else one QuillError naming the file and the field."""
    for name, (lo, hi) in INT_FIELDS.items():
        if name in hf and not (hf[name] is None and name in NULLABLE):
            value = hf[name]
            if not isinstance(value, int) or isinstance(value, bool):
                raise QuillError(f"{source}: {name} is {_shown(value)}, not an integer; fix the file (an integer from {lo} to {hi:,})")
            if not lo <= value <= hi:
                raise QuillError(f"{source}: {name}={_shown(value)} is out of range; it must be from {lo} to {hi:,}")
    for name, most in FLOAT_FIELDS.items():
        if name in hf and (hf[name] is not None or name in NOT_NULL):
            _check_number(hf[name], most, name, source)
    for name in BOOL_FIELDS:
        if name in hf and hf[name] is not None and not isinstance(hf[name], bool):
            raise QuillError(f"{source}: {name} is {_shown(hf[name])}, not true or false")
    check_rope(hf, source)


def check_rope(hf: dict[str, Any], source: str) -> None:
    """rope_parameters (transformers 5) and rope_scaling (older): null or an object whose base
    and factors are numbers in range (a string "1e4" is not read as one)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise QuillError(f"{source}: {key} is {_shown(params)}; it must be an object (or null for plain RoPE)")
        for name, most in ROPE_FIELDS.items():
            if name in params:
                _check_number(params[name], most, f"{key}.{name}", source)
        for name, most in ROPE_INT_FIELDS.items():
            value = params.get(name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise QuillError(f"{source}: {key}.{name} is {_shown(value)}; it must be an integer from 1 to {most:,}")


def _check_number(value: Any, most: float, name: str, source: str) -> None:
    """A finite number above 0 and at most `most`, else one QuillError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 < value <= most):
        raise QuillError(f"{source}: {name} is {_shown(value)}; it must be a finite number above 0 and at most {most:g}")


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 40:  # repr of 5,000 digits fails
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1:,} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_weights(state: dict[str, Any], model_cfg: Any, source: str) -> None:
    """The converted weights against the model the config describes (built without memory, on
    torch's meta device): every tensor there, of its shape, and none besides; else one QuillError
    naming the first difference, before anything is written."""
    import torch

    from quillgpt.model.gpt import GPT

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in GPT(model_cfg).state_dict().items()}
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if wrong:
        k = wrong[0]
        raise QuillError(
            f"{source}: the weights do not match its config.json: {k} is {list(state[k].shape)}, the config makes it "
            f"{list(expected[k])} ({len(wrong)} tensor(s) differ); check hidden_size, num_attention_heads, "
            "num_key_value_heads, head_dim, intermediate_size and vocab_size"
        )
    if missing or extra:
        what = f"has no {missing[0]}" if missing else f"has {extra[0]}, which the config has no place for"
        raise QuillError(
            f"{source}: the weights do not match its config.json: the model {what}; check num_hidden_layers and the weight files"
        )
