"""int8 kernels on every width: a kernel that cannot take a layer's shape is never called on it
(torch._weight_int8pack_mm segfaulted on widths that are not a multiple of its SIMD block).
Each case runs in a child process (int8_shapes_worker.py), so a crash fails the test."""

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from quillgpt.quant.int8_kernels import KERNELS, int8pack_fits

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCALE = int(os.environ.get("QUILL_PROPERTY_SCALE", "1"))


@st.composite
def shapes(draw):
    """(n_embd, n_head): an odd head count, an even head size, n_embd within 8…136."""
    n_head = draw(st.sampled_from([1, 3, 5, 7, 9]))
    head = draw(st.integers(1, 136 // (2 * n_head)).map(lambda h: 2 * h).filter(lambda h: n_head * h >= 8))
    return [n_head * head, n_head]


@settings(max_examples=2 * SCALE, deadline=None, database=None, derandomize=SCALE == 1)
@given(st.lists(shapes(), min_size=5, max_size=5, unique_by=tuple))
def test_every_kernel_runs_every_width_and_equals_its_dequantized_model(cases):
    cases[:2] = [[40, 5], [36, 3]]  # the widths that crashed
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(HERE / "int8_shapes_worker.py"), json.dumps(cases)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, f"the kernels crashed or failed (exit {out.returncode}) on {cases}: {out.stderr[-2000:]}"
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["shape"] for r in rows] == cases
    for r in rows:
        for kernel, err in r["err"].items():
            assert err < (1e-2 if KERNELS[kernel].bf16 else max(1e-5, KERNELS[kernel].rounding)), (r["shape"], kernel, err)


def test_a_layer_the_packed_kernel_cannot_take_runs_the_dequantize_kernel():
    from torch import nn

    from quillgpt.quant.int8 import Int8Linear
    from quillgpt.quant.plan import KernelPlan

    plan = KernelPlan((1,), ("int8pack_mm/bf16",))
    assert Int8Linear.from_linear(nn.Linear(36, 40), plan).runs["int8pack_mm/bf16"] == "dequant/bf16"
    assert Int8Linear.from_linear(nn.Linear(48, 36), plan).runs["int8pack_mm/bf16"] == "int8pack_mm/bf16"
    assert [k for k in range(8, 137, 4) if int8pack_fits(64, k)] == list(range(16, 137, 16))
