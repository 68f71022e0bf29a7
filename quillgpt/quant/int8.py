"""int8 and int8-channel: every linear of the blocks and the head stores int8 weights, with a
scale and an offset per 32 weights, W ≈ q·s + o (int8-channel: one scale per output channel,
W ≈ q·s), so a decode step streams 36 bytes per 32 fp32 weights' 128. A tied head keeps its
embedding for the lookup and gets its own int8 copy for the matmul. The blocks call an
Int8Linear exactly as they call nn.Linear; which kernel multiplies is its plan (quant/plan.py).

Why per 32 by default: on SmolLM2-135M-Instruct one scale per row lost greedy answers where a
scale and an offset per 32 weights kept them, for 12% more bytes a token (docs/performance.md
has the figures); per channel is asked for by name (fewer bytes, torch's bf16 kernels for a long
prompt).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quillgpt import huge_pages, native
from quillgpt.quant import group_codes
from quillgpt.quant.group_codes import Form
from quillgpt.quant.int8_kernels import FUSED_ROWS, KERNELS, Kernel, Offset, dequant_linear, grouped_sum
from quillgpt.quant.plan import RULE_PLAN, KernelPlan, cached_plan
from quillgpt.quant.scheme import ConvertOptions, Packed, Scheme


class Int8Linear(nn.Module):
    """y = x·Wᵀ + b with W from int8 q (out, in): W = q·s with one scale per output channel (out,),
    or W = q·s + o with a scale and an offset per group of `group` inputs of each output channel
    (out, in / group) — each group symmetric (o = 0) or its 256 levels over its range, whichever
    rebuilds it better (`from_linear`); s and o fp16 values (kept in the model's dtype, and as fp16
    for group_gemv, which streams them). The float bias b. The same call as nn.Linear:
    (…, in) → (…, out) in x's dtype. Where group_gemv runs the layer, `weight` holds q in its
    layout (native.interleave: four rows at a time); `codes()` is q row after row."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None, plan: KernelPlan, offset: Offset = None, bits: int = 8) -> None:
        """`bits`: the codes' range, 8 or fewer (int5's codes are int8 codes in [-16, 15])."""
        super().__init__()
        self.in_features, self.out_features, self.bits = weight.shape[1], weight.shape[0], bits
        self.register_buffer("scale", scale)  # (out,) or (out, in / group) in the model's dtype
        self.register_buffer("offset", offset)  # None, or (out, in / group) as the scales
        self.group = self.in_features // scale.shape[1] if scale.dim() == 2 else 0  # 0: per output channel
        # group_gemv's copies (per channel: one group of the whole row); None where the scales are
        # not fp16 values (a range fp16 cannot hold). Offsets all 0 (per channel, or every group
        # symmetric, as in a Q8_0 file) are kept empty: the kernel implies them and streams 2 bytes
        # fewer a group of 32 weights
        groups = scale if offset is not None else scale[:, None]  # (out, in / group)
        half = groups.half()
        exact = bool(torch.equal(half.to(scale.dtype), groups))
        offsets = offset is not None and bool(offset.any())
        self.register_buffer("scale_half", half if exact else None)
        self.register_buffer("offset_half", (offset.half() if offsets else half.new_empty(0)) if exact else None)
        self.register_buffer("bias", bias)
        self.plan = plan
        # kernel → what runs
        fits = {k: kern.fits(*weight.shape, self.group) and (exact or not kern.half) for k, kern in KERNELS.items()}
        self.runs = {k: k if fits[k] else kern.fallback for k, kern in KERNELS.items()}
        self.interleaved = self.runs["group_gemv"] == "group_gemv"
        # (out, in) int8; interleaved in huge pages (huge_pages: the decode step streams it)
        self.register_buffer("weight", native.interleave(weight, huge_pages.empty_like(weight)) if self.interleaved else weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, plan: KernelPlan, group: int = 0, bits: int = 8) -> Int8Linear:
        """Symmetric quantization per row (group 0, or a group that does not divide in_features):
        s = max|w| / 127, q = round(w / s) in [-127, 127]. Or per `group` weights of a row, each
        group in whichever of two forms reconstructs it with less squared error: over its range,
        s = (max - min) / 255 and o = min + 128·s, q in [-128, 127]; or symmetric, s = max|w| / 127,
        o = 0, q in [-127, 127] (exact on weights that were Q8_0, as real models' embeddings often
        are). s and o are rounded to fp16 values first, so q rounds to what is multiplied. A group
        whose offset fp16 cannot hold is kept symmetric; a layer with a group neither form holds
        (|w| past 127 × 65504) keeps per-row scales, in fp32 where fp16 cannot hold them either.
        `bits` < 8: the same forms over 2**bits levels (int5: [-16, 15]), the symmetric one as
        llama.cpp's Q5_0 makes it, s = m / -16 for the weight m of largest magnitude (exact on
        weights that were Q5_0, as Gemma 3's q, k, gate and up are)."""
        bias = None if linear.bias is None else linear.bias.detach().clone()
        p = pack(linear.weight, group, bits)
        return cls(p["codes"], p["scale"], bias, plan, p.get("offset"), bits)

    @property
    def low_dtype(self) -> torch.dtype:
        """The "/bf16" kernels' activation dtype: bf16 for a float32 model, a bf16/fp16 model's own."""
        return torch.bfloat16 if self.scale.dtype == torch.float32 else self.scale.dtype

    def codes(self) -> Tensor:
        """q (out, in) int8, row after row (what every kernel but group_gemv takes)."""
        return native.deinterleave(self.weight) if self.interleaved else self.weight

    def dequantized(self) -> Tensor:
        """(out, in) float32 q·s (+ o): the weight this layer multiplies by (to rounding)."""
        return unpack({"codes": self.codes(), "scale": self.scale, "offset": self.offset})

    def forward(self, x: Tensor) -> Tensor:
        if self.group and x.dim() == 2 and torch.compiler.is_compiling():
            # the compiled decode step: group_gemv (one extern kernel) up to FUSED_ROWS rows, and past them
            # where the plan measured it fastest (a 16-row server: dequantizing every weight each step
            # cost more); else one fused loop for a few rows, and dequantize for more (int8pack_mm's
            # group-wise form crashes inductor's lowering: its spread input is computed)
            m, gemv = x.shape[0], self.runs["group_gemv"] == "group_gemv"
            if gemv and (m <= FUSED_ROWS or self.plan.pick(m) == "group_gemv"):
                return self.linear(x, "group_gemv")
            kernel = grouped_sum if m <= FUSED_ROWS else dequant_linear
            return self._out(kernel(x, self.codes(), self.scale, self.offset), x)
        if x.dim() == 2:  # (M, in): the decode step
            return self.linear(x, self.plan.pick(x.shape[0]))
        x2 = x.reshape(-1, x.shape[-1])
        return self.linear(x2, self.plan.pick(x2.shape[0])).view(*x.shape[:-1], self.out_features)

    def runs_native(self) -> bool:
        return self.runs["group_gemv"] == "group_gemv" and self.plan.may_pick("group_gemv")

    def packed(self) -> Packed:
        """The layer's codes, scales and offsets in pack's form (what `store` writes)."""
        packed = {"codes": self.codes(), "scale": self.scale}
        return packed if self.offset is None else {**packed, "offset": self.offset}

    def rows(self, idx: Tensor) -> Tensor:
        """(len(idx), in) float32 rows of the weight (an embedding lookup), without the whole weight."""
        q = native.rows_of(self.weight, idx) if self.interleaved else self.weight[idx]
        offset = None if self.offset is None else self.offset[idx]
        return unpack({"codes": q, "scale": self.scale[idx], "offset": offset})

    def native_weights(self, rows: int) -> tuple[Tensor, Tensor, Tensor, native.Format] | None:
        """(int8 q, fp16 s, fp16 o, their format) for the native decoder, where this layer runs group_gemv at `rows` rows."""
        if self.runs["group_gemv"] != "group_gemv" or self.plan.pick(rows) != "group_gemv":
            return None
        return self.weight, self.scale_half, self.offset_half, native.Format.INT8

    def linear(self, x: Tensor, kernel: str) -> Tensor:
        """(M, in) → (M, out) in x's dtype through `kernel`, or its fallback where it cannot take this shape."""
        kern = KERNELS[self.runs[kernel]]
        return self._out(kern.matmul(x, self.weight if kern.half else self.codes(), *self.scales_for(kern)), x)

    def scales_for(self, kern: Kernel) -> tuple[Tensor, Offset]:
        """The copy of the scales and offsets `kern` takes: bf16, fp16 (group_gemv) or the model's dtype."""
        if kern.bf16:  # cast per call (1/32 of the weight's elements at most): no third copy kept
            low = self.low_dtype
            return self.scale.to(low), None if self.offset is None else self.offset.to(low)
        return (self.scale_half, self.offset_half) if kern.half else (self.scale, self.offset)

    def _out(self, y: Tensor, x: Tensor) -> Tensor:
        """A kernel's output + the bias, in x's dtype."""
        return (y if self.bias is None else self.bias + y).to(x.dtype)

    def extra_repr(self) -> str:
        scales = f"{self.group} weights per scale" if self.group else "per-channel scales"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int{self.bits}, {scales}"


def _group_codes(w: Tensor, group: int, bits: int) -> Form:
    """Codes of `bits` (int8 for 8), scales and offsets of w's groups, each in the form (symmetric
    or over its range, see Int8Linear.from_linear) with the smaller squared error."""
    top, mid = 2 ** (bits - 1) - 1, 2 ** (bits - 1)  # 127, 128 for int8
    wg, low, high = group_codes.grouped(w, group)
    if bits == 8:  # Q8_0's: ±127 steps of max|w| / 127
        sym, least = _fp16_values(torch.maximum(-low, high) / top, w.dtype), -top
    else:  # Q5_0's: the weight of largest magnitude at code -mid (the scale takes its sign)
        sym, least = _fp16_values(torch.where(-low > high, low, high) / -mid, w.dtype), -mid
    zero = torch.zeros_like(sym)
    symmetric = (group_codes.codes(wg, sym, zero, least, top), sym, zero)
    scale = _fp16_values((high - low) / (top + mid), w.dtype)
    offset = _fp16_values(low + mid * scale, w.dtype)
    ranged = (group_codes.codes(wg, scale, offset, -mid, top), scale, offset)
    return group_codes.better(wg, symmetric, ranged)


def _fp16_values(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t (float32) as a scale or offset is stored: an fp16 value (group_gemv reads fp16), held in the
    model's dtype; inf where fp16 cannot hold it."""
    return t.half().to(dtype).float()


# --- the scheme: storage, conversion, the stats line ---------------------------------------------


def pack(w: Tensor, group: int, bits: int = 8) -> Packed:
    """w (out, in) → {"codes": int8 (out, in), "scale": (out,) or (out, in / group), and "offset"
    where group-wise} in w's dtype: see Int8Linear.from_linear for the forms (`bits`: their range)."""
    out, inp = w.shape
    w, top = w.detach(), 2 ** (bits - 1) - 1
    if group and inp % group == 0 and group < inp:
        q, scale, offset = _group_codes(w, group, bits)
        if scale.isfinite().all() and offset.isfinite().all():
            return {"codes": q.view(out, inp).to(torch.int8), "scale": scale.to(w.dtype), "offset": offset.to(w.dtype)}
    tiny = torch.finfo(torch.float32).tiny
    scale = w.float().abs().amax(dim=1) / top
    if (half := _fp16_values(scale, w.dtype)).isfinite().all():  # fp16 values where they hold (group_gemv reads fp16)
        scale = half
    q = torch.round(w.float() / scale.clamp(min=tiny)[:, None]).clamp_(-top, top)
    return {"codes": q.to(torch.int8), "scale": scale.to(w.dtype)}


def unpack(packed: Packed) -> Tensor:
    """pack's inverse to its rounding: (out, in) float32 q·s (+ o)."""
    q = packed["codes"]
    n, k = q.shape
    s = packed["scale"].float().view(n, -1)
    w = q.float().view(n, s.shape[1], -1) * s[:, :, None]
    offset = packed.get("offset")
    return (w if offset is None else w + offset.float()[:, :, None]).view(n, k)


def store(packed: Packed) -> Packed:
    """pack's tensors as a run stores them: the codes row after row, the scales and offsets fp16 (a
    per-row form of a group-wise scheme spread to its groups, so every layer of a scheme has one
    layout); weights beyond fp16's range cannot be stored."""
    codes, scale, offset = packed["codes"], packed["scale"], packed.get("offset")
    half = scale.half()
    if not half.isfinite().all() or (offset is not None and not offset.half().isfinite().all()):
        raise ValueError("a scale or offset is past fp16's range (weights past 8e6)")
    out = {"codes": codes, "scale": half}
    return out if offset is None else {**out, "offset": offset.half()}


def stored_shapes(out_features: int, in_features: int, group: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    shapes = {"codes": (torch.int8, (out_features, in_features))}
    if group == 0 or group >= in_features:
        return {**shapes, "scale": (torch.float16, (out_features,))}
    groups = (torch.float16, (out_features, in_features // group))
    return {**shapes, "scale": groups, "offset": groups}


def load(stored: Packed, bias: Tensor | None, dtype: torch.dtype, bits: int = 8) -> Int8Linear:
    offset = stored.get("offset")
    bias = None if bias is None else bias.to(dtype)
    return Int8Linear(stored["codes"], stored["scale"].to(dtype), bias, RULE_PLAN, None if offset is None else offset.to(dtype), bits)


def linear(lin: nn.Linear, group: int, kernel: str | None = None) -> Int8Linear:
    """One layer in int8 running `kernel` for every input (None: dequant/model until a plan is set)."""
    return Int8Linear.from_linear(lin, KernelPlan((1,), (kernel or "dequant/model",)), group)


def convert(model: nn.Module, group: int, options: ConvertOptions, bits: int = 8) -> None:
    """Swap every nn.Linear of `model` (a GPT: the blocks' and the head) for an Int8Linear, in
    place. options.kernel (a KERNELS name) fixes one kernel for every input; else one plan for
    every layer, measured at options.rows (or the one kept for this machine: options.cache).
    `bits`: the codes' range (int5: 5)."""
    kernel, rows = options.kernel, options.rows
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    places = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children() if isinstance(child, nn.Linear)
    ]
    layers = [Int8Linear.from_linear(lin, KernelPlan((1,), (kernel or "dequant/model",), rows), group, bits) for _, _, lin in places]
    if kernel is None:
        first = {id(m) for m in model.transformer.h[0].modules()}
        pairs = [(lin, q) for (_, _, lin), q in zip(places, layers)]
        plan = cached_plan(pairs, [p for p in pairs if id(p[0]) in first], rows, options.cache)
        for q in layers:
            q.plan = plan
    for (parent, name, _), q in zip(places, layers):
        setattr(parent, name, q)


def plan_of(model: nn.Module) -> KernelPlan | None:
    """The kernel plan of an int8 model's blocks (None: their weights are not int8)."""
    return next((m.plan for m in model.transformer.h.modules() if isinstance(m, Int8Linear)), None)


def note(model: nn.Module, sep: str, compiled: bool) -> str:
    """The stats line's words for an int8 model: its plan's, or the compiled step's few-rows kernel
    (`compiled`); why group_gemv is missing where it was asked for but did not build."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    group = max(m.group for m in layers)  # a layer whose width the group does not divide has per-channel scales
    what = f"int{max(m.bits for m in layers)} weights"
    missing = f" (group_gemv did not build: {native.why_not()})" if group and native.why_not() else ""
    if group and compiled:
        gemv = any(m.runs["group_gemv"] == "group_gemv" for m in layers)
        how = "group_gemv in the compiled step" if gemv else "grouped_sum fused into the compiled step"
        more = " and where measured fastest" if gemv and layers[0].plan.pick(layers[0].plan.rows) == "group_gemv" else ""
        return f"{sep}{what} ({group} per scale), {how} (up to {FUSED_ROWS} rows{more}){missing}"
    return f"{sep}{layers[0].plan.describe(f' ({group} per scale)' if group else ' (per-channel scales)', what)}{missing}"


# kernel → the relative error it may have against the reference: its activations' rounding (bf16:
# 2**-8 a value, summed; int16 per 32: ~2e-5)
TOLERANCES = {k: 1e-2 if kern.bf16 else max(1e-5, kern.rounding) for k, kern in KERNELS.items()}


def _scheme(name: str, group: int, help: str) -> Scheme:
    return Scheme(name, help, 8, group, Int8Linear, linear, convert, note, pack, unpack, TOLERANCES, store, stored_shapes, load)


INT8 = _scheme(
    "int8",
    32,
    "weight-only int8 linears with a scale and an offset per 32 weights (each group symmetric or over its range, "
    "whichever is closer), through the kernel measured fastest here (measured once per machine and model shape)",
)
INT8_CHANNEL = _scheme("int8-channel", 0, "one int8 scale per output channel (fewer bytes, a faster long prompt, less exact)")
