"""Causal self-attention (MHA / GQA / MQA, optionally a sliding window): token i sees tokens
(i − span, i]. Every default of `Variant` is this variant's."""

from __future__ import annotations

from quillgpt.model.variants.base import Variant


class Causal(Variant):
    name = "causal"
