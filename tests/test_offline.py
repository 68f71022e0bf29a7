"""A clean clone's suite runs offline: the files it would download ship in tests/fixtures/offline/,
and the session's last lines count what it skipped, by reason."""

import hashlib
from types import SimpleNamespace

import conftest
import pytest
import tiktoken.load
import tiktoken_ext.openai_public as openai_public


def test_tiktoken_builds_gpt2_and_r50k_base_from_the_shipped_cache_without_the_network(monkeypatch):
    """Each file is named by the sha1 of its URL and passes tiktoken's sha256 check, so nothing is
    fetched (a fetch fails here)."""

    def no_network(blobpath: str) -> bytes:
        raise AssertionError(f"tiktoken tried to download {blobpath}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(conftest.OFFLINE / "tiktoken_cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    for encoding in (openai_public.gpt2, openai_public.r50k_base):
        assert len(encoding()["mergeable_ranks"]) == 50256


def test_tiny_shakespeare_ships_whole(shakespeare_path):
    """The text the recorded runs were trained on, byte for byte (Karpathy's char-rnn input.txt)."""
    digest = hashlib.sha256(shakespeare_path.read_bytes()).hexdigest()
    assert digest == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert shakespeare_path.is_relative_to(conftest.ROOT)


def test_the_summary_counts_skips_by_reason():
    skipped = [SimpleNamespace(longrepr=("t.py", 3, f"Skipped: {reason}")) for reason in ["needs a CUDA device"] * 2 + ["minutes"]]
    lines = []
    conftest.pytest_terminal_summary(SimpleNamespace(stats={"skipped": skipped}, write_line=lines.append))
    assert lines == ["skipped 2: needs a CUDA device", "skipped 1: minutes"]


@pytest.mark.parametrize("longrepr", [("t.py", 3, "Skipped: why"), "why"])
def test_a_skip_reason_is_read_from_either_form_of_its_report(longrepr):
    assert conftest.skip_reason(SimpleNamespace(longrepr=longrepr)) == "why"
