"""Attention maps against softmax(QKᵀ/√d) by hand, head statistics by hand, images and curves."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from quillgpt.checkpoint import save_checkpoint
from quillgpt.cli import main
from quillgpt.config import Config, ModelConfig, load_config
from quillgpt.data.tokenizer_files import build_tokenizer
from quillgpt.errors import QuillError
from quillgpt.evaluate import attention_views as viz
from quillgpt.model.gpt import GPT
from quillgpt.quant import quantize
from quillgpt.runs import LoadOptions

ROOT = Path(__file__).resolve().parents[2]
ALPHABET = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind"
PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("char", text=ALPHABET)


def tiny_model(tok, **overrides) -> GPT:
    """A 2-layer model with sharpened attention, so maps have structure and few ties."""
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=4, n_embd=32, block_size=24, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(20)
    return model.eval()


@pytest.fixture(scope="module")
def run_dir(tok, tmp_path_factory):
    """A run directory as quill train writes it, holding the tiny model."""
    run = tmp_path_factory.mktemp("runs") / "tiny"
    run.mkdir()
    model = tiny_model(tok)
    cfg = Config(model=model.config)
    save_checkpoint({"model": model.state_dict(), "config": cfg.to_dict(), "tokenizer": tok.spec(), "step": 7}, run / "best.pt")
    return run


def cli(*args):
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    return exit_.value.code


# --- the weights ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides", [{}, {"n_kv_head": 1}, {"window": 3}, {"attn_impl": "math", "bias": False}], ids=["mha", "mqa", "window", "math-nobias"]
)
def test_weights_equal_softmax_recomputed_by_hand(tok, overrides):
    model = tiny_model(tok, **overrides)
    cfg = model.config
    inputs = {}
    hooks = [
        block.ln_1.register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, out)) for i, block in enumerate(model.transformer.h)
    ]
    attn = viz.attention_weights(model, tok, PROMPT)
    for h in hooks:
        h.remove()

    T, H, KV, hd = len(PROMPT), cfg.n_head, cfg.kv_heads, cfg.head_size
    assert attn.ids == tok.encode(PROMPT) and attn.cropped == 0 and len(attn.weights) == cfg.n_layer
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & (i - j < (cfg.window or T))  # (T, T)
    for layer, block in enumerate(model.transformer.h):
        x = inputs[layer][0]  # (T, C): the layer's input to attention
        qkv = x @ block.attn.c_attn.weight.T
        if block.attn.c_attn.bias is not None:
            qkv = qkv + block.attn.c_attn.bias
        q = qkv[:, : H * hd].view(T, H, hd)
        k = qkv[:, H * hd : (H + KV) * hd].view(T, KV, hd)
        for head in range(H):
            scores = q[:, head] @ k[:, head // (H // KV)].T / math.sqrt(hd)  # (T, T)
            expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            got = attn.weights[layer][head]
            assert got.shape == (T, T)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.sum(-1), torch.ones(T))
            assert (got.triu(1) == 0).all()


def test_long_prompt_keeps_its_last_block_size_tokens(tok):
    model = tiny_model(tok)
    text = "To be, or not to be: that is the question"
    attn = viz.attention_weights(model, tok, text)
    assert attn.cropped == len(text) - 24
    assert attn.ids == tok.encode(text)[-24:]
    assert attn.weights[0].shape == (4, 24, 24)
    bounded = viz.attention_weights(model, tok, text, max_tokens=10)  # the web page's bound: fewer still
    assert bounded.cropped == len(text) - 10 and bounded.ids == tok.encode(text)[-10:]
    assert viz.attention_weights(model, tok, text, max_tokens=100).ids == attn.ids  # never past block_size


def test_prompt_mistakes_are_quill_errors(tok):
    model = tiny_model(tok)
    with pytest.raises(QuillError, match="empty"):
        viz.attention_weights(model, tok, "")
    with pytest.raises(QuillError, match="Z"):  # 'Z' is not in the char vocabulary
        viz.attention_weights(model, tok, "To Zed")


def test_token_labels_are_readable():
    assert viz.token_label(b" ") == "␣"
    assert viz.token_label(b"\n\t\r") == "\\n\\t\\r"
    assert viz.token_label(b" the") == "␣the"
    assert viz.token_label("é".encode()) == "é"
    assert viz.token_label("é".encode()[:1]) == "\\xc3"  # half a character, from a BPE token
    assert viz.token_label(b"\x00") == "\\x00"
    assert viz.token_label(b"a\\b") == "a\\\\b"


# --- head summary -----------------------------------------------------------------------------


def test_head_summary_by_hand():
    spread = [[1, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]]
    diagonal = [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    sink = [[1, 0, 0], [1, 0, 0], [1, 0, 0]]
    w = torch.tensor([spread, diagonal, sink])  # (H=3, T=3, T=3)
    rows = viz.head_summary([w, w.flip(0)])
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    s, d, f = rows[:3]
    # queries 1 and 2 only (query 0 can only see itself)
    assert s["mean_distance"] == pytest.approx((0.5 * 1 + (0.25 * 2 + 0.25 * 1)) / 2)
    assert s["entropy"] == pytest.approx((math.log(2) + (0.5 * math.log(4) + 0.5 * math.log(2))) / 2)
    assert s["first_token_weight"] == pytest.approx((0.5 + 0.25) / 2)
    assert d["mean_distance"] == 0 and d["entropy"] == 0 and d["first_token_weight"] == 0
    assert f["mean_distance"] == pytest.approx(1.5) and f["first_token_weight"] == 1 and f["entropy"] == 0
    assert [r["focus"] for r in rows[:3]] == ["far", "local", "first"]  # uniform distance here: 0.75
    assert rows[3] == {**f, "layer": 1, "head": 0}
    table = viz.format_head_table(rows)
    assert len(table.splitlines()) == 7 and "first" in table.splitlines()[3]


# --- text view --------------------------------------------------------------------------------


def test_text_view_top_k_matches_the_weights(tok):
    attn = viz.attention_weights(tiny_model(tok), tok, PROMPT)
    text = viz.render_text(attn.tokens, attn.weights, layers=[1], heads=[2], top_k=3)
    lines = text.splitlines()
    assert lines[0].startswith("layer 1 head 2") and len(lines) == 1 + len(PROMPT)
    w = attn.weights[1][2]
    for i, line in enumerate(lines[1:]):
        picks = re.findall(r"(\S+)@(\d+) (\d\.\d\d)", line.split("→", 1)[1])
        values, where = torch.topk(w[i, : i + 1], min(3, i + 1))
        assert [int(p) for _, p, _ in picks] == where.tolist()
        assert [float(v) for _, _, v in picks] == pytest.approx(values.tolist(), abs=0.006)
        assert [t for t, _, _ in picks] == [attn.tokens[j] for j in where.tolist()]
    with pytest.raises(QuillError, match="top-k"):
        viz.render_text(attn.tokens, attn.weights, [0], [0], top_k=0)


def test_layer_head_and_format_choices():
    assert viz.select_layers("-1", 4) == [3] and viz.select_layers("all", 2) == [0, 1]
    assert viz.select_heads(None, 3) == [0, 1, 2] and viz.select_heads(1, 3) == [1]
    for bad in ("4", "x"):
        with pytest.raises(QuillError, match="--layer"):
            viz.select_layers(bad, 4)
    with pytest.raises(QuillError, match="--head 3"):
        viz.select_heads(3, 3)
    assert viz.output_format(None, None) == "text" and viz.output_format("a.SVG", None) == "svg"
    assert viz.output_format(None, "png") == "png"
    for out, fmt in (("a.jpg", None), ("a.svg", "png"), ("a.png", "text"), (None, "gif")):
        with pytest.raises(QuillError):
            viz.output_format(out, fmt)


# --- images -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers,heads", [([1], [0, 1, 2, 3]), ([0, 1], [0, 1, 2, 3]), ([1], [2])], ids=["one-layer", "all-layers", "one-head"]
)
def test_png_has_the_layout_size_and_is_not_blank(tok, tmp_path, layers, heads):
    attn = viz.attention_weights(tiny_model(tok), tok, PROMPT)
    out = viz.plot_attention(attn.tokens, attn.weights, tmp_path / "a.png", layers, heads, title="t", dpi=40)
    pixels = imread(out)  # (height, width, RGBA) floats in [0, 1]
    width, height = viz.attention_figsize(len(PROMPT), len(layers), len(heads))
    assert pixels.shape[:2] == (round(height * 40), round(width * 40))
    rgb = pixels[..., :3]
    assert rgb.var() > 0.01 and rgb.min() < 0.5


def test_svg_is_written(tok, tmp_path):
    attn = viz.attention_weights(tiny_model(tok), tok, PROMPT)
    tokens = ["$\\frac$", *attn.tokens[1:]]  # BPE tokens may hold '$': drawn as text, not (broken) TeX
    out = viz.plot_attention(tokens, attn.weights, tmp_path / "a.svg", [0], [1])
    text = out.read_text()
    assert "<svg" in text and "</svg>" in text


def test_missing_matplotlib_says_how_to_install(tok, tmp_path, monkeypatch, run_dir, capsys):
    attn = viz.attention_weights(tiny_model(tok), tok, PROMPT)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(QuillError, match=re.escape('pip install -e ".[plot]"')):
        viz.plot_attention(attn.tokens, attn.weights, tmp_path / "a.png", [0], [0])
    assert cli("attention", "--ckpt", run_dir, "--prompt", PROMPT, "--out", tmp_path / "a.png") == 2
    assert '".[plot]"' in capsys.readouterr().err
    assert cli("attention", "--ckpt", run_dir, "--prompt", PROMPT) == 0  # the text view needs nothing
    assert "layer 1 head 0" in capsys.readouterr().out


# --- the attention command --------------------------------------------------------------------


def test_cli_attention_image_and_summary_json(run_dir, tmp_path, capsys):
    out = tmp_path / "maps" / "attn.png"
    assert cli("attention", "--ckpt", run_dir, "--prompt", PROMPT, "--layer", "all", "--out", out) == 0
    printed = capsys.readouterr().out
    assert out.is_file() and imread(out).shape[:2] == (
        round(viz.attention_figsize(len(PROMPT), 2, 4)[1] * 100),
        round(viz.attention_figsize(len(PROMPT), 2, 4)[0] * 100),
    )
    record = json.loads((tmp_path / "maps" / "attn.heads.json").read_text())
    assert record["step"] == 7 and record["prompt"] == PROMPT and len(record["tokens"]) == len(PROMPT)
    assert [(h["layer"], h["head"]) for h in record["heads"]] == [(layer, h) for layer in range(2) for h in range(4)]
    assert len([line for line in printed.splitlines() if line.endswith(("local", "far", "first"))]) == 8

    summary = tmp_path / "s.json"
    assert cli("attention", "--ckpt", run_dir, "--prompt", PROMPT, "--head", "1", "--top-k", "2", "--summary-json", summary) == 0
    printed = capsys.readouterr().out
    assert "layer 1 head 1" in printed and "layer 1 head 0" not in printed
    assert len(json.loads(summary.read_text())["heads"]) == 8  # the JSON always has every head


def test_cli_attention_int8_shows_the_int8_models_heads(run_dir, tok, tmp_path, capsys, fixed_int8_kernel):
    summary = tmp_path / "s.json"
    assert cli("attention", "--ckpt", run_dir, "--prompt", PROMPT, "--quantize", "int8", "--summary-json", summary) == 0
    model = quantize(tiny_model(tok), "int8", kernel=fixed_int8_kernel)
    want = viz.head_summary(viz.attention_weights(model, tok, PROMPT).weights)
    assert json.loads(summary.read_text())["heads"] == json.loads(json.dumps(want))
    float_heads = viz.head_summary(viz.attention_weights(tiny_model(tok), tok, PROMPT).weights)
    assert want != float_heads  # int8 weights do change the maps a little


def test_cli_attention_mistakes_exit_2(run_dir, tmp_path, capsys):
    long_prompt = "To be, or not to be: that is the question"
    assert cli("attention", "--ckpt", run_dir, "--prompt", long_prompt, "--top-k", "1") == 0
    assert "kept its last 24 tokens" in capsys.readouterr().err
    for args in (
        ["--prompt", "Zounds"],
        ["--prompt", PROMPT, "--head", "4"],
        ["--prompt", PROMPT, "--layer", "2"],
        ["--prompt", PROMPT, "--out", tmp_path / "a.jpg"],
    ):
        assert cli("attention", "--ckpt", run_dir, *args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert cli("attention", "--ckpt", tmp_path / "nothing", "--prompt", PROMPT) == 2


# --- end to end -------------------------------------------------------------------------------


def test_a_trained_run_end_to_end(shakespeare_path, tmp_path, capsys):
    """quill train writes what quill plot and quill attention read."""
    from quillgpt.train.loop import train

    run = tmp_path / "run"
    cfg = load_config(
        ROOT / "configs" / "shakespeare_char_cpu.yaml",
        [
            f"data.path={shakespeare_path}",
            f"data.out_dir={tmp_path / 'data'}",
            f"train.out_dir={run}",
            "model.n_layer=2",
            "model.n_head=2",
            "model.n_embd=32",
            "model.block_size=16",
            "train.batch_size=4",
            "train.max_iters=6",
            "train.eval_interval=3",
            "train.eval_iters=1",
            "train.log_interval=1",
            "train.warmup_iters=1",
            "train.device=cpu",
        ],
    )
    train(cfg, progress=False)
    assert cli("plot", run, "--out", tmp_path / "loss.png") == 0
    assert "run: step 6" in capsys.readouterr().out
    assert cli("attention", "--ckpt", run, "--which", "latest", "--prompt", "ROMEO:\nO, she", "--out", tmp_path / "attn.png") == 0
    assert (tmp_path / "attn.png").is_file() and (tmp_path / "attn.heads.json").is_file()


def test_every_token_of_the_readmes_prompt_is_labelled_in_the_4x4_grid():
    """The quickstart's `--layer all` figure: 4 layers × 4 heads, 'To be, or not to be: that is the
    question.' (42 characters); only every second one was labelled."""
    from quillgpt.evaluate.attention_views import SMALLEST_LABEL_PT, _layout, tick_labels

    _, _, panel = _layout(42, 4, 4)
    ticks, size = tick_labels(42, panel, 7)
    assert ticks == list(range(42)) and SMALLEST_LABEL_PT <= size < 7
    assert tick_labels(10, panel, 7) == (list(range(10)), 7)  # room to spare: the usual size
    ticks, size = tick_labels(1000, 2.0, 7)  # far too many: every k-th, at the smallest size
    assert size == SMALLEST_LABEL_PT and ticks[:2] == [0, ticks[1]] and 1 < ticks[1] and len(ticks) <= 2.0 * 72 / (size * 1.25) + 1


def test_layer_all_labels_stay_readable_and_characters_stand_upright():
    """`--layer all` of a 6-layer × 6-head model on the README's prompt: its labels were 4.4 pt
    (6 px at 100 dpi) and every character was rotated on its side. Now at least SMALLEST_LABEL_PT
    (every other token where all do not fit), and one-character tokens stand upright."""
    from quillgpt.evaluate.attention_views import SMALLEST_LABEL_PT, _layout, key_label_rotation, tick_labels

    prompt = list("To be, or not to be: that is the question.")
    _, _, panel = _layout(len(prompt), 6, 6)
    ticks, size = tick_labels(len(prompt), panel, 7)
    assert size >= SMALLEST_LABEL_PT >= 5.0 and ticks[:2] == [0, 2]
    assert key_label_rotation(prompt) == 0 and key_label_rotation(["To", "␣be", ","]) == 90


# --- attention_report: quill attention ---------------------------------------------------------


def test_attention_report_shows_the_loaded_models_heads_and_saves_the_summary_beside_the_image(tok, run_dir, tmp_path):
    attn = viz.attention_weights(tiny_model(tok), tok, PROMPT)
    summary = viz.head_summary(attn.weights)
    report = viz.attention_report(run_dir, LoadOptions(), viz.AttentionRequest(PROMPT, layer="all", head=1, top_k=2))
    rows = [r for r in summary if r["head"] == 1]
    assert report.text == viz.render_text(attn.tokens, attn.weights, [0, 1], [1], 2) + "\n\n" + viz.format_head_table(rows)
    assert report.note is None and report.summary == summary and report.attention.ids == attn.ids
    out = tmp_path / "maps.svg"
    report = viz.attention_report(run_dir, LoadOptions(), viz.AttentionRequest(PROMPT * 3, out=out))
    heads = tmp_path / "maps.heads.json"
    assert report.text.endswith(f"saved head summary (all layers) → {heads}\nsaved svg → {out}") and out.is_file()
    assert report.note.startswith("note: the prompt is longer than block_size=24; kept its last 24 tokens")
    assert json.loads(heads.read_text())["step"] == 7
    with pytest.raises(QuillError, match="--format text prints to the terminal"):
        viz.attention_report(run_dir, LoadOptions(), viz.AttentionRequest(PROMPT, out=out, fmt="text"))
