"""Property-based bad input: generated config overrides, CLI flags, metrics lines and file
contents, thrown at the `quill` commands in-process. Whatever is generated, every command must

* exit 0 or 2 (2: exactly one `error: ` line on stderr), never raise or print a traceback;
* change no file of the existing run (or of its prepared data, or of an HF model it reads).

Counts are bounded (settings below) to keep the suite fast; QUILL_PROPERTY_SCALE=10 runs ten
times as many, with fresh random cases each run (the default run is derandomized for CI).
"""

import hashlib
import io
import json
import os
import shutil
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import deadline

from quillgpt.checkpoint import load_checkpoint
from quillgpt.cli import main
from quillgpt.config import (
    MAX_SEED,
    MODEL_SIZE_LIMITS,
    Config,
    DataConfig,
    ModelConfig,
    TrainConfig,
    load_config,
)
from quillgpt.errors import QuillError
from quillgpt.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_char_cpu.yaml"
SCALE = int(os.environ.get("QUILL_PROPERTY_SCALE", "1"))
RUN_FILES = ("ckpt.pt", "best.pt", "config.yaml", "tokenizer.json", "metrics.jsonl")


def bounded(examples: int):
    """Settings for one property: `examples` cases (× QUILL_PROPERTY_SCALE), no per-case deadline,
    no example database written into the checkout."""
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        database=None,
        derandomize=SCALE == 1,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# --- the workspace: one trained run, its data, an HF export of it --------------------------


def tiny(w, *extra):
    return [
        f"data.path={w.text}",
        f"data.out_dir={w.data}",
        f"train.out_dir={w.run}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=4",
        "train.max_iters=2",
        "train.eval_interval=2",
        "train.eval_iters=2",
        "train.device=cpu",
        *extra,
    ]


@pytest.fixture(scope="module")
def w(tmp_path_factory, shakespeare_path):
    root = tmp_path_factory.mktemp("properties")
    w = SimpleNamespace(root=root, text=shakespeare_path, data=root / "data", run=root / "run", scratch=root / "scratch")
    train(load_config(CONFIG, tiny(w)), progress=False)
    w.scratch.mkdir()
    w.small = root / "small.txt"
    w.small.write_text("To be, or not to be, that is the question.\n" * 3)
    w.hf = root / "hf"
    code, _, err = run(["export-hf", str(w.run), "--out", str(w.hf)])
    assert code == 0, err
    w.fifo = root / "fifo.png"  # a special file a careless -o might name
    os.mkfifo(w.fifo)
    w.protected = (w.run, w.data, w.hf, w.small)
    return w


@pytest.fixture(autouse=True, scope="module")
def in_scratch_dir(w):
    """Generated paths include "" (the working directory): let that be a scratch folder."""
    cwd, saved = w.root / "cwd", os.getcwd()
    cwd.mkdir(exist_ok=True)
    os.chdir(cwd)
    yield
    os.chdir(saved)


@pytest.fixture(autouse=True, scope="module")
def without_quill_debug():
    saved = os.environ.pop("QUILL_DEBUG", None)
    yield
    if saved is not None:
        os.environ["QUILL_DEBUG"] = saved


def run(argv: list[str]) -> tuple[int, str, str]:
    """`quill ARGV` in this process: (exit code, stdout, stderr). Anything but SystemExit escapes."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
    return code, out.getvalue(), err.getvalue()


def snapshot(paths) -> dict[Path, str]:
    files = []
    for p in paths:
        p = Path(p)
        files += [p] if p.is_file() else [q for q in sorted(p.rglob("*")) if q.is_file() and q.name != ".lock"]
    return {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def check_command(w, argv: list[str], allow_ok: bool = True) -> tuple[int, str, str]:
    """Run one generated command and assert the promises of the module docstring."""
    before = snapshot(w.protected)
    code, out, err = run(argv)
    assert snapshot(w.protected) == before, f"an existing file changed: quill {argv}"
    assert "Traceback" not in err, err
    if code == 2:
        lines = err.strip("\n").split("\n")
        assert len(lines) == 1 and lines[0].startswith("error: "), f"quill {argv}\n{err}"
    else:
        assert code == 0 and allow_ok, f"exit {code} for quill {argv}\n{err}"
        assert "error: " not in err, err
    return code, out, err


def scratch(w, name: str) -> Path:
    """A fresh path under the scratch directory (nothing there from an earlier case)."""
    path = w.scratch / name
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    return path


# --- generated values ------------------------------------------------------------------------

YAML_ODDITIES = [
    "nan",
    ".nan",
    "NaN",
    "inf",
    ".inf",
    "-.inf",
    "1e999",
    "-1e999",
    "1e-400",
    "0x10",
    "0o17",
    "1_000",
    "~",
    "null",
    "true",
    "no",
    "[]",
    "{}",
    "[1, [2, [3]]]",
    "{a: 1}",
    "&a [1, 2]",
    "*a",
    "!!python/name:os.system",
    "!!binary aGk=",
    "2024-01-01",
    "12:30:00",
    "'quoted'",
    '"\\x00"',
    "",
    " ",
    "-",
    "?",
    "|",
    ">",
    "@x",
    "%YAML",
    "[" * 200,
    "a: &a [1]\nb: *a",
    str(2**64),
    str(-(2**63) - 1),
    str(10**400),
    "9" * 400,
    "0.1" * 50,
]
NUMBERS = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.integers(min_value=-3, max_value=70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-2.0, max_value=2.0),
)
VALUES = st.one_of(NUMBERS.map(str), st.sampled_from(YAML_ODDITIES), st.text(max_size=40), st.booleans().map(str))
SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig}
KEYS = [f"{s}.{f}" for s, cls in SECTIONS.items() for f in cls.__dataclass_fields__]
# Keys the CLI-level property leaves alone: they choose where files go or what happens to the run.
CLI_KEYS = [
    k
    for k in KEYS
    if k.split(".")[0] != "data"
    and k not in ("train.out_dir", "train.overwrite", "train.resume", "train.init_from", "train.tensorboard", "train.compile")
]
OVERRIDE = st.one_of(
    st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=30),  # not an override at all
    st.tuples(st.sampled_from(["model", "train", "modle", ""]), st.text(max_size=10), VALUES).map(lambda t: f"{t[0]}.{t[1]}={t[2]}"),
)


def check_accepted(cfg: Config) -> None:
    """What validation promises about a config it accepts."""
    import math

    for section in (cfg.data, cfg.model, cfg.train):
        for name, value in vars(section).items():
            if isinstance(value, float):
                assert math.isfinite(value), (name, value)
    assert 0 <= cfg.train.seed <= MAX_SEED
    for key, most in MODEL_SIZE_LIMITS.items():
        value = getattr(cfg.model, key)
        assert value is None or 1 <= value <= most, (key, value)


# --- config overrides ------------------------------------------------------------------------


@bounded(200)
@given(overrides=st.lists(OVERRIDE, max_size=4))
def test_config_overrides_are_accepted_valid_or_refused_in_one_line(overrides):
    """Library level, many cases: a Config that satisfies every range, or one short QuillError."""
    try:
        cfg = load_config(CONFIG, overrides)
    except QuillError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)
    else:
        check_accepted(cfg)


@bounded(30)
@given(overrides=st.lists(st.tuples(st.sampled_from(CLI_KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=3))
def test_train_with_generated_overrides_never_touches_the_existing_run(w, overrides):
    """`quill train` over an existing run: refused (a bad value, or the run is there) — exit 2."""
    check_command(w, ["train", "--config", str(CONFIG), "-q", *tiny(w), *overrides], allow_ok=False)


SMALL_TRAIN = st.fixed_dictionaries(
    {},
    optional={
        "model.n_layer": st.integers(-1, 3),
        "model.n_head": st.integers(-1, 4),
        "model.n_embd": st.sampled_from([0, 8, 16, 24, 30]),
        "model.n_kv_head": st.sampled_from(["null", 0, 1, 2, 3]),
        "model.block_size": st.integers(-1, 24),
        "model.window": st.sampled_from(["null", 0, 1, 3, 100]),
        "model.pos": st.sampled_from(["learned", "rope", "x"]),
        "model.norm": st.sampled_from(["layernorm", "rmsnorm"]),
        "model.mlp": st.sampled_from(["gelu", "swiglu"]),
        "model.dropout": st.sampled_from([0.0, 0.5, 0.99, 1.0, "nan"]),
        "model.bias": st.booleans(),
        "model.tie_embeddings": st.booleans(),
        "model.attn_impl": st.sampled_from(["sdpa", "math"]),
        "train.batch_size": st.integers(-1, 5),
        "train.grad_accum": st.integers(0, 2),
        "train.learning_rate": st.sampled_from([1e-3, 0.0, 1e30, "inf", "nan", -1]),
        "train.grad_clip": st.sampled_from([0, 1.0, "nan", -1]),
        "train.warmup_iters": st.integers(-1, 3),
        "train.lr_schedule": st.sampled_from(["cosine", "wsd", "constant"]),
        "train.eval_iters": st.integers(0, 2),
        "train.log_interval": st.integers(0, 2),
        "train.seed": st.integers(-1, 2**33),
        "train.dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
        "train.time_budget": st.sampled_from(["1h", "0s", "x"]),
    },
)


@bounded(8)
@given(changes=SMALL_TRAIN)
def test_small_generated_runs_train_or_refuse(w, changes):
    """Valid small configs really train (exit 0) into a new directory; the rest exit 2."""
    out = scratch(w, "train_run")
    overrides = tiny(w, f"train.out_dir={out}", "train.max_iters=1", "train.eval_interval=1", "train.eval_iters=1")
    check_command(w, ["train", "--config", str(CONFIG), "-q", *overrides, *(f"{k}={v}" for k, v in changes.items())])


# --- CLI flags -------------------------------------------------------------------------------

DEVICES = st.one_of(
    st.sampled_from(["cpu", "auto", "meta", "xpu", "hpu", "cuda:7", "cpu:1", "mps", "", "cuda:-1", "cpu\n"]), st.text(max_size=12)
)


def paths(w, outputs: bool = False) -> st.SearchStrategy:
    """Paths a careless or hostile user might give, the protected files among them (refused as
    outputs unless --force, which asks for them to be written: see the test)."""
    common = [
        str(w.root),
        str(w.scratch / "new.txt"),
        "/proc/self/mem",
        "/proc/x/y.png",
        "/proc/self",
        str(w.scratch / ("n" * 300)),
        str(w.scratch / ("n" * 300) / "a.png"),
        str(w.scratch / "sub" / "dir" / "out.png"),
        str(w.scratch / "out.svg"),
        str(w.scratch / "x.json"),
        "",
        str(w.run),
    ]
    # Devices only as inputs: an output path that renamed over /dev/zero once replaced it (as root).
    inputs = [str(w.small), str(w.run / "ckpt.pt"), str(w.run / "config.yaml"), str(w.hf), "/dev/zero", "/dev/null"]
    protected = [
        str(w.run / "best.pt"),
        str(w.run / "config.yaml"),
        str(w.run / "tokenizer.json"),
        str(w.data / "meta.json"),
        str(w.hf / "config.json"),
        str(w.small),
    ]
    # A FIFO as an output, and as an input (refused by name: reading one would wait for a writer).
    return st.sampled_from(common + [str(w.fifo)] + (protected if outputs else inputs))


def flag_sets(w) -> st.SearchStrategy:
    ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70)).map(str)
    eval_flags = st.fixed_dictionaries(
        {"--text": paths(w)},
        optional={
            "--stride": st.one_of(st.integers(-2, 40).map(str), st.sampled_from(["x", "1e3"])),
            "--batch-size": ints,
            "--device": DEVICES,
            "--split": st.sampled_from(["val", "train", "test"]),
            "--which": st.sampled_from(["best", "latest", "newest", ""]),
        },
    ).map(lambda f: ["eval", "--ckpt", str(w.run), "--json", *sum(([k, v] for k, v in f.items()), [])])
    prompts = st.one_of(st.sampled_from(["To be", "", "\n", "First Citizen:\n" * 20]), st.text(max_size=20))
    attention_flags = st.fixed_dictionaries(
        {"-p": prompts},
        optional={
            "--layer": st.one_of(st.sampled_from(["all", "-1", "0", "2", "-3", "x"]), st.text(max_size=5)),
            "--head": ints,
            "--top-k": ints,
            "--device": DEVICES,
            "--out": paths(w, outputs=True),
            "--format": st.sampled_from(["png", "svg", "text", "jpg", ""]),
            "--summary-json": paths(w, outputs=True),
        },
    ).map(lambda f: ["attention", "--ckpt", str(w.run), *sum(([k, v] for k, v in f.items()), [])])
    plot_flags = st.fixed_dictionaries(
        {"-o": paths(w, outputs=True)},
        optional={
            "--x": st.sampled_from(["step", "tokens", "time", "epoch"]),
        },
    ).map(lambda f: ["plot", str(w.run), *sum(([k, v] for k, v in f.items()), [])])
    tokenizer_flags = st.fixed_dictionaries(
        {"-i": paths(w), "-o": paths(w, outputs=True)},
        optional={
            "--vocab-size": st.one_of(st.integers(-1, 300), st.integers(2**20, 2**70)).map(str),
            "--force": st.just(""),
        },
    ).map(lambda f: ["tokenizer", "train", *sum(([k] if k == "--force" else [k, v] for k, v in f.items()), [])])
    hf_flags = st.tuples(st.sampled_from(["import-hf", "export-hf"]), paths(w, outputs=True), st.booleans()).map(
        lambda t: [t[0], str(w.hf if t[0] == "import-hf" else w.run), "--out", t[1], *(["--force"] if t[2] else [])]
    )
    # -n stays small: a valid huge -n is honoured (sampling until it is done), which no test can wait for.
    floats = st.one_of(st.floats(), st.floats(-1, 3), st.sampled_from(["nan", "inf", "-inf", "1e999", "x"])).map(str)
    sample_flags = st.fixed_dictionaries(
        {"-p": prompts, "-n": st.integers(-2, 12).map(str)},
        optional={
            "--temperature": floats,
            "--top-k": ints,
            "--top-p": floats,
            "--min-p": floats,
            "--repetition-penalty": floats,
            "--seed": ints,
            "--num-samples": st.integers(-1, 3).map(str),
            "--stop": st.text(max_size=4),
            "--device": DEVICES,
            "--dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8"]),
            "--which": st.sampled_from(["best", "latest", "x"]),
        },
    ).map(lambda f: ["sample", "--ckpt", str(w.run), "--json", *sum(([k, v] for k, v in f.items()), [])])
    return st.one_of(eval_flags, attention_flags, plot_flags, tokenizer_flags, hf_flags, sample_flags)


@bounded(70)
@given(data=st.data())
def test_generated_flags_exit_0_or_2_and_change_nothing(w, data):
    argv = data.draw(flag_sets(w))
    if "--force" in argv:  # e.g. import-hf --out RUN --force: replacing it was asked for
        protected = {str(p) for p in w.protected} | {str(p) for d in w.protected if d.is_dir() for p in d.iterdir()}
        argv = argv[:3] + [str(w.scratch / "forced") if a in protected else a for a in argv[3:]]
    check_command(w, argv)


# --- metrics lines ---------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
METRIC_RECORD = st.fixed_dictionaries(
    {}, optional={k: st.one_of(JSON_VALUES, st.floats(0, 10)) for k in ("step", "train_loss", "val_loss", "lr", "elapsed_s", "tokens")}
)
METRIC_LINE = st.one_of(
    METRIC_RECORD.map(lambda r: json.dumps(r).encode()),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
    st.just(b'{"step": 1e999, "train_loss": 1.0}'),
    st.just(b'{"step": "abc", "train_loss": "abc"}'),
    st.just(b"\xff\xfe not utf-8"),
    st.just(b"[1, 2]"),
    st.just(b'{"step": NaN, "train_loss": Infinity}'),
)


@bounded(15)
@given(lines=st.lists(METRIC_LINE, max_size=8), keep_real=st.booleans())
def test_plot_reads_any_metrics_log(w, lines, keep_real):
    """metrics.jsonl is a log: whatever its lines hold, plot draws what it can or says why not."""
    run_dir = scratch(w, "metrics_run")
    run_dir.mkdir()
    real = (w.run / "metrics.jsonl").read_bytes() if keep_real else b""
    (run_dir / "metrics.jsonl").write_bytes(real + b"\n".join(lines))
    check_command(w, ["plot", str(run_dir), "-o", str(w.scratch / "curves.png")])


# --- file contents ---------------------------------------------------------------------------

CONFIG_TEXT = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=100).map(lambda b: b.decode("latin-1")),
    st.dictionaries(
        st.sampled_from(["data", "model", "train", "sample", "x"]),
        st.dictionaries(st.sampled_from([k.split(".")[1] for k in KEYS] + ["zz"]), JSON_VALUES, max_size=4),
        max_size=4,
    ).map(lambda d: yaml.safe_dump(d)),
    st.sampled_from(YAML_ODDITIES),
)


@bounded(40)
@given(text=CONFIG_TEXT)
def test_any_config_file_is_read_or_refused(w, text):
    path = scratch(w, "config.yaml")
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    # Whatever the file says, the data and the run's fate come from the command line: the file
    # may not ask to replace the run (that is what it would do if the user wrote it).
    fixed = [
        f"data.path={w.text}",
        "data.tokenizer=char",
        f"data.out_dir={w.scratch / 'config_data'}",
        f"train.out_dir={w.run}",
        "train.overwrite=false",
        "train.resume=false",
        "train.init_from=null",
    ]
    check_command(w, ["train", "--config", str(path), "-q", *fixed], allow_ok=False)


@bounded(25)
@given(data=st.binary(max_size=300), kind=st.sampled_from(["text", "tokenizer"]))
def test_any_text_or_tokenizer_file_is_read_or_refused(w, data, kind):
    path = scratch(w, "input.bin")
    path.write_bytes(data)
    if kind == "text":
        check_command(w, ["eval", "--ckpt", str(w.run), "--text", str(path), "--json"])
    else:
        path.write_bytes(
            json.dumps({"format": "quillgpt-tokenizer", "version": 1, "tokenizer": json.loads(json.dumps(_spec_from(data)))}).encode()
        )
        check_command(
            w,
            ["train", "--config", str(CONFIG), "-q", *tiny(w), f"data.tokenizer={path}", f"data.out_dir={scratch(w, 'tok_data')}"],
            allow_ok=False,
        )


def _spec_from(data: bytes):
    """A tokenizer spec-shaped object out of random bytes (type, then a field that is often wrong)."""
    kind = ["char", "tiktoken", "bpe", "x"][data[0] % 4] if data else "char"
    text = data[1:].decode("latin-1")
    return {
        "char": {"type": "char", "chars": text},
        "tiktoken": {"type": "tiktoken", "name": text[:8]},
        "bpe": {"type": "bpe", "ranks": [[text[:4], 0]], "special_tokens": {}, "pattern": text[:8]},
        "x": {"type": text[:5]},
    }[kind]


def _damage(data: bytes, how: str, at: float, size: int) -> bytes:
    i = int(at * len(data))
    if how == "truncate":
        return data[:i]
    if how == "zero":
        return data[:i] + bytes(min(size, len(data) - i)) + data[i + size :]
    return data[:i] + bytes(b ^ 0xFF for b in data[i : i + size]) + data[i + size :]


@bounded(25)
@given(how=st.sampled_from(["truncate", "zero", "flip"]), at=st.floats(0, 1), size=st.integers(1, 5000))
def test_damaged_checkpoint_bytes_are_refused_or_harmless(w, how, at, size):
    path = scratch(w, "damaged.pt")
    path.write_bytes(_damage((w.run / "best.pt").read_bytes(), how, at, size))
    check_command(w, ["eval", "--ckpt", str(path), "--text", str(w.small), "--json"])


STATE_VALUES = st.one_of(
    JSON_VALUES,
    st.sampled_from(
        [
            torch.zeros(3),
            torch.zeros(2, dtype=torch.long),
            torch.tensor(float("nan")),
            torch.zeros(0),
            {"a": torch.zeros(1)},
            [torch.zeros(1)],
        ]
    ),
)


@bounded(25)
@given(
    where=st.sampled_from(["top", "model", "config", "config.model", "tokenizer"]),
    key=st.one_of(
        st.sampled_from(
            [
                "step",
                "model",
                "config",
                "tokenizer",
                "format",
                "sampler",
                "n_layer",
                "transformer.wte.weight",
                "lm_head.weight",
                "type",
                "chars",
                "vocab_size",
            ]
        ),
        st.text(max_size=6),
    ),
    value=STATE_VALUES,
    delete=st.booleans(),
)
def test_checkpoints_with_unexpected_content_are_refused_or_work(w, where, key, value, delete):
    state = load_checkpoint(w.run / "best.pt")
    target = state
    for part in where.split(".") if where != "top" else []:
        target = target[part]
    if delete:
        target.pop(key, None)
    else:
        target[key] = value
    path = scratch(w, "crafted.pt")
    torch.save(state, path)
    check_command(w, ["eval", "--ckpt", str(path), "--text", str(w.small), "--json"])


HF_VALUES = st.one_of(JSON_VALUES, st.sampled_from([1e999, -1, 0, 10**7, 2**40, "gelu", "gpt2", 64, 32, 65, 4]))


@bounded(15)
@given(
    changes=st.dictionaries(
        st.sampled_from(
            [
                "n_embd",
                "n_layer",
                "n_head",
                "n_positions",
                "vocab_size",
                "n_inner",
                "layer_norm_epsilon",
                "activation_function",
                "model_type",
                "tie_word_embeddings",
                "scale_attn_weights",
                "n_ctx",
            ]
        ),
        HF_VALUES,
        min_size=1,
        max_size=3,
    )
)
def test_import_hf_with_any_config_json(w, changes):
    src = scratch(w, "hf_src")
    shutil.copytree(w.hf, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **changes}))
    check_command(w, ["import-hf", str(src), "--out", str(scratch(w, "imported"))])


# --- inputs that never end -------------------------------------------------------------------


def never_ending(w) -> dict[str, str]:
    """Inputs that never end, or that only end as errors: a FIFO, /dev/zero, a link to it, a
    directory holding a FIFO, a glob through a symlink loop, HF directories with a FIFO inside
    (config.json, the weights, quill_tokenizer.json)."""
    root = w.root / "never"
    if not root.exists():
        (root / "withfifo").mkdir(parents=True)
        os.mkfifo(root / "pipe.txt")
        os.mkfifo(root / "withfifo" / "a.txt")
        os.symlink("/dev/zero", root / "zero.txt")
        (root / "loop" / "deeper").mkdir(parents=True)
        shutil.copy(w.small, root / "loop" / "deeper" / "real.txt")
        os.symlink(".", root / "loop" / "self")
        os.symlink("..", root / "loop" / "deeper" / "up")
        for name in ("config.json", "model.safetensors", "quill_tokenizer.json"):
            shutil.copytree(w.hf, root / f"hf_{name}")
            (root / f"hf_{name}" / name).unlink()
            os.mkfifo(root / f"hf_{name}" / name)
    return {
        "fifo": str(root / "pipe.txt"),
        "zero": "/dev/zero",
        "link": str(root / "zero.txt"),
        "dir": str(root / "withfifo"),
        "loop": str(root / "loop" / "**" / "*.txt"),
        "hf_config": str(root / "hf_config.json"),
        "hf_weights": str(root / "hf_model.safetensors"),
        "hf_tokenizer": str(root / "hf_quill_tokenizer.json"),
    }


def input_commands(w, x: str) -> list[list[str]]:
    out = scratch(w, "never_out")
    return [
        ["prepare", "--config", str(CONFIG), *tiny(w), f"data.path={x}", f"data.out_dir={out}"],
        [
            "train",
            "--config",
            str(CONFIG),
            "-q",
            *tiny(w),
            f"data.path={x}",
            f"data.out_dir={out}",
            f"train.out_dir={out}_run",
            "train.max_iters=1",
        ],
        ["eval", "--ckpt", str(w.run), "--text", x, "--json"],
        ["tokenizer", "train", "-i", x, "--vocab-size", "260", "-o", str(out) + ".json"],
        ["prepare", "--config", x],
        ["sample", "--ckpt", str(w.run), "--prompt-file", x, "-n", "2"],
        ["sample", "--ckpt", x, "-n", "2"],
        ["import-hf", x, "--out", str(out)],
        ["chat", "--ckpt", x, "-n", "2"],
        ["train", "--config", str(CONFIG), "-q", *tiny(w), f"data.tokenizer={x}", f"data.out_dir={out}"],
    ]


NEVER = ["fifo", "zero", "link", "dir", "loop", "hf_config", "hf_weights", "hf_tokenizer"]


@bounded(40)
@given(which=st.sampled_from(NEVER), command=st.integers(0, 9))
@example(which="zero", command=0).via("the issue: data.path=/dev/zero")
@example(which="zero", command=1).via("the issue: quill train prepares first")
@example(which="fifo", command=0).via("the issue: data.path=<a FIFO>")
@example(which="fifo", command=2).via("the issue: quill eval --text <fifo>")
@example(which="fifo", command=3).via("the issue: quill tokenizer train -i <fifo>")
@example(which="loop", command=0).via("the issue: a glob through a symlink loop")
def test_inputs_that_never_end_are_refused_by_name_and_never_hang(w, which, command):
    """The issue: data.path=/dev/zero ran forever at 100 % CPU, a FIFO as data.path, eval --text or
    tokenizer train -i waited forever, and a glob through a symlink loop never ended."""
    argv = input_commands(w, never_ending(w)[which])[command]
    with deadline(60):
        code, _, err = check_command(w, argv)
    if which == "loop" and argv[0] == "prepare" and "data.path" in argv[-2]:
        assert code == 0, err  # the loop ends, and the real file under it is the corpus
    elif which != "loop":
        assert code == 2, f"quill {argv} exit {code}"


# --- outputs ---------------------------------------------------------------------------------


def output_commands(w, target: str) -> list[list[str]]:
    """Every command that writes a user-named path, writing `target` (or into its directory)."""
    summary = str(w.scratch / "side.heads.json")
    return [
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--summary-json", target],
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--out", target, "--summary-json", summary],
        ["attention", "--ckpt", str(w.run), "-p", "To be", "--out", str(Path(target).with_suffix(".png"))],  # derived summary
        ["plot", str(w.run), "-o", target],
        ["tokenizer", "train", "-i", str(w.small), "--vocab-size", "260", "-o", target],
        ["train", "--config", str(CONFIG), "-q", *tiny(w), f"train.out_dir={Path(target).parent}"],
        ["prepare", "--config", str(CONFIG), *tiny(w), f"data.out_dir={Path(target).parent}"],
    ]


def foreign_files(root: Path) -> list[Path]:
    """Files quill did not write: an HF hub download (its tokenizer.json), a nanoGPT dataset
    (train.bin), notes that are no image, a JSON that is no head summary."""
    files = {
        "hub/config.json": "{}",
        "hub/model.safetensors": "x",
        "hub/tokenizer.json": '{"version": "1.0"}',
        "nanogpt/train.bin": "\x01\x00" * 64,
        "nanogpt/val.bin": "\x01\x00" * 8,
        "nanogpt/meta.pkl": "x",
        "notes.png": "my notes, not an image",
        "art.heads.json": '{"mine": 1}',
    }
    for name, text in files.items():
        path = root / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return [root / name for name in files]


@bounded(45)
@given(data=st.data())
def test_no_output_replaces_a_file_of_a_run_a_dataset_an_hf_model_or_another_kind(w, data):
    """The issue's `quill attention --summary-json RUN/best.pt` (exit 0, best.pt gone) among every
    file of the run, its prepared data, an HF model and foreign files, through every command that
    writes a user-named path: refused in one line, every existing file unchanged (new files may
    appear beside them), unless --force."""
    names = {
        w.run: RUN_FILES,
        w.data: ("meta.json", "train.bin", "val.bin"),
        w.hf: ("config.json", "model.safetensors", "quill_tokenizer.json"),
    }
    targets = [d / n for d, ns in names.items() for n in ns] + [w.small, *foreign_files(w.root / "foreign")]
    target = data.draw(st.sampled_from(targets))
    argv = data.draw(st.sampled_from(output_commands(w, str(target))))
    before = snapshot([*w.protected, w.root / "foreign"])
    code, _, err = run(argv)
    after = snapshot([*w.protected, w.root / "foreign"])
    assert {f: after.get(f) for f in before} == before, f"an existing file changed: quill {argv}\n{err}"
    assert "Traceback" not in err and code in (0, 2), f"quill {argv}\n{err}"
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("error: "), err
    if argv[0] in ("attention", "plot", "tokenizer") and "--summary-json" in argv[-2:]:
        assert code == 2, f"quill {argv} replaced {target}"


def test_an_output_of_its_own_kind_is_replaced_and_force_replaces_the_rest(w):
    png, summary = w.scratch / "again.png", w.scratch / "again.heads.json"
    for _ in range(2):  # an earlier image and summary are this command's own: replaced
        assert run(["attention", "--ckpt", str(w.run), "-p", "To be", "--out", str(png)])[0] == 0
    assert png.read_bytes().startswith(b"\x89PNG") and json.loads(summary.read_text())["heads"]
    other = scratch(w, "other.png")
    other.write_text("someone's notes")
    code, _, err = run(["plot", str(w.run), "-o", str(other)])
    assert code == 2 and "exists and is not a PNG image" in err and "--force" in err
    assert run(["plot", str(w.run), "-o", str(other), "--force"])[0] == 0 and other.read_bytes().startswith(b"\x89PNG")
    copy = scratch(w, "run_copy")
    shutil.copytree(w.run, copy)
    code, _, err = run(["attention", "--ckpt", str(copy), "-p", "To be", "--summary-json", str(copy / "config.yaml")])
    assert code == 2 and "is a file of the run in" in err and "--force" in err
    code, _, err = run(["attention", "--ckpt", str(copy), "-p", "To be", "--summary-json", str(copy / "best.pt"), "--force"])
    assert code == 2 and "is also the input" in err  # --force never replaces what the command reads


def test_a_zip_member_with_a_wrong_crc_is_named():
    """The CRC check above rests on zipfile reporting the damaged member; pin that down."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data/0", b"x" * 1000)
    data = bytearray(buf.getvalue())
    data[data.index(b"x" * 1000) + 10] ^= 1
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        assert z.testzip() == "archive/data/0"
