"""Helpers shared by several test files (not collected: no test_ prefix)."""

import quillgpt.train as train_mod

# Tiny model variants every attention proof runs over: vocab V, block BLOCK.
BLOCK, V = 16, 37
VARIANTS = {
    "mha-learned": {},
    "gqa": {"n_kv_head": 2},
    "mqa": {"n_kv_head": 1},
    "window": {"window": 5},
    "rope": {"pos": "rope"},
    "rope-window-gqa": {"pos": "rope", "window": 5, "n_kv_head": 2},
    "rmsnorm-swiglu": {"norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False, "tie_embeddings": False},
}


def poison_loss_at(monkeypatch, call: int) -> None:
    """Make the `call`-th training forward return a NaN loss (as a diverging run would)."""
    original, calls = train_mod.GPT.forward, {"n": 0}

    def forward(self, idx, targets=None, **kw):
        logits, loss = original(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == call:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(train_mod.GPT, "forward", forward)


def assert_same_state(a, b, where: str = "") -> None:
    """Nested dicts/lists/tuples of tensors and plain values are equal, bit for bit; the message
    names the first differing path, e.g. optimizer['state'][3]['exp_avg']."""
    import torch

    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
