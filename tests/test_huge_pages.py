"""huge_pages.empty: a tensor like torch.empty's, whose whole 2 MiB pages ask for huge pages."""

import mmap
import sys
from pathlib import Path

import pytest
import torch

from quillgpt import huge_pages, native
from quillgpt.tensor_file import TensorFile, TensorWriter

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages: Linux with them enabled",
)


def vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("shape", [(3, 5), (1000, 1100), (3 << 20,)], ids=["small", "4-MB", "whole-pages"])
def test_a_tensor_like_torch_empty_s(shape):
    t = huge_pages.empty(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    values = torch.arange(t.numel(), dtype=torch.float32).view(shape)
    t.copy_(values)
    assert torch.equal(t, values)
    assert torch.equal(t.view(torch.uint8).view(-1)[:8], values.view(torch.uint8).view(-1)[:8])


@pytest.mark.parametrize("shape", [(3, 5), (1000, 1100)], ids=["small", "4-MB"])
def test_zeros_are_zeros(shape):
    assert torch.equal(huge_pages.zeros(shape, torch.float16), torch.zeros(shape, dtype=torch.float16))


@needs_thp
def test_its_whole_pages_ask_for_huge_ones_and_its_tail_does_not():
    t = huge_pages.empty((1000, 1100), torch.float32)  # 4.4 MB: two whole 2 MiB pages, then a tail
    start, nbytes = t.data_ptr(), t.numel() * 4
    assert start % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(start) and "hg" in vm_flags(start + 2 * huge_pages.HUGE_PAGE - 1)
    assert "nh" in vm_flags(start + nbytes - 1)


@needs_thp
def test_a_quantized_layers_codes_are_interleaved_straight_into_huge_pages():
    """empty_like's memory for a large CPU tensor is in huge pages, and the kernels' layout written
    into it (interleave's out, pack4's) equals the one interleave allocates itself."""
    t = torch.randint(-127, 128, (1024, 4096), dtype=torch.int8)
    into = huge_pages.empty_like(t)
    assert into.shape == t.shape and into.dtype == t.dtype and "hg" in vm_flags(into.data_ptr())
    assert native.interleave(t, into) is into and torch.equal(into, native.interleave(t))
    q = torch.randint(0, 16, (1027, 4096), dtype=torch.uint8)
    packed = native.pack4(q, huge_pages.empty((1027, 2048), torch.uint8))
    assert torch.equal(packed, native.pack4(q)) and torch.equal(native.unpack4(packed), q)
    small = torch.randn(4, 4)
    assert huge_pages.empty_like(small).shape == (4, 4)


@needs_thp
def test_a_weights_file_reads_its_large_tensors_into_huge_pages(tmp_path):
    tensors = {"big": torch.randn(2048, 1024), "small": torch.randn(4, 4)}
    with TensorWriter(tmp_path / "w.safetensors", [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], {}) as w:
        for name, t in tensors.items():
            w.write(name, t)
    f = TensorFile(tmp_path / "w.safetensors")
    big = f.read("big")
    assert torch.equal(big, tensors["big"]) and torch.equal(f.read("small"), tensors["small"])
    assert "hg" in vm_flags(big.data_ptr())
