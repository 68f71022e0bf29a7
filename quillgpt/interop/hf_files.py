"""Hugging Face model directories as people download them: config.json, weights as
model.safetensors or pytorch_model.bin (sharded or not, read without running code), a hub name
resolved from huggingface_hub's cache, and the --out directory checks both directions share.

transformers, safetensors and huggingface_hub are the optional `hf` extra, imported inside the
functions that need them.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from quillgpt import checkpoint as ckpt
from quillgpt.config import shown_value
from quillgpt.errors import QuillError
from quillgpt.files import atomic_write_text, input_file, probe_writable, read_json, shown

HF_INSTALL = 'pip install -e ".[hf]"'


HUB_WEIGHTS = (  # what import-hf fetches from the Hub: safetensors first, else the pickle format
    ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors"],
    ["config.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"],
)


def require(module: str) -> ModuleType:
    """Import part of the `hf` extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise QuillError(f"Hugging Face interop needs {top} (the hf extra): {HF_INSTALL}") from None


class HFWeights(Mapping[str, Tensor]):
    """The tensors of an HF model directory, read lazily one at a time (a model is never held twice):
    model.safetensors, else pytorch_model.bin (sharded or not; .bin loads without running code)."""

    def __init__(self, src: Path) -> None:
        self._where: dict[str, Any] = {}  # tensor name → the open file that holds it
        for name, opener in (("model.safetensors", _open_safetensors), ("pytorch_model.bin", _open_bin)):
            index = src / f"{name}.index.json"
            files = [src / name] if input_file(src / name, name) else []  # a FIFO or device: refused by name
            if not files and input_file(index, index.name):
                files = [src / s for s in _shard_names(index)]
            for path in files:
                handle = opener(path)
                self._where.update(dict.fromkeys(handle.keys(), (handle, path)))
            if files:
                return
        raise QuillError(
            f"{src} has no weights: expected model.safetensors or pytorch_model.bin (or their sharded *.index.json) next to config.json"
        )

    def __getitem__(self, name: str) -> Tensor:
        handle, path = self._where[name]
        if hasattr(handle, "get_slice"):  # safetensors: the header's dtype, before torch is asked to read it
            _check_dtype(path, name, _stored_dtype(handle, name))
        try:
            t = handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001 — a truncated file fails here, with the library's own type
            raise QuillError(f"{shown(path)}: cannot read {name[:100]} ({type(e).__name__}: {str(e)[:100]}); download it again") from None
        if not isinstance(t, Tensor):
            raise QuillError(f"{shown(path)}: {name[:100]} is not a tensor; is it a model's weights file?")
        if t.is_floating_point():
            _check_dtype(path, name, str(t.dtype).removeprefix("torch."))
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# The weight dtypes import-hf converts (as torch and safetensors name them); the integer and bool
# types pass too (GPT-2's attention-mask buffers; a weight of them is refused by its codec by name).
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "F32", "F16", "BF16", "F64"})
OTHER_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})


def _stored_dtype(handle: Any, name: str) -> str:
    try:
        return str(handle.get_slice(name).get_dtype())
    except Exception:  # noqa: BLE001 — left to get_tensor, which names what is wrong with the file
        return "F32"


def _check_dtype(path: Path, name: str, dtype: str) -> None:
    """Refuse by name a weight in a dtype quill does not convert (fp8, fp4, ...): one line, not a
    traceback later or weights silently read as something else."""
    if dtype in FLOAT_DTYPES or dtype in OTHER_DTYPES:
        return
    fp8 = " (fp8)" if dtype.upper().startswith(("F8", "FLOAT8")) else ""
    raise QuillError(
        f"{shown(path)}: {name[:100]} is stored as {dtype[:40]}{fp8}, which import-hf does not convert; it reads "
        "float32, float16 and bfloat16 weights: use the model's bf16 or fp16 release (or dequantize it to one first)"
    )


def load_hf_weights(src: Path) -> HFWeights:
    """The tensors of an HF model directory (see HFWeights)."""
    return HFWeights(src)


def _shard_names(index: Path) -> list[str]:
    """The shard files an *.index.json names: plain file names beside it, never a path elsewhere."""
    try:
        shards = sorted(set(read_json(index, "shard index", limit=1 << 26, kind="a valid shard index")["weight_map"].values()))
    except (KeyError, TypeError, AttributeError) as e:
        raise QuillError(f"{shown(index)} is not a valid shard index ({type(e).__name__}: {str(e)[:100]})") from None
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise QuillError(f"{shown(index)} names the shard {shown_value(shard)}; shards must be files beside it")
    return shards


def _open_safetensors(path: Path) -> Any:
    safetensors = require("safetensors")
    if not input_file(path, "shard"):
        raise QuillError(f"{shown(path)} is missing (named in the shard index)")
    try:
        return safetensors.safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 — SafetensorError, OSError, and whatever a crafted header raises
        raise QuillError(
            f"{shown(path)} is not a readable safetensors file ({type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0][:100]}); download it again"
        ) from None


class _BinFile:
    """A pytorch_model.bin as safe_open's interface: keys(), get_tensor(name); memory-mapped."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> Any:
        return self.tensors[name]


def _torch_load(path: Path) -> Any:
    """torch.load without running code, memory-mapped where the file allows it (the zip format;
    files from before torch 1.6 load whole)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _open_bin(path: Path) -> _BinFile:
    if not input_file(path, "shard"):
        raise QuillError(f"{shown(path)} is missing (named in the shard index)")
    try:
        tensors = _torch_load(path)
    except pickle.UnpicklingError as e:
        raise QuillError(
            f"{shown(path)} was refused: loading it needs code execution, which is unsafe "
            f"({ckpt.refused_call(e)}); use the model's model.safetensors instead"
        ) from None
    except Exception as e:  # noqa: BLE001 — damaged bytes fail in torch.load with many types
        raise QuillError(
            f"{shown(path)} is not a readable PyTorch weights file ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]})"
        ) from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
        raise QuillError(f"{shown(path)} is not a state dict (names → tensors); is it a model's weights file?")
    return _BinFile(tensors)


def resolve_source(src: str | Path) -> Path:
    """A local HF model directory, or a hub name (gpt2, gpt2-medium, openai-community/gpt2)
    resolved from huggingface_hub's cache, downloading when online."""
    path = Path(src)
    if os.path.exists(path):  # os.path: False, not an OSError, for a name too long to exist
        if os.path.isfile(path) and path.suffix.lower() == ".gguf":
            raise QuillError(f"{shown(path)} is a GGUF file: import it with `quill import-gguf {shown(path)} -o RUN`")
        if not os.path.isfile(path / "config.json"):
            raise QuillError(f"{shown(path)} is not a Hugging Face model directory (no config.json in it)")
        return path
    name = str(src)
    if not re.fullmatch(r"[\w.-]{1,96}(/[\w.-]{1,96})?", name):  # the Hub's repo id rules
        raise QuillError(f"{shown(name)} not found: pass a local model directory or a hub name such as gpt2")
    hub = require("huggingface_hub")
    errors = require("huggingface_hub.errors")
    try:
        for patterns in HUB_WEIGHTS:
            snapshot = Path(hub.snapshot_download(name, allow_patterns=patterns))
            if any((snapshot / p).is_file() for p in patterns[1:3]):
                return snapshot
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.HFValidationError) as e:
        raise QuillError(
            f"{name} is neither a local directory nor a model on the Hugging Face Hub "
            f"({type(e).__name__}); check the name, e.g. gpt2, gpt2-medium, openai-community/gpt2"
        ) from None
    except (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError) as e:
        cache = hub.constants.HF_HUB_CACHE
        cause = e.__cause__ or e  # e.g. httpx's ConnectError behind LocalEntryNotFoundError
        why = "HF_HUB_OFFLINE is set" if hub.constants.HF_HUB_OFFLINE else f"{type(cause).__name__}: {cause}"
        raise QuillError(
            f"{name} is not a local directory, not in the Hugging Face cache ({cache}), and could not be "
            f"downloaded ({why}); on a machine with internet run `hf download {name} config.json "
            f"model.safetensors tokenizer.json --local-dir DIR` (`huggingface-cli download` before huggingface_hub 1.0), "
            f"copy DIR here, then run `quill import-hf DIR --out RUN_DIR`"
        ) from None
    raise QuillError(f"the Hub repository {name} has no model.safetensors or pytorch_model.bin")


def check_out_dir(out_dir: Path, ours: tuple[str, ...], force: bool, what: str) -> None:
    """Before any long work: --out must be a writable directory holding none of the files this
    command writes or removes (any one of them is someone's work), unless --force."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise QuillError(f"--out {shown(out_dir)} is a file; pass a directory")
    existing = [n for n in ours if os.path.lexists(out_dir / n)]  # os.path: no OSError for odd names
    if existing and not force:
        raise QuillError(
            f"--out {shown(out_dir)} already holds {what} ({', '.join(existing)}); choose another --out or pass --force to overwrite"
        )
    probe_writable(out_dir, "--out", create=False)  # made when the files are written: a failure leaves nothing


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
