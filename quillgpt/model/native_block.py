"""The decode step's blocks as one native call each (csrc/decode_block.cpp), where a block's four
linears are in group_gemv's int8 or 4-bit layout.

Why: op by op, a block's decode step is ~15 kernel launches, and eager each is a Python call
too: SmolLM2 (30 blocks) spent more of an int4 token between kernels than in them (77 tokens/s
eager, 139 compiled, where its weights stream in ~5 ms). The native block runs norm → q/k/v →
QK-norm, RoPE, the cache write → attention → output projection → norm → MLP in one OpenMP
region: its threads split each linear's columns and the attention's heads and meet at a barrier
between phases, and nothing else runs. It is the same arithmetic as Block.decode with these
layers (group_gemv rounds each linear's input to int16 per 32 either way), so tokens equal the
op-by-op step's and logits agree to float rounding (tests/model/test_native_block.py).

`decode_stack` runs every block (and the final norm and head) in one call; `decode_tokens` the
whole unmasked step from token ids, the embedding, the cache slots and the RoPE angles included;
`argmax_finite` the engine's greedy draw and its not-finite check in one pass over the logits.

`fits(block)` says once whether a block can run it: causal attention (its window or prefix mask
comes in as the step's additive mask), RMSNorm or LayerNorm, a GELU, ReLU² or SwiGLU MLP, every
linear offering `native_weights`. `decode` then also needs float32 activations, and a cache of
float32 or float16 (CACHE_DTYPES: attention reads float16 keys and values as float32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from quillgpt import native
from quillgpt.model.kv_cache import KVCache, SlotIndex

CACHE_DTYPES = (torch.float32, torch.float16)  # the KV caches decode_blocks reads and writes


class NativeLinear(Protocol):
    """A linear layer decode_block can read: its weights in group_gemv's layout at `rows` input rows."""

    bias: Tensor | None

    def native_weights(self, rows: int) -> tuple[Tensor, Tensor, Tensor, native.Format] | None:
        """(q, s, o, format): int8 (out, in) or 4-bit (out, in / 2) codes, fp16 scales and offsets
        (out, groups), and which of the two; None where this layer would not run group_gemv at `rows` rows."""
        ...


_enabled = True
_generation = 0  # bumped whenever any module gains or swaps a submodule: stack_arguments' memo key


def changed() -> None:
    """Drop every model's stack memo: a module's tensors were replaced (Block and GPT call it from
    _apply, as model.to does), or a module gained or swapped a submodule (the hook below)."""
    global _generation
    _generation += 1


torch.nn.modules.module.register_module_module_registration_hook(lambda module, name, submodule: changed())


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Decode op by op inside (the plain computation the tests and benchmarks compare with)."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


ACTIVATIONS = {"gelu": 0, "relu2": 1, "swiglu": 2}  # decode_block.cpp's Act
NONE = torch.empty(0)  # an absent optional tensor (decode_block takes empty for none)
Args = tuple[list[Tensor], list[Tensor], list[int], float]  # arguments(): linears, norms, ints, eps
Stack = tuple[Args, list[Tensor]]  # stack_arguments(): every block's Args as one, head_arguments()


def _norm_params(norm: nn.Module) -> tuple[Tensor, Tensor, float] | None:
    """(weight, bias or NONE, eps) of an RMSNorm or LayerNorm with a gain; None for anything else."""
    if type(norm) not in (nn.RMSNorm, nn.LayerNorm) or norm.weight is None:
        return None
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    bias = getattr(norm, "bias", None)
    return norm.weight, NONE if bias is None else bias, eps


def fits(block: nn.Module) -> bool:
    """Whether `block` (a gpt.Block) has the shape decode_block runs: see the module docstring."""
    from quillgpt.model.attention import CausalSelfAttention  # attention imports kv_cache; kept local for the seam

    attn, mlp = block.attn, block.mlp
    norms = [_norm_params(n) for n in (block.ln_1, block.ln_2)]
    if type(attn) is not CausalSelfAttention or mlp.kind not in ACTIVATIONS or None in norms:
        return False
    if norms[0][2] != norms[1][2] or type(block.ln_1) is not type(block.ln_2):
        return False
    if attn.q_norm is not None and (attn.q_norm.eps != norms[0][2] or attn.k_norm.eps != norms[0][2]):
        return False
    linears = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
    return all(hasattr(lin, "native_weights") for lin in linears) and native.available()


def arguments(block: nn.Module, rows: int) -> Args | None:
    """What decode_block takes from a block that fits, at `rows` rows: the linears' 16 tensors,
    the 6 norm tensors, [n_head, kv_heads, layer_norm, activation, the four linears' formats] and
    eps; None where a linear would not run group_gemv at this many rows."""
    attn, mlp = block.attn, block.mlp
    lin: list[Tensor] = []
    formats: list[int] = []
    for layer in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj):
        weights = layer.native_weights(rows)
        if weights is None:
            return None
        lin += [*weights[:3], NONE if layer.bias is None else layer.bias]
        formats.append(int(weights[3]))
    (w1, b1, eps), (w2, b2, _) = _norm_params(block.ln_1), _norm_params(block.ln_2)
    qk = [NONE, NONE] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
    ints = [attn.n_head, attn.kv_heads, int(type(block.ln_1) is nn.LayerNorm), ACTIVATIONS[mlp.kind], *formats]
    return lin, [w1, b1, w2, b2, *qk], ints, eps


def _parts(block: nn.Module) -> tuple[nn.Module | None, ...]:
    """The modules arguments() reads, through _modules: nn.Module's __getattr__ made this check
    ~0.5 ms of a SmolLM2 token (8 lookups a block, 30 blocks)."""
    m = block._modules
    attn, mlp = m["attn"]._modules, m["mlp"]._modules
    return m["ln_1"], m["ln_2"], m["attn"], m["mlp"], attn.get("c_attn"), attn.get("c_proj"), mlp.get("c_fc"), mlp.get("c_proj")


def memo_arguments(block: nn.Module, memo: dict, rows: int) -> Args | None:
    """arguments(block, rows), kept in `memo` (the block's) while the block's modules are the same
    objects: quantize swaps linears in after a model may have decoded, and the block's _apply
    (model.to) clears the memo where buffers are replaced. None: the block does not fit."""
    if not _enabled:
        return None
    if torch.compiler.is_compiling():  # traced once: no memo (its checks would become guards)
        return arguments(block, rows) if fits(block) else None
    parts = _parts(block)
    if memo.get("parts") != parts:  # modules compare by identity
        memo.clear()
        memo.update(parts=parts, fits=fits(block))
    if not memo["fits"]:
        return None
    if rows not in memo:
        memo[rows] = arguments(block, rows)
    return memo[rows]


def _ints(stack: Stack, slots: int) -> list[int]:
    """decode_blocks' ints: n_head, kv_heads, the slots attended, layer_norm, activation, formats."""
    n_head, kv_heads, layer_norm, act, *formats = stack[0][2]
    return [n_head, kv_heads, slots, layer_norm, act, *formats]


def _call(
    x: Tensor,
    stack: Stack,
    layers: slice,
    rope: tuple[Tensor, Tensor] | None,
    mask: Tensor | None,
    cache: KVCache,
    at: SlotIndex,
    n_keys: int | None,
) -> Tensor:
    """decode_blocks over `stack` with the cache's `layers`: x (R, C) float32, the step's RoPE
    angles and additive mask (R, 1, 1, S) as GPT.decode makes them, the caches written at `at`."""
    (lin, norms, _, eps), head = stack
    R, S = x.shape[0], n_keys or cache.capacity
    cos, sin = (NONE, NONE) if rope is None else (rope[0].reshape(R, -1), rope[1].reshape(R, -1))
    bias = NONE if mask is None else mask.reshape(R, S)
    return native.decode_blocks(x, lin, norms, head, cache.k[layers], cache.v[layers], at[1], cos, sin, bias, _ints(stack, S), eps)


def decode(
    x: Tensor,
    args: Args,
    rope: tuple[Tensor, Tensor] | None,
    mask: Tensor | None,
    cache: KVCache,
    layer: int,
    at: SlotIndex,
    n_keys: int | None,
) -> Tensor:
    """Block.decode's result through decode_blocks: `args` (arguments()), this layer's cache."""
    return _call(x, (args, []), slice(layer, layer + 1), rope, mask, cache, at, n_keys)


def head_arguments(norm: nn.Module, head: nn.Module | None, rows: int, layer_norm: int, eps: float) -> tuple[list[Tensor], list[int]]:
    """[norm w, b, q, s, o, bias] for decode_blocks to end in the logits, and [the head's format]
    for its ints: the final norm (of the blocks' kind and eps) and the head, where the head offers
    group_gemv's layout at `rows` rows (head None: the model's head does more, e.g. a soft cap);
    else [], [] (the head runs after)."""
    weights = head.native_weights(rows) if hasattr(head, "native_weights") else None
    params = _norm_params(norm)
    if weights is None or params is None or params[2] != eps or int(type(norm) is nn.LayerNorm) != layer_norm:
        return [], []
    return [params[0], params[1], *weights[:3], NONE if head.bias is None else head.bias], [int(weights[3])]


def stack_arguments(blocks: Sequence[nn.Module], norm: nn.Module, head: nn.Module | None, memo: dict, rows: int) -> Stack | None:
    """Every block's arguments() as one list each, and head_arguments, for one decode_blocks call
    over the whole stack (30 calls a SmolLM2 token cost ~0.3 ms of Python, and ln_f and the head's
    Python after the blocks ~0.4 ms, slow with the caches cold from streaming the weights). None: a
    block does not fit, or the blocks differ in heads, norm, activation or eps. Kept in `memo`
    (the model's) until changed(): any module anywhere gains or swaps a submodule (quantize, LoRA,
    a layer replaced by hand), or a block or the model is cast or moved; checking each block's
    modules instead took ~0.2 ms a token, cold."""
    if not _enabled:
        return None
    compiling = torch.compiler.is_compiling()  # traced once: no memo (its checks would become guards)
    kept = None if compiling else memo.get(rows)
    if kept is not None and kept[0] == _generation:
        return kept[1]
    generation = _generation
    args = [memo_arguments(block, block._native, rows) for block in blocks]
    stacked = None
    if all(a is not None and a[2] == args[0][2] and a[3] == args[0][3] for a in args):
        lin, norms = [t for a in args for t in a[0]], [t for a in args for t in a[1]]
        head_args, head_format = head_arguments(norm, head, rows, args[0][2][2], args[0][3])
        stacked = (lin, norms, args[0][2] + head_format, args[0][3]), head_args
    if not compiling:
        memo[rows] = (generation, stacked)
    return stacked


def decode_stack(
    x: Tensor,
    stack: Stack,
    rope: tuple[Tensor, Tensor] | None,
    mask: Tensor | None,
    cache: KVCache,
    at: SlotIndex,
    n_keys: int | None,
) -> Tensor:
    """GPT.decode's blocks in one call, every layer's cache: stack_arguments' `stack`; the logits
    (R, V) where it holds the head's arguments, else the hidden states (R, C)."""
    return _call(x, stack, slice(None), rope, mask, cache, at, n_keys)


def decode_tokens(
    idx: Tensor, pos: Tensor, stack: Stack, embed: list[Tensor], inv_freq: Tensor | None, cache: KVCache, n_keys: int | None
) -> Tensor:
    """GPT.decode's whole unmasked step in one call, from the token ids idx and positions pos (R,):
    each row's slot (its position recorded in cache.pos), its embedding (embed: [wte] or [wte, wpe])
    and RoPE angles (inv_freq; None: learned positions) as well, where those torch ops took ~0.4 ms
    a SmolLM2 token, cold after the last step's weights. Every row sees all of the first n_keys
    slots. Returns what decode_stack returns."""
    (lin, norms, _, eps), head = stack
    freq = NONE if inv_freq is None else inv_freq
    ints = _ints(stack, n_keys or cache.capacity)
    return native.decode_tokens(idx, pos, cache.pos, embed, freq, lin, norms, head, cache.k, cache.v, ints, eps)


def argmax_finite(logits: Tensor) -> Tensor | None:
    """(n, V) logits → (2, n) int64: each row's argmax (its first maximum), and 1 where the row is not
    finite (a NaN or infinite logit, or a sum past float's range), in one C++ pass: the same from
    torch ops cost ~0.5 ms a SmolLM2 token, cold after a step that streamed the weights. None where
    it does not run: not float32 on the CPU, or the library not built (a model whose layers do not
    use it need not wait for its build)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or not native.built() or torch.compiler.is_compiling():
        return None
    return native.argmax_finite(logits.contiguous())
