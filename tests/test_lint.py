"""ruff (the dev extra's linter and formatter, configured in pyproject.toml) is clean on the
library, the tests and the scripts: the README's test command runs both here, so CI does too."""

import subprocess
import sys

from support import ROOT


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "quillgpt", "tests", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ruff_is_clean():
    done = ruff("check")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_ruff_format_leaves_every_file_as_it_is():
    done = ruff("format", "--check")
    assert done.returncode == 0, "run `ruff format quillgpt tests scripts`:\n" + done.stdout[-3000:] + done.stderr[-1000:]
