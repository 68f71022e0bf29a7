"""scripts/ as a small tested bench package: every script's --smoke run (a tiny model, seconds,
nothing downloaded) exits 0 without a traceback; the scripts import nothing of each other but
scripts/harness.py and never touch sys.path; the harness's own pieces do what they say.
The test tools run like scripts live in tests/: fuzz.py has its --smoke run here too;
gpu_check.sh and gpu_check.py are tests/test_gpu_check.py's."""

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from made_text import made_text
from support import ROOT

SCRIPTS = ROOT / "scripts"
TEXT = {
    "bench.py",
    "bench_attention.py",
    "bench_commits.py",
    "bench_tasks.py",
    "fuzz.py",
    "make_chat_data.py",
    "speedrun.py",
}
SMOKE = {  # script → extra arguments of its smoke run
    "bench.py": [],
    "bench_attention.py": [],
    "bench_busy.py": [],
    "bench_commits.py": [],
    "bench_finetune.py": [],
    "bench_pp.py": [],
    "bench_prepare.py": [],
    "bench_real.py": [],
    "bench_tasks.py": [],
    "finetune_recipe.py": [],
    "fuzz.py": [],
    "load_chat.py": [],
    "load_serve.py": [],
    "make_chat_data.py": [],
    "passkey.py": ["--generate", "20"],
    "prefix_task.py": [],
    "quant_real.py": ["--passage", "16"],
    "serve_screenshots.py": [],
    "structured_real.py": [],
    "speedrun.py": [],
}
ELSEWHERE = {"fuzz.py": ROOT / "tests" / "fuzz.py"}  # smoked here, but not in scripts/
NOT_SMOKED = {"harness.py"}  # the shared module


NEEDS_GPT2 = {"bench_prepare.py"}  # measures prepare with GPT-2's own tokenizer


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    """Speeches in Tiny Shakespeare's shape (NAME:, lines, a blank line): 30 kB (tests/made_text.py)."""
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text(made_text(30_000), encoding="utf-8")
    return path


def test_every_script_but_the_harness_has_a_smoke_run():
    assert {p.name for p in SCRIPTS.glob("*.py")} == set(SMOKE) - set(ELSEWHERE) | NOT_SMOKED
    for name in SMOKE:
        source = ELSEWHERE.get(name, SCRIPTS / name).read_text(encoding="utf-8")
        assert any(how in source for how in ("add_common(", "add_toy_task(", '"--smoke"')), name  # harness's switches, or its own


def smoke(name, text, tmp):
    """One script's --smoke run in `tmp`, with the worktree's package and a kernel-plan cache of its own."""
    args = [*SMOKE[name], *(["--data-path", str(text)] if name in TEXT else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "QUILL_CACHE_DIR": str(tmp / "cache")}
    command = [sys.executable, str(ELSEWHERE.get(name, SCRIPTS / name)), "--smoke", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp, env=env, timeout=300)


@pytest.fixture(scope="module")
def smoke_runs(request, small_text, tmp_path_factory):
    """The selected scripts' smoke runs, started together, as many at once as there are cores (most
    of a run is importing torch on one core): each test waits for its own."""
    names = [item.callspec.params["name"] for item in request.session.items if item.originalname == "test_smoke_run"]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        yield {name: pool.submit(smoke, name, small_text, tmp_path_factory.mktemp(name)) for name in names}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_smoke_run(name, smoke_runs, request):
    if name in NEEDS_GPT2:
        request.getfixturevalue("gpt2_bpe")
    done = smoke_runs[name].result()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def imports(path):
    """The top-level names a file imports, however deep in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    return {n.split(".")[0] for n in names} | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_scripts_import_only_the_harness_of_each_other_and_leave_sys_path_alone():
    scripts = {p.stem for p in SCRIPTS.glob("*.py")}
    for path in SCRIPTS.glob("*.py"):
        assert imports(path) & scripts <= {"harness"} - {path.stem}, path.name
        assert "sys.path.insert" not in path.read_text(encoding="utf-8"), path.name


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import harness

    return harness


def test_stats_and_interleaving(harness):
    st = harness.Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (st.median, st.lo, st.hi, st.n) == (2.5, 1.0, 10.0, 4) and str(st) == "2.5 (1.0–10.0)"
    calls = []
    got = harness.interleaved({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}, 3)
    assert calls == ["a", "b"] * 3 and got == {"a": [1.0] * 3, "b": [2.0] * 3}  # rep 1 of each, then rep 2, ...


def test_machine_and_load_lines(harness):
    name, isa = harness.cpu()
    assert name and set(isa) <= set(harness.FLAGS)
    line = harness.machine_line()
    assert line.startswith(f"CPU {name}") and " threads | torch " in line
    assert harness.load_line("before").startswith("load average before: ") and len(harness.load_line("x").split()) == 6


def test_peak_memory_sees_an_allocation(harness):
    import torch

    with harness.PeakMemory() as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MB, written
        x += 1
    assert mem.rss_mb > 40


def test_the_package_train_step_on_a_sampler_of_ones_own_learns(harness):
    import torch

    from quillgpt.config import ModelConfig, TrainConfig
    from quillgpt.model.gpt import GPT

    class Repeat:  # the same batch every step: its loss must fall
        def next(self):
            x = torch.arange(16).repeat(4, 1) % 7
            return x, (x + 1) % 7

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=7, block_size=16, n_layer=1, n_head=2, n_embd=16))
    t = harness.trainer(model, TrainConfig(batch_size=4, learning_rate=1e-2, warmup_iters=0, device="cpu"), Repeat())
    before = model(*Repeat().next())[1].item()
    harness.train(t, 30)
    assert model(*Repeat().next())[1].item() < before / 2


def test_quant_reals_row_gives_the_mean_kl_from_fp32_and_the_agreement(harness, capsys):
    """scripts/quant_real.py's table row: KL(fp32 ‖ row) averaged over positions (0 for fp32's own
    logits), top-1 agreement, and the prompts that keep all of fp32's greedy tokens."""
    import quant_real
    import torch

    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    base = quant_real.Baseline(1.0, logits.log_softmax(-1), [[1, 2]] * 10, 2)
    base.row("same", "fp32", 1.0, logits, [[1, 2]] * 10)
    other = torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]])
    base.row("other", "fp32", 1.1, other, [[1, 3]] + [[1, 2]] * 9)
    p, q = logits[0].softmax(-1), other[0].softmax(-1)
    kl = float((p * (p / q).log()).sum()) / 2  # the second position is the same
    same, moved = capsys.readouterr().out.splitlines()
    assert "| 0.0000 | 100.00% | 10/10 |" in same
    assert f"| {kl:.4f} | 50.00% | 9/10 |" in moved
