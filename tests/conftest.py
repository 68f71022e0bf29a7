"""Shared fixtures. Tests run offline. Tiny Shakespeare and GPT-2's BPE files (tiktoken's gpt2 and
r50k_base) come from ../shared, a folder beside the clone (or from $QUILL_SHARED); CONTRIBUTING.md
says how to provide them. Without ../shared a test that trains on "a text" gets a play-shaped one
made here (tests/made_text.py); only the tests that compare against runs recorded on the real text,
or that need GPT-2's exact vocabulary where tiktoken cannot download it, are skipped, saying so.
Tests marked `cuda` are skipped where torch sees no CUDA device, `gguf_slow` and
`memory_calibration` unless selected with -m; the summary's last lines count every skip by reason."""

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("QUILL_SHARED") or ROOT.parent / "shared")

# A fixed thread count: training would otherwise give way to other processes on a busy machine
# (quillgpt/cpu_share.py), and sums split over another count round differently, which the
# bit-exact tests would see. tests/test_cpu_share.py unsets it where it tests giving way.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

# tiktoken reads its BPE files from this cache (each file named by the sha1 of its URL) instead of
# downloading them; subprocesses inherit it. A cache the caller set is kept.
if (SHARED / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))


@pytest.fixture(scope="session")
def real_shakespeare_path() -> Path:
    """Tiny Shakespeare (1.1 MB, public domain), whole: for the tests that compare against runs
    recorded on it, or run a tool that reads ../shared itself (CONTRIBUTING.md: Tests)."""
    path = SHARED / "data" / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip(f"needs Tiny Shakespeare itself (a run recorded on it, or a tool reading ../shared), not at {path}")
    return path


@pytest.fixture(scope="session")
def shakespeare_path(tmp_path_factory) -> Path:
    """A training text: Tiny Shakespeare where ../shared has it, else a play-shaped text of the
    same length and the same 65 characters made for the session (tests/made_text.py)."""
    path = SHARED / "data" / "tinyshakespeare.txt"
    if path.is_file():
        return path
    from made_text import write_made_text

    return write_made_text(tmp_path_factory.mktemp("text") / "made_play.txt")


@pytest.fixture(scope="session")
def gpt2_bpe() -> None:
    """GPT-2's BPE files through tiktoken: ../shared's cache, tiktoken's own, or a download. The
    tests that need GPT-2's exact vocabulary (its HF import and export) are skipped where none
    of the three has them."""
    import tiktoken

    try:
        tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 — tiktoken raises requests' errors offline
        pytest.skip(f"needs GPT-2's BPE files: not in tiktoken's cache, download failed ({type(e).__name__}); CONTRIBUTING.md: Tests")


@pytest.fixture(scope="session")
def byte_bpe():
    """A byte-level BPE of GPT-2's kind (the 256 bytes, then merges, then an end-of-text id) made
    for the tests from a made text, for tests about byte-level tokens that need no GPT-2 id: it
    merges "hello" and " world" and leaves CJK characters as byte tokens."""
    from made_text import made_text

    from quillgpt.data.tokenizer import train_bpe

    return train_bpe(made_text(60_000) + "\nhello world, hello moon\n" * 300, vocab_size=600)


@pytest.fixture(autouse=True, scope="session")
def checkout_stays_clean():
    """No test may leave files in the project's root (a command given an empty path writes to
    the working directory): compare the root's entries before and after the whole session."""
    before = set(os.listdir(ROOT))
    yield
    new = sorted(set(os.listdir(ROOT)) - before - {".pytest_cache", ".hypothesis"})
    assert not new, f"tests left files in {ROOT}: {new}"


@pytest.fixture(autouse=True)
def kernel_cache_in_tmp(monkeypatch, tmp_path_factory):
    """--quantize keeps its measured kernel plans under the user's cache directory
    (quant/plan_cache.py): each test gets an empty one of its own, never the user's."""
    monkeypatch.setenv("QUILL_CACHE_DIR", str(tmp_path_factory.mktemp("quill_cache")))


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the bf16 int8 kernels open a parallel region per call,
    and beside other busy processes each one waits for a second core, which makes a tiny model's
    decoding crawl. What such tests prove holds at any thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fixed_int8_kernel(monkeypatch, one_thread):
    """`quantize` with dequant/model (float32, the plain computation) for every input instead of the measured choice, so a command
    test of --quantize int8 runs one known kernel on a tiny model (the measured choice is tested
    in tests/quant/test_int8.py). Yields the kernel."""
    from quillgpt.quant import plan

    kernel = "dequant/model"
    monkeypatch.setattr(plan, "measure_plan", lambda every, block, rows: plan.KernelPlan((1,), (kernel,), rows))
    yield kernel


def pytest_collection_modifyitems(config, items):
    if "gguf_slow" not in (config.getoption("-m") or ""):  # minutes each: run by `pytest -m gguf_slow`
        slow = pytest.mark.skip(reason="a real model or llama.cpp, minutes: run with pytest -m gguf_slow")
        for item in items:
            if item.get_closest_marker("gguf_slow"):
                item.add_marker(slow)
    if "memory_calibration" not in (config.getoption("-m") or ""):
        alone = pytest.mark.skip(reason="measures peak RSS, which earlier tests of a session shift: pytest -m memory_calibration")
        for item in items:
            if item.get_closest_marker("memory_calibration"):
                item.add_marker(alone)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu_check.sh runs these on a GPU)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per reason a test was skipped, with its count: what a run left out, and why."""
    reasons = Counter(skip_reason(report) for report in terminalreporter.stats.get("skipped", []))
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"skipped {count}: {reason}")


def skip_reason(report) -> str:
    """A skip's reason as pytest -rs shows it (its longrepr is (path, line, 'Skipped: reason'))."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")
