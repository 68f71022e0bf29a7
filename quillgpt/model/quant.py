"""--quantize: int8 here, int4 in model/int4.py (quantize() swaps in either).

Weight-only int8: every linear layer of the blocks and the head stores int8 weights with a scale
and an offset per 32 weights, W ≈ q·s + o (int8-channel: one scale per output channel, W ≈ q·s),
so a decode step streams 36 bytes per 32 fp32 weights' 128.

`quantize(model, "int8")` swaps each nn.Linear for an `Int8Linear` once, from the model's own
weights (no new checkpoint format). A tied head keeps its embedding for the lookup and gets its
own int8 copy for the matmul. The blocks call an Int8Linear exactly as they call nn.Linear.

Which kernel multiplies is measured, not assumed: at quantize time each candidate (quill's C++
group_gemv where it builds, int8 matmul `torch._weight_int8pack_mm`, or dequantize then
F.linear; activations in bf16, int16 per 32 or the model's dtype) is timed against the F.linear
it replaces — at the decode batch `rows` on every layer (what a decode step streams), and at 1,
2, 4, … 256 rows on the first block's layers. An input of m rows then runs the kernel that was
fastest at the smallest measured size ≥ m, so a one-token decode step and a 512-token prompt may
take different kernels (their results agree to bf16 rounding). Where no int8 kernel beats the
float linears at the decode batch (a tiny model, or a burst of load during the measurement) the
fastest int8 kernel still runs, as asked, and the stats line says it measured slower. On CUDA
the dequantize form is gpt-fast's; it pays there once the decode step is compiled (inductor
fuses the dequantization into the matmul), which the engine's compile=True does.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt import native
from quillgpt.errors import QuillError
from quillgpt.model import group_codes, int4, kernel_cache
from quillgpt.model.fusion import stored
from quillgpt.model.gpt import GPT
from quillgpt.model.group_codes import Form
from quillgpt.model.int4 import Int4Linear

# scheme → weights per scale (0: one per output channel, symmetric; else a scale and an offset per
# group). On SmolLM2-135M-Instruct one scale per row (576-1536 weights) lost greedy answers (the
# sleeping-tips prompt: "1. **1.1.1.1…"; scripts/quant_real.py: +0.28% loss, 95.8% top-1, 3 of 10
# answers) where a scale and an offset per 32 weights kept them (+0.001%, 99.6%, 10 of 10) for 12%
# more bytes a token, and decoded faster there through group_gemv: so int8 is per 32, and
# int8-channel (fewer bytes, torch's bf16 kernels for a long prompt) is asked for by name.
SCHEMES = {"int8": 32, "int8-channel": 0}
# int4 scheme → weights per scale and zero (model/int4.py): chosen by scripts/quant_real.py on SmolLM2
INT4_SCHEMES = {"int4": 32, "int4-g64": 64, "int4-g128": 128}


def parse_quantize(name: str | None, setting: str = "--quantize") -> str | None:
    """A scheme a user names: int8, int8-channel, int4, int4-g64, int4-g128, or none / None for the float weights."""
    if name is None or name == "none":
        return None
    if name not in SCHEMES and name not in INT4_SCHEMES:
        raise QuillError(f"{setting} must be {', '.join([*SCHEMES, *INT4_SCHEMES])} or none, got {str(name)[:60]!r}")
    return name


# --- kernels: (x (M, K), weight int8 (N, K), scale (N,) or (N, K/G), offset None or (N, K/G)) → (M, N),
# x cast to the scale's dtype; W = q·s per output channel, or q·s + offset per group of G inputs ---

Offset = Tensor | None
FUSED_ROWS = 8  # group-wise layers of a compiled step with this many rows or fewer: group_gemv where it builds, else
# grouped_sum (at 16 rows inductor chose a loop order ~100x slower; up to 8 it beat dequantize + F.linear 3-16x on SmolLM2)


def int8pack_mm(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    """torch's int8 × bf16/fp16/fp32 matmul with one scale per output channel. Group-wise scales
    (N, K/G): the kernel multiplies x spread over K/G rows, row g keeping only group g's inputs,
    by the weight with unit scales (one pass over the weight, K/G times the multiply-adds); each
    group's partial sums are scaled and added, and each group's offset times its inputs' sum."""
    x = x.to(scale.dtype).contiguous()  # .to keeps x's strides: a transposed x's spread would not view
    if scale.dim() == 1:
        return _int8pack(x, weight, scale)
    (m, k), groups = x.shape, scale.shape[1]
    xg = x.view(m, 1, groups, k // groups)
    spread = (xg * torch.eye(groups, dtype=x.dtype, device=x.device)[:, :, None]).view(m * groups, k)
    parts = _int8pack(spread, weight, torch.ones_like(scale[:, 0])).view(m, groups, -1)
    y = torch.einsum("mgn,ng->mn", parts.float(), scale.float())
    if offset is not None:
        y = y + xg[:, 0].float().sum(-1) @ offset.float().t()
    return y.to(scale.dtype)


def _int8pack(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    x = x.contiguous()
    # its bf16/fp16 SIMD loads are aligned: a view into a larger tensor gets a fresh copy (compiled: no
    # address to test while tracing, so always; a decode step's x is one row per sequence)
    if torch.compiler.is_compiling() or x.data_ptr() % 64:
        x = x.clone()
    return torch._weight_int8pack_mm(x, weight, scale)


def dequant_linear(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    if scale.dim() == 1:
        return F.linear(x.to(scale.dtype), weight.to(scale.dtype)) * scale
    n, k = weight.shape
    w = weight.view(n, scale.shape[1], -1).to(scale.dtype) * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return F.linear(x.to(scale.dtype), w.view(n, k))


def gemv_linear(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    """quillgpt/native's C++ kernel: weights in groups of a multiple of 32 (per channel: one
    group a row, offsets 0) with fp16 scales and offsets (Int8Linear's scale_half, offset_half), x
    rounded to int16 per 32 inputs and multiplied in integer pairs; float32 out."""
    assert offset is not None and scale.dtype == torch.float16, "group_gemv takes (out, groups) fp16 scales and offsets"
    return native.group_gemv(x.float(), weight, scale, offset)


def grouped_sum(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset = None) -> Tensor:
    """Σ_k x·(q·s + o) written as elementwise products and a sum over each output's inputs: no
    kernel of its own, but inside a compiled step inductor fuses it into one loop that reads each
    int8 weight once and dequantizes it in registers (eager, it would build an (M, N, K) product:
    never taken there). Two forms of one sum: on AVX-512 int8 lanes load directly; elsewhere
    the int8 weights are read four to a 32-bit word (_packed_sum)."""
    x = x.float()
    x = stored(x)  # else inductor recomputes x's producer (an RMSNorm) for every weight: 2-3x slower
    if PACKED_LOADS and (weight.shape[1] // scale.shape[1]) % 4 == 0:  # whole words per group
        return _packed_sum(x, weight, scale.float(), offset)
    n, k = weight.shape
    groups = scale.shape[1]
    w = weight.view(n, groups, k // groups).float() * scale.float()[:, :, None]
    if offset is not None:
        w = w + offset.float()[:, :, None]
    return (w * x.view(-1, 1, groups, k // groups)).sum((-1, -2))


# Whether grouped_sum reads int8 weights four to a 32-bit word. Inductor loads a vector of int8
# weights (8 of a 32-lane register on AVX2) as a partial load, which AVX-512 masks but AVX2's at::vec
# copies through the stack: measured on SmolLM2 (2-core EPYC, AVX2) the int8 form ran at 1 GB/s of
# weights, 6.9 tokens/s where per-channel int8pack_mm gave 30; the packed form gave 39. On AVX-512
# the int8 form measured 94 tokens/s (0.71x llama.cpp Q8_0); the packed form is not measured there.
PACKED_LOADS = sys.byteorder == "little" and torch.backends.cpu.get_cpu_capability() != "AVX512"


def _packed_sum(x: Tensor, weight: Tensor, scale: Tensor, offset: Offset) -> Tensor:
    """grouped_sum with weight (N, K) int8 read as (N, K/4) words: loaded as float bits (a full
    vector load; int32's partial load is AVX2's slow path), cast to int32 in registers, and byte j
    of word i (weight[4i + j], little-endian) sign-extended by two shifts. x is regrouped to match:
    xt[j, g, i] = x[g·G + 4i + j]; the offset term Σ_i o·Σ_j xt rides in the same sum."""
    n, k = weight.shape
    groups = scale.shape[1]
    per = k // groups // 4  # words per group
    words = weight.view(torch.float32).view(n, groups, per).view(torch.int32)
    xt = x.view(-1, groups, per, 4).permute(0, 3, 1, 2).contiguous()  # (M, 4, groups, per)
    xt = stored(xt)
    part = sum(((words << (24 - 8 * j)) >> 24).float() * xt[:, j, None] for j in range(4))  # (M, N, groups, per)
    part = part * scale[:, :, None]
    if offset is not None:
        part = part + offset.float()[:, :, None] * xt.sum(1)[:, None]
    return part.sum((-1, -2))


def int8pack_fits(out_features: int, in_features: int, group: int = 0) -> bool:
    """Whether torch._weight_int8pack_mm can take the shape: its bf16/fp16 path reads each row of
    x and of the weight in aligned SIMD blocks of 8 (AVX2, NEON) or 16 (AVX-512) values with no
    tail loop, so in_features must be a multiple of 16, else it reads past the row or faults on a
    misaligned load (a segfault). Its fp32 path is a plain loop, but a model converted to bf16
    after quantizing would take the other, so the rule holds for both."""
    return in_features % 16 == 0


def any_shape(out_features: int, in_features: int, group: int = 0) -> bool:
    return True


def gemv_fits(out_features: int, in_features: int, group: int = 0) -> bool:
    """group_gemv takes layers whose group (per channel: the whole row) is a multiple of 32, where
    its C++ kernel builds on this machine (the first call builds it: tens of seconds, then cached by torch)."""
    width = group or in_features
    return width % native.BLOCK == 0 and in_features % width == 0 and native.available()


@dataclass(frozen=True)
class Kernel:
    """A matmul, whether it takes bf16 activations (the bf16 scales; else the model's dtype), and
    which (out_features, in_features) it can take: a layer it cannot take runs `fallback` instead,
    decided when the layer is made, before any call (a kernel given a bad shape can crash the process)."""

    matmul: Callable[[Tensor, Tensor, Tensor, Offset], Tensor]
    bf16: bool
    fits: Callable[[int, int, int], bool]  # (out_features, in_features, group: 0 per channel)
    fallback: str
    rounding: float = 1e-6  # the relative error of its activations' rounding (bf16: 2**-8)
    half: bool = False  # group_gemv: the fp16 copies of the scales and offsets (scale_half, offset_half),
    # and the codes as Int8Linear keeps them for it (native.interleave's layout); the others take codes()


# name → Kernel; "/bf16": bf16 activations, "/model": the model's dtype
KERNELS: dict[str, Kernel] = {
    "int8pack_mm/bf16": Kernel(int8pack_mm, True, int8pack_fits, "dequant/bf16", 2**-8),
    "int8pack_mm/model": Kernel(int8pack_mm, False, int8pack_fits, "dequant/model"),
    "dequant/bf16": Kernel(dequant_linear, True, any_shape, "dequant/bf16", 2**-8),
    "dequant/model": Kernel(dequant_linear, False, any_shape, "dequant/model"),
    "group_gemv": Kernel(gemv_linear, False, gemv_fits, "dequant/model", 1e-4, half=True),  # x to int16 per 32: ~2e-5
}


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel runs an input of m rows: kernels[i] up to sizes[i] rows (the last beyond).
    ms: what was measured at each size, {kernel or "float": ms} (at `rows`: every layer; else
    the first block's)."""

    sizes: tuple[int, ...]
    kernels: tuple[str, ...]
    rows: int = 1  # the decode batch the plan was checked at
    ms: tuple[dict[str, float], ...] = ()
    source: str = ""  # how the plan was had: "measured in 2.1 s", "cached"; "" fixed by the caller

    def pick(self, m: int) -> str:
        for size, kernel in zip(self.sizes, self.kernels):  # a loop torch.compile can trace; small m exit first
            if m <= size:
                return kernel
        return self.kernels[-1]

    def describe(self, scales: str = "") -> str:
        """A few words for the stats line: the decode step's kernel and what it was measured against
        (`scales`: a note on the weights' scales, after "int8 weights")."""
        kernel = self.pick(self.rows)
        if not self.ms:
            return f"int8 weights{scales}, {kernel}"
        ms = self.ms[self.sizes.index(self.rows)]
        slower = " (slower here: a model this small, or a busy machine while it was measured)" if ms[kernel] >= ms["float"] else ""
        how = f"; {self.source}" if self.source else ""
        return f"int8 weights{scales}, {kernel}: a step's linears {ms[kernel]:.2f} ms vs {ms['float']:.2f} ms float{slower}{how}"


class Int8Linear(nn.Module):
    """y = x·Wᵀ + b with W from int8 q (out, in): W = q·s with one scale per output channel (out,),
    or W = q·s + o with a scale and an offset per group of `group` inputs of each output channel
    (out, in / group) — each group symmetric (o = 0) or its 256 levels over its range, whichever
    rebuilds it better (`from_linear`); s and o fp16 values (kept in the model's dtype, and as fp16
    for group_gemv, which streams them). The float bias b. The same call as nn.Linear:
    (…, in) → (…, out) in x's dtype. Where group_gemv runs the layer, `weight` holds q in its
    layout (native.interleave: four rows at a time); `codes()` is q row after row."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None, plan: KernelPlan, offset: Offset = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("scale", scale)  # (out,) or (out, in / group) in the model's dtype
        self.register_buffer("offset", offset)  # None, or (out, in / group) as the scales
        self.group = self.in_features // scale.shape[1] if scale.dim() == 2 else 0  # 0: per output channel
        low = torch.bfloat16 if scale.dtype == torch.float32 else scale.dtype  # bf16/fp16 models: their own
        self.register_buffer("scale_low", scale.to(low))  # the same scales for the "/bf16" kernels
        self.register_buffer("offset_low", None if offset is None else offset.to(low))
        # group_gemv's copies (per channel: one group of the whole row, offsets 0); None where the
        # scales are not fp16 values (a range fp16 cannot hold)
        groups = scale if offset is not None else scale[:, None]  # (out, in / group)
        half = groups.half()
        exact = bool(torch.equal(half.to(scale.dtype), groups))
        self.register_buffer("scale_half", half if exact else None)
        self.register_buffer("offset_half", (torch.zeros_like(half) if offset is None else offset.half()) if exact else None)
        self.register_buffer("bias", bias)
        self.plan = plan
        # kernel → what runs
        fits = {k: kern.fits(*weight.shape, self.group) and (exact or not kern.half) for k, kern in KERNELS.items()}
        self.runs = {k: k if fits[k] else kern.fallback for k, kern in KERNELS.items()}
        self.interleaved = self.runs["group_gemv"] == "group_gemv"
        self.register_buffer("weight", native.interleave(weight) if self.interleaved else weight)  # (out, in) int8

    @classmethod
    def from_linear(cls, linear: nn.Linear, plan: KernelPlan, group: int = 0) -> Int8Linear:
        """Symmetric quantization per row (group 0, or a group that does not divide in_features):
        s = max|w| / 127, q = round(w / s) in [-127, 127]. Or per `group` weights of a row, each
        group in whichever of two forms reconstructs it with less squared error: over its range,
        s = (max - min) / 255 and o = min + 128·s, q in [-128, 127]; or symmetric, s = max|w| / 127,
        o = 0, q in [-127, 127] (exact on weights that were Q8_0, as real models' embeddings often
        are). s and o are rounded to fp16 values first, so q rounds to what is multiplied. A group
        whose offset fp16 cannot hold is kept symmetric; a layer with a group neither form holds
        (|w| past 127 × 65504) keeps per-row scales, in fp32 where fp16 cannot hold them either."""
        w = linear.weight.detach()
        out, inp = w.shape
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if group and inp % group == 0 and group < inp:
            q, scale, offset = _group_codes(w, group)
            if scale.isfinite().all() and offset.isfinite().all():
                return cls(q.view(out, inp).to(torch.int8), scale.to(w.dtype), bias, plan, offset.to(w.dtype))
        tiny = torch.finfo(torch.float32).tiny
        scale = w.float().abs().amax(dim=1) / 127
        if (half := _fp16_values(scale, w.dtype)).isfinite().all():  # fp16 values where they hold (group_gemv reads fp16)
            scale = half
        q = torch.round(w.float() / scale.clamp(min=tiny)[:, None]).clamp_(-127, 127)
        return cls(q.to(torch.int8), scale.to(w.dtype), bias, plan)

    def codes(self) -> Tensor:
        """q (out, in) int8, row after row (what every kernel but group_gemv takes)."""
        return native.deinterleave(self.weight) if self.interleaved else self.weight

    def dequantized(self) -> Tensor:
        """(out, in) float32 q·s (+ o): the weight this layer multiplies by (to rounding)."""
        n, s = self.out_features, self.scale.float().view(self.out_features, -1)
        w = self.codes().float().view(n, s.shape[1], -1) * s[:, :, None]
        return (w if self.offset is None else w + self.offset.float()[:, :, None]).view(n, self.in_features)

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

    def native_weights(self, rows: int) -> tuple[Tensor, Tensor, Tensor, native.Format] | None:
        """(int8 q, fp16 s, fp16 o, their format) for native_block, where this layer runs group_gemv at `rows` rows."""
        if self.runs["group_gemv"] != "group_gemv" or self.plan.pick(rows) != "group_gemv":
            return None
        return self.weight, self.scale_half, self.offset_half, native.Format.INT8

    def linear(self, x: Tensor, kernel: str) -> Tensor:
        """(M, in) → (M, out) in x's dtype through `kernel`, or its fallback where it cannot take this shape."""
        kern = KERNELS[self.runs[kernel]]
        return self._out(kern.matmul(x, self.weight if kern.half else self.codes(), *self.scales_for(kern)), x)

    def scales_for(self, kern: Kernel) -> tuple[Tensor, Offset]:
        """The copy of the scales and offsets `kern` takes: bf16, fp16 (group_gemv) or the model's dtype."""
        if kern.bf16:
            return self.scale_low, self.offset_low
        return (self.scale_half, self.offset_half) if kern.half else (self.scale, self.offset)

    def _out(self, y: Tensor, x: Tensor) -> Tensor:
        """A kernel's output + the bias, in x's dtype."""
        return (y if self.bias is None else self.bias + y).to(x.dtype)

    def extra_repr(self) -> str:
        scales = f"{self.group} weights per scale" if self.group else "per-channel scales"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8, {scales}"


def _group_codes(w: Tensor, group: int) -> Form:
    """int8 codes, scales and offsets of w's groups, each in the form (symmetric or over its range,
    see Int8Linear.from_linear) with the smaller squared error."""
    wg, low, high = group_codes.grouped(w, group)
    sym = _fp16_values(torch.maximum(-low, high) / 127, w.dtype)
    zero = torch.zeros_like(sym)
    symmetric = (group_codes.codes(wg, sym, zero, -127, 127), sym, zero)
    scale = _fp16_values((high - low) / 255, w.dtype)
    offset = _fp16_values(low + 128 * scale, w.dtype)
    ranged = (group_codes.codes(wg, scale, offset, -128, 127), scale, offset)
    return group_codes.better(wg, symmetric, ranged)


def _fp16_values(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t (float32) as a scale or offset is stored: an fp16 value (group_gemv reads fp16), held in the
    model's dtype; inf where fp16 cannot hold it."""
    return t.half().to(dtype).float()


# --- choosing the kernels and swapping the layers ----------------------------------------------


def quantize(
    model: GPT, scheme: str | None, rows: int = 1, kernel: str | None = None, cache: bool = False, group: int | None = None
) -> GPT:
    """Swap every nn.Linear of `model` (the blocks' and the head) for an Int8Linear, in place,
    and return it; scheme None returns the model unchanged. `rows`: the decode batch (one
    token per row) the kernels are measured at (measure_plan); `kernel` (a KERNELS name) fixes
    one kernel for every input instead (tests, reproducing a run). `cache`: take the plan
    measured before on this machine for this shape, and keep a new one (model/kernel_cache.py).
    `group`: weights per scale instead of the scheme's (0: per output channel; measuring schemes)."""
    scheme = parse_quantize(scheme, "scheme")
    if scheme is None:
        return model
    if any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules()):
        raise ValueError("the model is already quantized")
    if scheme in INT4_SCHEMES:
        if kernel is not None:
            raise ValueError(f"kernel names an int8 kernel; {scheme} takes its one kernel per shape (model/int4.py)")
        return quantize_int4(model, INT4_SCHEMES[scheme] if group is None else group)
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    places = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children() if isinstance(child, nn.Linear)
    ]
    group = SCHEMES[scheme] if group is None else group
    layers = [Int8Linear.from_linear(lin, KernelPlan((1,), (kernel or "dequant/model",), rows), group) for _, _, lin in places]
    if kernel is None:
        first = {id(m) for m in model.transformer.h[0].modules()}
        pairs = [(lin, q) for (_, _, lin), q in zip(places, layers)]
        plan = cached_plan(pairs, [p for p in pairs if id(p[0]) in first], rows, cache)
        for q in layers:
            q.plan = plan
    for (parent, name, _), q in zip(places, layers):
        setattr(parent, name, q)
    return model


def quantize_int4(model: GPT, group: int) -> GPT:
    """Every nn.Linear of the blocks whose in_features a kernel group (≤ `group`) divides → an
    Int4Linear, in place; the others keep their float weights (weights_note counts them). The head
    stays at 8 bits or more: in int4 it alone cost SmolLM2 most of its loss (llama.cpp's Q4 files
    keep it at 6-8 bits too). It is int8 with a scale and an offset per 32 weights through
    group_gemv where that kernel takes it (36 bytes per 32 weights; the loss of int8 is
    ~0.001%), else bf16 weights (64 bytes per 32)."""
    for parent in list(model.transformer.h.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (g := int4.group_for(child.in_features, group)):
                setattr(parent, name, Int4Linear(child, g))
    if isinstance(model.lm_head, nn.Linear):
        head = Int8Linear.from_linear(model.lm_head, HEAD_PLAN, SCHEMES["int8"]) if native.available() else None
        model.lm_head = head if head is not None and head.runs["group_gemv"] == "group_gemv" else int4.Bf16Linear(model.lm_head)
    return model


# an int4 model's int8 head: group_gemv up to int4.GEMV_ROWS rows (a decode step), the weight
# dequantized for more (a prompt scored at every position)
HEAD_PLAN = KernelPlan((int4.GEMV_ROWS,), ("group_gemv", "dequant/model"))


def cached_plan(every: list[Pair], block: list[Pair], rows: int, cache: bool) -> KernelPlan:
    """measure_plan's plan, or (cache) the one stored for this machine and these layers' shapes."""
    w, candidates = every[0][0].weight, _candidates(every[0][1])
    shape = {
        "dtype": str(w.dtype),
        "rows": rows,
        "layers": sorted({(q.out_features, q.in_features, q.group, layer.bias is not None) for layer, q in every}),
        "block": [(q.out_features, q.in_features, q.group) for _, q in block],
        "candidates": candidates,  # a kernel added (or one that now builds) measures again
        "group_gemv": native.build_name() if "group_gemv" in candidates else None,  # a changed build too
    }
    k = kernel_cache.key(w.device, shape) if cache else ""
    if cache and (hit := kernel_cache.lookup(k)) is not None:
        try:
            return KernelPlan(tuple(hit["sizes"]), tuple(hit["kernels"]), hit["rows"], tuple(hit["ms"]), source="cached")
        except (KeyError, TypeError):
            pass  # an entry of another layout: measure again
    start = time.perf_counter()
    plan = measure_plan(every, block, rows)
    plan = dataclasses.replace(plan, source=f"measured in {time.perf_counter() - start:.1f} s")
    if cache and kernel_cache.store(k, {"sizes": plan.sizes, "kernels": plan.kernels, "rows": plan.rows, "ms": plan.ms}):
        plan = dataclasses.replace(plan, source=plan.source + ", cached for the next load")
    return plan


def plan_of(model: GPT) -> KernelPlan | None:
    """The kernel plan of an int8 model (None: float or int4 weights; an int4 model's int8 head has a fixed plan)."""
    if any(isinstance(m, Int4Linear) for m in model.modules()):
        return None
    return next((m.plan for m in model.modules() if isinstance(m, Int8Linear)), None)


def weights_note(model: GPT, sep: str = ", ", compiled: bool = False) -> str:
    """`sep` + the plan's few words for a quantized model's start-up or stats line; "" for float
    weights. `compiled`: the decode step ran compiled (group-wise layers then run group_gemv or grouped_sum)."""
    if fours := [m for m in model.modules() if isinstance(m, Int4Linear)]:
        kernels = sorted({m.kernel if m.kernel != "dequantize" else "dequantize (slow)" for m in fours})
        if "group_gemv4" in kernels:
            kernels[kernels.index("group_gemv4")] = f"group_gemv4 (up to {int4.GEMV_ROWS} rows)"
        floats = sum(isinstance(m, nn.Linear) for m in model.modules())
        kept = f", {floats} linears kept float (no group divides their width)" if floats else ""
        head = ""
        if isinstance(model.lm_head, int4.Bf16Linear):
            head = ", head in bf16"
        elif isinstance(model.lm_head, Int8Linear):
            group = model.lm_head.group
            head = f", head int8 ({f'{group} per scale' if group else 'per-channel scales'}, group_gemv)"
        return f"{sep}int4 weights ({max(m.group for m in fours)} per scale), {' + '.join(kernels)}{head}{kept}"
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if not layers:
        return ""
    group = max(m.group for m in layers)  # a layer whose width the group does not divide has per-channel scales
    if group and native.why_not():  # asked for, but the C++ kernel did not build: say why, once per line
        return _int8_note(layers, group, sep, compiled) + f" (group_gemv did not build: {native.why_not()})"
    return _int8_note(layers, group, sep, compiled)


def _int8_note(layers: list[Int8Linear], group: int, sep: str, compiled: bool) -> str:
    """weights_note for int8 layers: the compiled step's few-rows kernel, or the plan's words."""
    if group and compiled:
        gemv = any(m.runs["group_gemv"] == "group_gemv" for m in layers)
        how = "group_gemv in the compiled step" if gemv else "grouped_sum fused into the compiled step"
        more = " and where measured fastest" if gemv and layers[0].plan.pick(layers[0].plan.rows) == "group_gemv" else ""
        return f"{sep}int8 weights ({group} per scale), {how} (up to {FUSED_ROWS} rows{more})"
    return f"{sep}{layers[0].plan.describe(f' ({group} per scale)' if group else ' (per-channel scales)')}"


Pair = tuple[nn.Linear, Int8Linear]  # a float layer and its int8 copy


def measure_plan(every: list[Pair], block: list[Pair], rows: int, largest: int = 256) -> KernelPlan:
    """Time the kernels against F.linear: at `rows` on every layer (what a decode step streams:
    in a real model more than the last-level cache holds), at 1, 2, 4, … up to `largest` rows
    on one block's layers (compute decides there). A kernel 20× slower than F.linear is not timed at
    larger sizes, but the fastest always is (a burst of load may slow them all), and a size
    where none runs takes the kernel chosen at `rows`."""
    sizes = sorted({2**i for i in range(largest.bit_length())} | {rows})
    kernels, chosen, table = _candidates(every[0][1]), [], []
    for m in sizes:
        ms = _timings(every, kernels, m, budget_s=0.3) if m == rows else _timings(block, kernels, m)
        best = min((k for k in ms if k != "float"), key=ms.get, default=None)
        if m == rows and best is None:
            raise QuillError(f"--quantize int8: no int8 kernel runs on {every[0][0].weight.device.type} here; run without --quantize")
        kernels = [k for k in kernels if k in ms and ms[k] < 20 * ms["float"]] or ([best] if best else kernels)
        chosen.append(best)
        table.append(ms)
    at_rows = chosen[sizes.index(rows)]
    return KernelPlan(tuple(sizes), tuple(k or at_rows for k in chosen), rows, tuple(table))


def _timings(pairs: list[Pair], kernels: list[str], m: int, budget_s: float = 0.05) -> dict[str, float]:
    """{"float" or kernel: ms} of the layers on one random (m, in) input each: the fastest of at
    least 3 calls taken in turns, more within budget_s (other work on the machine only ever adds
    time, and a burst of it slows every candidate alike); kernels that cannot run here are left out."""
    w = pairs[0][0].weight
    xs = [torch.randn(m, lin.in_features, device=w.device, dtype=w.dtype) for lin, _ in pairs]
    fns = {"float": lambda: [F.linear(x, lin.weight, lin.bias) for x, (lin, _) in zip(xs, pairs)]}
    for k in kernels:
        fns[k] = lambda k=k: [q.linear(x, k) for x, (_, q) in zip(xs, pairs)]
        try:
            fns[k]()  # warm-up: one-time set-up of the kernel
        except (RuntimeError, NotImplementedError):
            del fns[k]
    fns["float"]()
    best = dict.fromkeys(fns, float("inf"))
    start, calls = time.perf_counter(), 0
    while calls < 3 or (time.perf_counter() - start < budget_s and calls < 50):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            _sync(w.device)
            best[k] = min(best[k], 1e3 * (time.perf_counter() - t))
        calls += 1
    return best


def _candidates(q: Int8Linear) -> list[str]:
    """The kernels worth timing: the "/bf16" ones only on a per-channel float32 model (else they are
    the "/model" ones; group-wise scales are asked for their quality, and a bf16 prefill parted
    SmolLM2's greedy answer from fp32's where group_gemv's decode alone kept it); group_gemv only
    where it runs (else it is dequant/model again)."""
    bf16 = q.scale_low.dtype != q.scale.dtype and not q.group
    return [k for k, kern in KERNELS.items() if (bf16 or not kern.bf16) and (k != "group_gemv" or q.runs[k] == k)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
