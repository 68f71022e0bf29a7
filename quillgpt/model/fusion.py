"""`stored(t)`: a compiled graph writes t to memory once, where inductor would recompute it.

Inductor inlines a cheap producer into each loop that reads it. Where that loop runs many times
over the same values (an RMSNorm's rsqrt inside a matmul's loop over weights, RoPE's cos/sin
inside attention's loop over keys, the decode step's mask inside each of 30 layers) the
recomputation costs more than a store: measured on SmolLM2's compiled decode step, attention's
kernel went from 74 to 34 us a layer when its query was stored once. An as_strided view is the
barrier (inductor realizes its input); eager, it is a free view.
"""

from __future__ import annotations

import torch
from torch import Tensor


def stored(t: Tensor) -> Tensor:
    """t itself (a view of it): in a compiled graph, computed once and read from memory."""
    return torch.as_strided(t, t.shape, t.stride())
