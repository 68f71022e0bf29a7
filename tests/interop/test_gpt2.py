"""GPT-2 interop against transformers itself: same logits, same greedy tokens, same tensors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel  # noqa: E402

from quillgpt.checkpoint import save_checkpoint  # noqa: E402
from quillgpt.cli import main  # noqa: E402
from quillgpt.config import Config, ModelConfig, load_config  # noqa: E402
from quillgpt.data.tokenizer_files import build_tokenizer  # noqa: E402
from quillgpt.errors import QuillError  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.interop.convert import export_hf, import_hf  # noqa: E402
from quillgpt.model.gpt import GPT  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402
from quillgpt.train.loop import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPT2_VOCAB = 50257
N_POSITIONS = 32


def random_gpt2(seed: int = 0, **config) -> GPT2LMHeadModel:
    """A tiny GPT-2 with every parameter random (biases and LayerNorm gains too), in eval mode."""
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_head=4, n_embd=64, n_positions=N_POSITIONS, vocab_size=GPT2_VOCAB, layer_norm_epsilon=1e-5)
    model = GPT2LMHeadModel(GPT2Config(**{**cfg, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if name.endswith("bias") or ".ln_" in name else 0.02))
    return model.eval()


def hf_logits(model: GPT2LMHeadModel, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def quill_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, all_logits=True)[0]


def save_legacy_bin(model: GPT2LMHeadModel, path: Path) -> None:
    """The layout of the original gpt2 pytorch_model.bin: no `transformer.` prefix, no lm_head,
    and the causal-mask buffers attn.bias / attn.masked_bias saved as if they were weights."""
    path.mkdir(parents=True)
    model.config.to_json_file(path / "config.json")
    state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    n = model.config.n_positions
    for i in range(model.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.uint8)).view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, path / "pytorch_model.bin")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, gpt2_bpe):  # an import speaks GPT-2's vocabulary: tiktoken's files
    """A random GPT-2 with GPT-2's vocabulary, saved by transformers as safetensors."""
    model = random_gpt2()
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    return import_hf(hf_dir[1], tmp_path_factory.mktemp("runs") / "imported").path


@pytest.mark.parametrize("layout", ["safetensors", "legacy-bin"])
def test_import_gives_transformers_logits_and_greedy_tokens(hf_dir, tmp_path, layout):
    hf, path = hf_dir
    if layout == "legacy-bin":
        path = tmp_path / "bin"
        save_legacy_bin(hf, path)
    run = import_hf(path, tmp_path / "run").path
    model = load_run(run).model
    assert model.config.block_size == N_POSITIONS and model.config.vocab_size == GPT2_VOCAB

    idx = torch.randint(0, GPT2_VOCAB, (3, N_POSITIONS), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(quill_logits(model, idx), hf_logits(hf, idx), atol=1e-4, rtol=0)

    prompt = idx[0, :5]
    ours = torch.stack(list(generate_tokens(model, [prompt.tolist()], 12))).squeeze(1)
    seq = prompt[None]
    for _ in range(12):  # HF greedy, spelled out
        seq = torch.cat([seq, hf_logits(hf, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ours.tolist() == seq[0, 5:].tolist()


def test_round_trip_import_export_gives_identical_tensors(hf_dir, imported, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export-hf", str(imported), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 0 and "exported" in capsys.readouterr().out
    original, exported = load_file(hf_dir[1] / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "activation_function", "layer_norm_epsilon"):
        assert config[key] == hf_dir[0].config.to_dict()[key], key
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["bos_token_id"] == 50256

    with pytest.raises(SystemExit) as exit_:  # a second export does not overwrite by accident
        main(["export-hf", str(imported), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "--force" in capsys.readouterr().err


def test_imported_run_speaks_gpt2s_vocabulary(imported, tmp_path, capsys):
    run = load_run(imported)
    tok = run.tokenizer
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode(tok.encode("Hello world, Ünïcode ✓")) == "Hello world, Ünïcode ✓"
    new = [int(t) for t in generate_tokens(run.model, [tok.encode("Hello world")], 5)]
    assert len(new) == 5 and all(0 <= t < GPT2_VOCAB for t in new)
    assert isinstance(tok.decode(new), str)
    saved = load_config(imported / "config.yaml")  # training with it fine-tunes, never overwrites
    assert saved.train.init_from == str(imported) and saved.train.out_dir == f"{imported}-finetune"
    assert saved.data.path is None and saved.data.url is None  # no data of its own (it kept Tiny Shakespeare's URL)
    with pytest.raises(SystemExit) as exit_:  # preparing it asks for the user's data in one line
        main(["prepare", "--config", str(imported / "config.yaml"), f"data.out_dir={tmp_path / 'data'}"])
    assert exit_.value.code == 2 and "no data to prepare: set data.path" in capsys.readouterr().err

    greedy = [int(t) for t in generate_tokens(run.model, [tok.encode("Hello world")], 8)]
    with pytest.raises(SystemExit) as exit_:  # quill sample encodes and decodes with GPT-2's vocabulary
        main(
            [
                "sample",
                "--ckpt",
                str(imported),
                "--prompt",
                "Hello world",
                "--temperature",
                "0",
                "-n",
                "8",
                "--device",
                "cpu",
                "--json",
                "-q",
            ]
        )
    assert exit_.value.code == 0
    assert json.loads(capsys.readouterr().out)["samples"] == [tok.decode(greedy)]

    text = tmp_path / "text.txt"  # quill eval reads the imported run like any other
    text.write_text("Hello world. " * 10, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--ckpt", str(imported), "--text", str(text), "--json"])
    assert exit_.value.code == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(tok.encode("Hello world. " * 10)) - 1


def _train_char(shakespeare_path, tmp_path, *extra):
    overrides = [
        f"data.path={shakespeare_path}",
        f"data.out_dir={tmp_path / 'data'}",
        f"train.out_dir={tmp_path / 'run'}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=4",
        "train.max_iters=6",
        "train.eval_interval=3",
        "train.eval_iters=2",
        "train.warmup_iters=2",
        "train.learning_rate=1e-2",
        "train.device=cpu",
        "train.dtype=float32",
        *extra,
    ]
    train(load_config(ROOT / "configs" / "shakespeare_char_cpu.yaml", overrides), progress=False)
    return tmp_path / "run"


@pytest.mark.parametrize(
    "extra",
    [
        ["model.bias=true"],
        ["model.bias=false", "model.tie_embeddings=false", "model.mlp_hidden=48"],  # zero biases, untied, n_inner
    ],
    ids=["gpt2", "nobias-untied-ninner"],
)
def test_exported_trained_checkpoint_loads_in_transformers(shakespeare_path, tmp_path, extra):
    run = _train_char(shakespeare_path, tmp_path, *extra)
    export_hf(run, tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = load_run(run)
    idx = torch.randint(0, ours.config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf_logits(hf, idx), quill_logits(ours.model, idx), atol=1e-4, rtol=0)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())  # the char tokenizer: no end-of-text
    sample = ours.config.sample
    assert generation == {
        "max_new_tokens": sample.max_new_tokens,
        "do_sample": True,
        "temperature": sample.temperature,
        "top_k": sample.top_k,
        "top_p": 1.0,
    }
    GenerationConfig.from_pretrained(tmp_path / "hf")  # transformers reads it

    back = load_run(import_hf(tmp_path / "hf", tmp_path / "back").path)  # and home again, tokenizer included
    assert back.tokenizer.spec() == ours.tokenizer.spec()
    torch.testing.assert_close(quill_logits(back.model, idx), quill_logits(ours.model, idx), atol=1e-5, rtol=0)


def test_fine_tune_an_imported_model(imported, shakespeare_path, tmp_path):
    text = tmp_path / "slice.txt"
    text.write_text(shakespeare_path.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    cfg = load_config(
        ROOT / "configs" / "shakespeare_gpt2.yaml",
        [
            f"data.path={text}",
            f"data.out_dir={tmp_path / 'data'}",
            f"train.out_dir={tmp_path / 'ft'}",
            f"train.init_from={imported}",
            "model.block_size=16",
            "model.dropout=0.0",
            "train.batch_size=2",
            "train.grad_accum=1",
            "train.max_iters=2",
            "train.eval_interval=2",
            "train.eval_iters=1",
            "train.warmup_iters=0",
            "train.device=cpu",
            "train.dtype=float32",
        ],
    )
    result = train(cfg, progress=False)
    assert result.step == 2 and result.last_val_loss is not None and result.last_val_loss < 20
    tuned, source = load_run(tmp_path / "ft", which="latest").model, load_run(imported).model
    assert tuned.config.n_embd == 64 and tuned.config.block_size == 16
    wte = "transformer.wte.weight"
    assert tuned.state_dict()[wte].shape == source.state_dict()[wte].shape
    assert not torch.equal(tuned.state_dict()[wte], source.state_dict()[wte])  # it did train


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(pos="rope"), "model.pos=rope: GPT-2 has learned positions only"),
        (dict(norm="rmsnorm"), "model.norm=rmsnorm: GPT-2 has LayerNorm only"),
        (dict(mlp="swiglu"), "model.mlp=swiglu: GPT-2's MLP is GELU only"),
        (dict(n_kv_head=1), "model.n_kv_head=1: GPT-2 has multi-head attention only"),
        (dict(window=4), "model.window=4: GPT-2 has full causal attention only"),
    ],
)
def test_export_refuses_what_gpt2_cannot_express(tmp_path, change, message):
    tok = build_tokenizer("char", text="abcdefgh")
    cfg = Config(model=ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=8, **change))
    save_checkpoint(
        {"model": GPT(cfg.model).state_dict(), "config": cfg.to_dict(), "tokenizer": tok.spec(), "step": 0}, tmp_path / "ckpt.pt"
    )
    with pytest.raises(QuillError, match=message):
        export_hf(tmp_path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(activation_function="gelu"), "activation_function='gelu'"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=true"),
        (dict(scale_attn_weights=False), "scale_attn_weights=false"),
        (dict(add_cross_attention=True), "add_cross_attention=true"),
        (dict(model_type="falcon"), "model_type is 'falcon', not 'gpt2'"),  # (llama is the Llama family's now)
        (dict(vocab_size=1000), "vocab_size=1000, fewer than the 50257 ids"),
        (dict(n_layer=3), r"missing: transformer\.h\.2\."),  # config.json and weights disagree
        (dict(n_head=5), r"n_embd \(64\) must be divisible by model.n_head \(5\)"),
        (dict(n_embd="wide"), "config.json: n_embd is 'wide', not an integer"),  # interop/hf_config.py
        (dict(n_embd=float("inf")), "config.json: n_embd is inf, not an integer"),  # json.dumps writes Infinity
        (dict(n_layer=10**7), "config.json: n_layer=10000000 is out of range"),
        (dict(n_layer=2000), "model.n_layer must be between 1 and 1,024, got 2000"),
        (dict(n_positions=-1), "config.json: n_positions=-1 is out of range"),
        (dict(layer_norm_epsilon="nan"), "config.json: layer_norm_epsilon is 'nan'; it must be a finite number"),
        (dict(n_inner=[1] * 10_000), r"config.json: n_inner is \[1, 1, 1"),
    ],
)
def test_import_refuses_what_quill_cannot_run_exactly(hf_dir, tmp_path, change, message):
    src = tmp_path / "src"
    shutil.copytree(hf_dir[1], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(QuillError, match=message):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_upcast_attention_and_other_tanh_gelus_import_exactly(tmp_path, gpt2_bpe):
    """reorder_and_upcast_attn changes only rounding; gelu_pytorch_tanh is gelu_new."""
    hf = random_gpt2(
        seed=3,
        reorder_and_upcast_attn=True,
        activation_function="gelu_pytorch_tanh",
        attn_implementation="eager",
        n_inner=96,
        layer_norm_epsilon=1e-6,
    )
    hf.save_pretrained(tmp_path / "hf")
    model = load_run(import_hf(tmp_path / "hf", tmp_path / "run").path).model
    assert model.config.mlp_hidden == 96 and model.config.norm_eps == 1e-6
    idx = torch.randint(0, GPT2_VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(quill_logits(model, idx), hf_logits(hf, idx), atol=1e-4, rtol=0)


def test_hub_name_offline_says_what_to_download(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "no-cache"), "QUILL_DEBUG": ""}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "quillgpt", "import-hf", "gpt2", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "hf download gpt2 config.json model.safetensors tokenizer.json --local-dir DIR" in proc.stderr
    assert "quill import-hf DIR" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr


def test_missing_hf_extra_says_how_to_install(imported, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if the hf extra were not installed
    with pytest.raises(QuillError, match=r'pip install -e "\.\[hf\]"'):
        export_hf(imported, tmp_path / "hf")


class Payload:
    """Anything beyond tensors and containers needs code to unpickle."""


def test_unsafe_or_missing_weights_are_clear_errors(hf_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(hf_dir[1] / "config.json", src)
    with pytest.raises(QuillError, match="no weights: expected model.safetensors"):
        import_hf(src, tmp_path / "run")
    torch.save({"w": Payload()}, src / "pytorch_model.bin")
    with pytest.raises(
        QuillError,
        match="refused: loading it needs code execution, which is unsafe "
        r"\(it would call [\w.]*Payload\)",
    ):
        import_hf(src, tmp_path / "run")
    torch.save({0: torch.zeros(2)}, src / "pytorch_model.bin")  # integer keys
    with pytest.raises(QuillError, match=r"is not a state dict \(names → tensors\)"):
        import_hf(src, tmp_path / "run")
    with pytest.raises(QuillError, match="not a Hugging Face model directory"):
        import_hf(tmp_path, tmp_path / "run")
    (src / "pytorch_model.bin").unlink()
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(QuillError, match="shards must be files beside it"):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_non_finite_or_integer_weights_are_refused(hf_dir, tmp_path):
    from safetensors.torch import save_file

    for name, change in [("nan", lambda t: t.fill_(float("nan"))), ("int", lambda t: t.long())]:
        src = tmp_path / name
        shutil.copytree(hf_dir[1], src)
        tensors = load_file(src / "model.safetensors")
        key = next(k for k in tensors if k.endswith("ln_f.weight"))
        tensors[key] = change(tensors[key].clone())
        save_file(tensors, src / "model.safetensors")
        with pytest.raises(QuillError, match="holds NaN or infinite values" if name == "nan" else "is a torch.int64 tensor"):
            import_hf(src, tmp_path / f"run_{name}")
        assert not (tmp_path / f"run_{name}").exists()


@pytest.mark.parametrize(
    "command, existing",
    [
        ("import-hf", "config.yaml"),
        ("import-hf", "tokenizer.json"),
        ("import-hf", "metrics.jsonl"),
        ("import-hf", "best.pt"),
        ("export-hf", "generation_config.json"),
        ("export-hf", "quill_tokenizer.json"),
        ("export-hf", "config.json"),
        ("export-hf", "ckpt.pt"),
        ("import-hf", "model.safetensors"),
    ],
)
def test_out_dir_with_any_file_of_ours_needs_force(hf_dir, imported, tmp_path, capsys, command, existing):
    """Without --force nothing in --out is rewritten or deleted, whichever of our files it holds."""
    out = tmp_path / "out"
    out.mkdir()
    (out / existing).write_text("the user's work")
    src = hf_dir[1] if command == "import-hf" else imported
    with pytest.raises(SystemExit) as exit_:
        main([command, str(src), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--force" in err and existing in err, err
    assert [p.name for p in out.iterdir()] == [existing] and (out / existing).read_text() == "the user's work"


@pytest.mark.parametrize(
    "out, message",
    [
        ("/proc/self", "--out /proc/self is not writable"),
        ("/proc/x/run", "--out /proc/x/run is not writable"),
        ("{tmp}/" + "d" * 300, "File name too long"),
        ("{tmp}/file.txt", "is a file; pass a directory"),
    ],
)
def test_out_dir_that_cannot_be_written_is_refused_before_any_work(hf_dir, tmp_path, capsys, out, message):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        main(["import-hf", str(hf_dir[1]), "--out", out.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("depth", ["out", "out/a/b"])
def test_export_on_a_full_disk_leaves_no_out_behind(imported, tmp_path, monkeypatch, depth):
    """The issue: export-hf on a full disk left an empty --out; the directories it made go again."""
    import errno

    import quillgpt.interop.convert as convert_mod

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(convert_mod, "atomic_write_bytes", full)
    with pytest.raises(SystemExit) as e:
        main(["export-hf", str(imported), "--out", str(tmp_path / depth)])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
