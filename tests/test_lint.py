"""ruff (the dev extra's linter, configured in pyproject.toml) is clean on the library, the tests
and the scripts: the README's test command runs it here, so CI does too."""

import subprocess
import sys

from support import ROOT


def test_ruff_is_clean():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "quillgpt", "tests", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
