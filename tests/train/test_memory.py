"""The training memory estimate: within 25% of the peak a real run measures (its peak RSS less
its RSS at the start, in a fresh process), over a few shapes; a run over the limit is refused
before its first step, with the numbers and the knobs."""

import json
import os
import subprocess
import sys

import pytest
from hf_support import make_hf_model
from support import ROOT

import quillgpt.train.loop as train_mod
from quillgpt.config import load_config
from quillgpt.errors import QuillError
from quillgpt.interop.convert import import_hf

MEASURE = """
import json, resource, sys
from quillgpt.config import load_config
from quillgpt.train import loop

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

seen = {}
check = loop.check_train_memory
loop.check_train_memory = lambda *a, **k: seen.setdefault("need", check(*a, **k))
cfg = load_config(sys.argv[1], sys.argv[2:])
start = rss()
loop.train(cfg, progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"estimate": seen["need"].total, "measured": peak - start}))
"""


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A random 2-layer Llama imported, and 64 conversations of one length (so every batch has it)."""
    root = tmp_path_factory.mktemp("memory")
    hf = make_hf_model(root / "hf", "smollm2", hidden_size=128, intermediate_size=384, max_position_embeddings=1024)
    import_hf(hf, root / "run")
    words = "the light through yonder window breaks it is east and juliet is the sun".split()
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": " ".join(words[(i + j) % len(words)] for j in range(160))},
                    {"role": "assistant", "content": " ".join(words[(i * j) % len(words)] for j in range(40))},
                ]
            }
        )
        for i in range(64)
    ]
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return root


def overrides(root, *extra):
    return [
        f"data.path={root / 'chat.jsonl'}",
        "data.format=chat",
        f"data.out_dir={root / 'data'}",
        f"train.out_dir={root / 'out'}",
        "train.overwrite=true",
        "train.max_iters=2",
        "train.eval_interval=2",
        "train.eval_iters=1",
        "train.device=cpu",
        "train.dtype=float32",
        "model.block_size=1024",
        *extra,
    ]


@pytest.mark.memory_calibration  # in a full suite run the same runs measured 1.5-3x more (an earlier test's state; not found)
@pytest.mark.parametrize(
    "shape",
    [("lora.rank=8", "train.batch_size=16"), ("lora.rank=8", "train.batch_tokens=4000"), ("train.batch_size=8",)],
    ids=["lora-rows", "lora-budget", "full"],
)
def test_the_estimate_is_within_a_quarter_of_the_measured_peak(imported, shape):
    # a clean environment: what libraries imported by earlier tests set in os.environ must not change the run
    keep = ("PATH", "HOME", "OMP_NUM_THREADS", "TIKTOKEN_CACHE_DIR", "QUILL_CACHE_DIR", "TMPDIR")
    env = {**{k: os.environ[k] for k in keep if k in os.environ}, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(imported / "run" / "config.yaml"), *overrides(imported, *shape)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["measured"] > 150e6  # the batch's activations dominate what is measured
    assert 0.75 <= got["estimate"] / got["measured"] <= 1.25, got


def test_a_run_over_the_limit_is_refused_before_its_first_step(imported, monkeypatch):
    monkeypatch.setattr("quillgpt.train.memory.available_bytes", lambda device: 200_000_000)
    steps = []
    monkeypatch.setattr(train_mod, "train_step", lambda *a, **k: steps.append(1))
    cfg = load_config(imported / "run" / "config.yaml", overrides(imported, "lora.rank=8", "train.batch_size=32"))
    cfg.train.out_dir = str(imported / "refused")
    with pytest.raises(QuillError) as e:
        train_mod.train(cfg, progress=False)
    message = str(e.value)
    assert "GB is free" in message and "32 rows × " in message and "train.batch_tokens" in message
    assert "train.activation_checkpointing=true" in message
    assert steps == [] and not (imported / "refused" / "ckpt.pt").exists()


def test_geglu_counts_as_swiglu_and_sandwich_norms_as_two_more_norms():
    """GeGLU keeps SwiGLU's tensors for backward ([gate | up], the gate's activation, their
    product); Gemma's norms after each branch keep what a norm before one does."""
    from dataclasses import replace

    from quillgpt.config import ModelConfig, TrainConfig
    from quillgpt.train.memory import estimate_train_bytes, layer_bytes_per_token

    swiglu = ModelConfig(
        vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=64, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False
    )
    geglu = replace(swiglu, mlp="geglu")
    gelu = replace(swiglu, mlp="gelu", mlp_hidden=swiglu.hidden_dim)
    assert layer_bytes_per_token(geglu, 4) == layer_bytes_per_token(swiglu, 4) > layer_bytes_per_token(gelu, 4)
    assert estimate_train_bytes(geglu, TrainConfig()).total == estimate_train_bytes(swiglu, TrainConfig()).total
    sandwich = replace(geglu, sandwich_norm=True)
    assert layer_bytes_per_token(sandwich, 4) - layer_bytes_per_token(geglu, 4) == 2 * (4 + 4 + 4) * 64
