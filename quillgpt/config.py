"""Typed configuration: YAML → validated dataclasses, with dotted `key=value` overrides.

Every section is a dataclass whose type hints are the schema. `load_config` reads a YAML
file, applies overrides, coerces each value to its field's type and validates the whole;
any mistake raises one `QuillError` naming the key (with the closest valid key for typos).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

from quillgpt.errors import QuillError
from quillgpt.files import atomic_write_text, read_text
from quillgpt.sampling_params import MAX_SEED, InvalidParam, SamplingParams

# Bounds that keep every number inside what numpy, torch and Python's float can represent;
# what fits in memory is checked later against the machine (train/memory.py).
MAX_INT = 2**62  # any int field: larger cannot be an index, a count or a size
MAX_VOCAB = 2**24  # ids of a vocabulary (o200k_base has 200k); also bounds data.bpe_vocab_size
MAX_CONFIG_BYTES = 1 << 24  # a config file; /dev/zero given as --config must not fill memory
MAX_YAML_NODES = 100_000  # a config expanded through its aliases; a real one has a few hundred
SHOWN_VALUE_CHARS = 200  # error messages print a user value cut to this length


def shown_value(value: Any) -> str:
    """repr() of a user value, bounded in time and length (an alias bomb must not be printed)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxtuple, r.maxset = 3, 8, 8, 8, 8
    r.maxstring = r.maxother = r.maxlong = SHOWN_VALUE_CHARS
    text = r.repr(value)
    return _cut(text)


def check_finite(section: Any, name: str) -> None:
    """Every float of a section is finite: ranges below compare with NaN as False, so a config
    built in Python (not through _coerce) gets the same guarantee."""
    for key, value in vars(section).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise QuillError(f"{name}.{key} must be a finite number, got {value}")


def expand_home(section: Any, keys: tuple[str, ...]) -> None:
    """A leading ~ in a path key is the home directory, as in a shell (a shell leaves
    data.path=~/corpus.txt alone: the ~ is not at the start of the word)."""
    for key in keys:
        value = getattr(section, key)
        if isinstance(value, str) and value.startswith("~"):
            setattr(section, key, os.path.expanduser(value))


def _shown_key(key: Any) -> str:
    """A config key as messages print it: as is when it looks like one, else repr'd and cut."""
    return _cut(key) if isinstance(key, str) and key.isidentifier() else shown_value(key)


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 3] + "..."


TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and where token files go."""

    path: str | None = None  # a text file, a directory or a glob of .txt/.jsonl/.parquet (.gz/.zst); unset: `url`
    url: str | None = TINY_SHAKESPEARE_URL  # downloaded once, verified against `sha256`
    sha256: str | None = TINY_SHAKESPEARE_SHA256
    # char | gpt2 | r50k_base | cl100k_base | o200k_base | bpe | path/to/tokenizer.json; null: char, or with
    # train.init_from the base run's own (fine-tuning reads text the way the base model was trained to)
    tokenizer: str | None = None
    bpe_vocab_size: int = 4096  # vocabulary size when `tokenizer: bpe` trains one on the corpus
    out_dir: str = "data/shakespeare_char"  # token shards (train.bin, train-000001.bin, ..., val.bin) and meta.json
    val_fraction: float = 0.1  # val: the last fraction of the documents (of the text, for one document)
    text_field: str = "text"  # the field (jsonl) or column (parquet) that holds each document's text
    shard_tokens: int = 100_000_000  # token ids per shard file
    workers: int | None = None  # tokenizer processes; null = every core (in-process for a small corpus)
    format: Literal["text", "chat"] = "text"  # chat: jsonl conversations, the loss on the assistant's tokens only
    skip_bad_lines: bool = False  # chat: skip (and count) lines that are not a valid conversation instead of failing

    def validate(self) -> None:
        check_finite(self, "data")
        expand_home(self, ("path", "out_dir", "tokenizer"))
        if self.skip_bad_lines and self.format != "chat":
            raise QuillError("data.skip_bad_lines applies to chat data (data.format=chat)")
        if not 0.0 < self.val_fraction < 1.0:
            raise QuillError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if not 1024 <= self.shard_tokens <= 2**40:
            raise QuillError(f"data.shard_tokens must be between 1024 and 2^40, got {self.shard_tokens}")
        if self.workers is not None and not 1 <= self.workers <= 1024:
            raise QuillError(f"data.workers must be between 1 and 1024 (or null for every core), got {self.workers}")
        if not self.text_field:
            raise QuillError("data.text_field must name the jsonl field / parquet column that holds the text")
        if not 257 <= self.bpe_vocab_size <= MAX_VOCAB:
            raise QuillError(f"data.bpe_vocab_size must be between 257 (256 bytes + 1 merge) and {MAX_VOCAB:,}, got {self.bpe_vocab_size}")


# The largest value of each size of ModelConfig (None = unset is allowed where the type says so).
# Generous for any model this toolkit can train; what fits in memory is checked against the machine.
MODEL_SIZE_LIMITS = {
    "vocab_size": MAX_VOCAB,
    "block_size": 2**24,
    "n_layer": 1024,
    "n_head": 2**12,
    "n_kv_head": 2**12,
    "n_embd": 2**17,
    "mlp_hidden": 2**19,
    "window": 2**24,
    "head_dim": 2**14,
    "rope_original_context": 2**24,
}


@dataclass
class ModelConfig:
    """The Transformer's shape and the attention variant (model/variants/)."""

    vocab_size: int | None = None  # filled in from the tokenizer when unset
    block_size: int = 256  # context length in tokens
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int | None = None  # None = n_head (MHA); 1 = multi-query; divisor of n_head = grouped-query
    n_embd: int = 384
    head_dim: int | None = None  # None = n_embd / n_head; set where a model's heads are not n_embd / n_head wide (Qwen3)
    dropout: float = 0.0
    bias: bool = True  # biases in linear layers and norms (GPT-2 has them)
    qkv_bias: bool = False  # biases on the q, k, v projections even with bias=false (Qwen2)
    pos: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    rope_scaling: Literal["linear", "llama3"] | None = None  # RoPE frequency scaling for long context; null = none
    rope_factor: float = 1.0  # linear / llama3: how much longer the context is than the one trained with
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_context / this are divided by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_context / this are kept
    rope_original_context: int = 8192  # llama3: the context length the frequencies were trained for
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    # relu2: relu(x)² (modded-nanogpt, Primer); geglu: SwiGLU's gate through GELU (tanh) instead of SiLU (Gemma)
    mlp: Literal["gelu", "swiglu", "relu2", "geglu"] = "gelu"
    mlp_hidden: int | None = None  # None = 4·n_embd for gelu/relu2, ≈ 8/3·n_embd (multiple of 64) for swiglu/geglu
    qk_norm: bool = False  # RMSNorm (learned gains) on each head's q and k before attention and RoPE
    logit_softcap: float | None = None  # c: logits = c·tanh(logits/c), bounded in (-c, c) (Gemma 2); null = off
    zero_init_proj: bool = False  # output projections (attn.c_proj, mlp.c_proj) start at zero: blocks start as identity
    window: int | None = None  # sliding-window attention: token i sees tokens (i-window, i]
    tie_embeddings: bool = True  # share the token embedding with the output head
    embed_scale: bool = False  # token embeddings × √n_embd, the factor rounded to the weights' dtype (Gemma)
    sandwich_norm: bool = False  # a norm after attention and after the MLP too, before each adds to the residual (Gemma 2/3)
    attn_scale: float | None = None  # the attention scores' scale; null = 1/√head_dim (Gemma: query_pre_attn_scalar^-0.5)
    global_every: int | None = None  # with model.window: every k-th layer attends globally, the others through the window
    local_rope_theta: float | None = None  # with global_every: the windowed layers' RoPE base (no scaling); null = rope_theta
    attn_impl: Literal["sdpa", "math"] = "sdpa"  # fused kernel, or explicit softmax(QK^T/√d)V
    # causal | prefix (prefix-LM: the prompt/prefix attends both ways) | infini (Infini-attention)
    attention: Literal["causal", "prefix", "infini"] = "causal"
    prefix_max: int | None = None  # prefix: training prefixes drawn uniform in [0, prefix_max]; None = block_size/2
    prefix_sep: str | None = None  # prefix: a one-token separator; a window's prefix ends at its first one
    segment_size: int | None = None  # infini: tokens per segment (block_size = k × segment_size)
    memory_update: Literal["linear", "delta"] = "linear"  # infini: how a segment is written to memory

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_size(self) -> int:
        """Each head's width: model.head_dim, or n_embd / n_head."""
        return self.n_embd // self.n_head if self.head_dim is None else self.head_dim

    @property
    def train_prefix_max(self) -> int:
        """A prefix-LM's largest training prefix: model.prefix_max, or block_size / 2."""
        return self.block_size // 2 if self.prefix_max is None else self.prefix_max

    @property
    def gated_mlp(self) -> bool:
        """The MLP's c_fc gives [gate | up] (SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    @property
    def hidden_dim(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp in ("gelu", "relu2"):
            return 4 * self.n_embd
        return 64 * ((int(8 * self.n_embd / 3) + 63) // 64)

    def validate(self) -> None:
        check_finite(self, "model")
        for key, most in MODEL_SIZE_LIMITS.items():
            value = getattr(self, key)
            if value is not None and not 1 <= value <= most:
                raise QuillError(f"model.{key} must be between 1 and {most:,}, got {value}")
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            raise QuillError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head}), or set model.head_dim")
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head != 0):
            raise QuillError(f"model.n_kv_head ({self.n_kv_head}) must divide model.n_head ({self.n_head})")
        if self.pos == "rope" and self.head_size % 2 != 0:
            what = "n_embd/n_head" if self.head_dim is None else "model.head_dim"
            raise QuillError(f"model.pos=rope needs an even head size, got {what} = {self.head_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise QuillError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise QuillError("model.rope_theta and model.norm_eps must be positive")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise QuillError(f"model.logit_softcap must be positive (e.g. 30) or null, got {self.logit_softcap}")
        self._validate_rope_scaling()
        self._validate_attention()
        self._validate_layer_pattern()

    def _validate_rope_scaling(self) -> None:
        """The scaling keys need model.pos=rope and a scaling that reads them; factors are positive."""
        defaults = {f.name: f.default for f in fields(self) if f.name.startswith("rope_") and f.name != "rope_theta"}
        changed = [k for k in defaults if k != "rope_scaling" and getattr(self, k) != defaults[k]]
        if self.rope_scaling is not None and self.pos != "rope":
            raise QuillError(f"model.rope_scaling={self.rope_scaling} needs model.pos=rope, got model.pos={self.pos}")
        llama3_only = [k for k in changed if k != "rope_factor"]
        if (self.rope_scaling is None and changed) or (self.rope_scaling == "linear" and llama3_only):
            raise QuillError(f"model.{(llama3_only or changed)[0]} has no effect with model.rope_scaling={self.rope_scaling}")
        if self.rope_factor <= 0 or self.rope_low_freq_factor <= 0 or self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise QuillError(
                "need model.rope_factor > 0 and 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, got "
                f"{self.rope_factor}, {self.rope_low_freq_factor}, {self.rope_high_freq_factor}"
            )

    def _validate_attention(self) -> None:
        """The attention variant's own keys, and the combinations that cannot work (both keys named)."""
        a = f"model.attention={self.attention}"
        if self.attention != "prefix" and (self.prefix_max is not None or self.prefix_sep is not None):
            raise QuillError(f"model.prefix_max / model.prefix_sep need model.attention=prefix, got {a}")
        if self.attention != "infini" and (self.segment_size is not None or self.memory_update != "linear"):
            raise QuillError(f"model.segment_size / model.memory_update need model.attention=infini, got {a}")
        if self.attention != "causal" and self.window is not None:
            raise QuillError(f"{a} does not combine with model.window (set model.window=null)")
        if self.attention == "prefix" and self.prefix_max is not None and not 0 <= self.prefix_max <= self.block_size:
            raise QuillError(f"model.prefix_max must be in [0, model.block_size={self.block_size}], got {self.prefix_max}")
        if self.attention == "prefix" and self.prefix_sep == "":
            raise QuillError("model.prefix_sep must be a non-empty string (or null)")
        if self.attention == "infini" and (self.segment_size is None or self.segment_size < 1 or self.block_size % self.segment_size):
            raise QuillError(f"{a} needs model.segment_size dividing model.block_size ({self.block_size}), got {self.segment_size}")
        if self.attn_scale is not None and (self.attn_scale <= 0 or self.attention == "infini"):
            raise QuillError(f"model.attn_scale must be positive (or null: 1/√head_dim) and needs causal or prefix attention, got {a}")

    def windowed(self, layer: int) -> bool:
        """Whether `layer` attends through model.window: every layer, or with model.global_every=k
        all but every k-th (layers k-1, 2k-1, …, as Gemma 3's 5 sliding then 1 global)."""
        if self.window is None:
            return False
        return self.global_every is None or (layer + 1) % self.global_every != 0

    def _validate_layer_pattern(self) -> None:
        """model.global_every needs a window to alternate with; local_rope_theta needs both and RoPE."""
        if self.global_every is not None and (self.window is None or not 2 <= self.global_every <= 1024):
            raise QuillError(
                f"model.global_every must be from 2 to 1,024 with model.window set, got {self.global_every} (window {self.window})"
            )
        if self.local_rope_theta is not None and (self.global_every is None or self.pos != "rope" or self.local_rope_theta <= 0):
            raise QuillError(
                f"model.local_rope_theta ({self.local_rope_theta}) must be positive and needs model.global_every and model.pos=rope"
            )


@dataclass
class TrainConfig:
    """The optimisation loop, evaluation, checkpoints and hardware."""

    out_dir: str = "out/run"  # run directory: config.yaml, ckpt.pt, best.pt, metrics.jsonl
    max_iters: int = 5000  # optimizer steps
    batch_size: int = 64  # sequences per micro-step (with batch_tokens: at most this many)
    # chat data: a micro-step's token budget, rows × its longest row (padding included); rows of similar length go together
    batch_tokens: int | None = None
    grad_accum: int = 1  # micro-steps per optimizer step
    learning_rate: float = 1e-3
    min_lr: float = 1e-4  # floor of the decay
    warmup_iters: int = 100
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # wsd = warmup-stable-decay
    decay_frac: float = 0.2  # wsd only: fraction of the run spent decaying
    weight_decay: float = 0.1  # only on ≥2-D weights
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon for the blocks' matrices, AdamW for the rest
    muon_lr: float = 0.02  # muon: Muon's peak lr (scaled by the schedule like learning_rate)
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the Muon matrices
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables
    eval_interval: int = 250  # evaluate and checkpoint every N steps
    eval_iters: int = 20  # fixed batches per split for each evaluation
    log_interval: int = 10  # a metrics.jsonl line every N steps
    device: str = "auto"  # auto (cuda → mps → cpu), cpu, cuda, cuda:1, mps
    # auto: bf16 (fp16 if unsupported) on CUDA, bf16 on CPUs with bf16 units, else fp32
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    compile: bool = False  # torch.compile the model
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"  # under torchrun: ddp copies the model, fsdp shards it; auto: ddp if it fits
    activation_checkpointing: bool = False  # recompute each block's activations in backward (less memory, ~1/3 more compute)
    resume: bool | Literal["auto"] = False  # true: continue the run in out_dir; auto: if one exists
    time_budget: str | None = None  # e.g. 90s, 5m, 1h: stop (with a checkpoint) when it runs out
    init_from: str | None = None  # start from another run's weights (fine-tuning), fresh optimizer
    seed: int = 1337
    tensorboard: bool = False  # also write TensorBoard event files (losses, lr, tokens/s, MFU) into out_dir
    overwrite: bool = False  # replace a run already in out_dir (--overwrite); without it or resume, train refuses

    def validate(self) -> None:
        check_finite(self, "train")
        expand_home(self, ("out_dir", "init_from"))
        for key in ("max_iters", "batch_size", "grad_accum", "eval_interval", "eval_iters", "log_interval"):
            if getattr(self, key) < 1:
                raise QuillError(f"train.{key} must be at least 1, got {getattr(self, key)}")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise QuillError(f"train.batch_tokens must be at least 1 (or null: train.batch_size rows a step), got {self.batch_tokens}")
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
        if self.muon_lr <= 0 or not 0.0 <= self.muon_momentum < 1.0:
            raise QuillError(f"need train.muon_lr > 0 and train.muon_momentum in [0, 1), got {self.muon_lr}, {self.muon_momentum}")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise QuillError(f"train.device must be auto, cpu, cuda, cuda:N or mps, got {shown_value(self.device)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise QuillError(f"train.seed must be between 0 and {MAX_SEED} (2**32 - 1), got {self.seed}")
        if self.time_budget is not None:
            parse_duration(self.time_budget, key="train.time_budget")


LORA_TARGETS = ("q", "k", "v", "o", "mlp")  # c_attn's q / k / v rows, attn.c_proj, the MLP's two linears


@dataclass
class LoraConfig:
    """Low-rank adapters (model/lora.py) on a frozen base (train.init_from): W x + (alpha/rank)·B(A x)."""

    rank: int = 0  # 0: off (full fine-tuning)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input
    targets: list[Literal["q", "k", "v", "o", "mlp"]] = field(default_factory=lambda: list(LORA_TARGETS))

    def validate(self) -> None:
        check_finite(self, "lora")
        if not 0 <= self.rank <= 4096:
            raise QuillError(f"lora.rank must be between 0 (off) and 4096, got {self.rank}")
        if self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise QuillError(f"need lora.alpha > 0 and lora.dropout in [0, 1), got {self.alpha}, {self.dropout}")
        if self.rank and (not self.targets or len(set(self.targets)) != len(self.targets)):
            raise QuillError(f"lora.targets must name each linear once, from {', '.join(LORA_TARGETS)}; got {self.targets}")


@dataclass
class SampleConfig:
    """Defaults for `quill sample`: SamplingParams' fields (no stop strings); flags override them."""

    max_new_tokens: int = 500
    temperature: float = 0.8  # 0 = greedy
    top_k: int | None = 200
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = 1337

    def validate(self) -> None:
        self.params()

    def params(self, *, stop: tuple[str, ...] = (), **flags: Any) -> SamplingParams:
        """These settings with the flags that were given (None: not given; top_k 0: no limit) and
        the stop strings, as SamplingParams; a bad value is named where it came from: --top-p for
        a flag, sample.top_p for the config."""
        given = {k: v for k, v in flags.items() if v is not None}
        values = {**asdict(self), **given}
        if given.get("top_k") == 0:
            values["top_k"] = None
        try:
            return SamplingParams(**values, stop=stop)
        except InvalidParam as e:
            from_flag = e.param in given or e.param == "stop"
            raise QuillError(e.message("--" + e.param.replace("_", "-") if from_flag else "sample." + e.param)) from None


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    # The keys the command line set ("model.n_layer", ...; load_config), not a config key and
    # not saved: train.init_from refuses the model keys it cannot apply instead of ignoring them.
    overridden: ClassVar[frozenset[str]] = frozenset()

    def validate(self) -> None:
        if self.data.tokenizer is None and self.train.init_from is None:
            self.data.tokenizer = "char"  # with train.init_from: the base run's, read by with_base_tokenizer
        self.data.validate()
        try:
            self.model.validate()
        except QuillError as e:  # e.g. model.n_embd=128 against the default n_head: not the point when fine-tuning
            if self.train.init_from is None:
                raise
            raise QuillError(
                f"train.init_from={self.train.init_from} takes its architecture from the base run, so these model "
                f"settings do not apply ({e}); drop the model.* keys that set the shape"
            ) from None
        self.train.validate()
        self.lora.validate()
        self.sample.validate()
        if self.lora.rank and not self.train.init_from:
            raise QuillError("lora.rank > 0 adapts a trained model: set train.init_from to the base run (or lora.rank=0)")
        if self.train.batch_tokens is not None and self.data.format != "chat":
            raise QuillError("train.batch_tokens batches conversations (data.format=chat); text trains train.batch_size windows")
        if self.lora.rank and self.train.optimizer != "adamw":
            raise QuillError("LoRA adapters train with AdamW: set train.optimizer=adamw (or lora.rank=0)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def with_base_tokenizer(cfg: Config) -> Config:
    """cfg with data.tokenizer, when unset, the base run's tokenizer.json (train.init_from): read
    where a config is loaded or a run opened, not while validating."""
    if cfg.data.tokenizer is None:
        cfg.data.tokenizer = base_tokenizer(cfg.train.init_from) or "char"
    return cfg


def base_tokenizer(init_from: str | None) -> str | None:
    """The tokenizer file of the run train.init_from names (its directory's tokenizer.json), or None."""
    if init_from is None:
        return None
    run = Path(os.path.expanduser(init_from))
    if not run.exists():
        raise QuillError(f"train.init_from: checkpoint not found: {init_from} (pass a run directory or a .pt file)")
    path = (run if os.path.isdir(run) else run.parent) / "tokenizer.json"
    if not os.path.isfile(path):
        raise QuillError(
            f"train.init_from={init_from} has no tokenizer.json beside its checkpoint; "
            "set data.tokenizer to the tokenizer its model was trained with"
        )
    return str(path)


def parse_duration(text: str, key: str = "duration") -> float:
    """'90s', '5m', '1.5h' or a bare number of seconds → seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m or not 0 < float(m.group(1)) < 1e9:  # 1e9 s: 31 years, and never inf
        raise QuillError(f"{key} must be a positive duration such as 90s, 5m or 1h, got {shown_value(text)}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


# ---------------------------------------------------------------------------------------------
# Dict → dataclass, with type coercion and helpful errors


def _suggest(key: str, valid: list[str], most: int = 24) -> str:
    """The closest valid key, else the valid keys (the first `most`: the message stays one short line)."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f" (did you mean {close[0]!r}?)"
    more = f" and {len(valid) - most} more" if len(valid) > most else ""
    return f" (valid keys: {', '.join(valid[:most])}{more})"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) if not isinstance(a, str) else a for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
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
        number = value if _matches(value, int) else int(value) if isinstance(value, float) and value.is_integer() else None
        if number is not None:
            if abs(number) > MAX_INT:
                raise QuillError(f"{key} must be between -2**62 and 2**62, got {shown_value(value)}")
            return number
    elif tp is float:
        number = _to_float(value)
        if number is not None:
            if not math.isfinite(number):
                raise QuillError(f"{key} must be a finite number, got {shown_value(value)}")
            return number
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    raise QuillError(f"{key} must be {_type_name(tp)}, got {shown_value(value)}")


def _to_float(value: Any) -> float | None:
    """A YAML number (or a string such as "1e-3", which YAML 1.1 reads as a string) as a float,
    inf for an int too large for one; None when `value` is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except OverflowError:  # float(10**400)
        return math.inf
    except ValueError:
        return None


def _matches(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp)
    if tp is float:
        return isinstance(value, float)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


# Keys earlier versions accepted. `false` asks for nothing, so old runs' config.yaml and
# checkpoints still load; anything else is refused with the reason.
REMOVED_KEYS = {
    "train.wandb": "Weights & Biases logging was never implemented; delete the key (train.tensorboard=true writes TensorBoard logs)",
}


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise QuillError(f"{prefix.rstrip('.') or 'the config'} must be a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if f"{prefix}{key}" in REMOVED_KEYS:
            if value is False:
                continue
            raise QuillError(f"{prefix}{key} is no longer supported: {REMOVED_KEYS[prefix + key]}")
        if key not in valid:
            raise QuillError(f"unknown config key {prefix}{_shown_key(key)}{_suggest(_cut(str(key)), valid)}")
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
            raise QuillError(f"override {shown_value(item)} must look like section.key=value, e.g. train.max_iters=200")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) != 2:
            raise QuillError(f"override key {shown_value(dotted)} must be section.key, e.g. model.n_layer")
        section, key = parts
        if section not in sections:
            raise QuillError(f"unknown config section {shown_value(section)}{_suggest(_cut(section), sections)}")
        try:
            value = parse_yaml(raw, "override") if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        out.setdefault(section, {})
        if not isinstance(out[section], dict):
            raise QuillError(f"config section {shown_value(section)} must be a mapping")
        out[section][key] = value
    return out


MAX_YAML_INT_DIGITS = 4000  # below int()'s own limit (4,300 digits); a config's integers are at most 2**62
SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")  # YAML 1.1's base 60: 1:30 is 90


class ConfigLoader(yaml.SafeLoader):
    """The one loader of every config and YAML file quill reads: SafeLoader, except that a
    document whose aliases expand it past MAX_YAML_NODES nodes is refused (a 400-byte "billion
    laughs" file would otherwise become gigabytes), `1:30` stays the text it looks like (not
    YAML 1.1's 90), `!!binary` is refused (no value of a config is bytes), and an integer too long
    to be a value is a YAML error (Python refuses int() of over 4,300 digits with a ValueError)."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _expanded_size(node, {}, set())
        return node

    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0] and isinstance(value, str) and SEXAGESIMAL.fullmatch(value):
            return "tag:yaml.org,2002:str"
        return super().resolve(kind, value, implicit)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_YAML_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value):,} digits is too long for any config value (at most 2**62)", node.start_mark
            )
        return super().construct_yaml_int(node)

    def refuse_binary(self, node: yaml.Node) -> None:
        raise yaml.constructor.ConstructorError(
            None, None, "a !!binary value (bytes): no config value is bytes; write the text or number itself", node.start_mark
        )


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:binary", ConfigLoader.refuse_binary)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes in `node` with every alias expanded (memoized: each shared node is counted once per use)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise QuillError("the YAML refers to itself through an alias (a recursive structure); remove the alias")
    open_nodes.add(id(node))
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    total = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
    open_nodes.discard(id(node))
    if total > MAX_YAML_NODES:
        raise QuillError(f"the YAML expands to more than {MAX_YAML_NODES:,} values through its aliases (&/*); write the values out")
    sizes[id(node)] = total
    return total


def parse_yaml(text: str, what: str) -> Any:
    """yaml.safe_load with aliases bounded; nesting too deep for the parser is a QuillError.
    Syntax errors stay yaml.YAMLError for the caller to word."""
    try:
        return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 — a SafeLoader subclass
    except RecursionError:
        raise QuillError(f"{what} is nested too deeply to be a config") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    hint = " (pass --config with a YAML file, e.g. configs/shakespeare_char_cpu.yaml)"
    text = read_text(path, "--config", hint=hint, limit=MAX_CONFIG_BYTES)
    try:
        values = parse_yaml(text, "the YAML")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = _cut(str(getattr(e, "problem", None) or e).replace("\n", " "))
        raise QuillError(f"{path} is not valid YAML{where}: {problem}") from None
    except QuillError as e:
        raise QuillError(f"{path}: {e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise QuillError(f"{path} must be a YAML mapping with sections data/model/train/sample (and lora: for adapters)")
    return values


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults when `path` is None), apply overrides, validate."""
    values = read_yaml(path) if path is not None else {}
    cfg = config_from_dict(apply_overrides(values, list(overrides or [])))
    cfg.overridden = frozenset(item.split("=", 1)[0].strip() for item in overrides or [])
    return with_base_tokenizer(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write YAML via a temp file + rename, so a kill never leaves a half-written config."""
    path = Path(path)
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
