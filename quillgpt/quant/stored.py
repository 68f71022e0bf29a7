"""A quantized model as a run stores it, and back: each quantized layer as its scheme's stored
tensors (`Scheme.store`: the kernels' layout), the rest as float tensors, and which layer is which
scheme in one table (`layers`: module path → scheme name) in the weights file's metadata
(tensor_file.py). Loading builds the model on the meta device and puts each layer in from the
file one tensor at a time: the fp32 model is never made.

Paths: a linear's module path (transformer.h.0.attn.c_attn, lm_head) and "transformer.wte" for an
embedding table kept quantized (quant/embedding.py). A tied model whose head is quantized and whose
file holds no transformer.wte.weight looks its embeddings up in the head's layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from quillgpt.config import ModelConfig
from quillgpt.errors import QuillError
from quillgpt.model.gpt import GPT
from quillgpt.quant import SCHEMES
from quillgpt.quant.embedding import QuantEmbedding
from quillgpt.quant.scheme import Scheme

EMBEDDING = "transformer.wte"
Spec = tuple[str, torch.dtype, tuple[int, ...]]


def scheme_of(layer: nn.Module) -> Scheme:
    """The registered scheme a quantized layer is (its Linear type and group)."""
    for s in SCHEMES.values():
        if type(layer) is s.layer and s.group == layer.group and getattr(layer, "bits", s.bits) == s.bits:
            return s
    raise ValueError(f"{type(layer).__name__} with {layer.group} weights per scale is no registered scheme")


def layer_specs(path: str, scheme: Scheme, out_features: int, in_features: int, bias: torch.dtype | None) -> list[Spec]:
    """The tensors a layer of `scheme` stores, named under `path` (and its bias, in `bias`'s dtype)."""
    specs = [(f"{path}.{k}", dt, shape) for k, (dt, shape) in scheme.stored_shapes(out_features, in_features, scheme.group).items()]
    return specs + ([(f"{path}.bias", bias, (out_features,))] if bias is not None else [])


def model_tensors(model: GPT) -> tuple[dict[str, str], Iterator[tuple[str, Tensor]]]:
    """(layers, every tensor to store in order) of a converted model (quant.quantize's): each quantized
    layer's stored tensors, each float weight once (a tied float head: lm_head.weight only)."""
    kinds = tuple(s.layer for s in SCHEMES.values())
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, kinds)}
    if isinstance(model.transformer.wte, QuantEmbedding) and model.transformer.wte.table is not model.lm_head:
        quantized[EMBEDDING] = model.transformer.wte.table
    layers = {name: scheme_of(m).name for name, m in quantized.items()}

    def tensors() -> Iterator[tuple[str, Tensor]]:
        for name, m in quantized.items():
            yield from ((f"{name}.{k}", t) for k, t in scheme_of(m).store(m.packed()).items())
            if m.bias is not None:
                yield f"{name}.bias", m.bias
        tied = model.config.tie_embeddings and isinstance(model.lm_head, nn.Linear)
        for name, t in model.state_dict().items():
            owner = name.rsplit(".", 1)[0]
            in_layer = any(owner == p or owner.startswith(p + ".") for p in [*quantized, EMBEDDING + ".table"])
            if not in_layer and not (tied and name == EMBEDDING + ".weight"):
                yield name, t

    return layers, tensors()


def build_model(cfg: ModelConfig, layers: dict[str, str], read: Callable[[str], Tensor], names: set[str], dtype: torch.dtype | None) -> GPT:
    """The GPT of a quantized run: built on the meta device, each layer of `layers` made from its
    stored tensors (read(name) reads one; `names`: what the file holds), every float weight
    read and cast to `dtype` (None: as stored). A tensor of the wrong shape or dtype, missing or
    unexpected, is one QuillError."""
    with torch.device("meta"):
        model = GPT(cfg)
    float_dtype, used = dtype or torch.float32, set()
    for path, name in layers.items():
        target = _module(model, path)
        if name not in SCHEMES or not isinstance(target, (nn.Linear, nn.Embedding)):
            raise QuillError(f"its layer table names {path[:80]} as {str(name)[:40]}: no quantized layer of quill's")
        out, inp = target.weight.shape
        specs = layer_specs(path, SCHEMES[name], out, inp, None)
        stored = {spec[0].rsplit(".", 1)[1]: _checked(read, spec, names) for spec in specs}
        bias = read(f"{path}.bias") if f"{path}.bias" in names else None
        used.update([spec[0] for spec in specs] + [f"{path}.bias"])
        if bias is not None and (bias.shape != (out,) or not bias.is_floating_point()):
            raise QuillError(f"{path}.bias is {tuple(bias.shape)}, not ({out},)")
        layer = SCHEMES[name].load(stored, bias, float_dtype)
        _put(model, path, QuantEmbedding(layer, float_dtype) if path == EMBEDDING else layer)
    tied_quantized = cfg.tie_embeddings and "lm_head" in layers
    if tied_quantized and EMBEDDING not in layers and f"{EMBEDDING}.weight" not in names:
        model.transformer.wte = QuantEmbedding(model.lm_head, float_dtype)
    floats = {k: v for k, v in model.state_dict().items() if v.is_meta}
    if cfg.tie_embeddings and not tied_quantized:
        floats.pop(f"{EMBEDDING}.weight", None)  # the head's weight, tied back by materialize
    weights = {k: _checked(read, (k, None, tuple(v.shape)), names) for k, v in floats.items()}
    if extra := sorted(names - used - set(weights)):
        raise QuillError(f"it holds tensors a model of its config has no place for: {', '.join(extra[:3])}")
    model.load_state_dict({k: v if dtype is None else v.to(dtype) for k, v in weights.items()}, strict=False, assign=True)
    model.materialize()
    return model


def _checked(read: Callable[[str], Tensor], spec: tuple[str, torch.dtype | None, tuple[int, ...]], names: set[str]) -> Tensor:
    name, dtype, shape = spec
    if name not in names:
        raise QuillError(f"it has no tensor {name[:100]}, which its layer table and config need")
    t = read(name)
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype) or (dtype is None and not t.is_floating_point()):
        want = f"{str(dtype).replace('torch.', '') if dtype else 'float'} {shape}"
        raise QuillError(f"{name[:100]} is {str(t.dtype).replace('torch.', '')} {tuple(t.shape)}, not {want}")
    return t


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _put(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def layers_json(layers: dict[str, str]) -> str:
    return json.dumps(layers, sort_keys=True)


def parse_layers(text: object) -> dict[str, str]:
    """The layer table of a weights file's metadata, checked to be {path: scheme name}."""
    try:
        layers = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        layers = None
    if not isinstance(layers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in layers.items()):
        raise QuillError("its layer table (metadata 'quantized') is not a JSON object of layer → scheme")
    return layers
