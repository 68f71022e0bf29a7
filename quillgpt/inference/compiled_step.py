"""The engine's compiled decode step: `decode_over` through torch.compile, one compiled function
per model (and per structure of it), with dynamo's guards on the model left out on the CPU.

Why: at each call dynamo checks every guard of the graphs it keeps for the compiled code before it
runs one. For a model passed as an argument those pin the whole module tree: thousands of checks
a call on SmolLM2-135M, a tenth of an int8 step (docs/performance.md). Here each model gets a copy of
`decode_over` with a code object of its own, so the graphs dynamo keeps for that copy serve that
model alone, and what the dropped guards pinned is this module's key instead, computed once per
engine (`structure_key`: the config, every module's type and plain attributes, every tensor's
name, dtype and shape; a model changed in place, e.g. quantized, gets a new key and a new
compile). The guards that stay: the tensors that are not the model's (the inputs, the cache), the
dynamic n_keys, and global state (grad mode, default device, ...).
"""

from __future__ import annotations

import hashlib
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from quillgpt.inference.native_decoder import Decoder
from quillgpt.model.gpt import GPT
from quillgpt.model.kv_cache import KVCache

# the guards kept on a model's own step (besides tensors that are not parameters): cheap, one each
KEPT = {
    "SHAPE_ENV",
    "GLOBAL_STATE",
    "GRAD_MODE",
    "DETERMINISTIC_ALGORITHMS",
    "TORCH_FUNCTION_STATE",
    "DEFAULT_DEVICE",
    "AUTOGRAD_SAVED_TENSORS_HOOKS",
}

_steps: weakref.WeakKeyDictionary[GPT, dict[str, Callable[..., Tensor]]] = weakref.WeakKeyDictionary()


def decode_over(model: GPT, idx: Tensor, pos: Tensor, cache: KVCache, key_pos: Tensor, native: bool) -> Tensor:
    """The model's decode step (native_decoder.Decoder: natively where it runs, op by op otherwise or
    where `native` is False) over the slots whose positions key_pos (rows, n_keys) views: what the
    engine compiles, n_keys then a size torch.compile can keep dynamic."""
    return Decoder(model, native)(idx, pos, cache, key_pos.shape[1])


def compiled_step(model: GPT, cuda: bool, native: bool = True) -> Callable[..., Tensor]:
    """decode_over compiled for `model` as it is now (see the module docstring). CUDA: fixed shapes
    over every slot, for CUDA graphs ("reduce-overhead"), dynamo's guards as they are."""
    # every model, structure and batch size is one more graph; past dynamo's limit (8) the step
    # would fail rather than run eager (fullgraph)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    if cuda:
        return torch.compile(decode_over, mode="reduce-overhead", fullgraph=True, dynamic=False)
    key = f"{structure_key(model)}:{native}"
    own = _steps.setdefault(model, {})
    if key not in own:
        code = decode_over.__code__.replace(co_name=f"decode_over_{id(model):x}_{len(own)}")
        fn = types.FunctionType(code, decode_over.__globals__, code.co_name)
        own[key] = torch.compile(fn, fullgraph=True, dynamic=False, options={"guard_filter_fn": model_guards_dropped})
    return own[key]


MIN_SHARED = 1024


def shared_capacity(tokens: int) -> int:
    """A cache size for `tokens` that engines made one after another can share, so they share the
    compiled graph (its shapes include the cache's capacity; a new capacity is a new compile):
    the next power of two, at least MIN_SHARED. quill chat's turns: one compile per doubling."""
    return max(MIN_SHARED, 1 << max(0, tokens - 1).bit_length())


def model_guards_dropped(entries: list[Any]) -> list[bool]:
    """dynamo's guard filter: keep the KEPT kinds and the tensor guards but those on the model's own
    tensors (its weights: their names, dtypes and shapes are in the structure key)."""
    return [e.guard_type in KEPT or (e.guard_type == "TENSOR_MATCH" and not _in_model(e)) for e in entries]


def _in_model(entry: Any) -> bool:
    """A tensor reached through decode_over's `model` argument (dynamo names it model._modules[...])."""
    return isinstance(entry.value, nn.Parameter) or str(entry.name).split(".")[0] == "model"


def structure_key(model: GPT) -> str:
    """What the dropped guards pinned, as one digest: the config, each module's name, type and plain
    attributes (an Int8Linear's kernel plan among them), each parameter's and buffer's name, dtype,
    shape and device."""
    parts = [repr(model.config)]
    for name, m in model.named_modules():
        plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and not isinstance(v, (Tensor, nn.Module))}
        parts.append(f"{name}:{type(m).__qualname__}:{plain!r}")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        parts.append(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.device}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()
