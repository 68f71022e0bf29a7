"""Will a training run fit? An estimate of what one process allocates at its peak, checked
against the device's free memory before anything big is allocated.

The estimate follows what autograd keeps for one micro-batch of the run's real shape (rows ×
the longest row: chat rows are as long as their conversations, not block_size), what the
weights and the optimizer take (full fine-tuning: fp32 weights, gradients and AdamW's two
moments; LoRA: the frozen base, plus all of that for the adapters only), and the evaluation's
logits. tests/train/test_memory.py holds it to within 25% of the peak a real run measures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from quillgpt.config import Config, LoraConfig, ModelConfig, TrainConfig
from quillgpt.device import available_bytes
from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT
from quillgpt.model.lora import adapter_shapes

GB = 1e9
# What a training process allocates besides tensors of this model and batch: the prepared data and
# tokenizer, the thread pools and kernel caches of the first steps, the allocator's slack. Measured:
# the peak RSS a run adds over its start, less the estimate below, on 2-64-row runs (test_memory.py).
RUNTIME_BYTES = 150_000_000


@dataclass
class TrainMemory:
    """An estimate of what one training process allocates at its peak, in bytes."""

    params: int  # parameter count (the base's, adapters not included)
    trained: int  # parameters that train: all of them, or the adapters
    state_bytes: int  # weights, the trained ones' gradients and AdamW moments
    activation_bytes: int  # what one micro-batch keeps for backward, its logits included
    eval_bytes: int  # an evaluation batch's logits (the activations are gone by then)
    windows_bytes: int = 0  # the fixed evaluation windows' starts: eval_iters × batch_size per split

    @property
    def total(self) -> int:
        return RUNTIME_BYTES + self.state_bytes + self.windows_bytes + max(self.activation_bytes, self.eval_bytes)


def count_params(cfg: ModelConfig, vocab_size: int) -> int:
    """GPT.num_params (tied weights once) of GPT(cfg) with this vocabulary, built on the meta
    device: shapes only, nothing allocated."""
    with torch.device("meta"):
        return GPT(dataclasses.replace(cfg, vocab_size=vocab_size)).num_params(non_embedding=False)


def layer_bytes_per_token(cfg: ModelConfig, act: int, lora: LoraConfig | None = None) -> int:
    """Bytes one block keeps for backward per token: the norms' fp32 inputs, the linears' inputs
    (in the activation dtype `act`: 2 under autocast, else 4), q/k/v before and after RoPE and
    attention's output, the MLP's wide tensors, and the adapters' rank-wide middles."""
    C, H, q, kv = cfg.n_embd, cfg.hidden_dim, cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
    wide = 4 * H if cfg.gated_mlp else 2 * H  # [gate | up], act(gate), their product / the activation's in and out
    # each norm's fp32 input and normalized output, and its output cast for the linear (sandwich: a norm after each branch too)
    norms = (4 if cfg.sandwich_norm else 2) * (4 * C + 4 * C + act * C)
    attention = (q + 2 * kv) + (q + kv) + 2 * (q - kv) + 2 * q  # q/k/v, after RoPE, k/v repeated for GQA, out, c_proj's input
    per = norms + act * (attention + wide)
    if lora is not None and lora.rank:
        per += act * lora.rank * len(adapter_shapes(dataclasses.replace(cfg, n_layer=1), lora)) // 2
    return per  # math attention's scores grow with T², not T: estimate_train_bytes adds them


def estimate_train_bytes(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    vocab_size: int | None = None,
    frozen: bool = False,
    shape: tuple[int, int, int] | None = None,
    lora: LoraConfig | None = None,
    autocast: bool = False,
    eval_rows: int | None = None,
) -> TrainMemory:
    """Bytes one training process needs at its peak for micro-batches of `shape` = (rows, T,
    scored: the targets the head runs on), default batch_size windows of block_size, all scored.
    frozen (LoRA): the base's weights only, plus weights, gradients and AdamW moments of
    `lora`'s adapters. autocast: activations in 2 bytes (bf16/fp16), else 4. eval_rows: rows of
    an evaluation batch (of T tokens; default batch_size)."""
    V = vocab_size or model_cfg.vocab_size or 256
    rows, T, scored = shape or (train_cfg.batch_size, model_cfg.block_size, train_cfg.batch_size * model_cfg.block_size)
    act = 2 if autocast else 4
    params = count_params(model_cfg, V)
    adapters = sum(a * b for a, b in adapter_shapes(model_cfg, lora).values()) if frozen and lora is not None and lora.rank else 0
    trained = adapters if frozen else params
    state = 4 * params + 16 * adapters if frozen else 16 * params
    if autocast:  # the linears' weights cast to 2 bytes, kept for backward (frozen) or cached (trained)
        state += 2 * params
    block = rows * T * layer_bytes_per_token(model_cfg, act, lora if frozen else None)
    if model_cfg.attn_impl == "math":
        block += 2 * act * rows * model_cfg.n_head * T * min(T, model_cfg.window or T)  # scores, softmax
    L = model_cfg.n_layer
    # recomputed blocks keep only their fp32 inputs, and one block's activations at a time
    layers = L * 4 * rows * T * model_cfg.n_embd + block if train_cfg.activation_checkpointing else L * block
    embed = 3 * 4 * rows * T * model_cfg.n_embd  # embeddings, ln_f's input, the gradient flowing back
    logits = scored * V * (2 * act + 8)  # logits, fp32 log-softmax kept, and their gradients
    wide = (6 if model_cfg.gated_mlp else 4) * model_cfg.hidden_dim
    backward = 4 * rows * T * (3 * model_cfg.n_embd + wide)  # one block's gradients at a time, fp32
    # evaluation (no autograd): one block's widest tensors at a time, all-position logits and their log-softmax, fp32
    eval_bytes = (eval_rows or train_cfg.batch_size) * T * (4 * (3 * model_cfg.n_embd + wide) + 2 * 4 * V)
    windows = 2 * 16 * train_cfg.eval_iters * train_cfg.batch_size  # train and val: float64 spacing, then int64 starts
    return TrainMemory(params, trained, state, layers + embed + logits + backward, eval_bytes, windows)


def check_train_memory(
    cfg: Config, device: torch.device, shape: tuple[int, int, int], autocast: bool = False, eval_rows: int | None = None
) -> TrainMemory:
    """Refuse a run that cannot fit on `device`, before anything is allocated: the numbers, and
    the knobs that bring them down."""
    frozen = bool(cfg.lora.rank)
    need = estimate_train_bytes(cfg.model, cfg.train, frozen=frozen, shape=shape, lora=cfg.lora, autocast=autocast, eval_rows=eval_rows)
    free = available_bytes(device)
    if free is not None and need.total > free:
        rows, T, _ = shape
        weights = "× 4 bytes of frozen base, plus the adapters' AdamW state" if frozen else "× 16 bytes for weights, gradients and AdamW"
        raise QuillError(
            f"this run needs at least {need.total / GB:,.1f} GB on {device} ({need.params:,} parameters {weights} = "
            f"{need.state_bytes / GB:,.1f} GB, plus {need.activation_bytes / GB:,.1f} GB of activations for {rows} rows × "
            f"{T} tokens a micro-batch, plus {need.windows_bytes / GB:,.1f} GB of evaluation windows for "
            f"train.eval_iters={cfg.train.eval_iters}), but {free / GB:,.1f} GB is free; lower train.batch_size or "
            "train.batch_tokens (raise train.grad_accum to keep the batch), train.eval_iters, model.block_size (longer "
            "conversations are cut) or the model's size, or set train.activation_checkpointing=true"
        )
    return need
