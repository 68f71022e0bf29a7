"""A corpus named by URL: downloaded once into data/downloads/, checked against its sha256."""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.parse
import urllib.request
from pathlib import Path

from tqdm import tqdm

from quillgpt.config import DataConfig
from quillgpt.errors import QuillError

DOWNLOAD_DIR = Path("data") / "downloads"  # relative to where `quill` runs; git-ignored


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def download(url: str, sha256: str | None, dest: str | Path, progress: bool = True) -> Path:
    """Fetch `url` to `dest` once (temp file, checksum, rename); later calls reuse the file."""
    dest = Path(dest)
    by_hand = f"download it yourself and place it at {dest.resolve()}"
    expected = sha256.lower() if sha256 else None
    if dest.is_file():
        actual = sha256_file(dest)
        if expected is None or actual == expected:
            return dest
        raise QuillError(
            f"{dest} has sha256 {actual}, expected {expected} (data.sha256); delete it to download {url} again, or fix data.sha256"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
            size = int(r.headers.get("Content-Length") or 0) or None
            with tqdm(total=size, unit="B", unit_scale=True, desc=f"download {dest.name}", disable=not progress) as bar:
                while block := r.read(1 << 16):
                    f.write(block)
                    h.update(block)
                    bar.update(len(block))
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError is an OSError
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or e
        raise QuillError(f"could not download {url} ({reason}); {by_hand}, or point data.path= at a copy you have") from None
    actual = h.hexdigest()
    if expected is not None and actual != expected:
        tmp.unlink(missing_ok=True)
        raise QuillError(f"checksum mismatch for {url}: expected sha256 {expected}, got {actual}; {by_hand}, or fix data.sha256")
    os.replace(tmp, dest)
    return dest


def source_path(cfg: DataConfig, progress: bool = True) -> Path:
    """The local text file for `cfg`: data.path, else data.url downloaded into data/downloads/
    (neither: an imported model's config.yaml names no data until the user does)."""
    if cfg.path is not None:
        return Path(cfg.path)
    if cfg.url is None:
        raise QuillError("no data to prepare: set data.path (a local text file, folder or glob) or data.url (a file to download)")
    return download(cfg.url, cfg.sha256, download_path(cfg), progress)


def download_path(cfg: DataConfig) -> Path:
    """Where data.url is downloaded to: data/downloads/<the URL's file name>."""
    return DOWNLOAD_DIR / (Path(urllib.parse.urlparse(cfg.url).path).name or "download.txt")


def local_text(path: str | Path | None, root: str | Path = ".", flag: str = "--data-path") -> Path:
    """A script's text file: `path`, or by default the Tiny Shakespeare that the README's quickstart
    downloaded (root/data/downloads/input.txt); one QuillError naming both ways when it is missing."""
    if path is not None:
        found = Path(path)
        if not found.is_file():
            raise QuillError(f"{flag} {found}: no such file; pass the path of a text file")
        return found
    found = Path(root) / DOWNLOAD_DIR / "input.txt"
    if not found.is_file():
        raise QuillError(
            f"no Tiny Shakespeare at {found}: `quill train --config configs/quickstart.yaml` downloads it there, "
            f"or pass {flag} FILE (a copy you have)"
        )
    return found
