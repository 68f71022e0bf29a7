"""Tensors in transparent huge pages: the memory a decode step streams, 2 MiB to a page.

A decode step reads every weight once, hundreds of MB a token, and each 4 KiB page of it costs a
TLB miss and stops the hardware prefetcher at its edge. Linux backs a region with 2 MiB pages when
the region asks (madvise MADV_HUGEPAGE); torch's allocator never asks, and with the kernel's usual
setting (defrag only where asked) a large tensor then gets few or none. A run's weights read into
huge pages made a Llama-3.2-1B-shaped int4 decode step 10-15% faster (docs/performance.md).

Only whole 2 MiB pages inside the tensor are asked for, so a tensor's memory is its bytes rounded
to 4 KiB as before; smaller tensors, and systems without madvise, take torch.empty.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor, its whole 2 MiB pages asked to be huge where the system offers them
    (Linux), else torch.empty. The memory is freed with the tensor (and every view of it)."""
    t = _mapped(shape, dtype)
    return torch.empty(shape, dtype=dtype) if t is None else t


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """empty's tensor of zeros: a new mapping is the system's zero pages, given memory only where
    written (torch.zeros writes every byte)."""
    t = _mapped(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if t is None else t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uninitialized tensor of t's shape and dtype on t's device, in empty's memory for
    a CPU tensor."""
    if t.device.type != "cpu":
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return empty(tuple(t.shape), t.dtype)


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor in a private anonymous mapping of its own, 2 MiB-aligned, its whole 2 MiB pages
    advised huge and the rest not; None below one whole page or without madvise."""
    nbytes = math.prod(shape) * dtype.itemsize
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if not whole or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the region: unmapped with the last view
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        region.madvise(mmap.MADV_NOHUGEPAGE, start + whole, len(region) - start - whole)  # the tail: its own bytes
    except OSError:  # a kernel without transparent huge pages: plain pages, as torch.empty's
        pass
    return raw[start : start + nbytes].view(dtype).view(shape)
