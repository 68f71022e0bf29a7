"""Model families as data: one record per family that import-hf, export-hf (and any other format)
read, so adding a Llama-shaped family is one record and a test, not a branch in every converter.

A record says what a family is called in each format (config.json's model_type and architecture,
llama.cpp's general.architecture and whether llama.cpp's converter permuted its q/k rows:
interop/gguf_family.py derives its GGUF table from the records), transformers' defaults for the
config.json keys it may leave out, and which of the decoder's features it has: where q/k/v biases
come from, QK-norm, how its config states a sliding window. The codec (gpt2.py or llama.py) maps
the weights and config keys the way every family of its shape shares; `export_family` picks the
record a run is written as.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from torch import Tensor

from quillgpt.config import ModelConfig
from quillgpt.data.tokenizer import Tokenizer


class Codec(Protocol):
    """How every family of one shape maps config.json and weights to quill's and back."""

    def model_config(self, hf: dict[str, Any], source: str) -> ModelConfig: ...

    def quill_state(self, weights: Mapping[str, Tensor], cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Tensor]: ...

    def incompatibilities(self, cfg: ModelConfig) -> list[str]: ...

    def hf_files(
        self, state: Mapping[str, Tensor], cfg: ModelConfig, family: Family, tok: Tokenizer
    ) -> tuple[dict[str, Tensor], dict[str, Any]]: ...


@dataclass(frozen=True)
class Family:
    """One decoder family: its names, its config.json defaults, and its features."""

    model_type: str  # config.json's model_type
    architecture: str  # transformers' class, config.json's architectures[0]
    name: str  # how messages call it
    codec: Literal["gpt2", "llama"]  # the weight and config mapping (interop/gpt2.py, interop/llama.py)
    gguf_arch: str  # llama.cpp's general.architecture for this family
    max_positions: int  # transformers' default max_position_embeddings
    window: int | None = None  # transformers' default sliding_window
    # where q/k/v biases come from: always there (Qwen2), config.json's attention_bias, or never
    qkv_bias: Literal["always", "attention_bias", "never"] = "attention_bias"
    o_bias: bool = True  # attention_bias=true puts a bias on o_proj too (quill has none: only zeros import)
    qk_norm: bool = False  # RMSNorm on each head's q and k (Qwen3)
    qwen_windows: bool = False  # windows stated by use_sliding_window / max_window_layers / layer_types
    exports_window: bool = False  # the family a run with a sliding window exports as
    mlp_bias_key: bool = False  # its config.json states mlp_bias (written false on export)
    needs_qwen_tokenizer: bool = False  # exported only with a tokenizer transformers' Qwen2Tokenizer keeps as is
    tiktoken: str | None = None  # its files' tokenizer is this tiktoken encoding; None: the directory's tokenizer.json
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # llama.cpp's gguf_arch rotates (2i, 2i + 1) pairs: its converter permuted q/k rows (llama: yes; qwen: NEOX RoPE, no)
    gguf_permuted_qk: bool = False
    # Gemma's decoder: GeGLU, sandwich norms, √n_embd-scaled embedding, query_pre_attn_scalar, windows
    # on the layer_types that say so (model.global_every), RMSNorm weights w stored for (1 + w)
    gemma: bool = False

    def defaults(self) -> dict[str, Any]:
        """transformers' values for the config.json keys this family may leave out."""
        return {
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "rope_theta": self.rope_theta,
            "sliding_window": self.window,
        }

    def fits(self, cfg: ModelConfig, qwen_tokenizer: bool) -> bool:
        """Whether a run of `cfg` is written exactly as this family (its features, nothing more)."""
        return (
            self.codec == "llama"
            and self.qk_norm == cfg.qk_norm
            and self.gemma == gemma_layers(cfg)
            and (self.gemma or self.exports_window == (cfg.window is not None))
            and not (cfg.qkv_bias and self.qkv_bias == "never")
            and (self.qkv_bias != "always" or (cfg.qkv_bias and qwen_tokenizer))
        )


def gemma_layers(cfg: ModelConfig) -> bool:
    """Whether a run has Gemma's decoder layers (GeGLU, sandwich norms, scaled embedding): only the
    Gemma record writes them, and it writes nothing else."""
    return cfg.mlp == "geglu" and cfg.sandwich_norm and cfg.embed_scale


GPT2 = Family("gpt2", "GPT2LMHeadModel", "GPT-2", "gpt2", "gpt2", 1024, qkv_bias="never", o_bias=False, tiktoken="gpt2")
LLAMA = Family("llama", "LlamaForCausalLM", "Llama", "llama", "llama", 2048, mlp_bias_key=True, gguf_permuted_qk=True)
QWEN2 = Family(
    "qwen2",
    "Qwen2ForCausalLM",
    "Qwen2",
    "llama",
    "qwen2",
    32768,
    qkv_bias="always",
    o_bias=False,
    qwen_windows=True,
    needs_qwen_tokenizer=True,
)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "Qwen3", "llama", "qwen3", 32768, qk_norm=True, qwen_windows=True)
MISTRAL = Family(
    "mistral",
    "MistralForCausalLM",
    "Mistral",
    "llama",
    "llama",
    131072,
    window=4096,
    qkv_bias="never",
    o_bias=False,
    exports_window=True,
    gguf_permuted_qk=True,
)

GEMMA3 = Family(
    "gemma3_text",
    "Gemma3ForCausalLM",
    "Gemma 3",
    "llama",
    "gemma3",
    131072,
    window=4096,
    qk_norm=True,
    rope_theta=1_000_000.0,
    tie_embeddings=True,
    gemma=True,
)

FAMILIES = (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA3)
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
LLAMA_FAMILY = tuple(f for f in FAMILIES if f.codec == "llama")
EXPORT_ORDER = (GEMMA3, QWEN3, QWEN2, MISTRAL, LLAMA)  # export-hf writes the first that fits: the most specific first


def family_of_config(hf: dict[str, Any]) -> Family:
    """The family of a config.json: its model_type (GPT-2 when it has none, as old GPT-2 files)."""
    return BY_MODEL_TYPE.get(hf.get("model_type", "gpt2"), GPT2)


def export_family(cfg: ModelConfig, qwen_tokenizer: bool = False) -> Family | None:
    """The Llama-family record a run of `cfg` is written as, or None when none has its features."""
    return next((f for f in EXPORT_ORDER if f.fits(cfg, qwen_tokenizer)), None)
