"""Will a training run fit? A lower estimate of what one process allocates, checked against the
device's free memory before anything big is allocated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from quillgpt.config import ModelConfig, TrainConfig
from quillgpt.device import available_bytes
from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT


@dataclass
class TrainMemory:
    """A lower estimate of what one training process allocates, in bytes."""

    params: int  # parameter count
    state_bytes: int  # fp32 weights + gradients + AdamW's two moments: 16 bytes per parameter (frozen: 4)
    activation_bytes: int  # what one micro-batch keeps for backward, logits included
    eval_bytes: int  # the fixed evaluation windows: eval_iters × batch_size starts per split

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes + self.eval_bytes


def count_params(cfg: ModelConfig, vocab_size: int) -> int:
    """GPT.num_params (tied weights once) of GPT(cfg) with this vocabulary, built on the meta
    device: shapes only, nothing allocated."""
    with torch.device("meta"):
        return GPT(dataclasses.replace(cfg, vocab_size=vocab_size)).num_params(non_embedding=False)


def estimate_train_bytes(
    model_cfg: ModelConfig, train_cfg: TrainConfig, vocab_size: int | None = None, frozen: bool = False
) -> TrainMemory:
    """Bytes one training process needs at least: weights, gradients and AdamW moments (fp32;
    frozen, as under LoRA: the weights only), plus one micro-batch of activations (2 bytes each,
    as under autocast) and fp32 logits with their gradient. Meant to refuse what cannot fit, so
    it errs low."""
    V = vocab_size or model_cfg.vocab_size or 256
    B, T, C, L = train_cfg.batch_size, model_cfg.block_size, model_cfg.n_embd, model_cfg.n_layer
    params = count_params(model_cfg, V)
    per_layer = B * T * (10 * C + 2 * model_cfg.hidden_dim)  # norms, q/k/v, attention out, MLP in/out
    if model_cfg.attn_impl == "math":
        per_layer += 2 * B * model_cfg.n_head * T * min(T, model_cfg.window or T)  # scores and softmax
    activations = 2 * L * per_layer + 2 * 4 * B * T * V + 2 * 8 * B * T  # + logits and grad, x and y
    windows = 2 * 16 * train_cfg.eval_iters * B  # train and val: float64 spacing, then int64 starts
    return TrainMemory(params, (4 if frozen else 16) * params, activations, windows)


def check_train_memory(model_cfg: ModelConfig, train_cfg: TrainConfig, device: torch.device, frozen: bool = False) -> TrainMemory:
    """Refuse a run that cannot fit on `device`, before anything is allocated."""
    need = estimate_train_bytes(model_cfg, train_cfg, frozen=frozen)
    free = available_bytes(device)
    if free is not None and need.total > free:
        gb = 1e9
        raise QuillError(
            f"this run needs at least {need.total / gb:,.1f} GB on {device} ({need.params:,} parameters × "
            f"{'4 bytes for frozen weights' if frozen else '16 bytes for weights, gradients and AdamW'} = "
            f"{need.state_bytes / gb:,.1f} GB, plus {need.activation_bytes / gb:,.1f} GB "
            f"of activations for train.batch_size={train_cfg.batch_size} × model.block_size={model_cfg.block_size}, "
            f"plus {need.eval_bytes / gb:,.1f} GB of evaluation windows for train.eval_iters={train_cfg.eval_iters}), "
            f"but {free / gb:,.1f} GB is free; lower train.batch_size (raise train.grad_accum to keep the batch), "
            "train.eval_iters, or the model's size"
        )
    return need
