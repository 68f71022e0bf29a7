"""Token generation: an iterator over new tokens, with a KV cache or by recomputing.

`generate_tokens` yields one (B,) tensor of next tokens per step; decoding text, stop strings and
streaming belong to the caller. Each logit transform is a small pure function so it can be
tested on hand-computed cases. Prompts of different lengths are left-padded into one batch
(pad tokens get negative positions and are never attended to), so a row's tokens are the same
alone or in a batch.

Past block_size (the semantics of model.py, identical with and without the cache):
* learned positions: the context is the last block_size tokens, positions 0..block_size-1
  (nanoGPT). The cache is refilled from that window at each such step, so these steps cost
  as much as recomputing.
* RoPE: absolute positions, each layer attending to the last min(window, block_size) positions.
  The cache rolls; recomputing feeds the last n_layer·(span-1)+1 tokens — the receptive field of
  the last token through n_layer banded layers — which gives exactly the same logits. (Feeding
  only the last block_size tokens would not: earlier tokens of that crop would lose context the
  cache had when it stored their keys.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from quillgpt.config import validate_sampling
from quillgpt.errors import QuillError
from quillgpt.model import GPT


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL/HF penalty on tokens already in the row (seen: (B, V) bool): a positive logit is
    divided by `penalty`, a negative one multiplied, so penalty > 1 always makes them less likely."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """Sharpen (< 1) or flatten (> 1) the distribution; temperature 0 is handled as argmax."""
    return logits / temperature


def apply_top_k(logits: Tensor, k: int | None) -> Tensor:
    """Keep the k largest logits per row (and any tied with the k-th); the rest become -inf."""
    if k is None or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus: keep the most likely tokens until their probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Drop tokens less likely than min_p × the most likely token's probability."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, V) logits → (B,) tokens: argmax at temperature 0, else a draw after the filters."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = apply_temperature(logits, temperature)
    logits = apply_min_p(apply_top_p(apply_top_k(logits, top_k), top_p), min_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise QuillError("no prompts given: pass at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise QuillError(f"prompt {i} is empty: it needs at least one token to continue from")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise QuillError(
                f"prompt {i} has token id {bad[0]} outside the model's vocabulary (0..{vocab_size - 1}); "
                "was it encoded with the model's own tokenizer?"
            )


@torch.inference_mode()
def generate_tokens(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_ids: Iterable[int] | None = None,
) -> Iterator[Tensor]:
    """Yield (B,) int64 tensors: each step's next token for every prompt.

    temperature 0 = greedy. With `stop_ids`, a row that has produced one of them keeps yielding
    that same id, and iteration ends once every row has stopped (the stop tokens are yielded).
    The model must be in eval mode (dropout off).
    """
    if model.training:
        raise ValueError("call model.eval() before generating: dropout would make tokens random")
    validate_sampling(temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens)
    cfg = model.config
    _check_prompts(prompts, cfg.vocab_size)
    device = model.lm_head.weight.device
    B, lengths = len(prompts), [len(p) for p in prompts]
    W = max(lengths)
    seq = torch.zeros(B, W + max_new_tokens, dtype=torch.long, device=device)  # left-padded tokens
    for r, p in enumerate(prompts):
        seq[r, W - len(p) : W] = torch.tensor(p, dtype=torch.long)
    n_pad = torch.tensor([W - n for n in lengths], device=device)  # (B,)
    max_pad = W - min(lengths)

    seen = None  # (B, V) which tokens each row contains, for the repetition penalty
    if repetition_penalty != 1.0:
        seen = torch.zeros(B, cfg.vocab_size, dtype=torch.bool, device=device)
        for r, p in enumerate(prompts):
            seen[r, p] = True
    stop = torch.tensor(sorted(set(stop_ids)), device=device) if stop_ids else None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stopped_with = torch.zeros(B, dtype=torch.long, device=device)

    learned = cfg.pos == "learned"
    # tokens that decide the next logits: the crop window (learned) or the receptive field (RoPE)
    context = cfg.block_size if learned else cfg.n_layer * (model.span - 1) + 1
    cache = model.make_cache(B) if use_cache else None
    w = W  # filled columns of seq
    for step in range(max_new_tokens):
        c = max(0, w - context)  # first column of the context
        if cache is not None and step > 0 and not (learned and c > 0):
            a = w - 1  # decode: only the newest token, the cache holds the rest
        else:
            a = c  # recompute, first prefill, or learned-position refill after a crop
            if cache is not None:
                cache.reset()
        cols = torch.arange(a, w, device=device)
        if learned:  # positions restart at the crop; pad tokens are negative
            pos = (cols - c)[None, :] - (n_pad - c).clamp(min=0)[:, None]
            default_pos = max_pad <= c
        else:  # RoPE: absolute positions within each row
            pos = cols[None, :] - n_pad[:, None]
            default_pos = max_pad == 0 and c == 0
        if cache is None and default_pos:
            pos = None  # plain 0..T-1: lets the model take the is_causal fast path
        logits, _ = model(seq[:, a:w], pos=pos, cache=cache)
        logits = logits[:, -1, :].float()  # (B, V)
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, repetition_penalty)
        nxt = sample_next(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=generator
        )
        if stop is not None:
            nxt = torch.where(done, stopped_with, nxt)
            newly = torch.isin(nxt, stop) & ~done
            stopped_with = torch.where(newly, nxt, stopped_with)
            done |= newly
        if seen is not None:
            seen[torch.arange(B, device=device), nxt] = True
        seq[:, w] = nxt
        w += 1
        yield nxt
        if stop is not None and bool(done.all()):
            return
