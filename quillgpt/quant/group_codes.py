"""Per-group weight codes, the parts int8 (quant/int8.py) and int4 (quant/int4.py) share: a
row's weights viewed in groups with each group's range, codes rounded against a scale and an
offset as stored, and the choice between two forms of a group (w ≈ q·s + o), whichever rebuilds
it with less squared error.

Why the choice: a real model's weights often were llama.cpp's Q8_0, Q4_0 or Q4_1 already, and
each of those is exact in one form (symmetric, or over the group's range) and moved onto other
levels by the other.
"""

from __future__ import annotations

import torch
from torch import Tensor

Form = tuple[Tensor, Tensor, Tensor]  # codes (out, groups, group), scale and offset (out, groups)


def grouped(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """w (out, in) as float32 groups (out, in / group, group), and each group's min and max."""
    out, inp = w.shape
    wg = w.detach().float().view(out, inp // group, group)
    return wg, wg.amin(dim=2), wg.amax(dim=2)


def codes(wg: Tensor, s: Tensor, o: Tensor, low: int, high: int) -> Tensor:
    """round((w - o) / s) in [low, high], against s and o (out, groups) as stored; a group whose
    scale is 0 gets code 0 (its weights are its offset)."""
    step = torch.where(s != 0, s.float(), 1.0)[..., None]  # s may be negative (Q4_0's form)
    return torch.round((wg - o.float()[..., None]) / step).clamp_(low, high)


def better(wg: Tensor, first: Form, second: Form) -> Form:
    """Per group, `second` where it rebuilds wg with less squared error than `first`, else `first`
    (on ties, and where second's error is not finite); a non-finite error of first's counts as
    infinite, so a form fp16 cannot hold loses to one it can."""

    def error(form: Form) -> Tensor:
        q, s, o = form
        err = (q * s.float()[..., None] + o.float()[..., None] - wg).square_().sum(dim=2)
        return err.nan_to_num_(nan=torch.inf)

    use = error(second) < error(first)
    (q1, s1, o1), (q2, s2, o2) = first, second
    return torch.where(use[..., None], q2, q1), torch.where(use, s2, s1), torch.where(use, o2, o1)
