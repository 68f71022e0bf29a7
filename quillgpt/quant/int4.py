"""Weight-only int4: each group of G weights along a row keeps 16 levels, so a decode step streams
about a sixth of fp32's weight bytes. Three layouts, the first that fits a layer on this machine:

- "group_gemv4": W = q·s + o with q in [0, 15] and an fp16 scale and offset per group, each group
  over its range (llama.cpp's Q4_1) or symmetric (Q4_0), whichever rebuilds it better
  (gemv4_codes), through quill's C++ kernel (the C++ kernels: x rounded
  to int16 per 32, 20 bytes per 32 weights; 18 where every group is symmetric, as in a Q4_0 file,
  the offsets then implied: kept_offsets) at any number of rows: a decode step's few rows
  against four weight rows at a time, a prompt's many (from 65) GEMM-blocked, PREFILL_ROWS rows a
  call so that a long prompt's scratch stays bounded. It takes K a multiple of 64 and G of 32
  where the kernel builds. Its decode step beat torch's int4pack_mm's, and its prefill the weight
  dequantized for F.linear (docs/kernels.md).
- "int4pack_mm": W ≈ (q - 8)·s + z with one bf16 scale s and zero z per group (gpt-fast's and
  torch's "tinygemm" layout) through torch's `_weight_int4pack_mm_for_cpu` (bf16 activations,
  the weight repacked once by `_convert_weight_to_int4pack_for_cpu`); out_features a multiple
  of 16 and G in 32/64/128/256 dividing in_features.
- "dequantize": the same codes two to a byte, dequantized before F.linear (slow, exact to the
  same rounding), for any other shape or device.

A layer whose width no group divides is not quantized (`convert` keeps it float). The head stays
at 8 bits or more (see `convert`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt import huge_pages, native
from quillgpt.errors import QuillError
from quillgpt.quant import group_codes
from quillgpt.quant.int8 import INT8, Int8Linear
from quillgpt.quant.plan import RULE_PLAN
from quillgpt.quant.scheme import ConvertOptions, Packed, Scheme

GROUPS = (32, 64, 128, 256)  # what the kernels take
# the native decoder's linears up to this many rows (its decode block runs the few-rows kernel)
GEMV_ROWS = 64
# a prompt's rows through group_gemv4 this many at a time (its GEMM: docs/kernels.md): x's int16
# copy and the kernel's scratch stay bounded, and the kernel already reads x in blocks of 256 rows
PREFILL_ROWS = 512
# the prompt's activations past GEMV_ROWS rows: int16 per 32 (the default: the float model's answers
# by construction), or int8 per 32 asked for by QUILL_PREFILL_ACTIVATIONS=int8 (group_gemv4_x8:
# 1.4-1.7x the GEMM's speed; what it costs in quality is docs/kernels.md's)
PREFILL_ACTIVATIONS = ("int16", "int8")


def prefill_activations() -> str:
    """QUILL_PREFILL_ACTIVATIONS (PREFILL_ACTIVATIONS' names; unset: int16), read at each prompt's
    call so that one process can compare both."""
    acts = os.environ.get("QUILL_PREFILL_ACTIVATIONS") or "int16"
    if acts not in PREFILL_ACTIVATIONS:
        raise QuillError(f"QUILL_PREFILL_ACTIVATIONS must be one of {', '.join(PREFILL_ACTIVATIONS)}, got {acts!r}: unset it for int16")
    return acts


def group_for(in_features: int, group: int) -> int:
    """The largest kernel group ≤ `group` that divides in_features (0: none does)."""
    return next((g for g in sorted(GROUPS, reverse=True) if g <= group and in_features % g == 0), 0)


def kernel_fits(out_features: int, in_features: int, group: int) -> bool:
    """Whether `_weight_int4pack_mm_for_cpu` takes the shape (it raises otherwise: checked first)."""
    return out_features % 16 == 0 and group in GROUPS and in_features % group == 0


def gemv4_fits(out_features: int, in_features: int, group: int) -> bool:
    """Whether group_gemv4 takes the shape (its first call builds the C++ kernel: tens of seconds once)."""
    return in_features % 64 == 0 and group % 32 == 0 and in_features % group == 0 and native.available()


def gemv4_codes(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """(q (out, in) uint8 in [0, 15], s, o (out, in / group) fp16) with w ≈ q·s + o per group, each
    group in whichever of two forms reconstructs it with less squared error: over its range
    (llama.cpp's Q4_1), s = (max - min) / 15 and o = min; or symmetric (Q4_0), s = -m / 8 for the
    weight m of largest magnitude and o = -8·s. s and o are rounded to fp16 values first, q
    against them, so weights that were either form come back exactly. None where fp16 cannot
    hold a group's range (weights past ±65504)."""
    wg, low, high = group_codes.grouped(w, group)
    s, o = ((high - low) / 15).half(), low.half()
    if not (s.isfinite().all() and o.isfinite().all()):
        return None
    s0 = torch.where(-low > high, low, high).div(-8).half()  # Q4_0: the largest magnitude maps to code 0
    o0 = (-8 * s0.float()).half()
    ranged = (group_codes.codes(wg, s, o, 0, 15), s, o)
    q, s, o = group_codes.better(wg, ranged, (group_codes.codes(wg, s0, o0, 0, 15), s0, o0))
    return q.view(w.shape).to(torch.uint8), s, o


def kept_offsets(scale: Tensor, offset: Tensor) -> Tensor | None:
    """`offset`, or None where every group is in Q4_0's symmetric form (offset = -8·scale in fp16,
    as gemv4_codes and a Q4_0 import make it): the C++ kernels then imply the offsets (quill.h's
    symmetric_offset), so a decode step streams 18 bytes a group of 32 weights rather than 20."""
    implied = (-8 * scale.float()).to(offset.dtype)
    return None if torch.equal(offset, implied) else offset


def int4_codes(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """(q (out, in) int32 in [0, 15], scales_zeros (in / group, out, 2) bf16) with
    w ≈ (q - 8)·s + z per group: s = (max - min) / 15 and z = min + 8·s over each group's weights,
    both rounded to bf16 first so q rounds against the values the kernel multiplies by."""
    wg, low, high = group_codes.grouped(w, group)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wg - zero[:, :, None]) / safe[:, :, None] + 8).clamp_(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q.view(w.shape).to(torch.int32), scales_zeros


def dequantize(q: Tensor, scales_zeros: Tensor, group: int) -> Tensor:
    """(out, in) float32 (q - 8)·s + z: the weight an int4 layer multiplies by."""
    out, inp = q.shape
    s, z = scales_zeros.float().unbind(-1)  # (in / group, out) each
    return ((q.float().view(out, inp // group, group) - 8) * s.t()[:, :, None] + z.t()[:, :, None]).view(out, inp)


class Int4Linear(nn.Module):
    """y = x·Wᵀ + b with W from 4-bit codes and a scale and zero (or offset) per `group` inputs of a
    row, in the first of the module docstring's layouts that fits (`kernel`). The same call as
    nn.Linear: (…, in) → (…, out) in x's dtype."""

    def __init__(self, linear: nn.Linear, group: int, kernel: str | None = None) -> None:
        """`kernel`: the layout to take where it fits (None: the first that fits, in KERNELS' order)."""
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.group = group
        cpu = linear.weight.device.type == "cpu"
        wanted = list(KERNELS)[list(KERNELS).index(kernel) if kernel else 0 :]
        gemv = None
        if "group_gemv4" in wanted and cpu and gemv4_fits(self.out_features, self.in_features, group):
            gemv = gemv4_codes(linear.weight, group)
        scale = offset = scales_zeros = None
        if gemv is not None:
            self.kernel = "group_gemv4"
            q, scale, offset = gemv
            codes = native.pack4(q, huge_pages.empty((self.out_features, self.in_features // 2), torch.uint8))  # streamed: huge pages
            offset = kept_offsets(scale, offset)
        else:
            q, scales_zeros = int4_codes(linear.weight, group)
            if "int4pack_mm" in wanted and cpu and kernel_fits(self.out_features, self.in_features, group):
                self.kernel = "int4pack_mm"
                codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)  # the kernel's own layout
            else:
                self.kernel = "dequantize"
                codes = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # two codes a byte, low nibble first
        self.register_buffer("codes", codes)
        self.register_buffer("scales_zeros", scales_zeros)  # int4pack_mm, dequantize: (in / group, out, 2) bf16
        self.register_buffer("scale", scale)  # group_gemv4: (out, in / group) fp16 each
        self.register_buffer("offset", offset)  # None with scale: -8·scale (kept_offsets)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def _scales_zeros(self) -> Tensor:
        sz = self.scales_zeros  # a model cast to another dtype casts this buffer too; the kernel takes bf16
        return sz if sz.dtype == torch.bfloat16 else sz.to(torch.bfloat16)

    @classmethod
    def from_stored(cls, stored: Packed, bias: Tensor | None = None) -> Int4Linear:
        """The layer of a quantized run's tensors (`store`'s form: pack4's codes, a scale and an
        offset per group), the codes kept as read; through group_gemv4 where it runs them, else
        dequantized for each call."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        codes, scale, offset = stored["codes"], stored["scale"], stored["offset"]
        layer.out_features, layer.in_features = codes.shape[0], 2 * codes.shape[1]
        layer.group = layer.in_features // scale.shape[1]
        fits = scale.dtype == torch.float16 and codes.device.type == "cpu"
        layer.kernel = "group_gemv4" if fits and gemv4_fits(layer.out_features, layer.in_features, layer.group) else "dequantize"
        offset = kept_offsets(scale, offset) if layer.kernel == "group_gemv4" else offset
        for name, t in (("codes", codes), ("scales_zeros", None), ("scale", scale), ("offset", offset), ("bias", bias)):
            layer.register_buffer(name, t)
        return layer

    def dequantized(self) -> Tensor:
        """(out, in) float32: the weight this layer multiplies by (int4pack_mm's layout is read back
        through the kernel on the identity: exact, bf16 values)."""
        if self.scale is not None:  # pack4's codes with a scale and an offset per group
            n, groups = self.out_features, self.scale.shape[1]
            q = native.unpack4(self.codes).float().view(n, groups, -1)
            return (q * self.scale.float()[:, :, None] + self._offsets()[:, :, None]).view(n, self.in_features)
        if self.kernel == "int4pack_mm":
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.codes.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.codes, self.group, self._scales_zeros()).float().t()
        low, high = self.codes & 15, self.codes >> 4
        q = torch.stack([low, high], dim=-1).view(self.out_features, self.in_features)
        return dequantize(q, self.scales_zeros, self.group)

    def runs_native(self) -> bool:
        return self.kernel == "group_gemv4"

    def packed(self) -> Packed:
        """The layer's codes, scales and offsets in pack's form (what `store` writes): group_gemv4's."""
        if self.scale is None or self.scale.dtype != torch.float16:
            why = native.why_not() or "its groups' ranges are past fp16's"
            raise QuillError(f"an int4 run is written in quill's C++ kernel's layout, which this layer could not take ({why})")
        return {"codes": native.unpack4(self.codes), "scale": self.scale, "offset": self._offsets().to(self.scale.dtype)}

    def rows(self, idx: Tensor) -> Tensor:
        """(len(idx), in) float32 rows of the weight (an embedding lookup), without the whole weight."""
        if self.scale is None:
            return self.dequantized()[idx]
        q = native.nibbles(native.rows_of(self.codes, idx)).float().view(len(idx), self.scale.shape[1], -1)
        return (q * self.scale[idx].float()[:, :, None] + self._offsets(idx)[:, :, None]).view(len(idx), self.in_features)

    def _offsets(self, idx: Tensor | None = None) -> Tensor:
        """(rows, in / group) float32 offsets of the rows `idx` (None: all), -8·scale where none are kept."""
        scale, offset = (self.scale, self.offset) if idx is None else (self.scale[idx], None if self.offset is None else self.offset[idx])
        return -8 * scale.float() if offset is None else offset.float()

    def _kernel_offsets(self) -> Tensor:
        """The kernels' o: the fp16 offsets, or empty where they are implied (quill.h's symmetric form)."""
        return self.scale.new_empty(0) if self.offset is None else self.offset

    def native_weights(self, rows: int) -> tuple[Tensor, Tensor, Tensor, native.Format] | None:
        """(4-bit codes, fp16 s, fp16 o, their format) for the native decoder, where this layer runs group_gemv4 at `rows` rows."""
        if self.kernel != "group_gemv4" or rows > GEMV_ROWS:
            return None
        return self.codes, self.scale, self._kernel_offsets(), native.Format.INT4

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "group_gemv4":
            y = self._gemv4(x2.float())
        elif self.kernel == "int4pack_mm":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.codes, self.group, self._scales_zeros())
        else:
            y = F.linear(x2.float(), self.dequantized().to(x2.device))
        y = y.to(x.dtype) if self.bias is None else self.bias + y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _gemv4(self, x: Tensor) -> Tensor:
        """(M, in) float32 → (M, out) float32 through group_gemv4, PREFILL_ROWS rows a call (past
        GEMV_ROWS rows with the activations prefill_activations() names)."""
        gemv = native.group_gemv4_x8 if x.shape[0] > GEMV_ROWS and prefill_activations() == "int8" else native.group_gemv4
        o = self._kernel_offsets()
        if x.shape[0] <= PREFILL_ROWS:
            return gemv(x, self.codes, self.scale, o)  # fp16 as made
        y = x.new_empty(x.shape[0], self.out_features)
        for i in range(0, x.shape[0], PREFILL_ROWS):
            y[i : i + PREFILL_ROWS] = gemv(x[i : i + PREFILL_ROWS], self.codes, self.scale, o)
        return y

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{shape}, int4, {self.group} per scale, {self.kernel}"


class Bf16Linear(nn.Module):
    """nn.Linear with its weight kept in bf16 (a copy: a tied head leaves its embedding as it
    was), x cast to bf16 for the matmul and the product back to x's dtype: half fp32's bytes."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16, copy=True))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        return self.weight.float()

    def runs_native(self) -> bool:
        return False  # no native kernel reads bf16 weights (the native decoder leaves this head to torch)

    def native_weights(self, rows: int) -> None:
        return None

    def rows(self, idx: Tensor) -> Tensor:
        return self.weight[idx].float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, bf16"


# --- the schemes: storage, conversion, the stats line ---------------------------------------------

# kernel (Int4Linear's layouts, in the order tried) → its relative error against the reference:
# int16 activations per 32, bf16 activations, float32
KERNELS = {"group_gemv4": 1e-4, "int4pack_mm": 1e-2, "dequantize": 1e-5}


def pack(w: Tensor, group: int) -> Packed:
    """w (out, in) → {"codes": uint8 (out, in) in [0, 15], "scale", "offset": fp16 (out, in / group)}
    in gemv4_codes' forms (Q4_1 or Q4_0 per group); the bf16 form of int4_codes where fp16 cannot
    hold a group's range ("offset" then the zero z: w ≈ (q - 8)·s + z)."""
    codes = gemv4_codes(w, group)
    if codes is not None:
        q, s, o = codes
        return {"codes": q, "scale": s, "offset": o}
    q, scales_zeros = int4_codes(w, group)
    s, z = scales_zeros.float().unbind(-1)  # (in / group, out) each
    return {"codes": q.to(torch.uint8), "scale": s.t().to(torch.bfloat16), "offset": (z - 8 * s).t().to(torch.bfloat16)}


def unpack(packed: Packed) -> Tensor:
    """pack's inverse to its rounding: (out, in) float32 q·s + o per group."""
    q = packed["codes"]
    n, k = q.shape
    s, o = packed["scale"].float(), packed["offset"].float()
    return (q.float().view(n, s.shape[1], -1) * s[:, :, None] + o[:, :, None]).view(n, k)


def linear(lin: nn.Linear, group: int, kernel: str | None = None) -> Int4Linear:
    return Int4Linear(lin, group, kernel)


def store(packed: Packed) -> Packed:
    """pack's tensors as a run stores them: the codes in pack4's layout (group_gemv4's), two a byte."""
    return {"codes": native.pack4(packed["codes"]), "scale": packed["scale"], "offset": packed["offset"]}


def stored_shapes(out_features: int, in_features: int, group: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    scales = (torch.float16, (out_features, in_features // group))
    return {"codes": (torch.uint8, (out_features, in_features // 2)), "scale": scales, "offset": scales}


def load(stored: Packed, bias: Tensor | None, dtype: torch.dtype) -> Int4Linear:
    return Int4Linear.from_stored(stored, None if bias is None else bias.to(dtype))


def convert(model: nn.Module, group: int, options: ConvertOptions) -> None:
    """Every nn.Linear of the blocks whose in_features a kernel group (≤ `group`) divides → an
    Int4Linear, in place; the others keep their float weights (the stats line counts them). The
    head stays at 8 bits or more: in int4 it alone cost SmolLM2 most of its loss (llama.cpp's Q4
    files keep it at 6-8 bits too). It is int8 with a scale and an offset per 32 weights through
    group_gemv where that kernel takes it (36 bytes per 32 weights; the loss of int8 is tiny),
    else bf16 weights (64 bytes per 32)."""
    if options.kernel is not None:
        raise ValueError(f"kernel names an int8 kernel; int4 takes its one kernel per shape (quant/int4.py), got {options.kernel!r}")
    for parent in list(model.transformer.h.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (g := group_for(child.in_features, group)):
                setattr(parent, name, Int4Linear(child, g))
    if isinstance(model.lm_head, nn.Linear):
        head = Int8Linear.from_linear(model.lm_head, RULE_PLAN, INT8.group) if native.available() else None
        model.lm_head = head if head is not None and head.runs["group_gemv"] == "group_gemv" else Bf16Linear(model.lm_head)


def note(model: nn.Module, sep: str, compiled: bool) -> str:
    """The stats line's words for an int4 model: its kernels, its head, the linears kept float."""
    fours = [m for m in model.modules() if isinstance(m, Int4Linear)]
    kernels = sorted({m.kernel if m.kernel != "dequantize" else "dequantize (slow)" for m in fours})
    if "group_gemv4" in kernels:
        kernels[kernels.index("group_gemv4")] = f"group_gemv4 (GEMM-blocked past {GEMV_ROWS} rows)"
    floats = sum(isinstance(m, nn.Linear) for m in model.modules())
    kept = f", {floats} linears kept float (no group divides their width)" if floats else ""
    head = ""
    if isinstance(model.lm_head, Bf16Linear):
        head = ", head in bf16"
    elif isinstance(model.lm_head, Int8Linear):
        group = model.lm_head.group
        head = f", head int8 ({f'{group} per scale' if group else 'per-channel scales'}, group_gemv)"
    return f"{sep}int4 weights ({max(m.group for m in fours)} per scale), {' + '.join(kernels)}{head}{kept}"


def _scheme(group: int) -> Scheme:
    name = "int4" if group == 32 else f"int4-g{group}"
    help = (
        "4-bit weights with a scale and a zero per 32 weights through quill's C++ kernel where it builds "
        "(else torch's int4pack), the head int8 (bf16 without the kernel)"
        if group == 32
        else f"int4 with a scale and a zero per {group} weights"
    )
    return Scheme(name, help, 4, group, Int4Linear, linear, convert, note, pack, unpack, KERNELS, store, stored_shapes, load)


INT4, INT4_G64, INT4_G128 = _scheme(32), _scheme(64), _scheme(128)
