"""A run's weights file: safetensors, written and read one tensor at a time, every byte checked.

Why safetensors and not the torch zip of ckpt.pt: a model larger than the free memory must be
written as it is converted and read straight into the layers that keep it, one tensor at a time,
and a safetensors file is a JSON header (names, dtypes, shapes, byte ranges) and the bytes: the
header is known before the first tensor is converted (`TensorWriter` takes the layout up front) and
any tensor is one read at its offset (`TensorFile.read`). It holds no pickle, and other tools read
it (the `safetensors` package reads these files as its own). The `safetensors` package itself
writes only a whole dict held in memory, and reads through a memory map whose pages count against
the process as they are touched; so the few lines of the format are here.

Every tensor's CRC-32 is in the header's metadata (written last, in place: fixed-width fields), and
`read` checks it: a flipped or truncated byte is one QuillError naming the file, never silently
wrong weights.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from quillgpt import huge_pages
from quillgpt.errors import QuillError
from quillgpt.files import os_error, shown

FORMAT = "quillgpt-weights-v1"
ALIGN = 64  # each tensor starts at a multiple of this in the file (the header is padded to it too)
MAX_HEADER = 100 << 20  # a header past 100 MB is not one quill wrote
DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
NAME_OF = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its dtype, shape and where its bytes are (from the data's start)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _layout(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, Entry]:
    entries, at = {}, 0
    for name, dtype, shape in specs:
        if name in entries:
            raise ValueError(f"tensor {name} is named twice")
        pad = (-at) % ALIGN
        if pad:  # safetensors allows no holes: the padding is a tensor of its own
            entries[f"__pad{len(entries)}"] = Entry(torch.uint8, (pad,), at, at + pad)
            at += pad
        size = math.prod(shape) * dtype.itemsize
        entries[name] = Entry(dtype, tuple(shape), at, at + size)
        at += size
    return entries


class TensorWriter:
    """Writes a file of the tensors `specs` names (name, dtype, shape), in that order, each given to
    `write` as it is made; `close` fills in the checksums. Used as a context manager, a failure
    leaves the partial file for the caller's made_dir to remove."""

    def __init__(self, path: str | Path, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> None:
        self.path, self.entries = Path(path), _layout(specs)
        self.names = [n for n in self.entries if not n.startswith("__pad")]
        self.metadata = {"format": FORMAT, **metadata, "crc32": json.dumps(dict.fromkeys(self.names, "00000000"))}
        self._order, self._next, self._crc = list(self.entries.items()), 0, {}  # (name, Entry) in file order
        try:
            self.f = open(self.path, "wb")  # noqa: SIM115 — closed in close()
            self.f.write(self._header())
        except OSError as e:
            raise os_error(e, self.path, "write", "weights file") from None

    def _header(self) -> bytes:
        header = {"__metadata__": self.metadata}
        for name, e in self.entries.items():
            header[name] = {"dtype": NAME_OF[e.dtype], "shape": list(e.shape), "data_offsets": [e.start, e.end]}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((-(8 + len(text))) % ALIGN)
        return struct.pack("<Q", len(text)) + text

    def write(self, name: str, t: torch.Tensor) -> None:
        """The next tensor of the layout: its name, dtype and shape must be the planned ones."""
        while self._next < len(self._order) and self._order[self._next][0].startswith("__pad"):
            pad = self._order[self._next][1]
            self.f.write(bytes(pad.end - pad.start))
            self._next += 1
        want, e = self._order[self._next] if self._next < len(self._order) else (None, None)
        if name != want or t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise ValueError(f"wrote {name} {t.dtype} {tuple(t.shape)}; the layout's next is {want} {e}")
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._crc[name] = f"{zlib.crc32(data):08x}"
        try:
            self.f.write(data.data)
        except OSError as err:
            raise os_error(err, self.path, "write", "weights file") from None
        self._next += 1

    def close(self) -> None:
        """Check every tensor was written, write the checksums into the header, and close."""
        missing = [n for n in self.names if n not in self._crc]
        if missing:
            self.f.close()
            raise ValueError(f"{len(missing)} tensors were never written (e.g. {missing[0]})")
        self.metadata["crc32"] = json.dumps(self._crc)
        try:
            self.f.seek(0)
            self.f.write(self._header())  # the same length: fixed-width checksums
            self.f.flush()
            os.fsync(self.f.fileno())
        except OSError as e:
            raise os_error(e, self.path, "write", "weights file") from None
        finally:
            self.f.close()

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        else:
            self.f.close()


class TensorFile:
    """A weights file opened for reading: its header checked whole before any tensor is read."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._damaged = f"{shown(self.path)} is damaged ({{}}); write it again (quill quantize, quill import-gguf)"
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= min(MAX_HEADER, size - 8):
                    raise QuillError(self._damaged.format("no safetensors header"))
                raw = f.read(n)
        except OSError as e:
            raise os_error(e, self.path, "read", "weights file") from None
        self.data_start = 8 + n
        self.entries, self.metadata = self._parse(raw, size - self.data_start)

    def _parse(self, raw: bytes, data_size: int) -> tuple[dict[str, Entry], dict[str, str]]:
        try:
            header = json.loads(raw)
            meta = header.pop("__metadata__", {}) if isinstance(header, dict) else None
            crcs = json.loads(meta.get("crc32", "{}")) if isinstance(meta, dict) else None
        except (ValueError, UnicodeDecodeError, TypeError) as e:
            raise QuillError(self._damaged.format(f"its header is not JSON: {str(e)[:60]}")) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(crcs, dict):
            raise QuillError(f"{shown(self.path)} is not a quill weights file (no {FORMAT!r} marker)")
        entries = {name: self._entry(name, e) for name, e in header.items()}
        at = 0
        for name, e in sorted(entries.items(), key=lambda kv: kv[1].start):
            if e.start != at:  # no gap, no overlap: every byte is one tensor's
                raise QuillError(self._damaged.format(f"tensor {str(name)[:60]} has a bad dtype, shape or byte range"))
            at = e.end
        if at != data_size:
            raise QuillError(self._damaged.format(f"it holds {data_size:,} bytes of tensors, its header says {at:,}: truncated?"))
        entries = {n: e for n, e in entries.items() if not n.startswith("__pad")}
        if set(crcs) != set(entries):
            raise QuillError(self._damaged.format("its checksums do not name its tensors"))
        self._crc = crcs
        return entries, meta

    def _entry(self, name: str, e: object) -> Entry:
        """One header entry, typed: its byte range as long as its dtype and shape make it."""
        try:
            dtype, shape, (start, end) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, start, end))
            ok = ok and end - start == math.prod(shape) * dtype.itemsize
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise QuillError(self._damaged.format(f"tensor {str(name)[:60]} has a bad dtype, shape or byte range"))
        return Entry(dtype, shape, start, end)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read into memory of its own (in huge pages where it spans them: a decode step
        streams it) and checked against its CRC-32."""
        e = self.entries[name]
        t = huge_pages.empty(e.shape, e.dtype)
        buf = t.reshape(-1).view(torch.uint8).numpy()
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + e.start)
                got = f.readinto(memoryview(buf))
        except OSError as err:
            raise os_error(err, self.path, "read", "weights file") from None
        if got != e.end - e.start or f"{zlib.crc32(buf):08x}" != self._crc[name]:
            raise QuillError(self._damaged.format(f"{name} fails its CRC check: bytes on disk changed"))
        return t
