"""Threads that give way to other processes (quillgpt/cpu_share.py): the decision from
/proc's readings, who is left alone, the count restored after a run, and a run whose threads
change mid-way training as one at a fixed count."""

import os
import subprocess
import sys
import time

import pytest
import torch
from support import ROOT, losses, tiny

from quillgpt import cpu_share
from quillgpt.config import load_config
from quillgpt.cpu_share import CpuShare, gives_way, read_proc, sharing_cpu
from quillgpt.train.loop import train


class FakeProc:
    """Readings of /proc as a test wants them: `others` cores busy besides this process's `ours`."""

    def __init__(self) -> None:
        self.wall = self.busy = self.ours = 0.0

    def advance(self, seconds: float, others: float, ours: float = 1.0) -> None:
        self.wall += seconds
        self.busy += seconds * (others + ours)
        self.ours += seconds * ours

    def __call__(self):
        return self.wall, self.busy, self.ours


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_cores_other_processes_leave(threads):
    torch.set_num_threads(4)
    proc = FakeProc()
    share = CpuShare(max_threads=4, cores=4, sample=proc, clock=lambda: proc.wall, hold_s=0.0)
    proc.advance(0.5, others=3.0)
    assert share.update() is None and torch.get_num_threads() == 4  # under a second: no look yet
    proc.advance(0.6, others=3.0)
    line = share.update()
    assert torch.get_num_threads() == 1 and "threads: 1 of 4" in line and "OMP_NUM_THREADS" in line
    proc.advance(1.0, others=1.6)
    share.update()
    assert torch.get_num_threads() == 2
    proc.advance(1.0, others=0.3)  # a light background process: every core is still ours
    assert "threads: 4 of 4" in share.update() and torch.get_num_threads() == 4
    proc.advance(1.0, others=0.3)
    assert share.update() is None  # no change, no line
    proc.advance(1.0, others=9.0)
    share.update()
    assert torch.get_num_threads() == 1  # never fewer than one


def test_a_thread_count_holds_for_hold_s_after_a_change(threads):
    torch.set_num_threads(2)
    proc = FakeProc()
    share = CpuShare(max_threads=2, cores=2, sample=proc, clock=lambda: proc.wall, hold_s=10.0)
    proc.advance(1.0, others=1.0)
    assert "threads: 1 of 2" in share.update()  # the first change: at once
    lines = []
    for second in range(1, 10):  # a neighbour busy every other second
        proc.advance(1.0, others=1.0 if second % 2 == 0 else 0.0)
        lines.append(share.update())
    assert lines == [None] * 9 and torch.get_num_threads() == 1  # held: no flips, no lines
    proc.advance(1.0, others=0.0)
    assert "threads: 2 of 2" in share.update()  # 10 s on, the cores it frees are taken back


def test_a_users_thread_count_cuda_and_ddp_are_left_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert CpuShare.for_run(torch.device("cpu"), 1) is not None
    assert CpuShare.for_run(torch.device("cuda"), 1) is None
    assert CpuShare.for_run(torch.device("cpu"), 2) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert CpuShare.for_run(torch.device("cpu"), 1) is None


def test_proc_readings_count_this_process(threads):
    wall0, busy0, ours0 = read_proc()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    wall1, busy1, ours1 = read_proc()
    assert wall1 - wall0 >= 0.3 and ours1 - ours0 >= 0.1 and busy1 - busy0 >= ours1 - ours0 - 0.05


def test_the_thread_count_is_restored_after_a_run(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    with sharing_cpu(torch.device("cpu"), 1) as share:
        torch.set_num_threads(1)
        assert share.max_threads == 2
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_whose_threads_change_mid_way_trains_as_one_that_kept_them(shakespeare_path, tmp_path, monkeypatch, threads, dtype):
    """The quickstart's kind of model (RoPE, SwiGLU, QK-norm, Muon): at a fixed 2 threads, and with
    'another process' taking a core from the second look on (1 thread), the same losses to
    rounding (bit for bit where the kernels split no sum by thread: cpu_share's docstring)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    overrides = [
        *tiny(shakespeare_path, tmp_path / "data", tmp_path / "x"),
        "model.n_embd=64",
        "train.max_iters=12",
        "train.batch_size=8",
        f"train.dtype={dtype}",
    ]
    runs, real = {}, torch.set_num_threads
    for name, others in (("fixed", 0.0), ("gave_way", 1.0)):
        proc = FakeProc()

        def sample(proc=proc, others=others):
            proc.advance(2.0, others * (os.cpu_count() - 1) if proc.wall >= 2 else 0.0)
            return proc()

        monkeypatch.setattr(cpu_share, "read_proc", sample)
        real(2)
        seen = []
        monkeypatch.setattr(torch, "set_num_threads", lambda n, seen=seen: (seen.append(n), real(n)))
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", [*overrides, f"train.out_dir={tmp_path / name}"])
        train(cfg, progress=False)
        runs[name] = losses(tmp_path / name)
        assert (1 in seen) == (name == "gave_way"), seen
    fixed, gave_way = runs["fixed"], runs["gave_way"]
    assert [r[0] for r in fixed] == [r[0] for r in gave_way]
    assert torch.allclose(torch.tensor([r[1] for r in fixed]), torch.tensor([r[1] for r in gave_way]), rtol=1e-3)


def test_a_cpu_peak_is_kept_only_when_measured_on_a_quiet_machine():
    from quillgpt.device import gpu_peak

    proc = FakeProc()

    def measure(others):
        proc.advance(1.0, others=others)
        return 5e10

    assert cpu_share.measured_quietly(lambda: measure(0.1), proc) == 5e10
    assert cpu_share.measured_quietly(lambda: measure(1.0), proc) is None  # one core busy elsewhere: no MFU
    assert gpu_peak("NVIDIA H200", torch.bfloat16) == 989e12 and gpu_peak("NVIDIA H200", torch.float32) == 989e12 / 2
    assert gpu_peak("Some Future GPU", torch.bfloat16) is None  # not guessed


def test_the_first_line_says_the_thread_count_may_give_way(monkeypatch):
    """Training's first line says its threads may give way to other processes where they will (so a
    later "threads: 1 of 2" contradicts nothing), and not where the count is the user's."""
    from types import SimpleNamespace

    from quillgpt.train.progress import startup_line

    model = SimpleNamespace(num_params=lambda non_embedding: 1e6)
    t = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(max_iters=4, time_budget=None)),
        raw_model=model,
        dtype=torch.float32,
        device=torch.device("cpu"),
        ddp=SimpleNamespace(world_size=1),
        budget_s=None,
        out_dir="out/run",
        step=0,
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert gives_way(torch.device("cpu"), 1) == os.path.exists("/proc/stat")
    if gives_way(torch.device("cpu"), 1):
        assert "thread(s) (fewer while other processes use the cores), 64 tokens/step" in startup_line(t, "64", False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not gives_way(torch.device("cpu"), 1) and "fewer while" not in startup_line(t, "64", False)
    assert not gives_way(torch.device("cuda"), 1) and not gives_way(torch.device("cpu"), 2)


def test_the_first_look_can_come_sooner_and_the_note_says_what_was_decided(threads):
    """Inference looks once FIRST_LOOK_S has passed (a short sample decodes in about a second),
    then every interval_s; its note is what the stats lines print."""
    torch.set_num_threads(2)
    proc = FakeProc()
    share = CpuShare(max_threads=2, cores=2, sample=proc, clock=lambda: proc.wall, first_s=cpu_share.FIRST_LOOK_S)
    assert share.note() == "2 threads"
    proc.advance(0.15, others=1.0)
    share.update()
    assert share.threads == 1 == torch.get_num_threads()
    assert share.note() == "1 of 2 threads (other processes used 1.0 of 2 cores)"
    proc.advance(0.15, others=0.0)
    assert share.update() is None and share.others_seen == 1.0  # the next look waits interval_s


def test_the_driver_gives_way_between_decode_steps_and_a_held_share_restores_the_count(threads):
    """TextBatch looks before every prefill and step (sample, chat and serve all drive through it);
    held() sets the decided count on entry and the starting one back on exit."""
    from support import V, random_model

    from quillgpt.data.tokenizer import CharTokenizer
    from quillgpt.inference.driver import TextBatch
    from quillgpt.inference.generate import make_engine
    from quillgpt.sampling_params import SamplingParams

    torch.set_num_threads(2)
    proc = FakeProc()
    share = CpuShare(max_threads=2, cores=2, sample=proc, clock=lambda: proc.wall, hold_s=0.0)
    looks = []
    with share.held():
        batch = TextBatch(make_engine(random_model(), 1), CharTokenizer("".join(map(chr, range(65, 65 + V)))), share)
        proc.advance(1.0, others=1.0)
        batch.join(0, [1, 2, 3], SamplingParams(max_new_tokens=6, temperature=0.0))
        looks.append(torch.get_num_threads())
        for others in (1.0, 0.0, 0.0):
            proc.advance(1.0, others=others)
            batch.step()
            looks.append(torch.get_num_threads())
        assert looks == [1, 1, 2, 2]  # a busy neighbour, then a quiet machine: every core again
        proc.advance(1.0, others=1.0)
        batch.step()
        assert share.threads == 1
    assert torch.get_num_threads() == 2


@pytest.fixture
def cpu_hog():
    """A child process that keeps one core busy for at most 60 s; killed when the test ends."""
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"])
    try:
        time.sleep(0.3)  # running at full speed before the test looks
        yield hog
    finally:
        hog.kill()
        hog.wait(timeout=10)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="giving a core away needs two of them")
def test_sample_beside_a_busy_process_takes_fewer_threads_and_says_so(tmp_path, monkeypatch, threads, cpu_hog):
    """`quill sample`'s path (open_sample) beside a process that keeps a core busy: fewer threads
    than torch's starting count from the first step, the stats line says why, and the count is
    back afterwards. (Other load on the machine only adds to the busy cores the test needs.)"""
    from support import V, random_model

    from quillgpt.config import Config
    from quillgpt.data.tokenizer import CharTokenizer
    from quillgpt.inference import generate
    from quillgpt.inference.generate import open_sample
    from quillgpt.runs import LoadOptions, write_run

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(os.cpu_count())
    model = random_model()
    (tmp_path / "run").mkdir()
    write_run(tmp_path / "run", Config(model=model.config), CharTokenizer("".join(map(chr, range(65, 65 + V)))), model.state_dict())
    real_load = generate.load_run

    def a_real_models_load(*args, **kwargs):  # seconds for a real model: the first look's window
        time.sleep(0.3)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(generate, "load_run", a_real_models_load)
    sample = open_sample(tmp_path / "run", "ABC", LoadOptions(), flags={"max_new_tokens": 8, "temperature": 0.0})
    seen = []
    for _ in sample.generation:
        seen.append(torch.get_num_threads())
    assert seen[0] < os.cpu_count() and max(seen) < os.cpu_count(), seen
    assert f"of {os.cpu_count()} threads (other processes used" in sample.stats_line()
    assert torch.get_num_threads() == os.cpu_count()


def test_a_chat_reply_gives_way_and_its_stats_line_says_so(threads):
    from support import random_model

    from quillgpt.data.tokenizer import CharTokenizer
    from quillgpt.inference.chat_session import ChatSession
    from quillgpt.sampling_params import SamplingParams

    torch.set_num_threads(2)
    proc = FakeProc()
    share = CpuShare(max_threads=2, cores=2, sample=proc, clock=lambda: proc.wall, first_s=cpu_share.FIRST_LOOK_S)
    tok = CharTokenizer("".join(sorted("\n :AU012345abcdefghijklmnopqrstuvwxyz")))  # V characters: the transcript's
    session = ChatSession(random_model(), tok, SamplingParams(max_new_tokens=4, temperature=0.0), threads=share)
    proc.advance(0.5, others=1.0)
    "".join(session.reply("hi"))
    assert "; 1 of 2 threads (other processes used 1.0 of 2 cores))" in session.last.line()
    assert torch.get_num_threads() == 2  # between replies: the starting count


def test_the_servers_health_reports_the_engine_threads_it_gives_way_with(threads):
    from support import random_model

    from quillgpt.inference.engine import Engine
    from quillgpt.serve.batcher import Batcher

    proc = FakeProc()
    share = CpuShare(max_threads=2, cores=2, sample=proc, clock=lambda: proc.wall)
    engine = Engine(random_model(), max_rows=1)
    assert Batcher(engine, threads=share).load()["threads"] == 2
    assert "threads" not in Batcher(engine).load()  # a fixed count (OMP_NUM_THREADS) or a GPU: nothing to report
