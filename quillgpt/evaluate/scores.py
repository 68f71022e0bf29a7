"""Score a model on every token of a text exactly once: loss, perplexity, bits per byte.

A sliding pass over the token stream t[0..N-1]. The first token has no prediction (nothing
precedes it), so N tokens give N-1 scored predictions. Windows hold L = min(block_size, N-1)
inputs; the first window scores all its L targets, each later window moves `stride` tokens on
and scores only its last `stride` targets, so every scored token sees the tokens before it in
its window as context. stride = block_size is the fast non-overlapping pass (context 1..L);
stride = 1 gives every token min(position, block_size) tokens of context, at L times the cost.

Per-token numbers depend on the tokenizer; per-byte and per-character numbers do not, so they
compare a char model with a BPE model on the same text:
    bits/byte = total nats / (ln 2 · UTF-8 bytes of the scored text)
where the scored text is the text of tokens 1..N-1 (the first token is context only). A
character counts where its first byte lies. A tokenizer with a BOS token (an imported Llama 3)
gets it before the text, as its model saw texts start: then every token of the text is scored,
the same predictions transformers' loss(labels=input_ids) averages.

A prefix-LM (model.attention=prefix) reads each window's context-only tokens as its bidirectional
prefix: a window that scores targets from offset `skip` on gets prefix_len = skip + 1 (its input
tokens 0..skip), so exactly the tokens after the prefix are scored, and the same tokens as for a
causal model (with the default stride = block_size every window but the last has prefix 1, causal).
The trainer's fixed windows use a fixed prefix (prefix.eval_prefix_len) and score what follows it.

Chat data is scored the way training scores it (data/chat_batches.py): one conversation a
row, truncated to block_size + 1 tokens, only the assistant's tokens counted; bytes and
characters are those of the scored tokens. A run trained on chat data scores its prepared
split so; `--format chat` scores a jsonl file of conversations so.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from quillgpt.cpu_share import FIRST_LOOK_S, CpuShare, holding
from quillgpt.data.batches import batch_from_starts
from quillgpt.data.chat_batches import ChatRows
from quillgpt.data.chat_data import encode_lines
from quillgpt.data.prefix_batches import mask_prefix_targets
from quillgpt.data.prepare import load_prepared, load_tokens, token_dtype
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.files import read_text
from quillgpt.model.gpt import evaluating
from quillgpt.model.variants.prefix import eval_prefix_len
from quillgpt.runs import LoadOptions, load_run

SPLITS = ("val", "train")


@dataclass
class EvalResult:
    """Totals of one pass; the per-token/byte/char rates are derived from them."""

    nats: float  # summed cross-entropy over scored tokens (natural log)
    tokens: int  # scored predictions (N-1 for a text of N tokens)
    bytes: int | None  # UTF-8 bytes of the scored text (None for overlapping windows)
    chars: int | None  # characters of the scored text
    seconds: float  # wall time of the pass
    stride: int | None = None  # None: fixed windows (evaluate_windows)
    unknown_dropped: int = 0  # characters removed by skip_unknown
    checkpoint: str | None = None
    step: int | None = None
    data: str | None = None  # "val", "train" or the text file
    quantize: str | None = None  # "int8": scored with int8 linears (quant/)

    @property
    def loss(self) -> float:
        """Mean nats per token."""
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_token(self) -> float:
        return self.loss / math.log(2)

    @property
    def bits_per_byte(self) -> float | None:
        return self.nats / (math.log(2) * self.bytes) if self.bytes else None

    @property
    def bits_per_char(self) -> float | None:
        return self.nats / (math.log(2) * self.chars) if self.chars else None

    def to_dict(self) -> dict[str, Any]:
        rates = {k: getattr(self, k) for k in ("loss", "perplexity", "bits_per_token", "bits_per_byte", "bits_per_char")}
        return {**rates, **asdict(self)}


# --- the sliding pass --------------------------------------------------------------------------


def sliding_windows(n_tokens: int, block_size: int, stride: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Plan the pass: (starts, skip, L). Window i feeds t[s : s+L] and predicts t[s+1 : s+L+1],
    scoring all but its first skip[i] targets; every target 1..N-1 is scored exactly once."""
    targets = n_tokens - 1
    if targets < 1:
        raise QuillError(f"need at least 2 tokens to score a prediction, got {n_tokens}")
    if not 1 <= stride <= block_size:
        raise QuillError(f"--stride must be between 1 and the model's block_size ({block_size}), got {stride}")
    length = min(block_size, targets)
    n_windows = 1 + -(-(targets - length) // stride)  # ceil
    ends = np.minimum(length + stride * np.arange(n_windows), targets)  # last target of each window
    scored = np.diff(ends, prepend=0)  # the first window scores all `length` targets
    return ends - length, length - scored, length


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def _batch_nats(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, prefix_len: torch.Tensor | None = None) -> float:
    """Summed cross-entropy of targets y != -1 given inputs x (B, T), accumulated in float64."""
    if prefix_len is not None and _is_prefix_lm(model):
        logits, _ = model(x, all_logits=True, prefix_len=prefix_len)  # (B, T, V)
    else:
        logits, _ = model(x, all_logits=True)
    return _nats(logits.flatten(0, 1), y.flatten())


def _scored_nats(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """_batch_nats for chat rows, as training computes them: the head on the scored targets only,
    and the rows' common prefix (a system prompt) run once."""
    logits, _ = model(x, y, scored_only=True, share_prefix=True)  # (N, V), in the order of y[y != -1]
    return _nats(logits, y[y != -1])


def _nats(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed cross-entropy of (N, V) logits at least in fp32, targets -1 left out, summed in float64."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction="none").double().sum().item()


def _is_prefix_lm(model: torch.nn.Module) -> bool:
    return model.variant.bidirectional_prefix


def evaluate_tokens(
    model: torch.nn.Module,
    tokens: np.ndarray | list[int],
    *,
    stride: int | None = None,
    batch_size: int = 16,
    device: str | torch.device | None = None,
    progress: bool = False,
    tokenizer: Tokenizer | None = None,
    threads: CpuShare | None = None,
) -> EvalResult:
    """Score tokens 1..N-1 of `tokens` once each with a sliding pass (stride defaults to
    block_size). With `tokenizer`, also count the bytes and characters of the scored text; with
    `threads` (a CpuShare), torch's threads give way to other processes between batches."""
    if batch_size < 1:
        raise QuillError(f"--batch-size must be at least 1, got {batch_size}")
    block_size = model.config.block_size
    stride = block_size if stride is None else stride
    tokens = np.asarray(tokens)
    starts, skip, length = sliding_windows(len(tokens), block_size, stride)
    device = torch.device(device) if device is not None else _model_device(model)
    t0 = time.perf_counter()
    offsets = np.arange(length)
    total = 0.0
    bar = tqdm(total=len(tokens) - 1, unit="tok", unit_scale=True, disable=not progress, delay=1.0, leave=False)
    with evaluating(model):
        for i in range(0, len(starts), batch_size):
            if threads is not None:
                threads.update()
            idx = starts[i : i + batch_size, None] + offsets  # (B, L) positions of the inputs
            x = torch.from_numpy(tokens[idx].astype(np.int64))
            y = torch.from_numpy(tokens[idx + 1].astype(np.int64))
            y[torch.from_numpy(offsets < skip[i : i + batch_size, None])] = -1  # context only
            prefix_len = torch.from_numpy(skip[i : i + batch_size] + 1).to(device)  # prefix-LM: the context
            total += _batch_nats(model, x.to(device), y.to(device), prefix_len)
            bar.update(int(length * len(idx) - skip[i : i + batch_size].sum()))
    bar.close()
    n_bytes = n_chars = None
    if tokenizer is not None:
        n_bytes, n_chars = scored_text_size(tokenizer, tokens)
    return EvalResult(total, len(tokens) - 1, n_bytes, n_chars, time.perf_counter() - t0, stride)


def scored_text_size(tokenizer: Tokenizer, tokens: np.ndarray, chunk: int = 1 << 20) -> tuple[int, int]:
    """(UTF-8 bytes, characters) of the text of tokens[1:], decoded in chunks to bound memory.

    Exact for byte-level and char tokenizers, whose bytes are the concatenation of each
    token's bytes; a character counts where its lead byte lies, so a character split
    across tokens is counted once over the whole text."""
    sizes = [text_size(tokenizer, tokens[i : i + chunk].tolist()) for i in range(1, len(tokens), chunk)]
    return sum(b for b, _ in sizes), sum(c for _, c in sizes)


def text_size(tokenizer: Tokenizer, ids: list[int]) -> tuple[int, int]:
    """(bytes, characters) of the ids' text: a character counts at its lead byte."""
    raw = np.frombuffer(tokenizer.decode_bytes(ids), dtype=np.uint8)
    return len(raw), int(np.count_nonzero((raw & 0xC0) != 0x80))  # not a continuation byte


def evaluate_windows(
    model: torch.nn.Module,
    tokens: np.ndarray,
    starts: np.ndarray,
    *,
    batch_size: int = 16,
    device: str | torch.device | None = None,
) -> EvalResult:
    """Mean loss over the fixed windows t[s : s+block_size+1] the trainer evaluates
    (data.fixed_windows): each window scores all block_size targets, windows may overlap."""
    block_size = model.config.block_size
    device = torch.device(device) if device is not None else _model_device(model)
    t0 = time.perf_counter()
    total, prefix, scored = 0.0, None, block_size
    if _is_prefix_lm(model):  # score what follows a fixed prefix
        P = eval_prefix_len(model.config)
        prefix, scored = torch.tensor([P], device=device), block_size - max(P - 1, 0)
    with evaluating(model):
        for i in range(0, len(starts), batch_size):
            x, y = batch_from_starts(tokens, starts[i : i + batch_size], block_size, device)
            if prefix is not None:
                prefix_len = prefix.expand(len(x))
                y = mask_prefix_targets(y, prefix_len)
                total += _batch_nats(model, x, y, prefix_len)
            else:
                total += _batch_nats(model, x, y)
    return EvalResult(total, len(starts) * scored, None, None, time.perf_counter() - t0)


def evaluate_rows(
    model: torch.nn.Module,
    rows: ChatRows,
    picks: np.ndarray | None = None,
    *,
    batch_size: int = 16,
    device: str | torch.device | None = None,
    tokenizer: Tokenizer | None = None,
    threads: CpuShare | None = None,
) -> EvalResult:
    """Summed loss over the assistant's tokens of the conversations `picks` (default: all), as
    training scores them; with `tokenizer`, also the bytes and characters of those tokens; with
    `threads`, torch's threads give way to other processes between batches."""
    if batch_size < 1:
        raise QuillError(f"--batch-size must be at least 1, got {batch_size}")
    device = torch.device(device) if device is not None else _model_device(model)
    picks = np.arange(len(rows)) if picks is None else picks
    t0 = time.perf_counter()
    total, scored, n_bytes, n_chars = 0.0, 0, 0, 0
    with evaluating(model):
        for i in range(0, len(picks), batch_size):
            if threads is not None:
                threads.update()
            x, y = rows.batch(picks[i : i + batch_size], device)
            total += _scored_nats(model, x, y)
            targets = y[y != -1]
            scored += len(targets)
            if tokenizer is not None:
                size = text_size(tokenizer, targets.tolist())
                n_bytes, n_chars = n_bytes + size[0], n_chars + size[1]
    sizes = (n_bytes, n_chars) if tokenizer is not None else (None, None)
    return EvalResult(total, scored, *sizes, time.perf_counter() - t0)


def chat_rows(tokenizer: Tokenizer, text: str, block_size: int, name: str) -> ChatRows:
    """A jsonl text of conversations (one a line) as rows, each line checked as `quill prepare`
    checks it (a bad line is one error naming it)."""
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise QuillError(f"{name} holds no conversations (one JSON object a line)")
    dtype = token_dtype(tokenizer.vocab_size)
    (ids, flags), _ = encode_lines(
        tokenizer, [line for _, line in lines], [f"{name} line {n}" for n, _ in lines], dtype, False, block_size + 1
    )
    return ChatRows(ids, flags, block_size, name)


# --- texts, splits and checkpoints -------------------------------------------------------------


def _describe_unknown(unknown: dict[str, int], name: str) -> str:
    top = sorted(unknown.items(), key=lambda kv: -kv[1])[:5]
    shown = ", ".join(f"{c!r} ×{k}" for c, k in top)
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return f"{name} has {sum(unknown.values())} character(s) the checkpoint's char vocabulary cannot encode ({shown}{more})"


def evaluate_text(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    text: str,
    *,
    stride: int | None = None,
    batch_size: int = 16,
    device: str | torch.device | None = None,
    progress: bool = False,
    skip_unknown: bool = False,
    name: str = "the text",
    threads: CpuShare | None = None,
) -> EvalResult:
    """Tokenize `text` with the model's tokenizer and score it. Characters the tokenizer
    cannot encode are an error, or with skip_unknown are dropped (bytes/chars then count
    the text actually scored)."""
    unknown = tokenizer.unknown_chars(text)
    if unknown and not skip_unknown:
        raise QuillError(f"{_describe_unknown(unknown, name)}; pass --skip-unknown to drop them")
    if unknown:
        text = "".join(c for c in text if c not in unknown)
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]  # as its model saw texts start (Llama 3)
    tokens = np.asarray(bos + tokenizer.encode(text), dtype=np.int64)
    if len(tokens) < 2:
        raise QuillError(f"{name} is {len(tokens)} token(s) long; scoring needs at least 2 (the first is context only)")
    settings = dict(stride=stride, batch_size=batch_size, device=device, progress=progress, tokenizer=tokenizer, threads=threads)
    result = evaluate_tokens(model, tokens, **settings)
    result.unknown_dropped = sum(unknown.values())
    return result


def _prepared(run: Any, split: str) -> Path:
    """The checkpoint's data.out_dir, holding `split` prepared with the run's tokenizer."""
    out_dir = Path(run.config.data.out_dir)
    config_yaml = run.path.parent / "config.yaml"
    how = f"run `quill prepare --config {config_yaml if config_yaml.is_file() else 'RUN/config.yaml'}`"
    if not (out_dir / f"{split}.bin").is_file() or not (out_dir / "meta.json").is_file():
        raise QuillError(f"no prepared {split} split in {out_dir} (the checkpoint's data.out_dir); {how} first")
    meta, _ = load_prepared(out_dir)
    if json.dumps(meta["tokenizer"], sort_keys=True) != json.dumps(run.tokenizer.spec(), sort_keys=True):
        raise QuillError(
            f"the data in {out_dir} was prepared with a different tokenizer than {run.path} was trained with; {how} --force to rebuild it"
        )
    return out_dir


def _score_split(run: Any, split: str, chat: bool, kwargs: dict[str, Any]) -> EvalResult:
    """The run's prepared split: every token (text), or the assistant's tokens (chat data)."""
    out_dir = _prepared(run, split)
    if chat:
        return _score_rows(run, ChatRows.prepared(out_dir, split, run.config.model.block_size), kwargs)
    return evaluate_tokens(run.model, load_tokens(out_dir, split), tokenizer=run.tokenizer, **kwargs)


def _score_text(run: Any, path: str | Path, chat: bool, skip_unknown: bool, kwargs: dict[str, Any]) -> EvalResult:
    text = read_text(path, "--text")
    if chat:
        return _score_rows(run, chat_rows(run.tokenizer, text, run.config.model.block_size, str(path)), kwargs)
    return evaluate_text(run.model, run.tokenizer, text, skip_unknown=skip_unknown, name=str(path), **kwargs)


def _score_rows(run: Any, rows: ChatRows, kwargs: dict[str, Any]) -> EvalResult:
    """Conversations, the loss on the assistant's tokens: each is one window (no stride)."""
    if kwargs["stride"] is not None:
        raise QuillError("--stride does not apply to chat data: each conversation is one window")
    return evaluate_rows(run.model, rows, batch_size=kwargs["batch_size"], tokenizer=run.tokenizer, threads=kwargs["threads"])


def evaluate_checkpoint(
    path: str | Path,
    *,
    which: str = "best",
    split: str = "val",
    texts: list[str | Path] | None = None,
    text_format: str = "text",
    stride: int | None = None,
    batch_size: int = 16,
    device: str = "auto",
    progress: bool = False,
    skip_unknown: bool = False,
    quantize: str | None = None,
) -> list[EvalResult]:
    """Load a run once and score its prepared `split`, or each of `texts` (files) instead: plain
    text, or with text_format="chat" jsonl conversations (the assistant's tokens); quantize="int8":
    with its linears in int8, as `quill sample --quantize int8` runs it."""
    if split not in SPLITS:
        raise QuillError(f"--split must be val or train, got {split!r}")
    if text_format not in ("text", "chat"):
        raise QuillError(f"--format must be text or chat, got {text_format!r}")
    if text_format == "chat" and not texts:
        raise QuillError(
            "--format chat scores the conversations of --text FILE.jsonl (a run trained on chat data "
            "scores its --split as conversations already)"
        )
    if text_format == "chat" and stride is not None:  # before the load (a chat split: _score_rows says so)
        raise QuillError("--stride does not apply to --format chat: each conversation is one window")
    options = LoadOptions.parse(device=device, quantize=quantize, which=which)
    threads = CpuShare.for_run(torch.device(options.device), first_s=FIRST_LOOK_S)  # the load: its first look's window
    run = load_run(path, options)  # a quantized model scored even where it runs no faster
    kwargs = dict(stride=stride, batch_size=batch_size, progress=progress, threads=threads)
    with holding(threads):
        if texts:
            results = [_score_text(run, t, text_format == "chat", skip_unknown, kwargs) for t in texts]
            for result, t in zip(results, texts):
                result.data = str(t)
        else:
            results = [_score_split(run, split, run.config.data.format == "chat", kwargs)]
            results[0].data = split
    for result in results:
        result.checkpoint, result.step, result.quantize = str(path), run.step, options.quantize
    return results


@dataclass
class Scores:
    """`quill eval`'s rows: each run's scores of its split or of each text, in order."""

    results: list[EvalResult]

    def table(self) -> str:
        return format_table(self.results)

    def to_json(self) -> str:
        """One object for one row, else a list of them."""
        rows = [r.to_dict() for r in self.results]
        return json.dumps(rows[0] if len(rows) == 1 else rows)


def evaluate_checkpoints(paths: list[str | Path], **settings: Any) -> Scores:
    """`quill eval` without --tasks: each run scored by evaluate_checkpoint (`settings`: its keywords)."""
    return Scores([result for path in paths for result in evaluate_checkpoint(path, **settings)])


def format_table(results: list[EvalResult]) -> str:
    """A plain-text comparison table, one row per result."""
    head = ["checkpoint", "step", "data", "tokens", "bytes", "loss", "ppl", "bits/tok", "bits/byte", "bits/char", "time"]

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def name(r: EvalResult) -> str:
        return (r.checkpoint or "-") + (f" ({r.quantize})" if r.quantize else "")

    rows = [
        [
            name(r),
            num(r.step, "d"),
            r.data or "-",
            f"{r.tokens:,}",
            num(r.bytes, ","),
            f"{r.loss:.4f}",
            f"{r.perplexity:.3f}",
            f"{r.bits_per_token:.4f}",
            num(r.bits_per_byte, ".4f"),
            num(r.bits_per_char, ".4f"),
            f"{r.seconds:.1f}s",
        ]
        for r in results
    ]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in [head, *rows]]
    notes = [f"{r.data}: dropped {r.unknown_dropped} unknown character(s)" for r in results if r.unknown_dropped]
    return "\n".join([*lines, *notes])
