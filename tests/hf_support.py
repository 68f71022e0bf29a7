"""Scaled-down Hugging Face models of the Llama family, built from configs with random weights and
saved by transformers' save_pretrained, each with a tokenizer trained here by `tokenizers` and
its family's kind of chat template (no weights are downloaded). Not collected: no test_ prefix."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun.",
    "JULIET: O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name.",
    "Ça va? Très bien, merci. Größe, Straße, naïve café — déjà vu. 日本語のテキストです。Привет, мир!",
    "The quick brown fox jumps over the lazy dog. 12345 67890 + - * / = ( ) [ ] { } 'quoted' \"double\"",
    "\n\nKING HENRY: Once more unto the breach, dear friends, once more;\nOr close the wall up with our English dead.",
]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) "
    "+ '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]  # every 3rd global, as 6th in Gemma 3

# family → (model_type, config keys, tokenizer specials, bos (post-processor) or None, eos, template)
FAMILIES = {
    "smollm2": (
        "llama",
        dict(tie_word_embeddings=True, num_key_value_heads=2, rope_theta=100000.0),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        CHATML,
    ),
    "llama3": (
        "llama",
        dict(
            tie_word_embeddings=False,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|end_of_text|>",
        LLAMA3,
    ),
    "qwen2": (
        "qwen2",
        dict(tie_word_embeddings=False, num_key_value_heads=2, rope_theta=1000000.0),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        CHATML,
    ),
    "qwen3": (
        "qwen3",
        dict(tie_word_embeddings=True, num_key_value_heads=2, head_dim=24, rope_theta=1000000.0),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        CHATML,
    ),
    "mistral": (
        "mistral",
        dict(tie_word_embeddings=False, num_key_value_heads=1, sliding_window=8),
        ["<unk>", "<s>", "</s>"],
        "<s>",
        "</s>",
        MISTRAL,
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=4,
            layer_types=GEMMA3_LAYERS,
            sliding_window=8,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<end_of_turn>",
        GEMMA,
    ),
}
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def train_tokenizer(specials: list[str], bos: str | None, qwen: bool = False):
    """A byte-level BPE trained on CORPUS, its post-processor adding `bos` if any: GPT-2's
    pre-tokenizer, or (qwen) Qwen's: NFC, then its split pattern (one digit a piece), as Qwen's own
    tokenizer.json has (and transformers' Qwen2Tokenizer imposes)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_hf_model(
    directory: Path, family: str, dtype: torch.dtype = torch.float32, seed: int = 0, shard: str | None = None, **config: object
) -> Path:
    """A random `family` model saved by save_pretrained into `directory`, with its tokenizer files;
    `config`: keys that replace or add to the family's and the default shape's (e.g. head_dim=24 on a qwen2, hidden_size=256)."""
    import transformers

    model_type, extra, specials, bos, eos, template = FAMILIES[family]
    tok = train_tokenizer(specials, bos, qwen=model_type.startswith("qwen"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos or specials[0], eos_token=eos)
    fast.chat_template = template
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[model_type])
    shape = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=160)
    config = config_cls(
        vocab_size=tok.get_vocab_size() + 5,
        rms_norm_eps=1e-6,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        **{**shape, **extra, **config},
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # decisive logits: greedy text has no near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    fast.save_pretrained(directory)
    return directory


def old_form_config(directory: Path) -> None:
    """Rewrite config.json in the pre-transformers-5 form: top-level rope_theta and rope_scaling."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {**rope, "type": rope["rope_type"]}
    path.write_text(json.dumps(config))


def ids_of(hf_dir: Path, text: str) -> list[int]:
    """The ids transformers' tokenizer of `hf_dir` gives `text`."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]


def assert_export_round_trip(run_dir: Path, hf_dir: Path, hf, out: Path, tol: float) -> Path:
    """export-hf of run_dir into out/export: importing it again gives the run bit for bit, and
    transformers computes from it the logits `hf` (the model run_dir was imported from) computes,
    within tol. Returns the export's directory."""
    import transformers

    from quillgpt.checkpoint import load_checkpoint
    from quillgpt.interop.convert import export_hf, import_hf

    done = export_hf(run_dir, out / "export", which="latest")
    assert done.architecture == hf.config.architectures[0]
    again = import_hf(out / "export", out / "again")
    a, b = (load_checkpoint(d / "ckpt.pt")["model"] for d in (run_dir, again.path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32).eval()
    ids = torch.tensor([ids_of(hf_dir, CORPUS[0] + " " + CORPUS[2])])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=tol, rtol=tol)
    return out / "export"


def real_gguf_import(path: Path | None, tmp_path_factory, name: str, how: str) -> Path:
    """The fp32 import (--dequantize: the conversion itself, against transformers' fp32 load) of a
    real model's GGUF file, in a folder of the test session's; skipped, saying `how` to get the
    file, where `path` is None or missing."""
    import pytest

    from quillgpt.interop.gguf_import import import_gguf

    if path is None or not path.is_file():
        pytest.skip(f"no {name} GGUF: {how}")
    out = tmp_path_factory.mktemp(name) / "run"
    import_gguf(path, out, dequantize=True)
    return out


def transformers_gguf_load(path: Path):
    """(model in float32, tokenizer): transformers' own load of a GGUF file, dequantized."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return hf, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
