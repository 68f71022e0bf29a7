"""See what the model does: attention heatmaps, per-head statistics and loss curves.

Attention weights come from `GPT.attention_maps`, the explicit softmax(QKᵀ/√d) path, so
they are the numbers the model used, not a re-derivation. Heads are summarised by three
numbers that separate the usual kinds: mean attention distance (local vs far), entropy
(focused vs spread) and weight on the first token (the "attention sink"). `attention_report` is
`quill attention`: a run's attention to one prompt, drawn or printed, its head summary saved.

matplotlib is optional (`pip install -e ".[plot]"`). It is imported only when drawing, and
only through `matplotlib.figure.Figure`, never pyplot: nothing global such as the backend
changes, PNGs are rendered by Agg and no display is needed. Without it the text views work.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from quillgpt.checkpoint import resolve_checkpoint
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.evaluate.figures import IMAGE_FORMATS, matplotlib_figure, save_figure
from quillgpt.files import check_output_file, write_file
from quillgpt.inference.driver import encode_prompt
from quillgpt.model.gpt import GPT, evaluating
from quillgpt.runs import LoadOptions, load_run

FIRST_TOKEN_SINK = 0.5  # a head putting at least this much weight on token 0 "looks at the first token"
LOCAL_FRACTION = 0.5  # a head is "local" below this fraction of uniform attention's mean distance

# --- collecting the weights -------------------------------------------------------------------


@dataclass
class Attention:
    """One prompt's attention, every layer and head."""

    ids: list[int]  # the token ids that were run (after cropping)
    tokens: list[str]  # a readable label per token (see token_label)
    weights: list[Tensor]  # per layer (n_head, T, T) float32 on CPU; row i = query i, sums to 1
    cropped: int  # tokens dropped from the front because the prompt exceeded block_size
    prefix: int = 0  # prefix-LM: the prompt is the prefix, its tokens attend both ways
    gates: list[Tensor] | None = None  # Infini-attention: per layer, each head's sigmoid(β)


def visible(T: int, prefix: int = 0) -> np.ndarray:
    """(T, T) bool: which keys a query may see — the past, plus the whole prefix inside the prefix."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    return (j <= i) | ((i < prefix) & (j < prefix))


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", " ": "␣"}


def token_label(raw: bytes) -> str:
    """One token's bytes as printable text: whitespace made visible, cut UTF-8 as \\xNN.

    A BPE token can hold half of a multi-byte character; decoding it alone would give U+FFFD,
    which hides which bytes it was.
    """
    text = raw.decode("utf-8", errors="surrogateescape")  # a stray byte b becomes U+DC00 + b
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif "\udc80" <= ch <= "\udcff":
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif not ch.isprintable():
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def _cropped_prompt(tokenizer: Tokenizer, prompt: str, block_size: int) -> tuple[list[int], int]:
    """(ids of the prompt's last block_size tokens, number of tokens cropped from the front).

    Cropping keeps the end of the prompt: that is the context the model would condition on
    when generating from it. Unknown characters get the same error as in `quill sample`.
    """
    if not prompt:
        raise QuillError("the prompt is empty; pass some text with --prompt")
    ids = encode_prompt(tokenizer, prompt)
    cropped = max(0, len(ids) - block_size)
    return ids[cropped:], cropped


def attention_weights(model: GPT, tokenizer: Tokenizer, prompt: str, max_tokens: int | None = None) -> Attention:
    """Run the prompt once and collect every layer's and head's attention weights: of its last
    block_size tokens, or its last `max_tokens` where that is fewer (the web page's bound)."""
    limit = min(model.config.block_size, max_tokens or model.config.block_size)
    ids, cropped = _cropped_prompt(tokenizer, prompt, limit)
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    prefix = len(ids) if model.variant.bidirectional_prefix else 0  # the prompt is the prefix
    with evaluating(model):
        maps = model.attention_maps(idx, prefix_len=torch.tensor([prefix], device=device) if prefix else None)
    weights = [m[0].float().cpu() for m in maps]
    tokens = [token_label(tokenizer.decode_bytes([i])) for i in ids]
    gates = model.variant.shows(model).get("gates")  # Infini-attention's memory gates
    return Attention(ids, tokens, weights, cropped, prefix, gates)


# --- per-head summary -------------------------------------------------------------------------


def head_summary(weights: list[Tensor]) -> list[dict[str, Any]]:
    """Per layer and head: mean distance, entropy and first-token weight, averaged over queries.

    For query i, distance = Σ_j w_ij·(i−j) (tokens back), entropy = −Σ_j w_ij·ln w_ij (nats),
    first-token weight = w_i0. Query 0 is left out of the averages when T > 1: it can only
    attend to itself, so it says nothing about the head. `focus` names the kind: "first"
    (weight on token 0 ≥ FIRST_TOKEN_SINK), "local" (distance below LOCAL_FRACTION of what
    uniform causal attention would give) or "far".
    """
    rows = []
    for layer, w in enumerate(weights):  # w: (H, T, T)
        T = w.shape[-1]
        w = w.double()
        back = torch.arange(T, dtype=w.dtype)[:, None] - torch.arange(T, dtype=w.dtype)[None, :]  # (T, T) i−j
        distance = (w * back.clamp(min=0)).sum(-1)  # (H, T)
        entropy = -(w * torch.log(w.clamp(min=1e-30))).sum(-1)  # (H, T); 0·ln 0 = 0
        first = w[..., 0]  # (H, T)
        queries = slice(1, None) if T > 1 else slice(None)
        uniform = (torch.arange(T, dtype=w.dtype) / 2)[queries].mean().item()  # Σ_j (i−j)/(i+1) = i/2
        for head in range(w.shape[0]):
            d = distance[head, queries].mean().item()
            f = first[head, queries].mean().item()
            if f >= FIRST_TOKEN_SINK:
                focus = "first"
            elif d < LOCAL_FRACTION * uniform:
                focus = "local"
            else:
                focus = "far"
            rows.append(
                {
                    "layer": layer,
                    "head": head,
                    "mean_distance": d,
                    "entropy": entropy[head, queries].mean().item(),
                    "first_token_weight": f,
                    "focus": focus,
                }
            )
    return rows


def format_head_table(summary: list[dict[str, Any]]) -> str:
    """The summary as an aligned text table."""
    lines = [f"{'layer':>5} {'head':>4} {'distance':>8} {'entropy':>7} {'first':>5}  focus"]
    for r in summary:
        lines.append(
            f"{r['layer']:>5} {r['head']:>4} {r['mean_distance']:>8.2f} {r['entropy']:>7.2f} {r['first_token_weight']:>5.2f}  {r['focus']}"
        )
    return "\n".join(lines)


def format_gates(gates: list[Tensor]) -> str:
    """Infini-attention: each head's gate sigmoid(β), the share of its output read from memory."""
    lines = ["memory gate sigmoid(β) per head (1 = reads only memory, 0 = only local attention)"]
    lines += [f"  layer {layer}: " + " ".join(f"{v:.2f}" for v in g.tolist()) for layer, g in enumerate(gates)]
    return "\n".join(lines)


def write_summary_json(path: str | Path, attention: Attention, summary: list[dict[str, Any]], force: bool = False, **info: Any) -> Path:
    """Save the head summary with the tokens it was measured on (and `info`, e.g. the run); an
    existing file there that is not a head summary is replaced only with `force`."""
    path = check_output_file(path, "--summary-json", kind="heads-json", force=force)
    record = {**info, "tokens": attention.tokens, "ids": attention.ids, "cropped": attention.cropped, "heads": summary}
    if attention.prefix:
        record["prefix"] = attention.prefix
    if attention.gates is not None:
        record["gates"] = [g.tolist() for g in attention.gates]
    data = (json.dumps(record, indent=1, ensure_ascii=False) + "\n").encode("utf-8")
    write_file(path, lambda f: f.write(data), "--summary-json")
    return path


# --- choosing what to show --------------------------------------------------------------------


def select_layers(layer: str | int, n_layer: int) -> list[int]:
    """'all' → every layer; an int (negative counts from the end, -1 = last) → that layer."""
    if layer == "all":
        return list(range(n_layer))
    try:
        index = int(layer)
    except ValueError:
        raise QuillError(f"--layer must be a layer number or 'all', got {layer!r}") from None
    if not -n_layer <= index < n_layer:
        raise QuillError(f"--layer {index} is out of range: the model has layers 0..{n_layer - 1}")
    return [index % n_layer]


def select_heads(head: int | None, n_head: int) -> list[int]:
    """None → every head; otherwise that head (checked against the model)."""
    if head is None:
        return list(range(n_head))
    if not 0 <= head < n_head:
        raise QuillError(f"--head {head} is out of range: the model has heads 0..{n_head - 1}")
    return [head]


def output_format(out: str | Path | None, fmt: str | None) -> Literal["png", "svg", "text"]:
    """The view to produce: --format when given, else --out's extension, else text."""
    suffix = Path(out).suffix.lower().lstrip(".") if out is not None else None
    if fmt is None:
        if out is None:
            return "text"
        if suffix not in IMAGE_FORMATS:
            raise QuillError(f"--out {out} must end in .png or .svg (or pass --format text)")
        return suffix  # type: ignore[return-value]
    if fmt not in (*IMAGE_FORMATS, "text"):
        raise QuillError(f"--format must be png, svg or text, got {fmt!r}")
    if fmt == "text" and out is not None:
        raise QuillError("--format text prints to the terminal; drop --out (--summary-json saves the head summary)")
    if fmt in IMAGE_FORMATS and suffix is not None and suffix != fmt:
        raise QuillError(f"--format {fmt} does not match --out {out}; use a .{fmt} file name")
    return fmt  # type: ignore[return-value]


# --- text view --------------------------------------------------------------------------------


def render_text(
    tokens: list[str],
    weights: list[Tensor],
    layers: list[int],
    heads: list[int],
    top_k: int = 3,
    prefix: int = 0,
) -> str:
    """For each query token, its top-k attended tokens with weights — for terminals (a prefix-LM's
    prefix queries also look right, up to the end of the prefix)."""
    if top_k < 1:
        raise QuillError(f"--top-k must be at least 1, got {top_k}")
    width = max(len(t) for t in tokens)
    cell = width + 10  # "label@pos 0.00"
    lines = []
    for layer in layers:
        for head in heads:
            lines.append(f"layer {layer} head {head}: query → top-{top_k} keys (token@position weight)")
            w = weights[layer][head]  # (T, T)
            for i, tok in enumerate(tokens):
                seen = max(i + 1, prefix if i < prefix else 0)  # query i sees 0..i (or the whole prefix)
                values, where = torch.topk(w[i, :seen], min(top_k, seen))
                picks = "".join(f"{tokens[j]}@{j} {v:.2f}".ljust(cell) for v, j in zip(values.tolist(), where.tolist()))
                lines.append(f"  {i:>3d} {tok:<{width}} → {picks}".rstrip())
    return "\n".join(lines)


# --- drawing ----------------------------------------------------------------------------------


def _layout(n_tokens: int, n_layers: int, n_heads: int) -> tuple[int, int, float]:
    """(rows, cols, panel inches): one layer's heads in a near-square grid, several layers as
    layer × head thumbnails; panels grow with the prompt up to a cap."""
    if n_layers > 1:
        rows, cols = n_layers, n_heads
    else:
        cols = math.ceil(math.sqrt(n_heads))
        rows = math.ceil(n_heads / cols)
    n = rows * cols
    per_token = 0.28 if n == 1 else 0.16 if n <= 16 else 0.08
    panel = min(max(per_token * n_tokens, 2.0), 12.0 if n == 1 else 4.0)
    return rows, cols, round(panel * 4) / 4  # quarter inches: whole pixels at common dpis


SMALLEST_LABEL_PT = 5.0  # token labels shrink to this (7 px at the default 100 dpi) before only every k-th one is drawn


def tick_labels(n_tokens: int, panel: float, fontsize: float) -> tuple[list[int], float]:
    """(the tokens labelled along a panel side, their font size): every token, in a font small
    enough that they fit (down to SMALLEST_LABEL_PT); past that, every k-th one at that size."""
    size = min(fontsize, panel * 72 / (n_tokens * 1.25))  # 72 pt an inch, 1.25: a label's line height
    if size >= SMALLEST_LABEL_PT:
        return list(range(n_tokens)), size
    size = min(fontsize, SMALLEST_LABEL_PT)
    fit = max(1, int(panel * 72 / (size * 1.25)))
    return list(range(0, n_tokens, max(1, math.ceil(n_tokens / fit)))), size


def key_label_rotation(labels: list[str]) -> int:
    """The key axis's labels side by side: characters read best upright, words on their side."""
    return 0 if max(map(len, labels), default=0) <= 2 else 90


def attention_figsize(n_tokens: int, n_layers: int, n_heads: int) -> tuple[float, float]:
    """Figure (width, height) in inches that plot_attention uses: panels plus room for
    labels, titles and the colour bar."""
    rows, cols, panel = _layout(n_tokens, n_layers, n_heads)
    return cols * panel + 1.5, rows * panel + 1.0


def plot_attention(
    tokens: list[str],
    weights: list[Tensor],
    out: str | Path,
    layers: list[int],
    heads: list[int],
    title: str | None = None,
    dpi: int = 100,
    prefix: int = 0,
    gates: list[Tensor] | None = None,
    force: bool = False,
) -> Path:
    """Heatmaps of the chosen layers × heads (query down, key across), saved as PNG or SVG (an
    existing file there that is not such an image is replaced only with `force`).

    Colours share one 0..1 scale so heads can be compared; the future (upper triangle) is
    left blank, except a prefix-LM's prefix block (square: it attends both ways). With `gates`
    (Infini-attention) each panel's title gives the head's memory gate sigmoid(β). Every token is
    labelled (tick_labels), on every panel for one layer, on the outer ones for several.
    """
    out = Path(out)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in IMAGE_FORMATS:
        raise QuillError(f"{out}: the image must be .png or .svg")
    with matplotlib_figure() as Figure:
        T = len(tokens)
        rows, cols, panel = _layout(T, len(layers), len(heads))
        fig = Figure(figsize=attention_figsize(T, len(layers), len(heads)), dpi=dpi, layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False)
        panels = [(layer, h) for layer in layers for h in heads]
        outer_only = len(layers) > 1  # thumbnails: labels on the left column and bottom row
        fontsize = 9 if rows * cols == 1 else 7  # thumbnails too: 7 pt is the least a title reads at 100 dpi
        ticks, label_size = tick_labels(T, panel, fontsize)
        rotation = key_label_rotation([tokens[i] for i in ticks])
        future = ~visible(T, prefix)
        image = None
        for n, ax in enumerate(axes.flat):
            if n >= len(panels):
                ax.set_axis_off()
                continue
            layer, head = panels[n]
            w = np.ma.masked_array(weights[layer][head].numpy(), mask=future)  # (T, T)
            image = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            gate = f", gate {gates[layer][head]:.2f}" if gates else ""
            ax.set_title(f"layer {layer} head {head}{gate}", fontsize=fontsize + 1)
            r, c = divmod(n, cols)
            left, bottom = not outer_only or c == 0, not outer_only or r == rows - 1
            ax.set_yticks(ticks, [tokens[i] for i in ticks] if left else [], fontsize=label_size)
            ax.set_xticks(ticks, [tokens[i] for i in ticks] if bottom else [], fontsize=label_size, rotation=rotation)
            ax.tick_params(length=0)
            if c == 0:
                ax.set_ylabel("query", fontsize=fontsize)
            if r == rows - 1 or n + cols >= len(panels):
                ax.set_xlabel("key (attended to)", fontsize=fontsize)
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
        if title:
            fig.suptitle(title, fontsize=10)
        save_figure(fig, out, fmt, dpi, force)
    return out


# --- loss curves ------------------------------------------------------------------------------


# --- quill attention --------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionRequest:
    """What `quill attention` shows of one prompt: which layer(s) and head(s), as text (top_k
    attended tokens per query) or an image at `out`, and where the per-head summary goes."""

    prompt: str
    layer: str = "-1"  # a layer number (negative from the end) or "all"
    head: int | None = None  # None: every head
    out: Path | None = None  # png/svg without it: attention.png/.svg
    fmt: str | None = None  # png, svg or text; None: from out's extension, text without out
    top_k: int = 3
    summary_json: Path | None = None  # None: <out stem>.heads.json beside out (none for text)
    force: bool = False  # replace an existing file that is not an earlier image / summary


@dataclass
class AttentionReport:
    """What `quill attention` found and wrote: the lines to print, and a note on a cropped prompt."""

    attention: Attention
    summary: list[dict[str, Any]]  # every layer's heads (head_summary)
    text: str  # the text view (or nothing for an image), the head table, the gates, what was saved
    note: str | None  # the prompt was longer than block_size: what was kept


def _outputs(ckpt: str | Path, options: LoadOptions, request: AttentionRequest) -> tuple[str, Path | None, Path | None]:
    """(view, image path, summary path), both outputs checked before the checkpoint loads (neither
    may replace the checkpoint read): png/svg without --out write attention.png/.svg, the summary goes beside."""
    view, out, summary_json = output_format(request.out, request.fmt), request.out, request.summary_json
    if view != "text" and out is None:
        out = Path(f"attention.{view}")
    if summary_json is None and out is not None:
        summary_json = out.with_name(f"{out.stem}.heads.json")
    try:
        inputs: tuple[Path, ...] = (resolve_checkpoint(ckpt, options.which),)
    except QuillError:
        inputs = ()  # loading it says why
    if out is not None:
        check_output_file(out, "--out", kind=view, force=request.force, inputs=inputs)
    if summary_json is not None:
        check_output_file(summary_json, "--summary-json", kind="heads-json", force=request.force, inputs=inputs)
    return view, out, summary_json


def attention_report(ckpt: str | Path, options: LoadOptions, request: AttentionRequest) -> AttentionReport:
    """Run `request.prompt` once through a run (with the weights `options` asks for, so a quantized
    model's attention is shown even where it runs no faster), draw or render the chosen heads, save
    the head summary of every layer; the report to print."""
    view, out, summary_json = _outputs(ckpt, options, request)
    run = load_run(ckpt, options)
    mcfg = run.config.model
    layers, heads = select_layers(request.layer, mcfg.n_layer), select_heads(request.head, mcfg.n_head)
    attn = attention_weights(run.model, run.tokenizer, request.prompt)
    note = None
    if attn.cropped:
        note = (
            f"note: the prompt is longer than block_size={mcfg.block_size}; kept its last {len(attn.ids)} tokens (dropped {attn.cropped})"
        )
    summary, lines = head_summary(attn.weights), []
    if view == "text":
        lines.append(render_text(attn.tokens, attn.weights, layers, heads, request.top_k, prefix=attn.prefix))
    else:
        title = f"{run.path} (step {run.step}): {''.join(attn.tokens)}"
        plot_attention(
            attn.tokens, attn.weights, out, layers, heads, title=title[:120], prefix=attn.prefix, gates=attn.gates, force=request.force
        )
    lines += ["", format_head_table([r for r in summary if r["layer"] in layers and r["head"] in heads])]
    if attn.gates is not None:
        lines.append(format_gates(attn.gates))
    if summary_json is not None:
        info = {"checkpoint": str(run.path), "step": run.step, "prompt": request.prompt}
        write_summary_json(summary_json, attn, summary, force=request.force, **info)
        lines.append(f"saved head summary (all layers) → {summary_json}")
    if out is not None and view != "text":
        lines.append(f"saved {view} → {out}")
    return AttentionReport(attn, summary, "\n".join(lines), note)
