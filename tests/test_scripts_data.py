"""The scripts' text: by default the Tiny Shakespeare the README's quickstart downloaded
(data/downloads/input.txt), another with --data-path; a missing one is one line, never a traceback,
and no script reads ../shared (beside the clone) unasked."""

import re
import subprocess
import sys

import pytest
from support import ROOT

from quillgpt.data.download import local_text
from quillgpt.errors import QuillError


def test_the_default_text_is_the_quickstarts_download(tmp_path):
    with pytest.raises(
        QuillError, match=r"no Tiny Shakespeare at .*data/downloads/input.txt: `quill train --config configs/quickstart.yaml`"
    ):
        local_text(None, tmp_path)
    (tmp_path / "data" / "downloads").mkdir(parents=True)
    (tmp_path / "data" / "downloads" / "input.txt").write_text("First Citizen:\n", encoding="utf-8")
    assert local_text(None, tmp_path) == tmp_path / "data" / "downloads" / "input.txt"
    with pytest.raises(QuillError, match="--data-path .*nothing.txt: no such file"):
        local_text(tmp_path / "nothing.txt", tmp_path)


def test_make_chat_data_takes_data_path_and_fails_in_one_line(tmp_path, shakespeare_path):
    run = [sys.executable, str(ROOT / "scripts" / "make_chat_data.py"), "--out", str(tmp_path / "chat")]
    bad = subprocess.run([*run, "--data-path", str(tmp_path / "missing.txt")], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: --data-path") and "no such file" in bad.stderr
    good = subprocess.run([*run, "--data-path", str(shakespeare_path)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert good.returncode == 0, good.stderr
    assert (tmp_path / "chat" / "speakers_train.jsonl").stat().st_size > 0


def test_no_script_reads_the_shared_folder_beside_the_clone_for_its_text():
    for path in sorted((ROOT / "scripts").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert not re.search(r"""["']shared["']\s*/\s*["']data["']""", source), f"{path.name} reads ../shared/data by default"


def test_the_packing_benchmark_says_unreliable_instead_of_reversing_under_load(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_recipe", ROOT / "scripts" / "finetune_recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    spec.loader.exec_module(recipe)
    steady = [0.100, 0.102, 0.101, 0.099, 0.100]
    assert recipe.unreliable(steady, [1.01 * t for t in steady], others=0.05) is None  # quiet: a result
    assert "other processes used 1.0 cores" in recipe.unreliable(steady, steady, others=1.0)
    burst = [0.100, 0.100, 0.190, 0.100, 0.100]  # one repeat beside a burst of other work
    assert recipe.unreliable(steady, burst, others=0.0) == "the masked step's 5 repeats spread 90%"
