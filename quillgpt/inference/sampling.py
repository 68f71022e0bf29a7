"""The next-token draw: logit filters and sampling, for generate, the engine and the server.

The settings themselves (SamplingParams) are quillgpt/sampling_params.py, torch-free so the
config can build them. The logit filters are small pure functions, tested on hand-computed cases.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quillgpt.sampling_params import MAX_SEED, SamplingParams

# --- logit filters: (B, V) float logits in, same shape out -------------------------------------
# Each filter drops tokens but never a row's most likely one, whatever the setting rounds to in
# the logits' dtype (a top_p of 1e-46 is 0 in float32): the nucleus of any p > 0 holds the top
# token, so a draw always has a token to draw.


def _drop(logits: Tensor, drop: Tensor) -> Tensor:
    """logits with the `drop` (B, V) bool positions at -inf, except each row's most likely token."""
    top = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    return logits.masked_fill(drop.scatter(-1, top, False), float("-inf"))


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL/HF penalty on tokens already in the row (seen: (B, V) bool): a positive logit is
    divided by `penalty`, a negative one multiplied, so penalty > 1 always makes them less likely.
    Clamped to finite values: a tiny penalty must not turn a logit into inf (softmax → NaN)."""
    if penalty == 1.0:
        return logits
    big = torch.finfo(logits.dtype).max
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-big, big)
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """Sharpen (< 1) or flatten (> 1) the distribution; temperature 0 is handled as argmax."""
    return logits / temperature


def apply_top_k(logits: Tensor, k: int | None) -> Tensor:
    """Keep the k largest logits per row (and any tied with the k-th); the rest become -inf."""
    if k is None or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return _drop(logits, logits < kth)


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus: keep the most likely tokens until their probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    drop_sorted = mass_before >= p
    return _drop(logits, drop_sorted.scatter(-1, order, drop_sorted))  # back to vocabulary order


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Drop tokens less likely than min_p × the most likely token's probability."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    return _drop(logits, probs < min_p * probs.max(dim=-1, keepdim=True).values)


def sample_next(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """(B, V) logits (repetition penalty already applied) → (B,) tokens on the logits' device:
    argmax at temperature 0, else a draw with `generator` after temperature, top-k, top-p, min-p."""
    if params.greedy:
        return logits.argmax(dim=-1)
    # shift so the best logit is 0 before dividing, and never divide by a temperature that rounds
    # to 0 or inf in the logits' dtype: a tiny one then gives 0 and -inf, a huge one 0 and small
    # values (or -inf where the shift overflowed), never inf - inf, 0/0 or -inf/inf
    finfo = torch.finfo(logits.dtype)
    temperature = min(max(params.temperature, finfo.tiny), finfo.max)
    logits = apply_temperature(logits - logits.max(dim=-1, keepdim=True).values, temperature)
    logits = apply_min_p(apply_top_p(apply_top_k(logits, params.top_k), params.top_p), params.min_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def row_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The row's own random stream: seeded from params.seed, or from torch's global generator
    when unset (so torch.manual_seed still makes a run repeatable); None for greedy rows."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int(torch.randint(0, MAX_SEED, ()))
    return torch.Generator(device=device).manual_seed(seed)


def sample_rows(
    logits: Tensor,
    params: list[SamplingParams | None],
    generators: list[torch.Generator | None],
    seen: Tensor | None = None,
    argmax: Tensor | None = None,
) -> Tensor:
    """(n, V) float logits → (n,) tokens, row i drawn with params[i] and generators[i] (None: an
    idle row, argmax). Greedy rows share one argmax (`argmax` where the caller has it); each
    sampling row draws from its own stream, so its tokens do not depend on the other rows. seen
    (n, V) bool: the rows' tokens so far, for the repetition penalty; updated in place with the new tokens."""
    nxt = logits.argmax(dim=-1) if argmax is None else argmax.clone()
    for i, p in enumerate(params):
        if p is None or (p.greedy and p.repetition_penalty == 1.0):
            continue
        lg = logits[i : i + 1]
        if p.repetition_penalty != 1.0:
            lg = apply_repetition_penalty(lg, seen[i : i + 1], p.repetition_penalty)
        nxt[i : i + 1] = sample_next(lg, p, generators[i])
    if seen is not None:
        rows = [i for i, p in enumerate(params) if p is not None and p.repetition_penalty != 1.0]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            seen[idx, nxt[idx]] = True
    return nxt
