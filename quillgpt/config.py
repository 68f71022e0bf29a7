"""Typed configuration: YAML → validated dataclasses, with dotted `key=value` overrides.

Every section is a dataclass whose type hints are the schema. `load_config` reads a YAML
file, applies overrides, coerces each value to its field's type and validates the whole;
any mistake raises one `QuillError` naming the key (with the closest valid key for typos).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from quillgpt.errors import QuillError
from quillgpt.files import atomic_write_text

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and where token files go."""

    path: str | None = None  # local UTF-8 text file; when unset, `url` is downloaded into data/
    url: str | None = TINY_SHAKESPEARE_URL  # downloaded once, verified against `sha256`
    sha256: str | None = TINY_SHAKESPEARE_SHA256
    tokenizer: str = "char"  # char | gpt2 | r50k_base | cl100k_base | o200k_base | bpe | path/to/tokenizer.json
    bpe_vocab_size: int = 4096  # vocabulary size when `tokenizer: bpe` trains one on the corpus
    out_dir: str = "data/shakespeare_char"  # train.bin, val.bin, meta.json go here
    val_fraction: float = 0.1  # the last fraction of the text is the validation split

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise QuillError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.path is None and self.url is None:
            raise QuillError("set data.path (a local text file) or data.url (a file to download)")
        if self.bpe_vocab_size < 257:
            raise QuillError(
                f"data.bpe_vocab_size must be at least 257 (256 bytes + 1 merge), got {self.bpe_vocab_size}"
            )


@dataclass
class ModelConfig:
    """The Transformer's shape and the attention variant (see attention.py)."""

    vocab_size: int | None = None  # filled in from the tokenizer when unset
    block_size: int = 256  # context length in tokens
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int | None = None  # None = n_head (MHA); 1 = multi-query; divisor of n_head = grouped-query
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # biases in linear layers and norms (GPT-2 has them)
    pos: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = "gelu"
    mlp_hidden: int | None = None  # None = 4·n_embd for gelu, ≈ 8/3·n_embd (multiple of 64) for swiglu
    window: int | None = None  # sliding-window attention: token i sees tokens (i-window, i]
    tie_embeddings: bool = True  # share the token embedding with the output head
    attn_impl: Literal["sdpa", "math"] = "sdpa"  # fused kernel, or explicit softmax(QK^T/√d)V

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden_dim(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return 64 * ((int(8 * self.n_embd / 3) + 63) // 64)

    def validate(self) -> None:
        for key in ("block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) < 1:
                raise QuillError(f"model.{key} must be at least 1, got {getattr(self, key)}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise QuillError(f"model.vocab_size must be at least 1, got {self.vocab_size}")
        if self.n_embd % self.n_head != 0:
            raise QuillError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.n_kv_head is not None and (
            self.n_kv_head < 1 or self.n_head % self.n_kv_head != 0
        ):
            raise QuillError(
                f"model.n_kv_head ({self.n_kv_head}) must divide model.n_head ({self.n_head})"
            )
        if self.pos == "rope" and self.head_dim % 2 != 0:
            raise QuillError(
                f"model.pos=rope needs an even head size, got n_embd/n_head = {self.head_dim}"
            )
        if self.window is not None and self.window < 1:
            raise QuillError(f"model.window must be at least 1 (or null for none), got {self.window}")
        if not 0.0 <= self.dropout < 1.0:
            raise QuillError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise QuillError(f"model.mlp_hidden must be at least 1, got {self.mlp_hidden}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise QuillError("model.rope_theta and model.norm_eps must be positive")


@dataclass
class TrainConfig:
    """The optimisation loop, evaluation, checkpoints and hardware."""

    out_dir: str = "out/run"  # run directory: config.yaml, ckpt.pt, best.pt, metrics.jsonl
    max_iters: int = 5000  # optimizer steps
    batch_size: int = 64  # sequences per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    learning_rate: float = 1e-3
    min_lr: float = 1e-4  # floor of the decay
    warmup_iters: int = 100
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # wsd = warmup-stable-decay
    decay_frac: float = 0.2  # wsd only: fraction of the run spent decaying
    weight_decay: float = 0.1  # only on ≥2-D weights
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables
    eval_interval: int = 250  # evaluate and checkpoint every N steps
    eval_iters: int = 20  # fixed batches per split for each evaluation
    log_interval: int = 10  # a metrics.jsonl line every N steps
    device: str = "auto"  # auto (cuda → mps → cpu), cpu, cuda, cuda:1, mps
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 (fp16 if unsupported) on CUDA, bf16 on CPUs with bf16 units, else fp32
    compile: bool = False  # torch.compile the model
    resume: bool | Literal["auto"] = False  # true: continue the run in out_dir; auto: if one exists
    time_budget: str | None = None  # e.g. 90s, 5m, 1h: stop (with a checkpoint) when it runs out
    init_from: str | None = None  # start from another run's weights (fine-tuning), fresh optimizer
    seed: int = 1337
    tensorboard: bool = False
    wandb: bool = False

    def validate(self) -> None:
        for key in ("max_iters", "batch_size", "grad_accum", "eval_interval", "eval_iters", "log_interval"):
            if getattr(self, key) < 1:
                raise QuillError(f"train.{key} must be at least 1, got {getattr(self, key)}")
        if self.warmup_iters < 0:
            raise QuillError(f"train.warmup_iters must be ≥ 0, got {self.warmup_iters}")
        if self.learning_rate <= 0 or self.min_lr < 0 or self.min_lr > self.learning_rate:
            raise QuillError(
                f"need 0 ≤ train.min_lr ≤ train.learning_rate and learning_rate > 0, "
                f"got min_lr={self.min_lr}, learning_rate={self.learning_rate}"
            )
        if not 0.0 <= self.decay_frac <= 1.0:
            raise QuillError(f"train.decay_frac must be in [0, 1], got {self.decay_frac}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise QuillError("train.grad_clip and train.weight_decay must be ≥ 0")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise QuillError("train.beta1 and train.beta2 must be in [0, 1)")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise QuillError(f"train.device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.time_budget is not None:
            parse_duration(self.time_budget, key="train.time_budget")


@dataclass
class SampleConfig:
    """Defaults for `quill sample`; command-line flags override them."""

    max_new_tokens: int = 500
    temperature: float = 0.8  # 0 = greedy
    top_k: int | None = 200
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 1337

    def validate(self) -> None:
        validate_sampling(
            self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
            self.max_new_tokens, prefix="sample.",
        )


def validate_sampling(
    temperature: float,
    top_k: int | None,
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    max_new_tokens: int,
    prefix: str = "--",
) -> None:
    """Shared by the config section and the CLI flags so both say the same thing."""
    dash = prefix == "--"

    def name(key: str) -> str:
        return prefix + (key.replace("_", "-") if dash else key)

    if temperature < 0:
        raise QuillError(f"{name('temperature')} must be ≥ 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise QuillError(f"{name('top_k')} must be at least 1, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise QuillError(f"{name('top_p')} must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p < 1.0:
        raise QuillError(f"{name('min_p')} must be in [0, 1), got {min_p}")
    if repetition_penalty <= 0:
        raise QuillError(f"{name('repetition_penalty')} must be > 0 (1 = off), got {repetition_penalty}")
    if max_new_tokens < 0:
        raise QuillError(f"{name('max_new_tokens')} must be ≥ 0, got {max_new_tokens}")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def validate(self) -> None:
        self.data.validate()
        self.model.validate()
        self.train.validate()
        self.sample.validate()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_duration(text: str, key: str = "duration") -> float:
    """'90s', '5m', '1.5h' or a bare number of seconds → seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise QuillError(f"{key} must be a positive duration such as 90s, 5m or 1h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


# ---------------------------------------------------------------------------------------------
# Dict → dataclass, with type coercion and helpful errors


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(valid)})"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) if not isinstance(a, str) else a for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp`, or raise a QuillError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:  # exact type matches first: a bool stays a bool in `bool | Literal`
            if option is not type(None) and _matches(value, option):
                return value
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except QuillError:
                pass
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise QuillError(f"{key} must be {_type_name(tp)}, got {value!r}")


def _matches(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp)
    if tp is float:
        return isinstance(value, float)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise QuillError(f"{prefix.rstrip('.') or 'the config'} must be a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in valid:
            raise QuillError(f"unknown config key {prefix}{key}{_suggest(str(key), valid)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def config_from_dict(values: dict[str, Any]) -> Config:
    """Build and validate a Config from plain data (a parsed YAML file or a checkpoint)."""
    cfg = _build(Config, values or {}, "")
    cfg.validate()
    return cfg


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings; values are parsed as YAML scalars (so 3 → int)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in (values or {}).items()}
    sections = [f.name for f in fields(Config)]
    for item in overrides:
        if "=" not in item:
            raise QuillError(f"override {item!r} must look like section.key=value, e.g. train.max_iters=200")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) != 2:
            raise QuillError(f"override key {dotted!r} must be section.key, e.g. model.n_layer")
        section, key = parts
        if section not in sections:
            raise QuillError(f"unknown config section {section!r}{_suggest(section, sections)}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        out.setdefault(section, {})
        if not isinstance(out[section], dict):
            raise QuillError(f"config section {section!r} must be a mapping")
        out[section][key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise QuillError(f"config file not found: {path} (pass --config with a YAML file, e.g. configs/shakespeare_char_cpu.yaml)")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise QuillError(f"{path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError as e:
        raise QuillError(f"{path} is not UTF-8 text (byte offset {e.start})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise QuillError(f"{path} must be a YAML mapping with sections data/model/train/sample")
    return values


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults when `path` is None), apply overrides, validate."""
    values = read_yaml(path) if path is not None else {}
    return config_from_dict(apply_overrides(values, list(overrides or [])))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write YAML via a temp file + rename, so a kill never leaves a half-written config."""
    path = Path(path)
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
