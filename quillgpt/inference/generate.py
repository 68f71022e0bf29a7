"""Generation: token ids or text out of a model, over the engine (or the recompute reference).

`generate_tokens` yields one (B,) tensor of next tokens per step for a batch of prompts: with the
KV cache it runs the engine (inference/engine.py: each prompt its own row, prefilled alone, rows
decoded together); with `use_cache=False` the Recompute engine reruns every step from the tokens
(the reference the engine is tested against). Both draw row i's tokens with its own generator,
seeded seed + i, so a row's tokens are the same alone or in a batch, cached or not.

`Generation` continues a batch of text prompts as text through the same engines and the one
driver, text.TextBatch; `stream_text` and `generate_text` are its two everyday forms. `open_sample`
is `quill sample`: a run loaded and its Generation set up, as a `Sample` that prints itself as
text, as its stats line and as JSON (--json).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor

from quillgpt import quant
from quillgpt.config import SampleConfig
from quillgpt.cpu_share import FIRST_LOOK_S, CpuShare, holding, threads_note
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.inference.driver import Join, Piece, TextBatch, TextStream, encode_prompt
from quillgpt.inference.engine import MEMORY_FIX, Engine, Finish, Prompt, Rows, check_prompt
from quillgpt.inference.native_decoder import step_note
from quillgpt.inference.recompute import Recompute
from quillgpt.model.gpt import GPT
from quillgpt.runs import LoadedRun, LoadOptions, load_run
from quillgpt.sampling_params import SamplingParams, offset_seed


def row_params(params: SamplingParams, row: int) -> SamplingParams:
    """Row i of a batch samples with seed + i: distinct samples, each repeatable alone."""
    if params.seed is None or row == 0:
        return params
    return dataclasses.replace(params, seed=offset_seed(params.seed, row))


def make_params(params: SamplingParams | None = None, **settings: Any) -> SamplingParams:
    """`params`, with any of its fields given as keyword arguments replaced (validated)."""
    params = params or SamplingParams()
    return dataclasses.replace(params, **settings) if settings else params


def make_engine(
    model: GPT,
    rows: int,
    use_cache: bool = True,
    dtype: torch.dtype | None = None,
    compile: bool | None = None,
    unit: str = "row",
    tokens: int | None = None,
    memory_fix: str = MEMORY_FIX,
    native: bool = True,
) -> Rows:
    """The static-cache Engine (native=False: its decode step op by op), or with use_cache=False
    the Recompute reference, for rows of at most `tokens` tokens (None: any number; the cache
    holds the attention span)."""
    if use_cache:
        return Engine(model, rows, dtype=dtype, compile=bool(compile), unit=unit, capacity=tokens, memory_fix=memory_fix, native=native)
    return Recompute(model, rows, dtype=dtype, unit=unit, capacity=tokens, memory_fix=memory_fix)


def _check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise QuillError("no prompts given: pass at least one prompt")
    for i, p in enumerate(prompts):
        check_prompt(p, vocab_size, what=f"prompt {i}")


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
    native: bool = True,
    **settings: Any,
) -> Iterator[Tensor]:
    """Yield (B,) int64 tensors: each step's next token for every prompt.

    Sampling: `params`, or SamplingParams fields as keywords (temperature=0 = greedy, seed, ...).
    With `stop_ids`, a row that has produced one of them keeps yielding that same id, and
    iteration ends once every row has stopped (the stop tokens are yielded). `dtype` (e.g.
    torch.bfloat16): run a copy of the model with its weights, and the KV cache, in that dtype;
    None = the model's own. `compile`: the engine's compiled decode step. native=False: its decode
    step op by op, never the native decoder (the plain computation, for comparisons).
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
    device = model.device
    tokens = max(map(len, prompts)) + params.max_new_tokens
    batch = TextBatch(make_engine(model, len(prompts), use_cache, dtype, compile, tokens=tokens, native=native))
    firsts = batch.join_all([Join(i, Prompt(p, row_params(params, i), stop_ids or ())) for i, p in enumerate(prompts)])
    if failed := next((piece.error for piece in firsts if piece.error is not None), None):
        raise failed
    last = [piece.token for piece in firsts]
    yield torch.tensor(last, device=device)
    while len(batch):  # a stopped row repeats its stop id
        for piece in batch.step():
            if piece.error is not None:
                raise piece.error
            last[piece.key] = piece.token
        yield torch.tensor(last, device=device)


@dataclass
class GenerationStats:
    """Counts and timings of one Generation; times cover the model and sampling, not printing."""

    prompt_tokens: list[int]  # per row
    new_tokens: list[int] = field(default_factory=list)  # per row, up to its stop / end-of-text
    finish: list[Finish] = field(default_factory=list)  # per row: "length", "stop" (string) or "eot"
    steps: int = 0
    prefill_ms: float = 0.0  # time to the first new token: the forward pass over the prompt
    total_s: float = 0.0
    compile_s: float = 0.0  # of total_s: compiling the decode step (--compile), not counted in tokens/s
    past_context: str = ""  # what happens to a prompt longer than the model's context ("" when none is)
    threads: str = ""  # the CPU threads it ran on and, when fewer than all, why (cpu_share.threads_note)

    @property
    def tokens_per_s(self) -> float:
        generating = self.total_s - self.compile_s
        return sum(self.new_tokens) / generating if generating > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each row's first over the time after the first: the decode speed alone, apart
        from the prompt's (a long prompt's prefill no longer reads as a slow decode)."""
        after = sum(max(0, n - 1) for n in self.new_tokens)
        decoding = self.total_s - self.compile_s - self.prefill_ms / 1000
        return after / decoding if decoding > 0 and after else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return sum(self.prompt_tokens) / (self.prefill_ms / 1000) if self.prefill_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        speeds = {"tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}
        return {**asdict(self), **speeds, "prompt_tokens_per_s": self.prompt_tokens_per_s}

    def line(self) -> str:
        n, rows = self.prompt_tokens, len(self.prompt_tokens)
        if len(set(n)) == 1:
            prompt = f"prompt {n[0]} tokens" + (f" x {rows} samples" if rows > 1 else "")
        else:
            prompt = f"prompts {'/'.join(map(str, n))} tokens"
        compiling = f", compile {self.compile_s:.1f} s (not in tokens/s)" if self.compile_s else ""
        new = f"{sum(self.new_tokens)} new tokens, {self.decode_tokens_per_s:.1f} tokens/s after the first"
        prefill = f"prefill {self.prefill_ms:.1f} ms ({self.prompt_tokens_per_s:,.0f} prompt tokens/s)"
        return f"{prompt}, {new}, {prefill}{compiling}{self.past_context}"


def past_context(model: GPT, prompts: list[list[int]]) -> str:
    """The stats line's words for a prompt longer than the model's context: what the model reads of
    it (learned positions: its last block_size tokens; RoPE: every position its last span keys)."""
    longest, context = max(map(len, prompts), default=0), model.config.block_size
    if longest <= context:
        return ""
    if model.variant.crops(model.config):
        what = f"only its last {context:,} tokens are read (cropped)"
    else:
        what = f"each position attends to at most the {model.span:,} before it (a sliding window)"
    return f"; the prompt ({longest:,} tokens) is past the model's {context:,}-token context: {what}"


class Generation:
    """Continue a batch of text prompts, step by step, as text.

    Iterate (once) for each step's new text of every row: a list with one string per row, ""
    while a row holds text back or has ended. A row ends at max_new_tokens, at the tokenizer's
    end-of-text token, or at the first of its stop strings (neither is included); an ended row
    leaves the engine at once. Afterwards `texts` holds each row's completion and `stats` its
    counts and timings. `samples` rows continue each prompt (row i samples with seed + i).
    Sampling: `params` and/or SamplingParams fields as keywords; `use_cache=False` recomputes
    (the reference); `dtype`, `compile` as in generate_tokens; `threads`: a CpuShare, so torch's
    threads give way to other processes between steps (None: they stay as they are).
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        prompts: list[str],
        max_new_tokens: int | None = None,
        *,
        samples: int = 1,
        params: SamplingParams | None = None,
        use_cache: bool = True,
        dtype: torch.dtype | None = None,
        compile: bool | None = None,
        threads: CpuShare | None = None,
        **settings: Any,
    ) -> None:
        self.threads = threads
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        self.params = make_params(params, **settings)
        if samples < 1:
            raise QuillError(f"--num-samples must be at least 1, got {samples}")
        if not prompts:
            raise QuillError("no prompts given: pass at least one prompt")
        self.tokenizer = tokenizer
        encoded = [encode_prompt(tokenizer, p) for p in prompts]
        _check_prompts(encoded, model.config.vocab_size)
        # the engine before anything is made per row: its memory check refuses --num-samples 10**10
        tokens = max(map(len, encoded)) + self.params.max_new_tokens
        fix = "generate fewer samples at once (--num-samples) or use a smaller dtype (--dtype bfloat16)"
        self.engine = make_engine(model, len(prompts) * samples, use_cache, dtype, compile, unit="sample", tokens=tokens, memory_fix=fix)
        self.prompt_ids = [ids for ids in encoded for _ in range(samples)]
        self.streams = [TextStream(tokenizer, self.params.stop) for _ in self.prompt_ids]
        self.stats = GenerationStats(prompt_tokens=[len(p) for p in self.prompt_ids], past_context=past_context(model, encoded))

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.streams]

    @property
    def compiled(self) -> bool:
        """Whether the engine runs its decode step compiled."""
        return self.engine.compiled

    def __iter__(self) -> Iterator[list[str]]:
        n, stats = len(self.prompt_ids), self.stats
        stats.new_tokens, stats.finish = [0] * n, ["length"] * n
        if self.params.max_new_tokens == 0:
            return
        batch = TextBatch(self.engine, self.tokenizer, self.threads)
        eot = self.tokenizer.stop_ids  # end of text (and an imported model's end of turn)
        with holding(self.threads):
            try:
                t0 = time.perf_counter()
                joins = [Join(r, Prompt(ids, row_params(self.params, r), eot), self.streams[r]) for r, ids in enumerate(self.prompt_ids)]
                pieces = batch.join_all(joins)  # prompts of one length prefill together
                while True:
                    stats.total_s += time.perf_counter() - t0
                    stats.compile_s = self.engine.compile_s
                    if stats.steps == 0:
                        stats.prefill_ms = 1000 * stats.total_s  # time to the first new token
                    stats.steps += 1
                    yield self._record(pieces)
                    if not len(batch):
                        return
                    t0 = time.perf_counter()
                    pieces = batch.step()
            finally:
                for r in range(n):
                    batch.leave(r)
                stats.threads = threads_note(self.threads, self.engine.model.device)

    def _record(self, pieces: list[Piece]) -> list[str]:
        """One step's pieces → each row's new text; counts and finish reasons into stats."""
        out = [""] * len(self.prompt_ids)
        for p in pieces:
            if p.error is not None:  # one line for the user; the cause is chained (QUILL_DEBUG=1 shows it)
                raise QuillError(f"sample {p.key + 1} failed: {p.error}") from p.error
            out[p.key] = p.text
            self.stats.new_tokens[p.key] = p.tokens
            if p.finish is not None:
                self.stats.finish[p.key] = p.finish
        return out


def stream_text(model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int | None = None, **kwargs: Any) -> Iterator[str]:
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


@dataclass
class Sample:
    """`quill sample`: a prompt's samples being generated, with the run and settings they come from.
    Iterate `generation` (or `write` it) once; then `stats_line` and `to_json` describe it."""

    run: LoadedRun
    generation: Generation
    options: LoadOptions
    prompt: str
    use_cache: bool
    load_s: float  # loading, quantizing (and any kernel probe): apart from the stats line's tokens/s

    def write(self, out: TextIO, echo: bool = True, stream: bool = True) -> None:
        """Sample 1 as it is generated (or at its end with stream=False), then samples 2..N in full,
        each under a `--- sample i ---` header when there are several, each ending in a newline;
        echo: each after its prompt."""
        gen, shown = self.generation, self.prompt if echo else ""
        head = (lambda i: f"--- sample {i} ---\n") if len(gen.prompt_ids) > 1 else (lambda i: "")
        out.write(head(1) + shown)
        out.flush()
        for pieces in gen:
            if stream and pieces[0]:
                out.write(pieces[0])
                out.flush()
        if not stream:
            out.write(gen.texts[0])
        for i, sample in enumerate(gen.texts, 1):
            if i > 1:
                out.write(head(i) + shown + sample)
            if not (shown + sample).endswith("\n"):
                out.write("\n")

    def stats_line(self) -> str:
        """The line `quill sample` ends with: speeds, then how the step ran and what loading took."""
        gen = self.generation
        how = "compiled kv cache" if gen.compiled else "kv cache" if self.use_cache else "no kv cache"
        note = quant.weights_note(gen.engine.model, compiled=gen.compiled)
        note += step_note(gen.engine.decoder) if isinstance(gen.engine, Engine) else ""
        threads = f", {gen.stats.threads}" if gen.stats.threads else ""
        where = f"{self.run.model.device.type}{threads}, {self.options.dtype_name}{note}"
        return f"{gen.stats.line()} ({how}, {where}; load {self.load_s:.1f} s, not in tokens/s)"

    def to_json(self) -> str:
        """--json: generate everything, then one line: the prompt, the continuations, the settings
        (the sampling settings used, how the model ran) and the stats."""
        gen, params = self.generation, self.generation.params
        for _ in gen:
            pass
        plan = quant.plan_of(gen.engine.model)
        settings = {f.name: getattr(params, f.name) for f in dataclasses.fields(SampleConfig)}
        settings.update(stop=list(params.stop), kv_cache=self.use_cache, compiled=gen.compiled, device=str(self.run.model.device))
        settings.update(dtype=self.options.dtype_name, quantize=self.options.quantize_name)
        settings["int8_kernel"] = None if plan is None else plan.pick(plan.rows)
        record = {"checkpoint": str(self.run.path), "step": self.run.step, "prompt": self.prompt, "samples": gen.texts}
        return json.dumps({**record, "settings": settings, "stats": gen.stats.to_dict()}, ensure_ascii=False) + "\n"


def open_sample(
    ckpt: str | Path,
    prompt: str,
    options: LoadOptions,
    *,
    samples: int = 1,
    flags: dict[str, Any] | None = None,
    stop: tuple[str, ...] = (),
    use_cache: bool = True,
) -> Sample:
    """Load a run (its int8 kernels measured at `samples` rows) and set up the generation of
    `samples` continuations of `prompt`: `flags` (SampleConfig's fields, None: not given) over the
    run's sample: config. The flags and stop strings are checked before the checkpoint loads, and
    the engine checks the KV cache fits before anything is made per sample. On a CPU its threads
    give way to other processes (cpu_share.py; the load is its first look's window)."""
    flags = flags or {}
    if samples < 1:
        raise QuillError(f"--num-samples must be at least 1, got {samples}")
    SampleConfig().params(**flags, stop=stop)  # a bad flag fails before the checkpoint loads
    started = time.perf_counter()
    threads = CpuShare.for_run(torch.device(options.device), first_s=FIRST_LOOK_S)
    run = load_run(ckpt, dataclasses.replace(options, rows=samples))
    params = run.config.sample.params(**flags, stop=stop)
    settings = dict(params=params, use_cache=use_cache, compile=options.compile, threads=threads)
    gen = Generation(run.model, run.tokenizer, [prompt], samples=samples, **settings)
    return Sample(run, gen, options, prompt, use_cache, time.perf_counter() - started)
