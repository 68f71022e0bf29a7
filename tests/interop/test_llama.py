"""The Llama family against transformers on the same weights and ids: SmolLM2-like (tied, GQA),
Llama 3 (llama3 rope scaling, BOS), Qwen2 (q/k/v biases), Qwen3 (head_dim, QK-norm), Mistral
(sliding window). Every model is scaled down and random (tests/hf_support.py); nothing is downloaded."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_support  # noqa: E402
from hf_support import CORPUS, FAMILIES, assert_export_round_trip, make_hf_model, old_form_config  # noqa: E402
from support import rel_err  # noqa: E402

from quillgpt.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from quillgpt.cli import main  # noqa: E402
from quillgpt.data.chat_template import render  # noqa: E402
from quillgpt.errors import QuillError  # noqa: E402
from quillgpt.evaluate.scores import evaluate_text  # noqa: E402
from quillgpt.inference.generate import generate_tokens  # noqa: E402
from quillgpt.interop.convert import export_hf, import_hf  # noqa: E402
from quillgpt.model.attention import rope_inv_freq  # noqa: E402
from quillgpt.quant import SCHEMES, quantize  # noqa: E402
from quillgpt.quant.int8 import Int8Linear  # noqa: E402
from quillgpt.quant.int8_kernels import KERNELS  # noqa: E402
from quillgpt.quant.plan import KernelPlan  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402

families = pytest.mark.parametrize("family", list(FAMILIES))
TEXT = CORPUS[0] + " " + CORPUS[2]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """family → (HF directory, transformers model, quill run directory)."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        hf_dir = make_hf_model(root / "hf", family)
        import_hf(hf_dir, root / "run")
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        out[family] = (hf_dir, hf, root / "run")
    return out


def ids_of(hf_dir, text=TEXT):
    return hf_support.ids_of(hf_dir, text)


@families
def test_logits_equal_transformers(imported, family):
    hf_dir, hf, run_dir = imported[family]
    run = load_run(run_dir, which="latest")
    ids = torch.tensor([ids_of(hf_dir)])
    assert ids.shape[1] > 20  # past Mistral's window of 8: the window is in play
    with torch.no_grad():
        want = hf(ids).logits
        got, _ = run.model(ids, all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@families
def test_greedy_text_equals_transformers_for_100_tokens(imported, family):
    hf_dir, hf, run_dir = imported[family]
    run = load_run(run_dir, which="latest")
    prompt = ids_of(hf_dir, "ROMEO: But, soft!")
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=100, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    got = torch.stack(list(generate_tokens(run.model, [prompt], 100))).T[0].tolist()
    assert got == want


@families
def test_cached_decoding_equals_recompute_and_rows_alone(imported, family):
    _, _, run_dir = imported[family]
    model = load_run(run_dir, which="latest").model
    prompts = [[5, 9, 11, 30, 7], [40, 41], list(range(60, 90))]
    cached = torch.stack(list(generate_tokens(model, prompts, 24))).T.tolist()
    assert cached == torch.stack(list(generate_tokens(model, prompts, 24, use_cache=False))).T.tolist()
    assert [torch.stack(list(generate_tokens(model, [p], 24))).T[0].tolist() for p in prompts] == cached


@families
def test_tokenizer_ids_and_chat_prompt_equal_autotokenizers(imported, family):
    hf_dir, _, run_dir = imported[family]
    tok = load_run(run_dir, which="latest").tokenizer
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for text in CORPUS + ["", "  leading spaces", "<|im_end|> inside text", "emoji 🎭 and \t tabs\r\n"]:
        bos = [] if tok.bos_id is None else [tok.bos_id]
        assert bos + tok.encode(text) == auto(text)["input_ids"], text
        assert tok.decode_bytes(tok.encode(text)).decode("utf-8") == text  # byte-level tokens are the text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who is Romeo?"},
        {"role": "assistant", "content": "A Montague."},
        {"role": "user", "content": "And Juliet?"},
    ]
    if family == "mistral":  # its template reads user and assistant turns only
        messages = messages[1:]
    rendered = render(tok.chat_template, messages, True, tok.bos_token, tok.eos_token)
    want = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.encode(rendered) == want
    end = {"llama3": "<|eot_id|>", "mistral": "</s>", "gemma3": "<end_of_turn>"}.get(family, "<|im_end|>")
    assert tok.tk.token_to_id(end) in tok.stop_ids  # a reply ends at the template's end of turn


@families
def test_eval_loss_equals_transformers_loss_on_the_same_ids(imported, family, tmp_path):
    hf_dir, hf, run_dir = imported[family]
    run = load_run(run_dir, which="latest")
    ids = torch.tensor([ids_of(hf_dir)])
    with torch.no_grad():
        want = hf(ids, labels=ids).loss.item()  # the mean over tokens 1..N-1 of the ids (BOS included)
    got = evaluate_text(run.model, run.tokenizer, TEXT)
    assert got.tokens == ids.shape[1] - 1
    assert got.loss == pytest.approx(want, rel=1e-5)


@families
def test_import_export_import_is_identical_and_transformers_loads_the_export(imported, family, tmp_path):
    hf_dir, hf, run_dir = imported[family]
    export = assert_export_round_trip(run_dir, hf_dir, hf, tmp_path, tol=1e-5)
    assert ids_of(export) == ids_of(hf_dir)  # its tokenizer files too


def test_old_config_form_bf16_and_sharded_weights_import_the_same(imported, tmp_path):
    """rope_scaling + top-level rope_theta (before transformers 5) and sharded bf16 safetensors."""
    hf_dir, _, run_dir = imported["llama3"]
    old = tmp_path / "old"
    shutil.copytree(hf_dir, old)
    old_form_config(old)
    import_hf(old, tmp_path / "old_run")
    assert load_run(tmp_path / "old_run", which="latest").config.model == load_run(run_dir, which="latest").config.model
    sharded = make_hf_model(tmp_path / "bf16", "qwen2", dtype=torch.bfloat16, shard="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    import_hf(sharded, tmp_path / "bf16_run")
    saved = load_checkpoint(tmp_path / "bf16_run" / "ckpt.pt")["model"]
    assert all(t.dtype == torch.bfloat16 for t in saved.values())  # kept as the model has them
    assert load_run(tmp_path / "bf16_run", which="latest", dtype=None).model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.usefixtures("one_thread")
def test_int8_of_a_qwen2_with_wide_heads_and_qkv_biases_is_transformers_on_its_int8_weights(tmp_path):
    """--quantize int8 on an import whose heads are not n_embd/n_head wide (4 heads of 24 in a
    48-wide model) and whose q/k/v have biases: every linear becomes int8 (a bias kept in float),
    and the model is transformers' with each of its own linears rounded to the same int8 steps
    (scales per output channel, or per group of its inputs, do not mind that quill fuses q/k/v,
    and gate/up, into one matrix):
    logits equal, 30 greedy tokens equal; for every kernel the engine's decode step gives the full
    forward's logits (and, with float32 activations, recompute's tokens)."""
    hf_dir = make_hf_model(tmp_path / "hf", "qwen2", head_dim=24)
    import_hf(hf_dir, tmp_path / "run")
    model = load_run(tmp_path / "run", which="latest").model
    cfg = model.config
    assert cfg.qkv_bias and cfg.head_size == 24 and cfg.n_head * cfg.head_size != cfg.n_embd
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(Int8Linear.from_linear(m, KernelPlan((1,), ("dequant/model",)), SCHEMES["int8"].group).dequantized())
    quantize(model, "int8", kernel="dequant/model")  # float32 activations, as transformers multiplies
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * cfg.n_layer + 1 and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.transformer.h[0].attn.c_attn.bias is not None and model.transformer.h[0].attn.c_proj.in_features == 96
    ids = torch.tensor([ids_of(hf_dir)])
    prompt = ids_of(hf_dir, "ROMEO: But, soft!")
    with torch.no_grad():
        torch.testing.assert_close(model(ids, all_logits=True)[0], hf(ids).logits, atol=1e-4, rtol=1e-4)
        want = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :]
    assert torch.stack(list(generate_tokens(model, [prompt], 30))).T[0].tolist() == want.tolist()
    for kernel, bf16 in ((k, kern.bf16) for k, kern in KERNELS.items()):  # each decode step over the cache = the full forward
        for m in layers:
            m.plan = KernelPlan((1,), (kernel,))
        with torch.no_grad():
            full = model(ids, all_logits=True)[0][0, 6:]  # (T - 6, V)
            cache = model.make_cache(1)
            model(ids[:, :6], pos=torch.arange(6), cache=cache)
            steps = torch.stack([model.decode(ids[:, t], torch.tensor([t]), cache)[0] for t in range(6, ids.shape[1])])
        assert rel_err(steps, full) < (1e-2 if bf16 else max(1e-5, KERNELS[kernel].rounding)), kernel  # to their activations' rounding
        if not bf16:  # (bf16's greedy tokens may part at a near-tie: this model has one 0.4% apart)
            prompts = [prompt, ids[0, :17].tolist()]
            cached = torch.stack(list(generate_tokens(model, prompts, 20)), 1)
            assert torch.equal(cached, torch.stack(list(generate_tokens(model, prompts, 20, use_cache=False)), 1)), kernel


def test_llama3_rope_scaling_equals_transformers_frequencies():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_inv_freq(64, 500000.0, "llama3", 8.0, 1.0, 4.0, 64)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    linear, _ = ROPE_INIT_FUNCTIONS["linear"](
        transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0}), "cpu"
    )
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, "linear", 4.0), linear, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
        ({"attention_bias": True}, "o_proj.bias"),  # SmolLM2 has no biases: missing tensors, named
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ],
)
def test_what_quill_cannot_compute_exactly_is_refused_by_name(imported, tmp_path, change, message):
    hf_dir = imported["smollm2"][0]
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(QuillError, match=message):
        import_hf(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_windows_on_some_layers_only_are_refused(imported, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(imported["qwen2"][0], src)
    config = json.loads((src / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuillError, match="some layers only"):
        import_hf(src, tmp_path / "run")


def test_cli_import_sample_and_attention_of_an_imported_model(imported, tmp_path, capsys):
    hf_dir, _, _ = imported["llama3"]
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["import-hf", str(hf_dir), "--out", str(run)])
    assert e.value.code == 0 and "LlamaForCausalLM" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["sample", "--ckpt", str(run), "-p", "ROMEO:", "-n", "12", "--temperature", "0", "--quiet"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("ROMEO:")
    with pytest.raises(SystemExit) as e:
        main(["attention", "--ckpt", str(run), "-p", "Ça va? Très bien", "--layer", "0", "--head", "3"])
    printed = capsys.readouterr().out
    # byte-level tokens labelled as text: whole characters as themselves, a cut one as its bytes
    assert e.value.code == 0 and " Ç " in printed and "Tr\\xc3" in printed and "layer 0 head 3" in printed


def test_serve_chat_uses_the_template_and_ends_at_the_end_of_turn(imported):
    from serve_support import running_server

    from quillgpt.inference.chat_session import ChatSession
    from quillgpt.sampling_params import SamplingParams

    openai = pytest.importorskip("openai")
    _, _, run_dir = imported["qwen2"]
    run = load_run(run_dir, which="latest")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Romeo?"}]
    session = ChatSession(run.model, run.tokenizer, SamplingParams(max_new_tokens=20, temperature=0.0), system="Be brief.")
    want = "".join(session.reply("Who is Romeo?"))
    with running_server(run_dir, max_batch=2) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.chat.completions.create(model=run_dir.name, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want
    from quillgpt.inference.chat_session import chat_prompt_ids

    assert got.usage.prompt_tokens == len(chat_prompt_ids(run.tokenizer, messages)[0])


def test_fine_tuning_an_imported_model_with_its_own_tokenizer(imported, tmp_path):
    """The run's config.yaml names its tokenizer and itself as init_from: quill train fine-tunes it."""
    from quillgpt.config import load_config
    from quillgpt.train.loop import train

    _, _, run_dir = imported["llama3"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 40), encoding="utf-8")
    cfg = load_config(
        run_dir / "config.yaml",
        [
            f"data.path={corpus}",
            f"data.out_dir={tmp_path / 'data'}",
            f"train.out_dir={tmp_path / 'tuned'}",
            "model.block_size=32",
            "train.batch_size=4",
            "train.max_iters=6",
            "train.eval_interval=6",
            "train.eval_iters=1",
            "train.warmup_iters=0",
            "train.learning_rate=3e-3",
            "train.min_lr=3e-4",
            "train.device=cpu",
            "train.dtype=float32",
        ],
    )
    result = train(cfg, progress=False)
    assert result.step == 6
    tuned = load_run(tmp_path / "tuned", which="latest")
    assert tuned.tokenizer.spec() == load_run(run_dir, which="latest").tokenizer.spec()
    from quillgpt.data.prepare import load_tokens

    tokens = load_tokens(tmp_path / "data", "train")
    assert tokens[0] == tuned.tokenizer.bos_id  # each document starts with BOS, as Llama 3 was trained


@pytest.mark.parametrize(
    "tokenizer, extra",
    [
        ("char", {}),
        ("gpt2", {"qkv_bias": True}),
        ("bpe", {"qk_norm": True, "head_dim": 12}),
        ("char", {"window": 6}),
    ],
)
def test_a_quill_trained_modern_model_exports_to_the_llama_family(tmp_path, shakespeare_path, request, tokenizer, extra):
    """RoPE + RMSNorm + SwiGLU (+ q/k/v biases → Llama's attention_bias with a zero o_proj bias, since
    transformers gives any qwen2 model Qwen's pre-tokenizer; QK-norm → Qwen3; a window → Mistral):
    transformers gives the same logits, and the exported tokenizer.json the same ids as quill's own."""
    from quillgpt.config import Config, ModelConfig
    from quillgpt.data.tokenizer_files import build_tokenizer
    from quillgpt.model.gpt import GPT

    if tokenizer == "gpt2":
        request.getfixturevalue("gpt2_bpe")
    text = shakespeare_path.read_text(encoding="utf-8")[:20000]
    tok = build_tokenizer(tokenizer, text, 300)
    cfg = Config(
        model=ModelConfig(
            vocab_size=tok.vocab_size,
            block_size=64,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=32,
            pos="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            tie_embeddings=False,
            **extra,
        )
    )
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    (tmp_path / "run").mkdir()
    save_checkpoint(
        {"model": model.state_dict(), "config": cfg.to_dict(), "tokenizer": tok.spec(), "step": 3}, tmp_path / "run" / "best.pt"
    )
    done = export_hf(tmp_path / "run", tmp_path / "hf")
    want_arch = "Qwen3ForCausalLM" if "qk_norm" in extra else "MistralForCausalLM" if "window" in extra else "LlamaForCausalLM"
    assert done.architecture == want_arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    sample = text[1000:1200]
    ids = torch.tensor([tok.encode(sample)[:64]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids, all_logits=True)[0], atol=1e-4, rtol=1e-4)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for piece in (sample, "ROMEO:\nO, she doth teach the torches to burn bright!", text[5000:5600]):
        assert auto(piece)["input_ids"] == tok.encode(piece)
    assert import_hf(tmp_path / "hf", tmp_path / "again").tokenizer == tok.name  # quill_tokenizer.json restores it


@pytest.mark.parametrize(
    "name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "model.safetensors"]
)
def test_a_fifo_among_an_hf_models_files_is_refused_by_name(imported, tmp_path, capsys, name):
    """Every file import-hf reads from a Llama-family directory goes through the one input check:
    a FIFO there (which would wait for a writer forever) is one line naming it, never read."""
    import os

    from support import deadline

    src = tmp_path / "hf"
    shutil.copytree(imported["smollm2"][0], src)
    (src / name).unlink(missing_ok=True)
    os.mkfifo(src / name)
    with pytest.raises(SystemExit) as e, deadline(60):
        main(["import-hf", str(src), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"{name} {src / name} is a FIFO" in err, err
    assert not (tmp_path / "run").exists()
