"""The static cache on its own: a ring written at explicit positions, rows independent, and the
plan and decode paths writing the same slots (the model-level cached = recompute tests are in
tests/inference/test_engine.py and tests/model/test_gpt.py)."""

import pytest
import torch

from quillgpt.model.kv_cache import EMPTY_POS, Cache, KVCache
from quillgpt.model.variants.infini import InfiniCache


def cache(rows=2, capacity=4, span=4) -> KVCache:
    return KVCache(n_layer=1, rows=rows, kv_heads=1, head_dim=2, capacity=capacity, span=span, device="cpu", dtype=torch.float32)


def kv(T: int, start: float) -> torch.Tensor:
    return (start + torch.arange(T, dtype=torch.float32)).view(1, 1, T, 1).expand(1, 1, T, 2).contiguous()


def test_a_prefill_then_decode_keeps_the_last_capacity_positions_in_a_ring():
    c = cache(rows=1)
    plan = c.plan(torch.arange(6)[None])  # 6 tokens into 4 slots: the last 4 are kept
    assert plan.first == 2 and plan.cached == 0
    k, _ = c.update(0, kv(6, 0.0), kv(6, 0.0), plan)
    assert k.shape[2] == 6  # the forward attends over its own 6 keys
    assert c.pos[0].tolist() == [4, 5, 2, 3] and c.k[0][0, 0, :, 0].tolist() == [4.0, 5.0, 2.0, 3.0]
    at = c.decode_slots(torch.tensor([6]))
    keys, _ = c.write_one(0, kv(1, 6.0), kv(1, 6.0), at)
    assert c.pos[0].tolist() == [4, 5, 6, 3] and keys[0, 0, :, 0].tolist() == [4.0, 5.0, 6.0, 3.0]


def test_rows_are_independent_and_reset_forgets_one():
    c = cache(rows=2)
    c.update(0, kv(2, 0.0), kv(2, 0.0), c.plan(torch.tensor([[0, 1]]), rows=torch.tensor([0])))
    c.update(0, kv(3, 10.0), kv(3, 10.0), c.plan(torch.tensor([[0, 1, 2]]), rows=torch.tensor([1])))
    assert c.pos[0, :2].tolist() == [0, 1] and c.pos[1, :3].tolist() == [0, 1, 2]
    c.reset(0)
    assert (c.pos[0] == EMPTY_POS).all() and c.pos[1, :3].tolist() == [0, 1, 2]
    later = c.plan(torch.tensor([[3]]), rows=torch.tensor([1]))
    assert later.cached and later.key_pos[0].tolist()[-1] == 3  # [cached | new]


def test_later_tokens_attend_over_the_slots_in_use_not_the_whole_capacity():
    # a prompt after a cached prefix (or a long prompt's next piece) in a cache sized for a long
    # context: its keys are the rows' slots up to the last one used, then its own
    c = cache(rows=2, capacity=64, span=64)
    c.update(0, kv(3, 0.0), kv(3, 0.0), c.plan(torch.arange(3)[None], rows=torch.tensor([0])))
    c.update(0, kv(5, 10.0), kv(5, 10.0), c.plan(torch.arange(5)[None], rows=torch.tensor([1])))
    plan = c.plan(torch.tensor([[5, 6]]), rows=torch.tensor([0, 1]))
    assert plan.cached == 5 and plan.key_pos.shape == (2, 7)
    assert plan.key_pos[0].tolist() == [0, 1, 2, EMPTY_POS, EMPTY_POS, 5, 6]  # row 0's unused slots stay masked
    new = kv(2, 20.0).expand(2, -1, -1, -1)  # both rows' two new tokens
    k, _ = c.update(0, new, new, plan)
    assert k.shape == (2, 1, 7, 2) and k[1, 0, :, 0].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 20.0, 21.0]


def test_a_cache_smaller_than_the_span_refuses_to_drop_visible_keys():
    c = cache(rows=1, capacity=4, span=8)
    c.plan(torch.arange(4)[None])
    with pytest.raises(ValueError, match="is full"):
        c.plan(torch.tensor([[4]]))


def test_both_caches_are_caches():
    infini = InfiniCache(1, 1, 1, 2, 4, "cpu", torch.float32)
    for made in (cache(), infini):
        assert isinstance(made.nbytes, int) and callable(made.reset) and callable(made.plan)
    assert all(hasattr(Cache, name) for name in ("nbytes", "reset", "plan"))
