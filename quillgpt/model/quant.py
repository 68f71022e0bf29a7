"""Weight-only int8: every linear layer of the blocks and the head stores int8 weights with one
scale per output channel, W ≈ q·s, so a decode step streams a quarter of fp32's weight bytes.

`quantize(model, "int8")` swaps each nn.Linear for an `Int8Linear` once, from the model's own
weights (no new checkpoint format). A tied head keeps its embedding for the lookup and gets its
own int8 copy for the matmul. The blocks call an Int8Linear exactly as they call nn.Linear.

Which kernel multiplies is measured, not assumed: at quantize time each candidate (int8 matmul
`torch._weight_int8pack_mm`, or dequantize then F.linear; activations in bf16 or the model's
dtype) is timed against the F.linear it replaces — at the decode batch `rows` on every layer
(what a decode step streams), and at 1, 2, 4, … 256 rows on the first block's layers. An input
of m rows then runs the kernel that was fastest at the smallest measured size ≥ m, so a
one-token decode step and a 512-token prompt may take different kernels (their results agree
to bf16 rounding). Where no int8 kernel beats the float linears at the decode batch (a tiny
model, or a burst of load during the measurement) the fastest int8 kernel still runs, as asked,
and the stats line says it measured slower. On CUDA
the dequantize form is gpt-fast's; it pays there once the decode step is compiled (inductor
fuses the dequantization into the matmul), which the engine's compile=True does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT

SCHEMES = ("int8",)


def parse_quantize(name: str | None, setting: str = "--quantize") -> str | None:
    """A scheme a user names: int8, or none / None for the float weights."""
    if name is None or name == "none":
        return None
    if name not in SCHEMES:
        raise QuillError(f"{setting} must be int8 or none, got {str(name)[:60]!r}")
    return name


# --- kernels: (x (M, K), weight int8 (N, K), scale (N,)) → (M, N), x cast to the scale's dtype ---


def int8pack_mm(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    x = x.to(scale.dtype).contiguous()
    if x.data_ptr() % 64:  # its bf16/fp16 SIMD loads are aligned: a view into a larger tensor gets a fresh copy
        x = x.clone()
    return torch._weight_int8pack_mm(x, weight, scale)


def dequant_linear(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return F.linear(x.to(scale.dtype), weight.to(scale.dtype)) * scale


def int8pack_fits(out_features: int, in_features: int) -> bool:
    """Whether torch._weight_int8pack_mm can take the shape: its bf16/fp16 path reads each row of
    x and of the weight in aligned SIMD blocks of 8 (AVX2, NEON) or 16 (AVX-512) values with no
    tail loop, so in_features must be a multiple of 16, else it reads past the row or faults on a
    misaligned load (a segfault). Its fp32 path is a plain loop, but a model converted to bf16
    after quantizing would take the other, so the rule holds for both."""
    return in_features % 16 == 0


def any_shape(out_features: int, in_features: int) -> bool:
    return True


@dataclass(frozen=True)
class Kernel:
    """A matmul, whether it takes bf16 activations (the bf16 scales; else the model's dtype), and
    which (out_features, in_features) it can take: a layer it cannot take runs `fallback` instead,
    decided when the layer is made, before any call (a kernel given a bad shape can crash the process)."""

    matmul: Callable[[Tensor, Tensor, Tensor], Tensor]
    bf16: bool
    fits: Callable[[int, int], bool]
    fallback: str


# name → Kernel; "/bf16": bf16 activations, "/model": the model's dtype
KERNELS: dict[str, Kernel] = {
    "int8pack_mm/bf16": Kernel(int8pack_mm, True, int8pack_fits, "dequant/bf16"),
    "int8pack_mm/model": Kernel(int8pack_mm, False, int8pack_fits, "dequant/model"),
    "dequant/bf16": Kernel(dequant_linear, True, any_shape, "dequant/bf16"),
    "dequant/model": Kernel(dequant_linear, False, any_shape, "dequant/model"),
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

    def pick(self, m: int) -> str:
        for size, kernel in zip(self.sizes, self.kernels):  # a loop torch.compile can trace; small m exit first
            if m <= size:
                return kernel
        return self.kernels[-1]

    def describe(self) -> str:
        """A few words for the stats line: the decode step's kernel and what it was measured against."""
        kernel = self.pick(self.rows)
        if not self.ms:
            return f"int8 weights, {kernel}"
        ms = self.ms[self.sizes.index(self.rows)]
        slower = " (slower here: a model this small, or a busy machine while it was measured)" if ms[kernel] >= ms["float"] else ""
        return f"int8 weights, {kernel}: a step's linears {ms[kernel]:.2f} ms vs {ms['float']:.2f} ms float{slower}"


class Int8Linear(nn.Module):
    """y = x·(q·s)ᵀ + b: int8 q (out, in), per-output-channel scales s, the float bias b.
    The same call as nn.Linear: (…, in) → (…, out) in x's dtype."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None, plan: KernelPlan) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)  # (out, in) int8
        self.register_buffer("scale", scale)  # (out,) in the model's dtype
        low = torch.bfloat16 if scale.dtype == torch.float32 else scale.dtype  # bf16/fp16 models: their own
        self.register_buffer("scale_low", scale.to(low))  # the same scales for the "/bf16" kernels
        self.register_buffer("bias", bias)
        self.plan = plan
        self.runs = {k: k if kern.fits(*weight.shape) else kern.fallback for k, kern in KERNELS.items()}  # kernel → what runs

    @classmethod
    def from_linear(cls, linear: nn.Linear, plan: KernelPlan) -> Int8Linear:
        """Symmetric per-row quantization: s = max|w| / 127, q = round(w / s) in [-127, 127]."""
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1).float() / 127
        q = torch.round(w.float() / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q.to(torch.int8), scale.to(w.dtype), bias, plan)

    def dequantized(self) -> Tensor:
        """(out, in) float32 q·s: the weight this layer multiplies by (to rounding)."""
        return self.weight.float() * self.scale.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:  # (M, in): the decode step
            return self.linear(x, self.plan.pick(x.shape[0]))
        x2 = x.reshape(-1, x.shape[-1])
        return self.linear(x2, self.plan.pick(x2.shape[0])).view(*x.shape[:-1], self.out_features)

    def linear(self, x: Tensor, kernel: str) -> Tensor:
        """(M, in) → (M, out) in x's dtype through `kernel`, or its fallback where it cannot take this shape."""
        kern = KERNELS[self.runs[kernel]]
        y = kern.matmul(x, self.weight, self.scale_low if kern.bf16 else self.scale)
        return y.to(x.dtype) if self.bias is None else self.bias + y  # the bias add casts too

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


# --- choosing the kernels and swapping the layers ----------------------------------------------


def quantize(model: GPT, scheme: str | None, rows: int = 1, kernel: str | None = None) -> GPT:
    """Swap every nn.Linear of `model` (the blocks' and the head) for an Int8Linear, in place,
    and return it; scheme None returns the model unchanged. `rows`: the decode batch (one
    token per row) the kernels are measured at (measure_plan); `kernel` (a KERNELS name) fixes
    one kernel for every input instead (tests, reproducing a run)."""
    scheme = parse_quantize(scheme, "scheme")
    if scheme is None:
        return model
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("the model is already quantized")
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    places = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children() if isinstance(child, nn.Linear)
    ]
    layers = [Int8Linear.from_linear(lin, KernelPlan((1,), (kernel or "dequant/model",), rows)) for _, _, lin in places]
    if kernel is None:
        first = {id(m) for m in model.transformer.h[0].modules()}
        pairs = [(lin, q) for (_, _, lin), q in zip(places, layers)]
        plan = measure_plan(pairs, [p for p in pairs if id(p[0]) in first], rows)
        for q in layers:
            q.plan = plan
    for (parent, name, _), q in zip(places, layers):
        setattr(parent, name, q)
    return model


def plan_of(model: GPT) -> KernelPlan | None:
    """The kernel plan of a quantized model (None: float weights)."""
    return next((m.plan for m in model.modules() if isinstance(m, Int8Linear)), None)


def weights_note(model: GPT, sep: str = ", ") -> str:
    """`sep` + the plan's few words for a quantized model's start-up or stats line; "" for float weights."""
    plan = plan_of(model)
    return "" if plan is None else f"{sep}{plan.describe()}"


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
    """The kernels worth timing: the "/bf16" ones only on a float32 model (else they are the "/model" ones)."""
    distinct = q.scale_low.dtype != q.scale.dtype
    return [k for k, kern in KERNELS.items() if distinct or not kern.bf16]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
