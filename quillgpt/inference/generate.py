"""Token generation over the engine, with the recompute path as the plain reference, and text
on top of tokens.

`generate_tokens` yields one (B,) tensor of next tokens per step for a batch of prompts: with the
KV cache it runs the engine (quillgpt/engine.py: each prompt its own row, prefilled alone, rows
decoded together); with `use_cache=False` it recomputes every step from the tokens (the
reference the engine is tested against). Both draw row i's tokens with its own generator, seeded
seed + i, so a row's tokens are the same alone or in a batch, cached or not.

Past block_size (the semantics of model.py, the same in both paths):
* learned positions: the context is the last block_size tokens, positions 0..block_size-1
  (nanoGPT); the engine refills that row of the cache from them at each such step.
* RoPE: absolute positions, each layer attending to the last min(window, block_size) positions.
  The cache rolls; recomputing feeds the last n_layer·(span-1)+1 tokens — the receptive field of
  the last token through n_layer banded layers — which gives exactly the same logits. (Feeding
  only the last block_size tokens would not: earlier tokens of that crop would lose context the
  cache had when it stored their keys.)

Text on top of tokens: `TextStream` turns one row's token ids into printable text (an incremental
UTF-8 decoder, so a character split across BPE tokens is printed whole, and `StopStrings`, which
works on the decoded text, so a stop string may span tokens). `Generation` runs a batch of text
prompts through the engine with one TextStream per row; `stream_text` and `generate_text` are its
two everyday forms, and `quill sample` is a thin shell over it.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from quillgpt.inference.engine import Engine, cache_bytes, check_memory, check_prompt, in_dtype
from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT
from quillgpt.train.prefix_batches import check_fits
from quillgpt.inference.sampling import SamplingParams, row_generator, sample_rows
from quillgpt.data.tokenizer import Tokenizer


def row_params(params: SamplingParams, row: int) -> SamplingParams:
    """Row i of a batch samples with seed + i: distinct samples, each repeatable alone."""
    if params.seed is None or row == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + row)


def _check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise QuillError("no prompts given: pass at least one prompt")
    for i, p in enumerate(prompts):
        check_prompt(p, vocab_size, what=f"prompt {i}")


def make_params(params: SamplingParams | None = None, **settings: Any) -> SamplingParams:
    """`params`, with any of its fields given as keyword arguments replaced (validated)."""
    params = params or SamplingParams()
    return dataclasses.replace(params, **settings) if settings else params


@torch.inference_mode()
def generate_tokens(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int | None = None,
    *,
    params: SamplingParams | None = None,
    use_cache: bool = True,
    stop_ids: Iterable[int] | None = None,
    dtype: torch.dtype | None = None,
    compile: bool | None = None,
    **settings: Any,
) -> Iterator[Tensor]:
    """Yield (B,) int64 tensors: each step's next token for every prompt.

    Sampling: `params`, or SamplingParams fields as keywords (temperature=0 = greedy, seed, ...).
    With `stop_ids`, a row that has produced one of them keeps yielding that same id, and
    iteration ends once every row has stopped (the stop tokens are yielded). `dtype` (e.g.
    torch.bfloat16): run a copy of the model with its weights, and the KV cache, in that dtype;
    None = the model's own. `compile`: the engine's compiled decode (None: where it pays).
    The model must be in eval mode (dropout off).
    """
    if max_new_tokens is not None:
        settings["max_new_tokens"] = max_new_tokens
    params = make_params(params, **settings)
    if model.training:
        raise ValueError("call model.eval() before generating: dropout would make tokens random")
    _check_prompts(prompts, model.config.vocab_size)
    if params.max_new_tokens == 0:
        return
    stop = frozenset(stop_ids or ())
    steps = _engine_steps if use_cache else _recompute_steps
    yield from steps(model, prompts, params, stop, dtype, compile)


def _engine_steps(model, prompts, params, stop, dtype, compile) -> Iterator[Tensor]:
    engine = Engine(model, len(prompts), dtype=dtype, compile=compile)
    first = [engine.add(p, row_params(params, i), stop) for i, p in enumerate(prompts)]
    last = [t.token for t in first]  # a stopped row repeats its stop id
    yield torch.tensor(last, device=model.lm_head.weight.device)
    for _ in range(params.max_new_tokens - 1):
        if not engine.active_rows():
            return
        for t in engine.step():
            last[t.row] = t.token
        yield torch.tensor(last, device=model.lm_head.weight.device)


def _recompute_steps(model, prompts, params, stop, dtype, compile) -> Iterator[Tensor]:
    """The plain reference: every step a forward over each row's context, left-padded."""
    model = in_dtype(model, dtype)
    cfg, device = model.config, model.lm_head.weight.device
    attention = getattr(cfg, "attention", "causal")
    learned = cfg.pos == "learned" and attention != "infini"
    context = cfg.block_size if learned else cfg.n_layer * (model.span - 1) + 1
    if attention == "infini":  # the memory holds every earlier token: recompute from the start
        context = None
    for p in prompts:
        check_fits(cfg, len(p), params.max_new_tokens)  # prefix-LM: the prompt is never cropped
    prefix = torch.tensor([len(p) for p in prompts], device=device) if attention == "prefix" else None
    rows = [row_params(params, i) for i in range(len(prompts))]
    gens = [row_generator(p, device) for p in rows]
    ctx = [deque(p, maxlen=context) for p in prompts]  # bounded: never the whole requested length
    total = [len(p) for p in prompts]
    seen = None  # (B, V) which tokens each row contains, for the repetition penalty
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(len(prompts), cfg.vocab_size, dtype=torch.bool, device=device)
        for r, p in enumerate(prompts):
            seen[r, p] = True
    done: list[int | None] = [None] * len(prompts)  # the stop id a row ended with
    for _ in range(params.max_new_tokens):
        W = max(len(c) for c in ctx)
        idx = torch.zeros(len(ctx), W, dtype=torch.long)
        pos = torch.zeros(len(ctx), W, dtype=torch.long)
        for r, c in enumerate(ctx):  # left padding: pad tokens get negative positions
            idx[r, W - len(c) :] = torch.tensor(list(c))
            first = 0 if learned else total[r] - len(c)  # RoPE keeps absolute positions
            pos[r] = torch.arange(W) - (W - len(c)) + first
        plain = bool((pos == torch.arange(W)).all())  # 0..W-1 everywhere: sdpa's causal fast path
        if context is None:  # infini: each row alone from its first token (no padding in the memory)
            last = torch.cat([model(torch.tensor([list(c)], device=device))[0][:, -1] for c in ctx])
        else:
            last = model(idx.to(device), pos=None if plain else pos.to(device), prefix_len=prefix)[0][:, -1]
        nxt = sample_rows(last.float(), rows, gens, seen).tolist()
        for r, t in enumerate(nxt):
            t = done[r] if done[r] is not None else t
            if t in stop:
                done[r] = t
            ctx[r].append(t)
            total[r] += 1
            nxt[r] = t
        yield torch.tensor(nxt, device=device)
        if stop and all(d is not None for d in done):
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
    end-of-text token, or at the first of its stop strings (neither is included); an ended row
    leaves the engine at once. Afterwards `texts` holds each row's completion and `stats` its
    counts and timings. Sampling: `params` and/or SamplingParams fields as keywords (row i
    samples with seed + i); `use_cache=False` recomputes (the reference); `dtype`, `compile` as
    in generate_tokens.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        prompts: list[str],
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        use_cache: bool = True,
        dtype: torch.dtype | None = None,
        compile: bool | None = None,
        **settings: Any,
    ) -> None:
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        self.params = make_params(params, **settings)
        if use_cache:  # before encoding: --num-samples 10**7 must fail at once, not after minutes
            check_memory(cache_bytes(model, len(prompts)), model.lm_head.weight.device,
                         f"the KV cache for {len(prompts)} sample(s)")
        self.model, self.tokenizer = model, tokenizer
        self.prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
        _check_prompts(self.prompt_ids, model.config.vocab_size)
        self.use_cache, self.dtype, self.compile = use_cache, dtype, compile
        self.streams = [TextStream(tokenizer, self.params.stop) for _ in prompts]
        self.stats = GenerationStats(prompt_tokens=[len(p) for p in self.prompt_ids])
        self._engine: Engine | None = None

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.streams]

    @property
    def compiled(self) -> bool:
        """Whether the engine ran its decode step compiled (known once iteration has started)."""
        return self._engine is not None and self._engine.compiled

    def _token_steps(self) -> Iterator[list[int | None]]:
        """Each step's new token per row (None: the row has left the engine)."""
        eot = [] if self.tokenizer.eot_id is None else [self.tokenizer.eot_id]
        if not self.use_cache:
            for ids in generate_tokens(self.model, self.prompt_ids, params=self.params, use_cache=False,
                                       stop_ids=eot, dtype=self.dtype):
                yield ids.tolist()
            return
        if self.params.max_new_tokens == 0:
            return
        engine = self._engine = Engine(self.model, len(self.prompt_ids), dtype=self.dtype, compile=self.compile)
        yield [engine.add(p, row_params(self.params, i), eot).token for i, p in enumerate(self.prompt_ids)]
        while engine.active_rows():
            out: list[int | None] = [None] * len(self.prompt_ids)
            for t in engine.step():
                out[t.row] = t.token
            yield out

    def __iter__(self) -> Iterator[list[str]]:
        stats, streams, eot = self.stats, self.streams, self.tokenizer.eot_id
        stats.new_tokens, stats.finish = [0] * len(streams), ["length"] * len(streams)
        steps = self._token_steps()
        try:
            while not all(s.done for s in streams):
                t0 = time.perf_counter()
                ids = next(steps, None)
                stats.total_s += time.perf_counter() - t0
                if ids is None:
                    break
                if stats.steps == 0:
                    stats.prefill_ms = 1000 * stats.total_s
                stats.steps += 1
                yield [self._push(r, t, eot) for r, t in enumerate(ids)]
        finally:
            steps.close()
        last = [s.finish() for s in streams]  # rows that ran to max_new_tokens
        if any(last):
            yield last

    def _push(self, r: int, token: int | None, eot: int | None) -> str:
        """Row r's new token → its new text; a row that ends here leaves the engine."""
        stream, stats = self.streams[r], self.stats
        if stream.done or token is None:
            return ""
        stats.new_tokens[r] += 1
        if token == eot:
            stats.finish[r] = "eot"
            return stream.finish()
        piece = stream.push(token)
        if stream.stopped:
            stats.finish[r] = "stop"
            if self._engine is not None:
                self._engine.release(r)
        return piece


def stream_text(
    model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int | None = None, **kwargs: Any
) -> Iterator[str]:
    """Yield the continuation of one prompt as it is generated (keyword arguments: Generation's).

        for piece in stream_text(run.model, run.tokenizer, "ROMEO:", 100, temperature=0.8, seed=1):
            print(piece, end="", flush=True)
    """
    for pieces in Generation(model, tokenizer, [prompt], max_new_tokens, **kwargs):
        if pieces[0]:
            yield pieces[0]


def generate_text(
    model: GPT, tokenizer: Tokenizer, prompts: str | list[str], max_new_tokens: int | None = None, **kwargs: Any
) -> tuple[list[str], GenerationStats]:
    """Continuations of one or more prompts (generated together in one batch), and the stats."""
    gen = Generation(model, tokenizer, [prompts] if isinstance(prompts, str) else prompts, max_new_tokens, **kwargs)
    for _ in gen:
        pass
    return gen.texts, gen.stats
