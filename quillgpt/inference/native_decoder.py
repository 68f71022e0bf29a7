"""The decode step the engine runs: a model's blocks (and its head) as one native call
(quillgpt/native: csrc/decode_block.cpp) where their linears are in group_gemv's int8 or 4-bit layout, else the
model's own op-by-op step (GPT.decode). The engine builds one `Decoder` for its model when it is
made; the model itself knows nothing of this path.

Why: op by op, a block's decode step is ~15 kernel launches, and eager each is a Python call
too: on SmolLM2 more of an int4 token went between kernels than into them (docs/kernels.md). The
native block runs norm → q/k/v → QK-norm, RoPE, the cache write → attention → output projection
→ norm → MLP in one OpenMP region: its threads split each linear's columns and the attention's
heads and meet at a barrier between phases, and nothing else runs. It is the same arithmetic as
Block.decode with these layers (group_gemv rounds each linear's input to int16 per 32 either way),
so tokens equal the op-by-op step's and logits agree to float rounding
(tests/inference/test_native_decoder.py).

`decode_stack` runs every block (and the final norm and head) in one call; `decode_tokens` the
whole unmasked step from token ids, the embedding, the cache slots and the RoPE angles included;
`argmax_finite` the engine's greedy draw and its not-finite check in one pass over the logits.

`fits(block)` says whether a block can run it: causal attention (its window or prefix mask comes
in as the step's additive mask) at the 1/√d scale, RMSNorm or LayerNorm before each branch and none
after (no sandwich norms), a GELU, ReLU² or SwiGLU MLP, every linear offering `native_weights`;
and the model's embedding unscaled, one mask and one RoPE for every layer (`unsupported` names what
a model has beyond that: Gemma's GeGLU, sandwich norms, scaled embedding, score scale, per-layer
windows; its step runs op by op and the stats line says why: `step_note`). The step then also
needs float32 activations on the CPU, and a cache of float32 or float16 (CACHE_DTYPES: attention
reads float16 keys and values as float32).

The KV cache's dtype is a stated choice (`cache_dtype`, the engine's `cache_dtype=`): by default
float16 where the step may run natively (half the bytes attention reads, as llama.cpp's default f16
cache), decided from the model's structure and the kernels its layers may run, never from a
kernel timing; the op-by-op step reads that cache too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from quillgpt import native
from quillgpt.model.attention import CausalSelfAttention
from quillgpt.model.gpt import GPT, DecodeInputs
from quillgpt.model.kv_cache import KVCache
from quillgpt.model.variants import Variant
from quillgpt.quant import QuantLinear

CACHE_DTYPES = (torch.float32, torch.float16)  # the KV caches decode_blocks reads and writes

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


def unsupported(model: GPT) -> list[str]:
    """The features of `model`'s layers decode_block does not compute (empty: none), by their
    model keys: its step then runs op by op (GPT.decode)."""
    cfg = model.config
    features = {
        f"model.mlp={cfg.mlp}": cfg.mlp not in ACTIVATIONS,
        "model.sandwich_norm": cfg.sandwich_norm,
        "model.embed_scale": cfg.embed_scale,
        "model.attn_scale": cfg.attn_scale is not None,
        "model.global_every (per-layer windows and RoPE)": bool(model.local_layers),
    }
    return [name for name, present in features.items() if present]


def op_by_op_note(model: GPT) -> str:
    """ ", decode step op by op (…)" where a quantized model's blocks would run natively but for
    features decode_block lacks (unsupported); else "": what chat's and serve's first line and
    sample's stats line say."""
    if not any(isinstance(m, QuantLinear) for m in model.transformer.h.modules()):
        return ""
    missing = unsupported(model)
    return f", decode step op by op (the native one lacks {', '.join(missing)})" if missing else ""


def step_note(decoder: Decoder) -> str:
    """op_by_op_note for the stats line of a step that ran (nothing where it ran natively)."""
    return "" if decoder.native else op_by_op_note(decoder.model)


def fits(block: nn.Module) -> bool:
    """Whether `block` (a gpt.Block) has the shape decode_block runs: see the module docstring."""
    attn, mlp = block.attn, block.mlp
    norms = [_norm_params(n) for n in (block.ln_1, block.ln_2)]
    if type(attn) is not CausalSelfAttention or mlp.kind not in ACTIVATIONS or None in norms:
        return False
    if block.sandwich or attn.scale is not None:
        return False
    if norms[0][2] != norms[1][2] or type(block.ln_1) is not type(block.ln_2):
        return False
    if attn.q_norm is not None and (attn.q_norm.eps != norms[0][2] or attn.k_norm.eps != norms[0][2]):
        return False
    return all(isinstance(lin, QuantLinear) for lin in _linears(block)) and native.available()


def _linears(block: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = block.attn, block.mlp
    return attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj


def arguments(block: nn.Module, rows: int) -> Args | None:
    """What decode_block takes from a block that fits, at `rows` rows: the linears' 16 tensors,
    the 6 norm tensors, [n_head, kv_heads, layer_norm, activation, the four linears' formats] and
    eps; None where a linear would not run group_gemv at this many rows."""
    attn, mlp = block.attn, block.mlp
    lin: list[Tensor] = []
    formats: list[int] = []
    for layer in _linears(block):
        weights = layer.native_weights(rows)
        if weights is None:
            return None
        lin += [*weights[:3], NONE if layer.bias is None else layer.bias]
        formats.append(int(weights[3]))
    (w1, b1, eps), (w2, b2, _) = _norm_params(block.ln_1), _norm_params(block.ln_2)
    qk = [NONE, NONE] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
    ints = [attn.n_head, attn.kv_heads, int(type(block.ln_1) is nn.LayerNorm), ACTIVATIONS[mlp.kind], *formats]
    return lin, [w1, b1, w2, b2, *qk], ints, eps


def _ints(stack: Stack, slots: int) -> list[int]:
    """decode_blocks' ints: n_head, kv_heads, the slots attended, layer_norm, activation, formats."""
    n_head, kv_heads, layer_norm, act, *formats = stack[0][2]
    return [n_head, kv_heads, slots, layer_norm, act, *formats]


def head_arguments(norm: nn.Module, head: nn.Module | None, rows: int, layer_norm: int, eps: float) -> tuple[list[Tensor], list[int]]:
    """[norm w, b, q, s, o, bias] for decode_blocks to end in the logits, and [the head's format]
    for its ints: the final norm (of the blocks' kind and eps) and the head, where the head offers
    group_gemv's layout at `rows` rows (head None: the model's head does more, e.g. a soft cap);
    else [], [] (the head runs after)."""
    weights = head.native_weights(rows) if isinstance(head, QuantLinear) else None
    params = _norm_params(norm)
    if weights is None or params is None or params[2] != eps or int(type(norm) is nn.LayerNorm) != layer_norm:
        return [], []
    return [params[0], params[1], *weights[:3], NONE if head.bias is None else head.bias], [int(weights[3])]


def stack_arguments(blocks: Sequence[nn.Module], norm: nn.Module, head: nn.Module | None, rows: int) -> Stack | None:
    """Every block's arguments() as one list each, and head_arguments, for one decode_blocks call
    over the whole stack (30 calls a SmolLM2 token cost more Python than one). None: a block does
    not fit, or the blocks differ in heads, norm, activation or eps."""
    if not all(fits(block) for block in blocks):
        return None
    args = [arguments(block, rows) for block in blocks]
    if not all(a is not None and a[2] == args[0][2] and a[3] == args[0][3] for a in args):
        return None
    lin, norms = [t for a in args for t in a[0]], [t for a in args for t in a[1]]
    head_args, head_format = head_arguments(norm, head, rows, args[0][2][2], args[0][3])
    return (lin, norms, args[0][2] + head_format, args[0][3]), head_args


def decode_stack(x: Tensor, stack: Stack, inputs: DecodeInputs, cache: KVCache, n_keys: int | None) -> Tensor:
    """GPT.decode's blocks in one call over every layer's cache: x (R, C) float32 and the step's
    RoPE angles, additive mask (R, 1, 1, S) and slots as GPT.decode_inputs makes them; the logits
    (R, V) where `stack` holds the head's arguments, else the hidden states (R, C)."""
    (lin, norms, _, eps), head = stack
    _, rope, mask, at = inputs
    R, S = x.shape[0], n_keys or cache.capacity
    cos, sin = (NONE, NONE) if rope is None else (rope[0].reshape(R, -1), rope[1].reshape(R, -1))
    bias = NONE if mask is None else mask.reshape(R, S)
    return native.decode_blocks(x, lin, norms, head, cache.k, cache.v, at[1], cos, sin, bias, _ints(stack, S), eps)


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
    finite (a NaN or infinite logit, or a sum past float's range), in one C++ pass (the same from
    torch ops read the logits twice, cold after a step that streamed the weights). None where
    it does not run: not float32 on the CPU, or the library not built (a model whose layers do not
    use it need not wait for its build)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or not native.built() or torch.compiler.is_compiling():
        return None
    return native.argmax_finite(logits.contiguous())


# --- the decoder the engine builds once -----------------------------------------------------------


def runs_natively(model: GPT) -> bool:
    """Whether `model`'s decode step can run natively: float32 on the CPU, every block fitting and
    every linear of theirs one the native kernels may run (its layout and plan, never a timing:
    which batch sizes run natively is each layer's plan's, per call)."""
    if model.dtype != torch.float32 or model.device.type != "cpu" or unsupported(model):
        return False
    if not all(fits(block) for block in model.transformer.h):
        return False
    return all(lin.runs_native() for block in model.transformer.h for lin in _linears(block))


def cache_dtype(model: GPT, native_step: bool = True) -> torch.dtype:
    """The KV cache's default dtype: float16 where the decode step runs natively (see the module
    docstring; native_step=False: asked to run op by op), else the model's own."""
    return Decoder(model, native_step).cache_dtype


class Decoder:
    """The decode step of one model (GPT.decode's call: idx, pos (R,) → next-token logits (R, V)),
    through the native stack where the model runs it (`native`, checked once here), else op by op.
    Each batch size's arguments are gathered once and kept: the model must not change (quantize,
    LoRA, .to) while a decoder of it is in use; build a new one after."""

    def __init__(self, model: GPT, native_step: bool = True) -> None:
        self.model = model
        self.native = native_step and runs_natively(model)
        self._stacks: dict[int, Stack | None] = {}  # rows → stack_arguments, where the cache is one it reads
        self._embedding = self.embedding() if self.native else None  # the model does not change under a decoder

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's default dtype for this step (see cache_dtype)."""
        return torch.float16 if self.native else self.model.dtype

    def __call__(self, idx: Tensor, pos: Tensor, cache: KVCache, n_keys: int | None = None, masked: bool = True) -> Tensor:
        stack = self.stack(len(pos)) if self.native and cache.k[0].dtype in CACHE_DTYPES else None
        if stack is None:
            return self.model.decode(idx, pos, cache, n_keys, masked)
        m = self.model
        embedding = None if masked or torch.compiler.is_compiling() else self._embedding
        if embedding is not None:  # the whole step in one native call, its embedding and slots too
            out = decode_tokens(idx, pos, stack, *embedding, cache, n_keys)
        else:
            inputs = m.decode_inputs(idx, pos, cache, n_keys, masked)
            out = decode_stack(inputs[0], stack, inputs, cache, n_keys)
        return out if stack[1] else m.head(m.transformer.ln_f(out))  # (R, V)

    def stack(self, rows: int) -> Stack | None:
        """stack_arguments at `rows` rows, kept (traced afresh inside torch.compile: its checks would become guards)."""
        t, m = self.model.transformer, self.model
        head = m.lm_head if m.config.logit_softcap is None else None
        if torch.compiler.is_compiling():
            return stack_arguments(t.h, t.ln_f, head, rows)
        if rows not in self._stacks:
            self._stacks[rows] = stack_arguments(t.h, t.ln_f, head, rows)
        return self._stacks[rows]

    def embedding(self) -> tuple[list[Tensor], Tensor | None] | None:
        """decode_tokens' [wte] or [wte, wpe] and RoPE frequencies (None: learned positions); None
        where the variant embeds other positions than the absolute ones (Infini's restart), or the
        table is kept quantized (quant/embedding.py: the model looks its rows up)."""
        m = self.model
        if type(m.variant).embed_positions is not Variant.embed_positions or not isinstance(m.transformer.wte, nn.Embedding):
            return None
        t = m.transformer
        if m.config.pos == "learned":
            return [t.wte.weight, t.wpe.weight], None
        return [t.wte.weight], m.inv_freq(m.device)
