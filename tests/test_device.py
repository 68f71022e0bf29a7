"""quillgpt/device.py: releasing a thread's OpenMP workers before another thread takes the torch work."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from quillgpt.device import release_thread_pool


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2, reason="Linux, two or more torch threads")
def test_release_thread_pool_ends_this_threads_idle_workers_and_torch_goes_on():
    """quill serve's make_app calls it before the batcher's thread decodes: the main thread's idle
    OpenMP workers exit (the process has fewer threads), and parallel ops still work, here and in
    another thread."""
    x = torch.randn(4_000_000)
    want = x.exp()  # a parallel region: this thread's pool has its workers now
    threads = len(os.listdir("/proc/self/task"))
    assert release_thread_pool()
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) >= threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/task")) < threads
    got: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: got.append(x.exp()))
    worker.start()
    worker.join(30)
    assert torch.equal(got[0], want) and torch.equal(x.exp(), want)
