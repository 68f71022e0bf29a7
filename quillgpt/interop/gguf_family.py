"""The GGUF side of each family: llama.cpp's architecture names (derived from the family records
in interop/families.py, so each family is defined once), the metadata keys that carry each
config.json key, the tensor types quill dequantizes, and llama.cpp's pre-tokenizer names. Import
reads a file's metadata into a config.json-like dict through this table (so the Hugging Face
converters in interop/llama.py and gpt2.py decide, and refuse, as they do for a directory); export
writes it back the same way. Tensor names are the `gguf` package's own map (gguf.TensorNameMap),
between Hugging Face's names and llama.cpp's.
"""

from __future__ import annotations

from dataclasses import dataclass

from quillgpt.interop import families
from quillgpt.interop.families import Family

LLAMA_KEYS = {  # GGUF key (after "<arch>.") → config.json key
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
GPT2_KEYS = {
    "context_length": "n_positions",
    "block_count": "n_layer",
    "feed_forward_length": "n_inner",
    "embedding_length": "n_embd",
    "attention.head_count": "n_head",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "vocab_size": "vocab_size",
}


KEYS = {"llama": LLAMA_KEYS, "gpt2": GPT2_KEYS}  # by the family's codec
# an architecture's keys beyond its codec's: llama.cpp's gemma3 reads its window, and where a file states
# them the layer pattern (else 6), the windowed layers' RoPE base (else 10,000) and a final soft cap; its
# score scale it computes (gemma3_score_scalar), as transformers' Gemma3TextConfig defaults them
ARCH_KEYS = {
    "gemma3": {
        "attention.sliding_window": "sliding_window",
        "attention.sliding_window_pattern": "sliding_window_pattern",
        "rope.freq_base_swa": "rope_local_base_freq",
        "final_logit_softcapping": "final_logit_softcapping",
    }
}
GEMMA3_27B_LAYERS = 62  # llama.cpp's gemma3 takes a model of this many layers for the 27B, whose score scale differs


def gemma3_score_scalar(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp's gemma3 scales scores with (1/√ of it; it reads none
    from the file): head_dim, or n_embd / n_head for a model of the 27B's 62 layers."""
    return n_embd // n_head if n_layer == GEMMA3_27B_LAYERS else head_dim


@dataclass(frozen=True)
class GGUFFamily:
    """A family record (interop/families.Family) as llama.cpp names it: its architecture, the
    config.json model_type it reads as, its metadata keys, and whether q/k rows were permuted."""

    family: Family

    @property
    def arch(self) -> str:
        return self.family.gguf_arch

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def keys(self) -> dict[str, str]:
        return {**KEYS[self.family.codec], **ARCH_KEYS.get(self.arch, {})}

    @property
    def permuted_qk(self) -> bool:
        return self.family.gguf_permuted_qk


def _by_arch() -> dict[str, GGUFFamily]:
    """One entry per llama.cpp architecture: the first record that names it (Mistral is written
    as llama.cpp's "llama", which reads back as Llama: a GGUF states no sliding window)."""
    table: dict[str, GGUFFamily] = {}
    for f in families.FAMILIES:
        table.setdefault(f.gguf_arch, GGUFFamily(f))
    return table


FAMILIES = _by_arch()

# ggml tensor types quill dequantizes (with gguf.quants, ggml's own reference code); others are refused by name
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
WRITE_TYPES = ("f32", "f16", "bf16", "q8_0")

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) → the split a `tokenizers` pipeline makes:
# ("bytelevel",) is GPT-2's own regex; ("digits", "bytelevel") splits every digit off first
# (llama.cpp's smollm); a regex string is a Split before a regex-free ByteLevel. transformers knows
# more of them (integrations.gguf's GGUF_PRE_TOKENIZER_SPLITS), tried after this table.
GPT2_REGEX = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # tiktoken's gpt2
GPT4_REGEX = (  # tiktoken's cl100k_base = quill's GPT4_SPLIT_PATTERN = llama.cpp's llama-bpe (Llama 3)
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt-2": ("bytelevel",),
    "smollm": ("digits", "bytelevel"),
}
# what export writes for a split it meets: the llama.cpp name that splits text the same way
PRE_NAMES: dict[tuple[str, ...], str] = {
    ("bytelevel",): "gpt-2",
    (GPT2_REGEX,): "gpt-2",
    ("digits", "bytelevel"): "smollm",
    (GPT4_REGEX,): "llama-bpe",
}
