"""The compiled decode step's per-model functions and the guards they keep (inference/compiled_step.py)."""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from support import PROMPTS, random_model
from torch import nn

from quillgpt.inference import compiled_step as cs
from quillgpt.inference.engine import Engine
from quillgpt.inference.generate import generate_tokens
from quillgpt.quant import quantize
from quillgpt.quant.plan import KernelPlan
from quillgpt.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=30)


def test_the_structure_key_names_what_the_dropped_guards_pinned():
    model = random_model("rope-window-gqa")
    key = cs.structure_key(model)
    assert cs.structure_key(model) == key == cs.structure_key(copy.deepcopy(model))  # values are not structure
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert cs.structure_key(model) == key
    assert cs.structure_key(model.to(torch.bfloat16)) != key  # dtypes
    quantized = quantize(random_model("rope-window-gqa"), "int8-channel", kernel="dequant/model")
    assert cs.structure_key(quantized) != key  # module types
    before = cs.structure_key(quantized)
    for m in quantized.modules():
        if hasattr(m, "plan"):
            m.plan = KernelPlan((1,), ("int8pack_mm/bf16",))  # a kernel plan is control flow
    assert cs.structure_key(quantized) != before
    other = random_model("rope-window-gqa")
    other.config = replace(other.config, logit_softcap=3.0)
    assert cs.structure_key(other) != key  # the config


def test_the_filter_keeps_input_cache_and_global_guards_only():
    entry = lambda kind, value=None, name="": SimpleNamespace(guard_type=kind, value=value, name=name)
    entries = [
        entry("TENSOR_MATCH", torch.zeros(2), "cache.k[0]"),  # an input or the cache
        entry("TENSOR_MATCH", nn.Parameter(torch.zeros(2))),  # a weight of the model
        entry("TENSOR_MATCH", torch.zeros(2, dtype=torch.int8), "model._modules['lm_head']._buffers['weight']"),
        entry("TYPE_MATCH"),
        entry("CONSTANT_MATCH"),
        entry("SHAPE_ENV"),
        entry("GLOBAL_STATE"),
        entry("GRAD_MODE"),
        entry("NOT_PRESENT_IN_GENERIC_DICT"),
    ]
    assert cs.model_guards_dropped(entries) == [True, False, False, False, False, True, True, True, False]


@pytest.mark.skipif(not os.environ.get("QUILL_TEST_COMPILE"), reason="torch.compile takes ~1 min on CPU: set QUILL_TEST_COMPILE=1")
def test_a_model_keeps_its_step_and_a_changed_model_compiles_anew():
    model = random_model("rope-window-gqa")
    params = replace(GREEDY, max_new_tokens=40)
    first = Engine(model, 2, compile=True)._compiled
    assert Engine(model, 3, compile=True)._compiled is first  # another engine, another batch: the same function
    assert Engine(random_model("rope-window-gqa"), 2, compile=True)._compiled is not first  # another model
    compiled = torch.stack(list(generate_tokens(model, PROMPTS, params=params, compile=True)), 1)
    assert torch.equal(compiled, torch.stack(list(generate_tokens(model, PROMPTS, params=params)), 1))
    quantize(model, "int8", kernel="dequant/model")  # in place: a new structure, a new compile
    assert Engine(model, 2, compile=True)._compiled is not first
    compiled = torch.stack(list(generate_tokens(model, PROMPTS, params=params, compile=True)), 1)
    assert torch.equal(compiled, torch.stack(list(generate_tokens(model, PROMPTS, params=params)), 1))


def test_shared_capacity_doubles_from_a_floor_and_always_holds_the_tokens():
    assert [cs.shared_capacity(t) for t in (1, 2, 1024, 1025, 3000, 4096, 4097)] == [1024, 1024, 1024, 2048, 4096, 4096, 8192]
    assert all(cs.shared_capacity(t) >= t for t in range(1, 20_000, 37))
