"""Writing files so that a crash never leaves half of one: temp file, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from quillgpt.errors import QuillError


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(file)` on a temp file beside `path`, fsync, then rename over `path`.

    A crash at any point leaves either the old file or the new one, never a partial file;
    a writer that raises leaves no temp file behind.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- the I/O boundary: a path the user gave that cannot be read or written is their mistake ---

MAX_SHOWN_PATH = 160  # a 300-character name is shown cut, not in full


def shown(path: str | Path) -> str:
    """A path as error messages print it: cut in the middle when very long."""
    text = str(path)
    if len(text) <= MAX_SHOWN_PATH:
        return text
    half = MAX_SHOWN_PATH // 2 - 2
    return f"{text[:half]}...{text[-half:]}"


def os_error(e: OSError, path: str | Path, action: str, what: str) -> QuillError:
    """One line for an OSError on a user's path: 'cannot read data.path /x: Permission denied'."""
    reason = e.strerror or type(e).__name__
    return QuillError(f"cannot {action} {what} {shown(path)}: {reason}")


def read_bytes(path: str | Path, what: str = "file") -> bytes:
    """The whole file, or a QuillError naming `what` (e.g. '--config'), the path and the reason."""
    path = Path(path)
    try:
        if path.is_dir():
            raise QuillError(f"{what} {shown(path)} is a directory; pass a file")
        return path.read_bytes()
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise QuillError(f"{what} {shown(path)} does not exist") from None
        raise os_error(e, path, "read", what) from None


def read_text(path: str | Path, what: str = "file") -> str:
    """The file as UTF-8 text, or one QuillError (unreadable, or not UTF-8 with the offset)."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuillError(f"{what} {shown(path)} is not UTF-8 text (invalid byte at offset {e.start})") from None


def probe_writable(directory: str | Path, what: str = "output directory") -> Path:
    """Create `directory` if needed and prove a file can be written there, before long work starts.

    Uses an unnamed temp file: nothing to clean up after a kill, no clash with another process.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as e:
        raise QuillError(f"{what} {shown(directory)} is not writable ({e.strerror}); choose another directory") from None
    return directory
