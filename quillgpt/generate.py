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

Text on top of tokens: `TextStream` turns one row's token ids into printable text (an incremental
UTF-8 decoder, so a character split across BPE tokens is printed whole, and `StopStrings`, which
works on the decoded text, so a stop string may span tokens). `Generation` runs a batch of text
prompts through `generate_tokens` with one TextStream per row; `stream_text` and
`generate_text` are its two everyday forms, and `quill sample` is a thin shell over it.
"""

from __future__ import annotations

import codecs
import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from quillgpt.config import validate_sampling
from quillgpt.errors import QuillError
from quillgpt.model import GPT
from quillgpt.tokenizer import Tokenizer


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
    dtype: torch.dtype | None = None,
) -> Iterator[Tensor]:
    """Yield (B,) int64 tensors: each step's next token for every prompt.

    temperature 0 = greedy. With `stop_ids`, a row that has produced one of them keeps yielding
    that same id, and iteration ends once every row has stopped (the stop tokens are yielded).
    `dtype` (e.g. torch.bfloat16): run the forward passes under autocast to it and keep the KV
    cache in it (half the memory); None = the model's own dtype, no autocast.
    The model must be in eval mode (dropout off).
    """
    if model.training:
        raise ValueError("call model.eval() before generating: dropout would make tokens random")
    validate_sampling(temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens)
    cfg = model.config
    _check_prompts(prompts, cfg.vocab_size)
    device, param_dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    amp = contextlib.nullcontext()
    if dtype is not None and dtype != param_dtype:
        amp = torch.autocast(device_type=device.type, dtype=dtype)
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
    cache = model.make_cache(B, dtype=dtype) if use_cache else None
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
        with amp:
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


# --- text: prompts in, streamed text out --------------------------------------------------------


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt text → ids. An empty prompt starts where documents start in training: after the
    end-of-text token (BPE), or after a newline (char; the first id if there is no newline)."""
    if text == "":
        if tokenizer.eot_id is not None:
            return [tokenizer.eot_id]
        return tokenizer.encode("\n") if not tokenizer.unknown_chars("\n") else [0]
    unknown = tokenizer.unknown_chars(text)
    if unknown:
        shown = ", ".join(repr(c) + (f" ({n}×)" if n > 1 else "") for c, n in list(unknown.items())[:8])
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise QuillError(
            f"the prompt has {sum(unknown.values())} character(s) that are not in the model's "
            f"{tokenizer.name} vocabulary: {shown}{more}; remove or replace them"
        )
    return tokenizer.encode(text)


class StopStrings:
    """Find the first stop string in text that arrives piece by piece (a stop may span pieces).

    `push` returns the text that can no longer be part of a stop, holding back the longest tail
    that could still be the start of one; at a stop it returns the text before it and then
    nothing more. `flush` releases the held tail when no more text will come.
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops = list(stops)
        if any(s == "" for s in self.stops):
            raise QuillError("a stop string must not be empty")
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


class TextStream:
    """One row's token ids → the text to print, piece by piece.

    A BPE token is a byte string and one character may span several tokens, so the bytes go
    through an incremental UTF-8 decoder, which keeps an unfinished character until its last byte
    arrives (U+FFFD only for bytes that can never form a character). The decoded text then goes
    through StopStrings. `text` is everything returned so far.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopStrings(stop)
        self._pieces: list[str] = []
        self.done = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found."""
        return self._stops.stopped

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        if self.done:
            return ""
        out = self._stops.push(self._utf8.decode(self.tokenizer.decode_bytes([token_id])))
        self.done = self._stops.stopped
        self._pieces.append(out)
        return out

    def finish(self) -> str:
        """No more tokens: end a cut character (as U+FFFD) and release held-back text."""
        if self.done:
            return ""
        out = self._stops.push(self._utf8.decode(b"", final=True))
        if not self._stops.stopped:
            out += self._stops.flush()
        self.done = True
        self._pieces.append(out)
        return out


@dataclass
class GenerationStats:
    """Counts and timings of one Generation; times cover the model and sampling, not printing."""

    prompt_tokens: list[int]  # per row
    new_tokens: list[int] = field(default_factory=list)  # per row, up to its stop / end-of-text
    finish: list[str] = field(default_factory=list)  # per row: "length", "stop" (string) or "eot"
    steps: int = 0
    prefill_ms: float = 0.0  # time to the first new token: the forward pass over the prompt
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}

    def line(self) -> str:
        n, rows = self.prompt_tokens, len(self.prompt_tokens)
        if len(set(n)) == 1:
            prompt = f"prompt {n[0]} tokens" + (f" x {rows} samples" if rows > 1 else "")
        else:
            prompt = f"prompts {'/'.join(map(str, n))} tokens"
        return (
            f"{prompt}, {sum(self.new_tokens)} new tokens, {self.tokens_per_s:.1f} tokens/s, "
            f"prefill {self.prefill_ms:.1f} ms"
        )


class Generation:
    """Continue a batch of text prompts, step by step, as text.

    Iterate (once) for each step's new text of every row: a list with one string per row, ""
    while a row holds text back or has ended. A row ends at max_new_tokens, at the tokenizer's
    end-of-text token, or at the first of `stop` (neither is included). Afterwards `texts` holds
    each row's completion and `stats` its counts and timings. Prompts of different lengths are
    batched with left padding and give the same tokens as alone. `seed` makes sampling
    repeatable (greedy needs none); `dtype` as in generate_tokens.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        prompts: list[str],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: Iterable[str] = (),
        use_cache: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        validate_sampling(temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens)
        self.model, self.tokenizer = model, tokenizer
        self.prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
        _check_prompts(self.prompt_ids, model.config.vocab_size)
        self.max_new_tokens = max_new_tokens
        self.sampling = dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, use_cache=use_cache, dtype=dtype,
        )
        self.seed = seed
        self.streams = [TextStream(tokenizer, stop) for _ in prompts]
        self.stats = GenerationStats(prompt_tokens=[len(p) for p in self.prompt_ids])

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.streams]

    def __iter__(self) -> Iterator[list[str]]:
        device = self.model.lm_head.weight.device
        generator = None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)
        eot = self.tokenizer.eot_id
        steps = generate_tokens(
            self.model, self.prompt_ids, self.max_new_tokens, generator=generator,
            stop_ids=None if eot is None else [eot], **self.sampling,
        )
        stats, streams = self.stats, self.streams
        stats.new_tokens, stats.finish = [0] * len(streams), ["length"] * len(streams)
        try:
            while not all(s.done for s in streams):
                t0 = time.perf_counter()
                ids = next(steps, None)
                ids = None if ids is None else ids.tolist()  # .tolist() waits for the device
                stats.total_s += time.perf_counter() - t0
                if ids is None:
                    break
                if stats.steps == 0:
                    stats.prefill_ms = 1000 * stats.total_s
                stats.steps += 1
                pieces = []
                for r, (stream, t) in enumerate(zip(streams, ids)):
                    if stream.done:
                        pieces.append("")
                        continue
                    stats.new_tokens[r] += 1
                    if t == eot:
                        stats.finish[r] = "eot"
                        pieces.append(stream.finish())
                    else:
                        pieces.append(stream.push(t))
                        if stream.stopped:
                            stats.finish[r] = "stop"
                yield pieces
        finally:
            steps.close()
        last = [s.finish() for s in streams]  # rows that ran to max_new_tokens
        if any(last):
            yield last


def stream_text(model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 200, **kwargs: Any) -> Iterator[str]:
    """Yield the continuation of one prompt as it is generated (keyword arguments: Generation's).

        for piece in stream_text(run.model, run.tokenizer, "ROMEO:", 100, temperature=0.8, seed=1):
            print(piece, end="", flush=True)
    """
    for pieces in Generation(model, tokenizer, [prompt], max_new_tokens, **kwargs):
        if pieces[0]:
            yield pieces[0]


def generate_text(
    model: GPT, tokenizer: Tokenizer, prompts: str | list[str], max_new_tokens: int = 200, **kwargs: Any
) -> tuple[list[str], GenerationStats]:
    """Continuations of one or more prompts (generated together in one batch), and the stats."""
    gen = Generation(model, tokenizer, [prompts] if isinstance(prompts, str) else prompts, max_new_tokens, **kwargs)
    for _ in gen:
        pass
    return gen.texts, gen.stats
