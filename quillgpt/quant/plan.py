"""Which int8 kernel multiplies an input of m rows: measured, not assumed. At conversion each
candidate (quill's C++ group_gemv where it builds, int8 matmul `torch._weight_int8pack_mm`, or
dequantize then F.linear; activations in bf16, int16 per 32 or the model's dtype) is timed
against the F.linear it replaces — at the decode batch `rows` on every layer (what a decode step
streams), and at 1, 2, 4, … 256 rows on the first block's layers. An input of m rows then runs
the kernel that was fastest at the smallest measured size ≥ m, so a one-token decode step and a
512-token prompt may take different kernels (their results agree to their activations'
rounding). Where no int8 kernel beats the float linears at the decode batch (a tiny model, or a
burst of load during the measurement) the fastest int8 kernel still runs, as asked, and the
stats line says it measured slower. A plan may be kept across runs (quant/plan_cache.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quillgpt import native
from quillgpt.errors import QuillError
from quillgpt.quant import plan_cache
from quillgpt.quant.int8_kernels import KERNELS

Pair = tuple[nn.Linear, Any]  # a float layer and its int8 copy (an int8.Int8Linear)
PLAN_SECONDS = 5.0  # a plan's measurement past the decode batch stops after this long
# the rule where nothing is measured: the decode batch's kernel up to RULE_ROWS rows, RULE_LARGE
# past them (the dequantized weight through F.linear: it led every measured prompt of 128+ rows)
RULE_ROWS, RULE_LARGE = 64, "dequant/model"


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

    def may_pick(self, kernel: str) -> bool:
        """Whether `kernel` is among those this plan chooses from: a measured plan's candidates (at
        any size: which one wins is the timing's), a fixed plan's own kernels."""
        return kernel in self.kernels or any(kernel in ms for ms in self.ms)

    def describe(self, scales: str = "", what: str = "int8 weights") -> str:
        """A few words for the stats line: the decode step's kernel and what it was measured against
        (`scales`: a note on the weights' scales, after `what`)."""
        kernel = self.pick(self.rows)
        if not self.ms:
            return f"{what}{scales}, {kernel}"
        ms = self.ms[self.sizes.index(self.rows)]
        slower = " (slower here: a model this small, or a busy machine while it was measured)" if ms[kernel] >= ms["float"] else ""
        how = f"; {self.source}" if self.source else ""
        return f"{what}{scales}, {kernel}: a step's linears {ms[kernel]:.2f} ms vs {ms['float']:.2f} ms float{slower}{how}"


# a layer loaded from a quantized run, where no float weight is at hand to measure against:
# group_gemv at every row count (it led every measured decode batch, and past 64 rows its GEMM ran
# 2.8-3.6x the dequantized weight through F.linear at 512 rows: docs/kernels.md); where it cannot
# take the layer, its fallback (the dequantized weight)
RULE_PLAN = KernelPlan((1,), ("group_gemv",))


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
    k = plan_cache.key(w.device, shape) if cache else ""
    if cache and (hit := plan_cache.lookup(k)) is not None:
        try:
            return KernelPlan(tuple(hit["sizes"]), tuple(hit["kernels"]), hit["rows"], tuple(hit["ms"]), source="cached")
        except (KeyError, TypeError):
            pass  # an entry of another layout: measure again
    start = time.perf_counter()
    plan = measure_plan(every, block, rows)
    plan = dataclasses.replace(plan, source=f"measured in {time.perf_counter() - start:.1f} s")
    if cache and plan_cache.store(k, {"sizes": plan.sizes, "kernels": plan.kernels, "rows": plan.rows, "ms": plan.ms}):
        plan = dataclasses.replace(plan, source=plan.source + ", cached for the next load")
    return plan


def measure_plan(every: list[Pair], block: list[Pair], rows: int, largest: int = 256, seconds: float | None = None) -> KernelPlan:
    """Time the kernels against F.linear: at `rows` on every layer (what a decode step streams:
    in a real model more than the last-level cache holds), then at 1, 2, 4, … up to `largest` rows
    on one block's layers (compute decides there) while `seconds` last (None: PLAN_SECONDS): a size past them takes the
    rule's kernel (RULE_ROWS), so a large model's first load measures seconds, not minutes. A
    kernel 20× slower than F.linear on one layer is not timed on every layer (int8pack_mm's
    group-wise form took 15 s a decode step of Qwen2.5-0.5B), nor at larger sizes, but the fastest
    always is (a burst of load may slow them all), and a size where none runs takes the kernel
    chosen at `rows`."""
    sizes = sorted({2**i for i in range(largest.bit_length())} | {rows})
    sizes = [rows] + [m for m in sizes if m != rows]  # the decode batch first: it decides the step
    seconds = PLAN_SECONDS if seconds is None else seconds
    kernels, chosen, table, start = _candidates(every[0][1]), {}, {}, time.perf_counter()
    probe = _timings(block[:1] or every[:1], kernels, rows, budget_s=0)  # one layer: what cannot win anywhere goes first
    kernels = [k for k in kernels if k in probe and probe[k] < 20 * probe["float"]] or kernels
    for m in sizes:
        if m != rows and time.perf_counter() - start > seconds:
            table[m], chosen[m] = {}, None  # not measured: the rule's below
            continue
        ms = _timings(every, kernels, m, budget_s=0.3) if m == rows else _timings(block, kernels, m)
        best = min((k for k in ms if k != "float"), key=ms.get, default=None)
        if m == rows and best is None:
            raise QuillError(f"--quantize int8: no int8 kernel runs on {every[0][0].weight.device.type} here; run without --quantize")
        kernels = [k for k in kernels if k in ms and ms[k] < 20 * ms["float"]] or ([best] if best else kernels)
        chosen[m], table[m] = best, ms
    at_rows, ordered = chosen[rows], sorted(chosen)

    def pick(m: int) -> str:
        if not table[m]:  # past the measurement's seconds
            return at_rows if m <= RULE_ROWS else RULE_LARGE
        return chosen[m] or at_rows

    return KernelPlan(tuple(ordered), tuple(pick(m) for m in ordered), rows, tuple(table[m] for m in ordered))


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


def _candidates(q: Any) -> list[str]:
    """The kernels worth timing: the "/bf16" ones only on a per-channel float32 model (else they are
    the "/model" ones; group-wise scales are asked for their quality, and a bf16 prefill parted
    SmolLM2's greedy answer from fp32's where group_gemv's decode alone kept it); group_gemv only
    where it runs (else it is dequant/model again)."""
    bf16 = q.low_dtype != q.scale.dtype and not q.group
    return [k for k, kern in KERNELS.items() if (bf16 or not kern.bf16) and (k != "group_gemv" or q.runs[k] == k)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
