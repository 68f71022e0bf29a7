"""The inference engine: a static KV cache, `prefill` and `decode_step` as separate steps, and
independent rows that join and leave while the others keep decoding (the gpt-fast design) —
and `Recompute`, the plain reference with the same interface, which reruns the model over each
row's tokens at every step.

Both hold up to `max_rows` rows. `add` puts a prompt into a free row and samples its first
token (`add_all` several: the static-cache engine prefills those of one length together, a
long prompt in pieces of PREFILL_CHUNK tokens, so its activations are one piece's);
`step` advances every active row by one token, sampled with the row's own SamplingParams and
random generator, so a row's tokens are the ones it gets alone, whoever shares the batch. A
row finishes ("length": max_new_tokens reached; "eot": one of its stop ids was produced, and is
included) and is released; its slot goes to the next `add`. A failure is the failing row's
alone: an `add` that fails (a forward that raises, logits that are not finite) releases its row
and raises `RowFailed`; a row whose logits are not finite at a `step` ends with finish "error",
and a shared decode step that raises ends every row in it that way; the engine stays usable.

The static cache holds `max_rows` rows of (kv_heads, capacity, head_dim) per layer, allocated
once; `step` runs one fixed-shape decode over rows 0..w-1, idle ones among them, each writing one
token at its own position: eagerly w is the last busy row + 1 (`add` takes the lowest free row),
so one request on a 16-row server costs a one-row step; compiled, w is max_rows, or after
`warm()` the narrowest of the power-of-two widths it compiled. Past block_size (model/gpt.py's
semantics, the same in both engines):
* RoPE: absolute positions, the cache is a ring of the last span keys: decoding goes on as is.
  A prompt longer than the receptive field n_layer·(span-1)+1 is cropped to it (same logits).
* learned positions: the context is the last block_size tokens at positions 0..block_size-1, so
  once a row is longer than block_size each of its steps refills its row of the cache from its
  last block_size tokens (a prefill; exact crop semantics, as costly as recomputing).
A variant without the static cache (Infini-attention) keeps a cache per row and steps rows one
by one. The decode step is the engine's `Decoder` (inference/native_decoder.py), built once with
the engine: the model's blocks as one native call where they run it (`native=False`: op by op),
over a KV cache of `cache_dtype` (default: float16 where the step runs natively, else the model's
dtype). `compile=True` runs the decode step through torch.compile (eager is the default: it
measured no slower on CPU, and stays the tested reference).

With `prompt_cache=` bytes (quill serve's default; off elsewhere) the engine keeps the KV of recent
sequences across rows (inference/prompt_cache.py): each prompt once prefilled, and a row's prompt
and generated tokens when it is released (not when it failed). A new row whose prompt starts with
a cached sequence (ids compared exactly) gets that prefix's KV copied into its row of the static
cache and prefills only the rest, so its tokens are those it gets without the cache; rows added
together read each other's (a row waits for the prefill of one sharing a longer prefix: `_ready`).
Only KV whose positions start at 0 and are still in the row is kept: not past a window's ring, a
learned-position refill or a cropped prompt; a prefix-LM and a variant without the static cache
have none (`prompt_cache_note` says why). `prefilled` counts the tokens prefills ran.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor

from quillgpt.device import available_bytes
from quillgpt.errors import QuillError
from quillgpt.inference import native_decoder
from quillgpt.inference.compiled_step import compiled_step
from quillgpt.inference.native_decoder import Decoder
from quillgpt.inference.prompt_cache import ID_BYTES, PromptCache, as_ids, common_prefix, default_budget
from quillgpt.inference.sampling import row_generator, sample_rows
from quillgpt.model.gpt import GPT
from quillgpt.model.kv_cache import EMPTY_POS, Cache
from quillgpt.sampling_params import SamplingParams

if TYPE_CHECKING:
    from quillgpt.inference.constraint import Constraint

# max_new_tokens reached; a stop string or a complete grammar; a stop token (end of text / turn); the row failed (RowFailed)
Finish = Literal["length", "stop", "eot", "error"]
FINISH_REASONS: tuple[Finish, ...] = get_args(Finish)
PREFILL_CHUNK = 512  # prompt tokens per prefill forward: memory O(chunk), not O(prompt); llama.cpp's micro-batch, rows for the GEMM
NOT_FINITE = (
    "the model's next-token logits are not finite (NaN or inf): the weights are damaged or the "
    "activations overflowed their dtype (float16 does easily); try --dtype bfloat16 or float32"
)
# the shared prefix a row of a burst waits for another row to store (prompt_cache): a chat template's
# opening tokens are cheaper to prefill again than a forward to wait for
SHARED_MIN = 8


class RowFailed(Exception):
    """A row could not go on (its forward raised, or its logits were not finite); the row was
    released. Not a user mistake: the message says what failed, __cause__ holds the error."""

    @classmethod
    def of(cls, what: str, e: Exception) -> RowFailed:
        error = cls(f"{what} failed ({type(e).__name__}: {str(e)[:300]})")
        error.__cause__ = e
        return error


@dataclass
class RowToken:
    """One new token of one row. finish: None while the row goes on; "length" (max_new_tokens
    reached) or "eot" (one of the row's stop ids was produced; that token is included); "error"
    (the row failed: `error` says why, `token` is -1)."""

    row: int
    token: int
    finish: Finish | None = None
    error: RowFailed | None = None
    logprob: TokenLogprob | None = None  # with add(logprobs=N): the token's log-probability and the top N
    cached: int = 0  # a row's first token: how many of its prompt's tokens came from the prompt cache


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (its raw next-token distribution:
    before temperature, filters and penalties) and the `top` most likely (id, logprob), best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Prompt:
    """A row for add_all: its prompt ids, sampling params, stop ids, with logprobs = N each
    token's logprob and the top N, and a constraint (inference/constraint.py): the tokens it may
    draw, masked before each draw; the row ends ("stop") once the constraint is done."""

    ids: list[int]
    params: SamplingParams
    stop_ids: Iterable[int] = ()
    logprobs: int | None = None
    constraint: Constraint | None = None


def token_logprobs(logits: Tensor, tokens: Tensor, n: int) -> list[TokenLogprob]:
    """(R, V) logits and the (R,) tokens drawn from them → each token's logprob and the top n."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
    values, ids = logp.topk(n, dim=-1) if n > 0 else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


@torch.inference_mode()
def prompt_logprobs(model: GPT, ids: list[int], n: int) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    """Each prompt token with its logprob given the tokens before it (the first has none) and the
    top n: one forward over the prompt (at most block_size tokens)."""
    idx = torch.tensor([ids], dtype=torch.long, device=model.device)
    logits, _ = model(idx, all_logits=True)  # (1, T, V)
    found = token_logprobs(logits[0, :-1], idx[0, 1:], n) if len(ids) > 1 else []
    return [(ids[0], None, None)] + [(t, f.logprob, f.top) for t, f in zip(ids[1:], found)]


@dataclass
class _Row:
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    tokens: deque[int]  # the tokens that can still matter: the crop window / receptive field (None: all)
    length: int  # tokens in the row: prompt + generated
    new: int = 0  # generated so far
    refill: bool = False  # learned positions past block_size: every step re-prefills
    logprobs: int | None = None  # report each token's logprob and the top N (None: not asked)
    cache: Cache | None = field(default=None, repr=False)  # a row's own cache (variants without the static cache)
    constraint: Constraint | None = None  # the tokens it may draw (None: any, and no mask work)
    ids: list[int] | None = None  # prompt + generated, while the row's KV may go to the prompt cache
    cached: int = 0  # prompt tokens whose KV came from the prompt cache
    reuse: Tensor | None = field(default=None, repr=False)  # that KV, until the prefill has loaded it


def check_prompt(ids: list[int], vocab_size: int, what: str = "the prompt") -> None:
    """A prompt needs at least one token, each inside the vocabulary."""
    if len(ids) == 0:
        raise QuillError(f"{what} is empty: it needs at least one token to continue from")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise QuillError(
            f"{what} has token id {bad[0]} outside the model's vocabulary (0..{vocab_size - 1}); "
            "was it encoded with the model's own tokenizer?"
        )


def check_room(model: GPT, prompt_len: int, max_new_tokens: int, name: str = "max_new_tokens", flag: str = "--max-new-tokens") -> None:
    """Refuse a prompt the variant cannot continue by max_new_tokens (a prefix-LM never crops its
    prompt), naming the setting as the caller knows it (`name`, and `flag` to change: a command
    line flag, or an HTTP request's field)."""
    room = model.variant.room(model.config, prompt_len)
    if room is None or max_new_tokens <= room[0]:
        return
    most, why = room
    fix = f"lower {flag} to {most}" if most > 0 else "shorten the prompt"
    raise QuillError(
        f"{why}: the prompt ({prompt_len} tokens) + {name} ({max_new_tokens}) exceeds block_size ({model.config.block_size}); {fix}"
    )


def in_dtype(model: GPT, dtype: torch.dtype | None) -> GPT:
    """The model with its weights in `dtype` (a converted copy; the model itself if it already is).
    Converted once, not autocast per step: autocast re-casts every weight at every step, which
    made bf16 decoding slower than fp32; bf16 weights halve the bytes a step reads."""
    if dtype is None or dtype == model.dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def cache_bytes(model: GPT, rows: int, capacity: int | None = None) -> int:
    """Bytes of a static KV cache of `rows` rows of `capacity` tokens (default: the attention
    span) for this model (keys + values + positions)."""
    cfg = model.config
    per_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_size * native_decoder.cache_dtype(model).itemsize + 8
    return rows * (model.span if capacity is None else capacity) * per_token


def cache_capacity(model: GPT, tokens: int) -> int:
    """The cache a row of at most `tokens` tokens needs: those, or the attention span if smaller
    (a ring of span slots holds any length). An imported model's span is its whole context (Llama
    3.2: 131,072 positions), far more than a reply needs."""
    return max(1, min(model.span, tokens))


MEMORY_FIX = "make fewer rows at once or use a smaller dtype"  # an engine's callers word it for their own settings


def memory_shortfall(model: GPT, rows: int, unit: str = "row", capacity: int | None = None) -> str | None:
    """What is wrong when a batch's KV cache (for Recompute: the same keys and values, made every
    step) is larger than the memory the device has free; None when it fits."""
    device, nbytes = model.device, cache_bytes(model, rows, capacity)
    free = available_bytes(device)
    if free is None or nbytes <= free:
        return None
    return f"the KV cache for {rows} {unit}(s) needs {nbytes / 2**30:.1f} GiB but {device.type} has {free / 2**30:.1f} GiB free"


class Rows:
    """What both engines share: rows with their settings, random streams and finish rule.
    Not thread-safe (one owner)."""

    compiled = False
    compile_s = 0.0  # seconds the compiled decode step's first call took (compiling it)

    def __init__(
        self, model: GPT, max_rows: int, dtype: torch.dtype | None, unit: str, capacity: int | None = None, memory_fix: str = MEMORY_FIX
    ) -> None:
        if model.training:
            raise ValueError("call model.eval() before generating: dropout would make tokens random")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.model = model = in_dtype(model, dtype)
        self.max_rows, self.device, self.dtype = max_rows, model.device, model.dtype
        self.capacity = model.span if capacity is None else cache_capacity(model, capacity)  # tokens a row may hold
        shortfall = memory_shortfall(model, max_rows, unit, self.capacity)
        if shortfall is not None:
            raise QuillError(f"{shortfall}: {memory_fix}")
        self.variant, self.context = model.variant, model.context()
        self.crops = model.variant.crops(model.config)  # learned positions: past block_size the context is cropped
        self._rows: list[_Row | None] = [None] * max_rows
        self._seen: Tensor | None = None  # (rows, V) tokens each row contains, for repetition penalties

    def free_rows(self) -> int:
        return sum(r is None for r in self._rows)

    def active_rows(self) -> list[int]:
        return [i for i, r in enumerate(self._rows) if r is not None]

    def release(self, row: int) -> None:
        """Free a row (finished, stop string found at text level, client gone); idempotent."""
        self._rows[row] = None

    def add(self, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = (), logprobs: int | None = None) -> RowToken:
        """Put `prompt_ids` into a free row; return its first new token. The row gets its own
        position, length, params and generator (seeded from params.seed); with `logprobs` = N each
        of its tokens carries its logprob and the top N (TokenLogprob). A row that fails at once
        (its prefill raised, its logits were not finite) is released and raises RowFailed."""
        first = self.add_all([Prompt(prompt_ids, params, stop_ids, logprobs)])[0]
        if first.error is not None:
            raise first.error
        return first

    @torch.inference_mode()
    def add_all(self, prompts: list[Prompt]) -> list[RowToken]:
        """add() for several prompts at once, into the lowest free rows in order: their first tokens.
        The static-cache engine prefills prompts of one length together in one forward (after
        those whose prefix their prompt cache will hold: Engine._ready); each row still draws with
        its own params and generator. Every prompt is checked before a row is
        claimed (a bad one raises and none is added); a batched prefill that raises is run again
        row by row, and a row whose own prefill raised or whose logits were not finite comes back
        with finish "error", released, while the others go on."""
        for p in prompts:
            self.check(p)
        if len(prompts) > self.free_rows():
            raise ValueError(f"no free row: {len(prompts)} prompts and {self.free_rows()} of {self.max_rows} rows free; release rows first")
        claimed = [self._claim(p) for p in prompts]
        firsts: dict[int, RowToken] = {}
        try:  # from here on the rows are claimed: whatever raises, every one of them is released
            waiting = list(range(len(claimed)))
            while waiting:  # an engine may hold rows back until others' KV is in its prompt cache
                now = self._ready(claimed, waiting)
                waiting = [i for i in waiting if i not in now]
                self._prefill_now(claimed, now, firsts)
        except BaseException:
            for r, _, _ in claimed:
                self.release(r)
            raise
        return [firsts[r] for r, _, _ in claimed]

    def _prefill_now(self, claimed: list[tuple[int, _Row, list[int]]], now: list[int], firsts: dict[int, RowToken]) -> None:
        """Prefill the claimed rows `now` (indices into claimed), each past its cached prefix, group
        by group, into `firsts`: a group's prefill that raises runs again row by row."""
        rest = {i: claimed[i][2][claimed[i][1].cached :] for i in now}
        groups = [[now[j] for j in g] for g in self._prefill_groups([(claimed[i][1], rest[i]) for i in now])]
        while groups:
            group = groups.pop(0)
            rs = [claimed[i][0] for i in group]
            try:
                logits = self._first_logits(rs, [claimed[i][1] for i in group], [rest[i] for i in group])  # (n, V)
            except QuillError:
                raise
            except Exception as e:
                if len(group) > 1:  # which row failed? each alone, so the others go on
                    groups[:0] = [[i] for i in group]
                    continue
                firsts[rs[0]] = self._fail(rs[0], RowFailed.of("the prefill", e))
                continue
            firsts.update((r, self._first_token(r, logits[j])) for j, r in enumerate(rs))

    def check(self, p: Prompt) -> None:
        """Raise what add_all would raise for this prompt (QuillError, ValueError, TypeError), claiming nothing."""
        if not isinstance(p.params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(p.params).__name__}")
        if p.params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1 to add a row")
        check_prompt(p.ids, self.model.config.vocab_size)
        check_room(self.model, len(p.ids), p.params.max_new_tokens)
        if self.capacity < self.model.span and len(p.ids) + p.params.max_new_tokens > self.capacity:
            raise QuillError(
                f"the prompt ({len(p.ids)} tokens) + max_new_tokens ({p.params.max_new_tokens}) exceeds "
                f"the {self.capacity:,} tokens this engine's KV cache holds per row"
            )

    def _claim(self, p: Prompt) -> tuple[int, _Row, list[int]]:
        """The lowest free row, now p's: (row index, its state, the prompt tokens that decide its logits)."""
        r = self._rows.index(None)
        ids = list(p.ids[-self.context :] if self.context else p.ids)
        row = _Row(p.params, row_generator(p.params, self.device), frozenset(p.stop_ids), deque(ids, maxlen=self._keep()), len(p.ids))
        row.logprobs, row.constraint = p.logprobs, p.constraint
        self._rows[r] = row
        if p.params.repetition_penalty != 1.0:
            seen = self._seen_rows()
            seen[r].zero_()
            seen[r, torch.tensor(p.ids, device=self.device)] = True
        return r, row, ids

    def _first_token(self, r: int, logits: Tensor) -> RowToken:
        """Row r's first token drawn from its prefill's (V,) logits; the row starts decoding."""
        row = self._rows[r]
        try:
            _, toks, bad = self._draw(logits[None], [r], first=r)
        except Exception as e:
            return self._fail(r, RowFailed.of("the prefill", e))
        if bad[0] is not None:
            return self._fail(r, bad[0])
        tok = toks[0]
        lp = None if row.logprobs is None else token_logprobs(logits[None], torch.tensor([tok], device=self.device), row.logprobs)[0]
        self._started(r, row, tok)
        rt = self._advance(r, tok)
        rt.logprob, rt.cached = lp, row.cached
        return rt

    @torch.inference_mode()
    def step(self) -> list[RowToken]:
        """One new token for every active row (finished and failed rows are released)."""
        active = self.active_rows()
        if not active:
            return []
        width = self._width(active)  # the step runs rows 0..width-1, every active row among them
        try:
            logits = self._step_logits(active, width)  # (width, V); idle rows' logits unused
            nxt, ids, bad = self._draw(logits, [r if self._rows[r] is not None else None for r in range(width)])
        except Exception as e:  # the shared step failed: it fails the rows in it, the engine goes on
            error = RowFailed.of("the decode step", e)
            return [self._fail(r, error) for r in active]
        lps = self._step_logprobs(logits, nxt, active)
        self._after_step(nxt)
        out = [self._fail(r, bad[r]) if bad[r] is not None else self._advance(r, ids[r]) for r in active]
        for rt in out:
            rt.logprob = lps.get(rt.row) if rt.finish != "error" else None
        return out

    def _step_logprobs(self, logits: Tensor, nxt: Tensor, active: list[int]) -> dict[int, TokenLogprob]:
        """The logprobs of this step's tokens for the rows that asked for them (one top-N for all)."""
        asked = [r for r in active if self._rows[r].logprobs is not None]
        if not asked:
            return {}
        n = max(self._rows[r].logprobs for r in asked)
        at = torch.tensor(asked, device=logits.device)
        found = token_logprobs(logits.index_select(0, at), nxt.index_select(0, at), n)
        return {r: TokenLogprob(f.logprob, f.top[: self._rows[r].logprobs]) for r, f in zip(asked, found)}

    def _fail(self, r: int, error: RowFailed) -> RowToken:
        if self._rows[r] is not None:
            self._rows[r].ids = None  # a failed row's KV is not kept
        self.release(r)
        return RowToken(r, -1, "error", error)

    # --- the parts each engine fills in ---------------------------------------------------------

    def _keep(self) -> int | None:
        """How many of a row's latest tokens it keeps (None: all)."""
        return self.context

    def _ready(self, claimed: list[tuple[int, _Row, list[int]]], waiting: list[int]) -> list[int]:
        """Which of the waiting claimed rows (indices into claimed) prefill now (the first at least):
        all of them unless an engine holds some back."""
        return waiting

    def _prefill_groups(self, claimed: list[tuple[_Row, list[int]]]) -> list[list[int]]:
        """Which of the newly claimed rows (row state, prompt tokens) prefill together: one at a time
        unless an engine can do better."""
        return [[i] for i in range(len(claimed))]

    def _first_logits(self, rs: list[int], rows: list[_Row], ids: list[list[int]]) -> Tensor:
        """(n, V) float next-token logits of the n rows rs (a _prefill_groups group) after their prompts."""
        raise NotImplementedError

    def _started(self, r: int, row: _Row, tok: int) -> None:
        pass

    def _width(self, active: list[int]) -> int:
        """How many rows (from row 0) a step runs: all of them, unless an engine knows better."""
        return self.max_rows

    def _step_logits(self, active: list[int], width: int) -> Tensor:
        raise NotImplementedError

    def _after_step(self, nxt: Tensor) -> None:
        pass

    # --- sampling and bookkeeping -------------------------------------------------------------

    def _seen_rows(self) -> Tensor:
        if self._seen is None:
            V = self.model.config.vocab_size
            self._seen = torch.zeros(self.max_rows, V, dtype=torch.bool, device=self.device)
        return self._seen

    def _draw(self, logits: Tensor, rows: list[int | None], first: int = 0) -> tuple[Tensor, list[int], list[RowFailed | None]]:
        """(n, V) logits of rows first..first+n-1 → (n,) device tokens, the same as ints, and why each
        row cannot go on (None: it can; its logits were not finite, or its constraint allows no
        token: its token is meaningless): the step's one wait for the device."""
        drawn = native_decoder.argmax_finite(logits)  # (2, n): each row's argmax, 1 where it is not finite
        if drawn is None:  # a non-finite logit makes its row's sum non-finite (as do logits past ~1e34, as
            # broken): one vectorized pass, where isfinite().all() would make a second one over the logits
            drawn = torch.stack([logits.argmax(dim=-1), (~logits.sum(dim=-1).isfinite()).long()])
        failed: dict[int, RowFailed] = {}
        constrained = [i for i, r in enumerate(rows) if r is not None and self._rows[r].constraint is not None]
        if constrained:  # rows without a constraint do no mask work at all
            logits, drawn = self._constrain(logits, drawn, [rows[i] for i in constrained], constrained, failed)
        params = [None if r is None else self._rows[r].params for r in rows]
        if any(p is not None and not (p.greedy and p.repetition_penalty == 1.0) for p in params):  # not argmax alone
            if any(p is not None and not p.greedy for p in params):
                logits = logits.masked_fill(drawn[1, :, None].bool(), 0.0)  # a bad row draws harmlessly
            drawn = torch.stack([self._sample(logits, rows, first, drawn[0]), drawn[1]])
        ids, flags = drawn.tolist()
        return drawn[0], ids, [failed.get(i) or (RowFailed(NOT_FINITE) if b else None) for i, b in enumerate(flags)]

    def _constrain(
        self, logits: Tensor, drawn: Tensor, rows: list[int], at: list[int], failed: dict[int, RowFailed]
    ) -> tuple[Tensor, Tensor]:
        """The logits with each constrained row's (rows[j], at index at[j]) forbidden tokens at -inf,
        and the drawn argmax of those rows anew; a row whose constraint allows nothing goes in `failed`."""
        V = logits.shape[1]
        masks = []
        for r, i in zip(rows, at):
            try:
                mask = self._rows[r].constraint.allowed(V)
                if mask is not None and not mask.any():
                    raise ValueError("it allows no next token: the model's vocabulary cannot go on with it")
            except Exception as e:  # this row's constraint failed: the row alone fails
                failed[i], mask = RowFailed.of("the row's constraint", e), None
            masks.append(torch.ones(V, dtype=torch.bool) if mask is None else mask)
        index = torch.tensor(at, device=logits.device)
        allowed = torch.stack(masks).to(logits.device)  # (c, V)
        masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        drawn = drawn.clone()
        drawn[0, index] = masked.argmax(dim=-1)
        return logits.index_copy(0, index, masked), drawn

    def _sample(self, logits: Tensor, rows: list[int | None], first: int, argmax: Tensor) -> Tensor:
        """(n, V) logits, row i belonging to row rows[i] = first + i (None: idle), and their argmax →
        (n,) device tokens."""
        live = [None if r is None else self._rows[r] for r in rows]
        params = [None if row is None else row.params for row in live]
        seen = None
        if any(p is not None and p.repetition_penalty != 1.0 for p in params):
            seen = self._seen[first : first + len(rows)]
        return sample_rows(logits, params, [None if row is None else row.generator for row in live], seen, argmax)

    def _advance(self, r: int, tok: int) -> RowToken:
        """Record row r's new token: the row finishes here (and is released), or goes on."""
        row = self._rows[r]
        row.new, row.length = row.new + 1, row.length + 1
        row.tokens.append(tok)
        if row.ids is not None:
            row.ids.append(tok)
        done = False
        if row.constraint is not None and tok not in row.stop_ids:
            try:
                row.constraint.advance(tok)
            except Exception as e:  # the constraint's own failure: this row's alone
                return self._fail(r, RowFailed.of("the row's constraint", e))
            done = row.constraint.done
        finish = "eot" if tok in row.stop_ids else "stop" if done else "length" if row.new >= row.params.max_new_tokens else None
        if finish is not None:
            self.release(r)
        else:
            self._continue(r, row, tok)
        return RowToken(r, tok, finish)

    def _continue(self, r: int, row: _Row, tok: int) -> None:
        pass


class Engine(Rows):
    """Rows of generation over one model and one static cache (see the module docstring)."""

    def __init__(
        self,
        model: GPT,
        max_rows: int = 1,
        *,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        unit: str = "row",
        capacity: int | None = None,
        memory_fix: str = MEMORY_FIX,
        cache_dtype: torch.dtype | None = None,
        native: bool = True,
        prompt_cache: int | None = 0,
    ) -> None:
        super().__init__(model, max_rows, dtype, unit, capacity, memory_fix)
        self.static = self.variant.static_cache
        self.decoder = Decoder(self.model, native)  # the decode step: native where the model runs it, else op by op
        self.cache_dtype = cache_dtype or self.decoder.cache_dtype
        self.cache = self.model.make_cache(max_rows, self.capacity, dtype=self.cache_dtype) if self.static else None
        self.prefilled = 0  # tokens run through a prefill (a prompt's cached prefix is not)
        self.prompt_cache, self.prompt_cache_note = self._make_prompt_cache(prompt_cache)
        self._tok = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # each row's newest token
        self._pos = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # ... and its position
        self._live = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # 1: decodes, pos advances
        self.compiled = bool(compile) and self.static
        self._all_slots = self.compiled and self.device.type == "cuda"  # else attend over the filled slots
        self._compiled = None
        # the widths a step may run (rows 0..width-1): eager, any (None: up to the last busy row, so
        # one request on a 16-row server costs one row's step); compiled, each width is a graph of its
        # own, so all rows until warm() has compiled the powers of two
        self._widths: list[int] | None = None
        self._compiled_widths: set[int] = set()
        if self.compiled:  # CUDA: fixed shapes over every slot, for CUDA graphs; CPU: dynamic in n_keys
            self._compiled = compiled_step(self.model, cuda=self._all_slots, native=self.decoder.native)
            self._widths = [max_rows]

    def _make_prompt_cache(self, budget: int | None) -> tuple[PromptCache | None, str]:
        """The prompt cache of `budget` bytes (None: prompt_cache.default_budget; 0: none), and a
        note: its size, or why there is none."""
        if budget == 0:
            return None, "off"
        if not self.static:
            return None, "off: the variant keeps a memory of its own per row, not the static KV cache"
        if self.variant.bidirectional_prefix:
            return None, "off: a prefix-LM's prompt attends both ways, so a prompt's keys depend on its last token"
        per_token = self._kv_token_bytes()
        if budget is None:
            budget = default_budget(per_token, available_bytes(self.device))
        most = budget // (per_token + ID_BYTES)
        if most < 1:
            return None, f"off: {budget:,} bytes hold no token's KV ({per_token:,} bytes a token)"
        return PromptCache(budget), f"up to {budget / 2**20:,.0f} MiB ({most:,} tokens of KV)"

    def _kv_token_bytes(self) -> int:
        """One token's keys and values in every layer, in the cache's dtype."""
        cfg = self.model.config
        return 2 * cfg.n_layer * cfg.kv_heads * cfg.head_size * self.cache_dtype.itemsize

    @property
    def _cache_most(self) -> int:
        """The longest entry the prompt cache holds (0: no cache)."""
        return 0 if self.prompt_cache is None else self.prompt_cache.budget // (self._kv_token_bytes() + ID_BYTES)

    def prompt_cache_summary(self) -> dict[str, Any]:
        """The prompt cache's figures (prompt_cache.PromptCache.summary) and its note; or why it is off."""
        if self.prompt_cache is None:
            return {"enabled": False, "note": self.prompt_cache_note}
        return {"enabled": True, "note": self.prompt_cache_note, **self.prompt_cache.summary()}

    @torch.inference_mode()
    def warm(self) -> float:
        """Compile the decode step now (compile=True), not in a row's step: a server compiles before
        it listens, so no request waits for it. On a CPU one graph per power-of-two width up to
        max_rows, so a step runs the narrowest that holds its busy rows (CUDA: all rows, as ever).
        One step over the idle rows each, whose cache is then forgotten. Returns compile_s."""
        if self._compiled is None or self.capacity < 2:
            return self.compile_s  # (n_keys 1 would be a graph of its own: dynamo specializes sizes 0 and 1)
        if self.active_rows():
            raise RuntimeError("warm() needs every row idle: it decodes them all once and forgets their cache")
        widths = [self.max_rows] if self._all_slots else sorted({min(1 << i, self.max_rows) for i in range(self.max_rows.bit_length() + 1)})
        for width in widths:
            self._decode(2, masked=True, width=width)
        self._widths = widths
        self.cache.reset()
        return self.compile_s

    def release(self, row: int) -> None:
        """Rows.release; a row that ran (not failed) first leaves its KV to the prompt cache."""
        state = self._rows[row]
        if self.prompt_cache is not None and state is not None and state.ids is not None and state.new > 0:
            self._store(row, state.ids, state.length - 1)  # the newest token was drawn, not yet run
        super().release(row)
        self._set(row, live=0, pos=0, tok=0)  # an idle row keeps decoding harmlessly at position 0

    def _claim(self, p: Prompt) -> tuple[int, _Row, list[int]]:
        """Rows._claim; the row keeps its prompt's ids where its KV may go to the prompt cache: not a
        cropped prompt's, whose keys are not those of its own positions from the first token (it
        neither reads nor leaves an entry). The row reads the cache when it is ready (_ready)."""
        r, row, ids = super()._claim(p)
        if self.prompt_cache is not None and len(ids) == len(p.ids):
            row.ids = list(p.ids)
        return r, row, ids

    def _ready(self, claimed: list[tuple[int, _Row, list[int]]], waiting: list[int]) -> list[int]:
        """Rows._ready: rows admitted together reuse each other's prefixes. A row waits while one
        going now (another prompt) shares SHARED_MIN more tokens with it than the cache holds; the
        others look the cache up and prefill, and the next round looks up what they stored. So a
        burst's shared system prompt runs once, and identical prompts still go together."""
        if self.prompt_cache is None:
            return waiting
        now: list[int] = []
        for i in waiting:
            row = claimed[i][1]
            if not (self._reads(row) and self._waits(row.ids, [claimed[k][1].ids for k in now])):
                now.append(i)
        for i in now:
            self._lookup(claimed[i][1])
        return now

    def _reads(self, row: _Row) -> bool:
        """Whether a row may read the prompt cache: not a cropped prompt, nor a row asking for
        logprobs: they stay bit for bit those of its whole prompt's prefill (a cached prefix's agree
        to float rounding); it leaves its KV all the same."""
        return row.ids is not None and row.logprobs is None

    def _most(self, ids: list[int]) -> int:
        """The most of a prompt's tokens the cache may give it: its last runs, for its logits."""
        return min(len(ids) - 1, self.capacity)

    def _waits(self, ids: list[int], going: list[list[int] | None]) -> bool:
        """Whether a prompt gains SHARED_MIN tokens or more by waiting for the prompts `going` to be
        stored (not those that leave no entry: None, or longer than a window's ring; nor its own
        ids: prefilled with it)."""
        most, own = self._most(ids), as_ids(ids)
        stored = [g for g in going if g is not None and g != ids and len(g) <= self.capacity]
        shared = max((common_prefix(own, as_ids(g)) for g in stored), default=0)
        return min(shared, most, self._cache_most) - self.prompt_cache.shared(ids, most) >= SHARED_MIN

    def _lookup(self, row: _Row) -> None:
        """The row's longest prefix in the prompt cache (ids compared exactly), if it reads it: its
        KV, loaded at the prefill, and only the rest to run (the last token at least)."""
        if not self._reads(row):
            return
        entry, n = self.prompt_cache.lookup(row.ids, most=self._most(row.ids))
        if entry is not None:
            row.reuse, row.cached = entry.kv[:, :, :, :n], n  # a view: the KV lives while the row needs it

    def _load(self, r: int, kv: Tensor) -> None:
        """Row r's first n positions from a prompt cache entry's (n_layer, 2, kv_heads, n, hd) KV."""
        n = kv.shape[3]
        for layer, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
            k[r, :, :n] = kv[layer, 0]
            v[r, :, :n] = kv[layer, 1]
        self.cache.pos[r, :n] = torch.arange(n, device=self.device)

    def _store(self, r: int, ids: list[int], n: int) -> None:
        """Copy row r's first n positions (the tokens ids[:n]) into the prompt cache, as far as they
        fit its budget, unless an entry holds them already or the ring has overwritten them."""
        n = min(n, self.capacity, self._cache_most)
        if n < 1 or self.prompt_cache.covers(ids[:n]):
            return
        if not bool((self.cache.pos[r, :n] == torch.arange(n, device=self.device)).all()):
            return
        k0 = self.cache.k[0]
        kv = torch.empty((len(self.cache.k), 2, k0.shape[1], n, k0.shape[3]), dtype=k0.dtype, device=self.device)
        for layer, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
            kv[layer, 0] = k[r, :, :n]
            kv[layer, 1] = v[r, :, :n]
        self.prompt_cache.insert(ids[:n], kv)

    def _set(self, row: int, live: int, pos: int, tok: int) -> None:
        self._live[row], self._pos[row], self._tok[row] = live, pos, tok

    def _keep(self) -> int | None:
        return self.context if self.crops else 1  # a refill needs the crop window; else the cache has the rest

    def _start(self, row: _Row, ids: list[int]) -> int:
        # learned: a crop starts at 0; RoPE: a crop keeps absolute positions; a cached prefix comes first
        return row.cached if self.crops else row.length - len(ids)

    def _prefill_groups(self, claimed: list[tuple[_Row, list[int]]]) -> list[list[int]]:
        """The static cache: rows whose prompts have one length and start prefill as one batch."""
        if not self.static:
            return super()._prefill_groups(claimed)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (row, ids) in enumerate(claimed):
            groups.setdefault((len(ids), self._start(row, ids)), []).append(i)
        return list(groups.values())

    def _first_logits(self, rs: list[int], rows: list[_Row], ids: list[list[int]]) -> Tensor:
        """The rows' prefill, after their cached prefixes are loaded (anew at each try: a failed
        forward may have written part of a row)."""
        start = self._start(rows[0], ids[0])
        if not self.static:
            return self.prefill_rows(rs, ids, start)
        for r, row in zip(rs, rows):
            self.cache.reset(r)
            if row.reuse is not None:
                self._load(r, row.reuse)
        logits = self.prefill_rows(rs, ids, start)
        for row in rows:
            row.reuse = None
        return logits

    def _started(self, r: int, row: _Row, tok: int) -> None:
        self._set(r, live=1, pos=row.length, tok=tok)  # the new token's position (learned: refill if past)
        if row.ids is not None:  # the prompt, for other rows now: a shared system prompt
            self._store(r, row.ids, row.length)

    def prefill(self, r: int, ids: list[int], start: int = 0) -> Tensor:
        """Forget row r's tokens from position start on and run `ids` at positions start.. into it,
        after the positions before start that it holds (a prompt cache's prefix; none after a
        reset): (V,) float logits of the last token."""
        return self.prefill_rows([r], [ids], start)[0]

    def prefill_rows(self, rs: list[int], ids: list[list[int]], start: int = 0) -> Tensor:
        """prefill for rows rs at once, their prompts of one length: (n, V) float logits. The
        model's ordinary forward, over the prompt in pieces of PREFILL_CHUNK tokens in order, each
        writing its positions into rows rs of the cache and attending over the pieces before it
        there; the last piece's last logits. So a long prompt's activations are one piece's. Per path:
        * the static cache (causal, GQA, windows, RoPE, learned positions; a cropped prompt, a
          learned-position refill and the rest after a cached prefix alike): in pieces. The ring
          holds the span's latest positions, so each query finds every key it may see: the logits
          of one forward to float rounding, and to the cache dtype's rounding of the earlier
          pieces' keys (float16 by default), as after a cached prefix.
        * a prefix-LM: one forward, since the whole prompt attends both ways (a piece's keys
          would depend on the pieces after it).
        * a variant without the static cache (Infini-attention: one row, given its own cache): in
          pieces, since its cache carries a segment across forwards (variants/infini.py).
        """
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)  # (n, T)
        self.prefilled += idx.numel()
        if self.static:
            for r in rs:
                self._forget(r, start)
            cache, rows = self.cache, torch.tensor(rs, device=self.device)
        else:
            (r,) = rs
            cache, rows = self.model.make_cache(1), None
            self._rows[r].cache = cache
        T = idx.shape[1]
        if self.variant.bidirectional_prefix:  # the prompt: the prefix
            return self._forward(idx, start, cache, rows, torch.full((len(rs),), T, device=self.device))
        for t in range(0, T, PREFILL_CHUNK):
            logits = self._forward(idx[:, t : t + PREFILL_CHUNK], start + t, cache, rows)
        return logits

    def _forward(self, idx: Tensor, start: int, cache: Cache, rows: Tensor | None, prefix: Tensor | None = None) -> Tensor:
        """The forward of idx (n, T) at positions start.. into the cache: (n, V) float logits of its
        last token (the model's head runs on that position alone)."""
        pos = torch.arange(start, start + idx.shape[1], device=self.device)[None]
        logits, _ = self.model(idx, pos=pos, cache=cache, rows=rows, prefix_len=prefix)
        return logits[:, -1].float()

    def _forget(self, r: int, start: int) -> None:
        """Forget row r's keys from position start on (all of them from 0)."""
        if start == 0:
            self.cache.reset(r)
        else:
            self.cache.pos[r].masked_fill_(self.cache.pos[r] >= start, EMPTY_POS)

    def _width(self, active: list[int]) -> int:
        need = max(active) + 1  # (add takes the lowest free row: busy rows gather at the start)
        return need if self._widths is None else min(w for w in self._widths if w >= need)

    def _step_logits(self, active: list[int], width: int) -> Tensor:
        """(width, V) float logits of rows 0..width-1's next tokens: one fixed-shape decode over
        those rows, then a refill prefill for each learned-position row past block_size."""
        rows = [self._rows[r] for r in active]
        if not self.static:  # each row its own cache, one token at its position
            logits = torch.zeros(width, self.model.config.vocab_size, device=self.device)
            for r, row in zip(active, rows):
                out, _ = self.model(self._tok[r].view(1, 1), pos=self._pos[r].view(1, 1), cache=row.cache)
                logits[r] = out[0, -1].float()
            return logits
        logits = None
        if any(not row.refill for row in rows):
            lengths = {row.length for row in rows if not row.refill}
            n_keys = None if self._all_slots else min(self.cache.capacity, max(lengths))  # the filled slots
            # rows of one length hold the same latest positions, all visible (capacity ≤ span): no mask
            # (eager only: compiled, the mask is fused and one graph serves every step)
            masked = self.compiled or len(lengths) > 1
            logits = self._decode(n_keys, masked, width).float()
        refills = [r for r, row in zip(active, rows) if row.refill]
        if refills:
            fresh = torch.stack([self.prefill(r, list(self._rows[r].tokens)) for r in refills])
            if logits is None:
                logits = torch.zeros(width, fresh.shape[1], device=self.device)
            logits = logits.index_copy(0, torch.tensor(refills, device=self.device), fresh)
        return logits

    def _decode(self, n_keys: int | None, masked: bool, width: int) -> Tensor:
        """GPT.decode of rows 0..width-1's newest tokens, eager or compiled (CPU: over a view of the
        filled slots' positions whose length is marked dynamic, so one graph serves every n_keys)."""
        tok, pos = self._tok[:width], self._pos[:width]
        if self._compiled is None:
            return self.decoder(tok, pos, self.cache, n_keys, masked)
        key_pos = self.cache.pos[:width, :n_keys]
        if n_keys is not None:
            torch._dynamo.maybe_mark_dynamic(key_pos, 1)  # a view of the whole buffer stays static
        if width in self._compiled_widths:
            return self._compiled(self.model, tok, pos, self.cache, key_pos, self.decoder.native)
        start = time.perf_counter()  # a width's first call compiles (or loads inductor's cache of an earlier run)
        logits = self._compiled(self.model, tok, pos, self.cache, key_pos, self.decoder.native)
        self.compile_s += time.perf_counter() - start
        self._compiled_widths.add(width)
        return logits

    def _after_step(self, nxt: Tensor) -> None:
        width = nxt.shape[0]  # next inputs stay on the device; idle rows keep position 0
        self._tok[:width].copy_(nxt)
        self._pos[:width] += self._live[:width]

    def _continue(self, r: int, row: _Row, tok: int) -> None:
        if self.crops and row.length > self.context and not row.refill:
            row.refill, row.ids = True, None  # positions would pass block_size: crop and refill from now on
            self._set(r, live=0, pos=0, tok=0)
