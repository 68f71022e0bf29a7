"""A quantized run (quill quantize; import-gguf keeping a file's quantization) is the model
--quantize makes at load, read without the float model, and refused in one line when damaged."""

import io
import re
import sys

import pytest
import torch

from quillgpt import quant
from quillgpt.cli import main
from quillgpt.config import Config, ModelConfig
from quillgpt.data.tokenizer import CharTokenizer
from quillgpt.model.gpt import GPT
from quillgpt.quant.int8 import Int8Linear
from quillgpt.quant.plan import RULE_PLAN
from quillgpt.quant.stored import model_tensors
from quillgpt.runs import WEIGHTS_FILE, load_run, quantize_run, write_run
from quillgpt.tensor_file import TensorFile

CHARS = "\n !',-.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TEXT = "ROMEO: But, soft! what light through yonder window breaks?"
SHAPES = {  # a tied head without biases, an untied one with q/k/v biases
    "tied": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, tie_embeddings=True),
    "qkv-bias": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, qkv_bias=True, tie_embeddings=False),
    "gpt2": dict(pos="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True),
}


def float_run(path, shape: str):
    """A random run of `shape` (128 wide: every scheme's stored layout takes it)."""
    cfg = ModelConfig(vocab_size=len(CHARS), block_size=96, n_layer=2, n_head=4, n_embd=128, **SHAPES[shape])
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("weight") and p.dim() == 1 else 0.0, 0.3 if p.dim() > 1 else 0.1)
    path.mkdir(parents=True)
    write_run(path, Config(model=cfg), CharTokenizer(CHARS), model.state_dict())
    return path


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", list(quant.SCHEMES))
def test_a_quantized_run_is_the_model_quantize_makes_at_load(tmp_path, scheme, shape):
    src = float_run(tmp_path / "float", shape)
    run = quantize_run(src, tmp_path / "q", scheme, which="latest")
    at_load = load_run(src, which="latest", quantize=scheme)
    stored = load_run(run, which="latest")
    f = TensorFile(run / WEIGHTS_FILE)
    layers, tensors = model_tensors(at_load.model)
    tensors = list(tensors)
    assert layers and set(f.entries) == {n for n, _ in tensors}  # the same tensors, named alike
    for name, t in tensors:  # bit for bit
        assert f.read(name).dtype == t.dtype and torch.equal(f.read(name), t), name
    for m in at_load.model.modules():  # int8's measured plan against the rule a stored run takes: the same kernels
        if isinstance(m, Int8Linear):
            m.plan = RULE_PLAN
    ids = torch.tensor([at_load.tokenizer.encode(TEXT)])
    with torch.no_grad():
        for rows in (ids, ids[:, :1]):  # a prompt (dequantized weights) and one decode row (the kernels)
            assert torch.equal(stored.model(rows, all_logits=True)[0], at_load.model(rows, all_logits=True)[0])
    assert (run / WEIGHTS_FILE).stat().st_size < 0.6 * (src / "ckpt.pt").stat().st_size


def test_a_quantized_run_loads_with_no_float_weight_of_its_layers(tmp_path, monkeypatch):
    run = quantize_run(float_run(tmp_path / "float", "tied"), tmp_path / "q", "int4", which="latest")
    made = []
    real = torch.nn.Linear.reset_parameters
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: (made.append(self.weight.device.type), real(self))[1])
    model = load_run(run, which="latest").model
    assert set(made) == {"meta"}  # every nn.Linear the loader made was shape only
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.fixture
def quill(capsys, monkeypatch):
    def call(*args, stdin: str = ""):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        out, err = capsys.readouterr()
        return exit_info.value.code, out, err

    return call


def _truncate(run):
    path = run / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-1000])


def _flip(run):
    path = run / WEIGHTS_FILE
    raw = bytearray(path.read_bytes())
    raw[-3000] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "truncated"),
        (_flip, "fails its CRC check"),
        (lambda run: (run / WEIGHTS_FILE).unlink(), "is missing"),
        (lambda run: (run / WEIGHTS_FILE).write_bytes(b"not a weights file"), "damaged|no safetensors header"),
    ],
)
def test_a_damaged_quantized_run_is_refused_in_one_line(tmp_path, quill, damage, message):
    run = quantize_run(float_run(tmp_path / "float", "tied"), tmp_path / "q", "int8", which="latest")
    damage(run)
    code, out, err = quill("sample", "--ckpt", run, "-p", "ROMEO:", "-n", 4)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error:"), err
    assert re.search(message, err)


def test_a_quantized_run_refuses_quantize_and_training_in_one_line(tmp_path, quill):
    src = float_run(tmp_path / "float", "tied")
    code, out, err = quill("quantize", src, "-o", tmp_path / "q", "--quantize", "int4", "--which", "latest")
    assert code == 0 and "int4" in out
    code, _, err = quill("sample", "--ckpt", tmp_path / "q", "-p", "ROMEO:", "-n", 4, "--quantize", "int8")
    assert code == 2 and "quantized weights already" in err and err.count("\n") == 1
    conversations = tmp_path / "chats.jsonl"
    conversations.write_text('{"prompt": "ROMEO: hi", "completion": " JULIET: hello"}\n' * 6)
    code, _, err = quill("finetune", tmp_path / "q", "-d", conversations, "-o", tmp_path / "ft", "--full", "train.min_lr=0")
    assert code == 2 and "quantized run" in err and "--dequantize" in err and err.count("\n") == 1  # LoRA only
    code, _, err = quill("sample", "--ckpt", tmp_path / "q", "-p", "ROMEO:", "-n", 4, "--temperature", 0)
    assert code == 0


def test_lora_fine_tunes_a_quantized_run_on_its_dequantized_weights(tmp_path, quill):
    src = float_run(tmp_path / "float", "qkv-bias")  # untied (a tied one trains with its embedding = its int8 head's values)
    base = quantize_run(src, tmp_path / "q", "int4", which="latest")
    conversations = tmp_path / "chats.jsonl"
    conversations.write_text('{"prompt": "ROMEO: hi", "completion": " JULIET: hello"}\n' * 6)
    code, out, err = quill("finetune", base, "-d", conversations, "-o", tmp_path / "ft", "train.max_iters=2")
    assert code == 0, err
    tuned = load_run(tmp_path / "ft", which="latest")  # the base's dequantized weights with the adapters merged in
    plain = quant.dequantize(load_run(base, which="latest").model)
    changed = [k for k, v in plain.state_dict().items() if not torch.equal(v, tuned.model.state_dict()[k])]
    assert changed and all(".attn." in k or ".mlp." in k for k in changed)  # only the adapted linears moved
    quantize_run(src, base, "int8", which="latest", force=True)  # the base's weights change under the adapters
    code, _, err = quill("sample", "--ckpt", tmp_path / "ft", "-p", "ROMEO:", "-n", 2)
    assert code == 2 and "have changed" in err and err.count("\n") == 1


def test_a_stored_int8_layer_runs_its_kernel_past_the_decode_rows(tmp_path, monkeypatch):
    """A kept-quantized run's int8 layers take group_gemv at every row count (its GEMM past 64 rows),
    not the dequantized weight: a 300-row prompt calls the kernel and matches the dequantized matmul."""
    from quillgpt import native

    if not native.available():
        pytest.skip(f"the C++ kernels do not build here: {native.why_not()}")
    stored = load_run(quantize_run(float_run(tmp_path / "float", "tied"), tmp_path / "q", "int8", which="latest"), which="latest")
    layer = next(m for m in stored.model.modules() if isinstance(m, Int8Linear))
    rows, real = [], native.group_gemv
    monkeypatch.setattr(native, "group_gemv", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    x = torch.randn(300, layer.in_features)
    y = layer(x)
    assert rows == [300]
    w = layer.dequantized()
    # x is rounded to int16 per 32 (a step of max|x| / 32767 in each block): each output may move by
    # half a step times |w| summed, plus float32's rounding of the sums
    half_steps = (x.view(300, -1, 32).abs().amax(-1, keepdim=True) / 32767 / 2).expand(-1, -1, 32).reshape(300, -1)
    bound = half_steps @ w.abs().t() + layer.in_features * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t())
    assert ((y - x @ w.t()).abs() <= bound).all()
