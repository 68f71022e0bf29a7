"""The attention variants, registered by name (model.attention): each owns its mask rule, its
cache, whether it decodes in the static KV cache, what a prompt may be and what `quill
attention` can show (variants/base.py). Adding one: a module here and a line below."""

from __future__ import annotations

from quillgpt.config import ModelConfig
from quillgpt.model.variants.base import Variant
from quillgpt.model.variants.causal import Causal
from quillgpt.model.variants.infini import Infini
from quillgpt.model.variants.prefix import Prefix

VARIANTS: dict[str, Variant] = {v.name: v for v in (Causal(), Prefix(), Infini())}


def variant_of(cfg: ModelConfig) -> Variant:
    """The variant a model config names (config validation has checked the name)."""
    return VARIANTS[cfg.attention]
