"""LoRA: the wrapped linear is W x + b + (alpha/rank)·B(A x) on its slots' rows, fresh adapters give
the base's logits exactly, gradients reach only the adapters, and merged weights give the logits
of base + adapters."""

import pytest
import torch
from support import VARIANTS, V, random_model

from quillgpt.config import LoraConfig
from quillgpt.model.gpt import GPT
from quillgpt.model.lora import LoRALinear, adapter_shapes, adapter_state, add_lora, is_adapter, lora_slots, merge_adapters

ALL = LoraConfig(rank=4, alpha=8.0)
X = torch.tensor([[(5 * i + 3) % V for i in range(12)], [(7 * i + 1) % V for i in range(12)]])


def random_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_a_lora_linear_is_w_x_plus_scaled_b_a_x_on_its_rows_by_hand():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 10)
    lora = LoRALinear(base, {"q": (0, 4), "v": (7, 10)}, rank=2, alpha=3.0, dropout=0.0)
    random_adapters(torch.nn.ModuleDict({"h": lora}))
    x = torch.randn(3, 5, 6)
    want = x @ base.weight.T + base.bias  # rows 4..6 (the k rows here): the base's alone
    want[..., 0:4] += (3.0 / 2) * (x @ lora.lora_A["q"].T) @ lora.lora_B["q"].T
    want[..., 7:10] += (3.0 / 2) * (x @ lora.lora_A["v"].T) @ lora.lora_B["v"].T
    torch.testing.assert_close(lora(x), want, atol=1e-6, rtol=1e-6)
    assert lora.weight is base.weight and lora.bias is base.bias  # the same tensors, the same names


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fresh_adapters_give_the_base_logits_exactly(variant):
    model = random_model(variant)
    want, _ = model(X, all_logits=True)
    add_lora(model, ALL)
    got, _ = model(X, all_logits=True)
    assert torch.equal(got, want)  # B = 0: not close, equal


def test_gradients_reach_only_the_adapters():
    model = random_model("rmsnorm-swiglu").train()
    add_lora(model, ALL)
    random_adapters(model)
    _, loss = model(X, X.roll(-1, 1))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.requires_grad == is_adapter(name), name
        assert (p.grad is not None and p.grad.abs().sum() > 0) == is_adapter(name), name
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapter_shapes(model.config, ALL))


@pytest.mark.parametrize("variant", ["mha-learned", "gqa", "rmsnorm-swiglu"])
@pytest.mark.parametrize("targets", [["q"], ["k", "v"], ["q", "k", "v", "o", "mlp"]], ids=["q", "kv", "all"])
def test_merged_weights_give_the_logits_of_base_plus_adapters(variant, targets):
    model = random_model(variant)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoraConfig(rank=3, alpha=5.0, targets=targets)
    add_lora(model, lora)
    random_adapters(model)
    want, _ = model(X, all_logits=True)
    merged = GPT(model.config).eval()
    merged.load_state_dict(merge_adapters(base, adapter_state(model.state_dict()), model.config, lora))
    got, _ = merged(X, all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_adapter_on_q_changes_only_the_q_rows_of_the_fused_projection():
    model = random_model("gqa")  # 4 query heads, 2 k/v heads of 8: c_attn rows [q 32 | k 16 | v 16]
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoraConfig(rank=2, targets=["q"])
    assert lora_slots(model.config, lora.targets) == {"attn.c_attn": {"q": (0, 32)}}
    add_lora(model, lora)
    random_adapters(model)
    merged = merge_adapters({k: v.clone() for k, v in base.items()}, adapter_state(model.state_dict()), model.config, lora)
    for name, w in merged.items():
        changed = (w != base[name]).any(dim=-1) if w.dim() == 2 else (w != base[name])
        if name.endswith("attn.c_attn.weight"):
            assert changed[:32].all() and not changed[32:].any(), name
        else:
            assert not changed.any(), name
