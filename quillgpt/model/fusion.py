"""`stored(t)`: a compiled graph writes t to memory once, where inductor would recompute it.

Inductor inlines a cheap producer into each loop that reads it. Where that loop runs many times
over the same values (an RMSNorm's rsqrt inside a matmul's loop over weights, RoPE's cos/sin
inside attention's loop over keys, the decode step's mask inside each of 30 layers) the
recomputation costs more than a store (SmolLM2's compiled attention took half the time with its
query stored once: docs/performance.md). An as_strided view is the
barrier (inductor realizes its input) of a contiguous tensor: given a view's own strides (a query
sliced from q/k/v, rows 3·C apart), inductor applied them to a buffer it had laid out afresh and
read past row 0 (tests/model/test_fusion.py). Eager, it is a free view of a contiguous t.
"""

from __future__ import annotations

import torch
from torch import Tensor


def stored(t: Tensor) -> Tensor:
    """t's values (a view of t where t is contiguous): in a compiled graph, computed once and read from memory."""
    t = t.contiguous()
    return torch.as_strided(t, t.shape, t.stride())
