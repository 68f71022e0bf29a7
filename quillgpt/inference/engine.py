"""The inference engine: a static KV cache, `prefill` and `decode_step` as separate steps, and
independent rows that join and leave while the others keep decoding (the gpt-fast design).

The cache holds `max_rows` rows of (kv_heads, capacity, head_dim) per layer, preallocated once.
`add` prefills a prompt into a free row and samples its first token; `step` runs one decode step
for every row at once — fixed shapes: every row, active or not, writes one token at its own
position — and samples each active row with its own SamplingParams and random generator, so a
row's tokens are the ones it gets alone, whoever shares the batch. A finished row is released
and its slot reused by the next `add`.

Past block_size (model.py's semantics, the same as the recompute reference in generate.py):
* RoPE: absolute positions, the cache is a ring of the last span keys: decoding goes on as is.
  A prompt longer than the receptive field n_layer·(span-1)+1 is cropped to it (same logits).
* learned positions: the context is the last block_size tokens at positions 0..block_size-1, so
  once a row is longer than block_size each of its steps refills its row of the cache from its
  last block_size tokens (a prefill; exact crop semantics, as costly as recomputing).

`compile=True` runs the decode step through torch.compile (eager stays the tested reference);
None chooses by device (see `compile_by_default`).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT
from quillgpt.device import available_bytes
from quillgpt.train.prefix_batches import check_fits
from quillgpt.inference.sampling import SamplingParams, row_generator, sample_rows


@dataclass
class RowToken:
    """One new token of one row. finish: None while the row goes on; "length" (max_new_tokens
    reached) or "stop_id" (one of the row's stop ids was produced; that token is included)."""

    row: int
    token: int
    finish: str | None = None


@dataclass
class _Row:
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    tokens: deque[int]  # the last tokens that can still matter (learned: the crop window)
    length: int  # tokens in the row: prompt + generated
    new: int = 0  # generated so far
    refill: bool = False  # learned positions past block_size: every step re-prefills
    cache: object = field(default=None, repr=False)  # a row's own cache (models without KVCache decode)


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


def compile_by_default(device: torch.device) -> bool:
    """Whether `compile=None` compiles the decode step: only where the bench measured it faster.
    Nowhere yet: on CPU compiling takes 20-130 s and the step was not faster (scripts/bench.py;
    6L/384 at batch 1, one thread: 74-92 tokens/s compiled vs 85-93 eager, CPU time, same tokens),
    since its 24 matmuls read 43 MB of weights per token and take ~75% of the eager step already."""
    return False


def in_dtype(model: GPT, dtype: torch.dtype | None) -> GPT:
    """The model with its weights in `dtype` (a converted copy; the model itself if it already is).
    Converted once, not autocast per step: autocast re-casts every weight at every step, which
    made bf16 decoding slower than fp32; bf16 weights halve the bytes a step reads."""
    if dtype is None or dtype == model.lm_head.weight.dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def cache_bytes(model: GPT, rows: int) -> int:
    """Bytes of a static KV cache of `rows` rows for this model (keys + values + positions)."""
    cfg = model.config
    per_row = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * model.lm_head.weight.element_size() + 8
    return rows * model.span * per_row


def check_memory(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse, in one line, an allocation larger than the memory the device has free."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise QuillError(
            f"{what} needs {nbytes / 2**30:.1f} GiB but {device.type} has {free / 2**30:.1f} GiB free: "
            "generate fewer rows at once (--num-samples) or use a smaller dtype"
        )


class Engine:
    """Rows of generation over one model and one static cache; not thread-safe (one owner)."""

    def __init__(
        self, model: GPT, max_rows: int = 1, *, dtype: torch.dtype | None = None, compile: bool | None = None
    ) -> None:
        if model.training:
            raise ValueError("call model.eval() before generating: dropout would make tokens random")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        model = in_dtype(model, dtype)
        cfg, weight = model.config, model.lm_head.weight
        self.model, self.max_rows, self.device, self.dtype = model, max_rows, weight.device, weight.dtype
        check_memory(cache_bytes(model, max_rows), self.device, f"the KV cache for {max_rows} row(s)")
        self.static = getattr(cfg, "attention", "causal") != "infini"  # infini keeps its own per-row state
        self.prefix_lm = getattr(cfg, "attention", "causal") == "prefix"  # the prompt attends both ways
        self.learned = cfg.pos == "learned" and self.static
        # tokens that decide the next logits: the crop window (learned) or the receptive field (RoPE)
        self.context = cfg.block_size if self.learned else cfg.n_layer * (model.span - 1) + 1
        self.cache = model.make_cache(max_rows) if self.static else None
        self._tok = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # each row's newest token
        self._pos = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # ... and its position
        self._live = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # 1: decodes, pos advances
        self._seen: Tensor | None = None  # (rows, V) tokens each row contains, for repetition penalties
        self._rows: list[_Row | None] = [None] * max_rows
        self.compiled = (compile_by_default(self.device) if compile is None else compile) and self.static
        self._decode = model.decode
        if self.compiled:
            mode = "reduce-overhead" if self.device.type == "cuda" else None  # CUDA graphs on GPU
            self._decode = torch.compile(model.decode, mode=mode, fullgraph=True, dynamic=False)

    # --- rows ---------------------------------------------------------------------------------

    def free_rows(self) -> int:
        return sum(r is None for r in self._rows)

    def active_rows(self) -> list[int]:
        return [i for i, r in enumerate(self._rows) if r is not None]

    def release(self, row: int) -> None:
        """Free a row (finished, stop string found at text level, client gone); idempotent."""
        if self._rows[row] is None:
            return
        self._rows[row] = None
        self._set(row, live=0, pos=0, tok=0)  # an idle row keeps decoding harmlessly at position 0

    def _set(self, row: int, live: int, pos: int, tok: int) -> None:
        self._live[row], self._pos[row], self._tok[row] = live, pos, tok

    # --- the two steps ------------------------------------------------------------------------

    @torch.inference_mode()
    def add(self, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()) -> RowToken:
        """Prefill `prompt_ids` into a free row; return its first new token. The row gets its own
        position, length, params and generator (seeded from params.seed)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1 to add a row")
        check_prompt(prompt_ids, self.model.config.vocab_size)
        check_fits(self.model.config, len(prompt_ids), params.max_new_tokens)  # a prefix is never cropped
        if self.free_rows() == 0:
            raise ValueError(f"no free row: all {self.max_rows} rows are generating; release one first")
        r = self._rows.index(None)
        ids = list(prompt_ids[-self.context :]) if self.static else list(prompt_ids)
        row = _Row(params, row_generator(params, self.device), frozenset(stop_ids),
                   deque(ids, maxlen=self.context if self.learned else 1), len(prompt_ids))
        self._rows[r] = row
        if params.repetition_penalty != 1.0:
            seen = self._seen_rows()
            seen[r].zero_()
            seen[r, torch.tensor(prompt_ids, device=self.device)] = True
        start = len(prompt_ids) - len(ids)  # RoPE: a crop keeps absolute positions
        logits = self.prefill(r, ids, 0 if self.learned else start)  # (V,)
        tok = int(self._sample(logits[None], [r])[0])
        self._set(r, live=1, pos=row.length, tok=tok)  # the new token's position (learned: refill if past)
        return self._advance(r, tok)

    def prefill(self, r: int, ids: list[int], start: int = 0) -> Tensor:
        """Forget row r's keys and run `ids` at positions start.. into it: (V,) float logits of the
        last token. The model's ordinary forward, on a one-row view of the cache."""
        row = self._rows[r]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = None if start == 0 else torch.arange(start, start + len(ids), device=self.device)
        if self.static:
            cache = self.cache.fresh_row(r)
        else:
            cache = row.cache = self.model.make_cache(1)
        prefix = torch.tensor([len(ids)], device=self.device) if self.prefix_lm else None  # the prompt
        logits, _ = self.model(idx, pos=pos, cache=cache, prefix_len=prefix)
        return logits[0, -1].float()

    @torch.inference_mode()
    def step(self) -> list[RowToken]:
        """One decode step for every active row: one RowToken each (finished rows are released)."""
        active = self.active_rows()
        if not active:
            return []
        logits = self.decode_step(active)  # (rows, V)
        nxt = self._sample(logits, [r if self._rows[r] is not None else None for r in range(self.max_rows)])
        ids = nxt.tolist()  # the step's one wait for the device
        self._tok.copy_(nxt)  # next inputs stay on the device; idle rows keep position 0
        self._pos += self._live
        return [self._advance(r, ids[r]) for r in active]

    def decode_step(self, active: list[int]) -> Tensor:
        """(rows, V) float logits of every row's next token: one fixed-shape decode over all rows,
        then a refill prefill for each learned-position row past block_size."""
        rows = [self._rows[r] for r in active]
        logits = None
        if not self.static:
            logits = torch.zeros(self.max_rows, self.model.config.vocab_size, device=self.device)
            for r, row in zip(active, rows):
                out, _ = self.model(self._tok[r].view(1, 1), cache=row.cache)
                logits[r] = out[0, -1].float()
            return logits
        if any(not row.refill for row in rows):
            n_keys = None
            if not self.compiled:  # eager: attend over the filled part only (slot = pos < capacity)
                n_keys = min(self.cache.capacity, max(row.length for row in rows if not row.refill))
            logits = self._decode(self._tok, self._pos, self.cache, n_keys).float()
        refills = [r for r, row in zip(active, rows) if row.refill]
        if refills:
            fresh = torch.stack([self.prefill(r, list(self._rows[r].tokens)) for r in refills])
            if logits is None:
                logits = torch.zeros(self.max_rows, fresh.shape[1], device=self.device)
            logits = logits.index_copy(0, torch.tensor(refills, device=self.device), fresh)
        return logits

    # --- sampling and bookkeeping -------------------------------------------------------------

    def _seen_rows(self) -> Tensor:
        if self._seen is None:
            V = self.model.config.vocab_size
            self._seen = torch.zeros(self.max_rows, V, dtype=torch.bool, device=self.device)
        return self._seen

    def _sample(self, logits: Tensor, rows: list[int | None]) -> Tensor:
        """(n, V) logits, row i belonging to cache row rows[i] (None: idle) → (n,) device tokens."""
        live = [None if r is None else self._rows[r] for r in rows]
        params = [None if row is None else row.params for row in live]
        seen = None
        if any(p is not None and p.repetition_penalty != 1.0 for p in params):
            seen = self._seen if len(rows) == self.max_rows else self._seen[rows[0] : rows[0] + 1]
        return sample_rows(logits, params, [None if row is None else row.generator for row in live], seen)

    def _advance(self, r: int, tok: int) -> RowToken:
        """Record row r's new token; finish the row or set up its next decode."""
        row = self._rows[r]
        row.new, row.length = row.new + 1, row.length + 1
        row.tokens.append(tok)
        finish = "stop_id" if tok in row.stop_ids else "length" if row.new >= row.params.max_new_tokens else None
        if finish is not None:
            self.release(r)
        elif self.learned and row.length > self.context and not row.refill:
            row.refill = True  # positions would pass block_size: crop and refill from now on
            self._set(r, live=0, pos=0, tok=0)
        return RowToken(r, tok, finish)
