"""A GGUF file is untrusted input: its structure is checked here before the `gguf` reader maps it,
and its tensors against what its metadata describes before anything is allocated or written.

`check_layout` walks the header itself, every count and length bounded by the bytes the file has
left (a metadata array that says 2^62 entries is one line, not a reader looping until memory runs
out), then checks each tensor's type, dims and data range (inside the file, aligned, overlapping
no other, rows a whole number of its type's blocks). `check_shapes` compares the tensors with the
shapes the model of the metadata needs (missing, extra, mis-shaped: one line each, naming the
tensor). `check_finite` names a quantization block whose scale is NaN or infinite, or a float
tensor holding such values, as damage of that tensor in the file: a GGUF file was never trained
here, so no message may blame a divergence.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quillgpt.errors import QuillError
from quillgpt.files import shown

MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # GGUF's, unless general.alignment says otherwise
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUFValueType → struct
STRING, ARRAY = 8, 9
# fp16 scale fields of each quantized type's block (byte offsets), as ggml-common.h lays them out
SCALE_BYTES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
SCAN_BLOCKS = 1 << 20  # blocks scanned for damage at a time: the temporaries stay a few MB


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it (dims innermost first, as ggml lists them)."""

    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int  # from the start of the data section


class _Header:
    """A cursor over the file's bytes; every read past the end is one QuillError naming `what`."""

    def __init__(self, path: Path, data: mmap.mmap | bytes) -> None:
        self.path, self.data, self.at, self.order = path, data, 0, "<"

    def damaged(self, what: str) -> QuillError:
        return QuillError(f"{shown(self.path)} is not a readable GGUF file ({what[:160]}); is it whole? download it again")

    def left(self) -> int:
        return len(self.data) - self.at

    def unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(self.order + fmt)
        if size > self.left():
            raise self.damaged(f"{what} runs past the end of the file")
        out = struct.unpack_from(self.order + fmt, self.data, self.at)
        self.at += size
        return out

    def count(self, what: str, least: int) -> int:
        """A u64 count of items of at least `least` bytes each, bounded by the bytes left."""
        (n,) = self.unpack("Q", what)
        if n * least > self.left():
            raise self.damaged(f"{what} says {n:,} entries but only {self.left():,} bytes follow")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1)
        raw = bytes(self.data[self.at : self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.damaged(f"{what} is not UTF-8") from None

    def value(self, kind: int, key: str, depth: int = 0) -> object:
        """A metadata value; arrays of scalars are skipped over (their size is known), others walked."""
        if kind == STRING:
            return self.string(f"the value of {key}")
        if kind in SCALARS:
            return self.unpack(SCALARS[kind], key)[0]
        if kind != ARRAY or depth > 2:
            raise self.damaged(f"{key} has value type {kind}, which GGUF does not define")
        (item,) = self.unpack("I", f"{key}'s item type")
        least = struct.calcsize(SCALARS[item]) if item in SCALARS else (8 if item == STRING else 12)
        n = self.count(f"{key}'s array count", least)
        if item in SCALARS:
            self.at += n * least
        else:
            for _ in range(n):
                self.value(item, key, depth + 1)
        return None


def check_layout(path: Path) -> None:
    """Walk the header: counts and lengths bounded by the file's size, then every tensor's type,
    dims and data range; one QuillError for the first thing that is wrong."""
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        data: mmap.mmap | bytes = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        _walk(_Header(path, data), size)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _walk(h: _Header, size: int) -> None:
    h.unpack("4s", "the magic")
    (version,) = h.unpack("I", "the version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        h.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise h.damaged(f"GGUF version {version}; quill reads versions 2 and 3")
    n_tensors = h.count("the tensor count", 24)
    n_keys = h.count("the metadata key count", 13)
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_keys):
        key = h.string("a metadata key")
        (kind,) = h.unpack("I", f"{key}'s type")
        value = h.value(kind, key)
        if key == "general.alignment":
            if kind != 4 or not value or value & (value - 1):
                raise h.damaged(f"general.alignment is {value!r}, not a power of two")
            alignment = value
    infos = [_tensor_info(h) for _ in range(n_tensors)]
    start = -(-h.at // alignment) * alignment
    _check_tensors(h, infos, start, alignment, size)


def _tensor_info(h: _Header) -> TensorInfo:
    name = h.string("a tensor name")
    (n_dims,) = h.unpack("I", f"tensor {name}'s dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise h.damaged(f"tensor {name} has {n_dims} dimensions; ggml's tensors have 1 to {MAX_DIMS}")
    dims = h.unpack("Q" * n_dims, f"tensor {name}'s dims")
    kind, offset = h.unpack("IQ", f"tensor {name}'s type and offset")
    return TensorInfo(name, dims, kind, offset)


def _check_tensors(h: _Header, infos: list[TensorInfo], start: int, alignment: int, size: int) -> None:
    """Each tensor's type known, dims positive, rows whole blocks, data aligned and inside the file,
    and no two tensors' data overlapping."""
    import gguf

    spans, names = [], set()
    for t in infos:
        if t.name in names:
            raise h.damaged(f"tensor {t.name} appears twice")
        names.add(t.name)
        try:
            qtype = gguf.GGMLQuantizationType(t.kind)
        except ValueError:
            raise h.damaged(f"tensor {t.name} has type number {t.kind}, which ggml does not define") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if min(t.dims) < 1 or math.prod(t.dims) > size * 8:
            raise h.damaged(f"tensor {t.name} has dims {list(t.dims)}, which no file of {size:,} bytes can hold")
        if t.dims[0] % block:
            raise QuillError(
                f"{shown(h.path)}: tensor {t.name} is {qtype.name} with rows of {t.dims[0]} weights, not a whole number "
                f"of its {block}-weight blocks: the file is damaged; download it again"
            )
        n_bytes = math.prod(t.dims) // block * type_size
        begin = start + t.offset
        if t.offset % alignment or begin + n_bytes > size:
            where = "is not aligned" if t.offset % alignment else f"runs past the end of the file ({size:,} bytes)"
            raise h.damaged(f"tensor {t.name}'s data (bytes {begin:,} to {begin + n_bytes:,}) {where}")
        spans.append((begin, begin + n_bytes, t.name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise h.damaged(f"tensors {a} and {b} overlap in the file")


def check_shapes(path: Path, have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]], optional: set[str], model: str) -> None:
    """The file's tensors (name → shape, PyTorch's order) are exactly those the model of its
    metadata (`model`, e.g. "2-layer model of its llama metadata") needs: `want`, of which
    `optional` may be absent."""
    missing = [n for n in want if n not in have and n not in optional]
    extra = sorted(set(have) - set(want))
    if missing or extra:
        what = f"missing {', '.join(missing[:3])}" if missing else f"it has {', '.join(extra[:3])} too"
        raise QuillError(
            f"{shown(path)}: the weights do not match a {model} ({what}): "
            "the file is damaged or its block_count is wrong; download it again"
        )
    for name, shape in want.items():
        if name in have and have[name] != shape:
            raise QuillError(
                f"{shown(path)}: tensor {name} is {_dims(have[name])}, but a {model} (embedding_length, head counts, "
                f"feed_forward_length, vocabulary) needs {_dims(shape)}: the file is damaged; download it again"
            )


def _dims(shape: tuple[int, ...]) -> str:
    return "×".join(str(d) for d in shape)


def damaged_block(raw: np.ndarray, qtype: str) -> int | None:
    """The index of the first block of a quantized tensor's bytes whose fp16 scale (or min) is
    NaN or infinite, or None."""
    if qtype not in SCALE_BYTES:
        return None
    import gguf

    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, size)
    for first in range(0, blocks.shape[0], SCAN_BLOCKS):
        chunk = blocks[first : first + SCAN_BLOCKS]
        for at in SCALE_BYTES[qtype]:
            bad = ~np.isfinite(np.ascontiguousarray(chunk[:, at : at + 2]).view(np.float16)[:, 0])
            if bad.any():
                return first + int(np.argmax(bad))
    return None


def check_finite(
    path: Path, name: str, qtype: str, raw: np.ndarray | None = None, values: np.ndarray | None = None, first_block: int = 0
) -> None:
    """A tensor's blocks (`raw`: its bytes, from block `first_block` on) or its values (`values`: as
    read or dequantized), refused by name where a scale or a value is NaN or infinite: damage in
    the file, not a trained model's."""
    block = None if raw is None else damaged_block(raw, qtype)
    if block is not None:
        raise QuillError(
            f"{shown(path)}: tensor {name}: block {first_block + block} has a non-finite scale ({qtype}): "
            "the file is damaged; download it again"
        )
    if values is not None and not np.isfinite(values).all():
        raise QuillError(f"{shown(path)}: tensor {name} ({qtype}) holds NaN or infinite values: the file is damaged; download it again")


FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16}
SCAN_BYTES = 1 << 24  # bytes of a tensor read at a time by scan_tensors


def scan_tensors(path: Path, tensors: list[tuple[str, str, int, int]]) -> None:
    """Every tensor's data (name, ggml type, offset, bytes) read in chunks (not mapped: mapped pages
    count in the process's memory) and checked by check_finite: a whole file's damage found before
    a byte is written."""
    import gguf

    with open(path, "rb") as fh:
        for name, qtype, offset, n_bytes in tensors:
            size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
            step = max(size, SCAN_BYTES // size * size)
            fh.seek(offset)
            for start in range(0, n_bytes, step):
                raw = np.frombuffer(fh.read(min(step, n_bytes - start)), dtype=np.uint8)
                if qtype == "BF16":
                    values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
                else:
                    values = raw.view(FLOAT_VIEWS[qtype]) if qtype in FLOAT_VIEWS else None
                check_finite(path, name, qtype, raw=None if values is not None else raw, values=values, first_block=start // size)
