"""Writing files so that a crash never leaves half of one: temp file, fsync, rename."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from quillgpt.errors import QuillError


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(file)` on a temp file beside `path`, fsync, then rename over `path`.

    A crash at any point leaves either the old file or the new one, never a partial file;
    a writer that raises leaves no temp file behind.
    """
    path = Path(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # renaming over /dev/zero or a FIFO would replace it
            raise QuillError(f"{shown(path)} is not a regular file (a directory, device, pipe or socket); write elsewhere")
    except FileNotFoundError:
        pass
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


def read_bytes(path: str | Path, what: str = "file", hint: str = "", limit: int | None = None) -> bytes:
    """The whole file, or a QuillError naming `what` (e.g. '--config'), the path and the reason.

    `hint` follows the "does not exist" message (how to get the file); a file longer than
    `limit` bytes (e.g. /dev/zero given as a config) is refused after reading limit + 1 bytes.
    """
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise QuillError(f"{what} {shown(path)} is a directory; pass a file")
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):  # /dev/zero would never end, a disk is no text
            raise QuillError(f"{what} {shown(path)} is a device, not a file; pass a file")
        with open(path, "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise QuillError(f"{what} {shown(path)} does not exist{hint}") from None
        raise os_error(e, path, "read", what) from None
    if limit is not None and len(data) > limit:
        raise QuillError(f"{what} {shown(path)} is larger than {limit:,} bytes; is it the right file?")
    return data


def read_text(path: str | Path, what: str = "file", hint: str = "", limit: int | None = None) -> str:
    """The file as UTF-8 text, or one QuillError (unreadable, or not UTF-8 with the offset)."""
    data = read_bytes(path, what, hint, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuillError(f"{what} {shown(path)} is not UTF-8 text (invalid byte at offset {e.start})") from None


def probe_writable(directory: str | Path, what: str = "output directory", create: bool = True) -> Path:
    """Create `directory` if needed and prove a file can be written there, before long work starts.

    Uses an unnamed temp file: nothing to clean up after a kill, no clash with another process.
    With create=False a missing directory is not made: its nearest existing parent is probed
    instead, and the names still to be made are checked for length (a failed command leaves nothing).
    """
    directory = Path(directory)
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory if create else _existing_parent(directory)) as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as e:
        raise QuillError(f"{what} {shown(directory)} is not writable ({e.strerror}); choose another directory") from None
    return directory


def _existing_parent(directory: Path) -> Path:
    """The nearest directory of `directory`'s ancestry (itself included) that exists; raises
    the OSError mkdir would for a name too long or a parent that is a file."""
    missing = []
    while not os.path.isdir(directory):
        if os.path.lexists(directory):
            raise NotADirectoryError(20, "Not a directory")
        missing.append(directory.name)
        if directory.parent == directory:
            break
        directory = directory.parent
    if any(len(name.encode()) > 255 for name in missing):
        raise OSError(36, "File name too long")
    return directory


def check_output_file(path: str | Path, what: str, force: bool = True, inputs: tuple[str | Path, ...] = ()) -> Path:
    """Refuse, before long work starts, an output file that cannot or must not be written:
    a directory, one of the command's `inputs`, an existing file without `force`, a name the
    file system refuses, or a directory that cannot be written. Creates the directory."""
    path = Path(path)
    try:
        exists = path.exists() or path.is_symlink()
        if path.is_dir():
            raise QuillError(f"{what} {shown(path)} is a directory; pass a file name")
        if exists and not stat.S_ISREG(path.stat().st_mode):  # /dev/zero, a FIFO: renaming over it replaces it
            raise QuillError(f"{what} {shown(path)} is not a regular file (a device, pipe or socket); pass a file name")
        if exists and any(_same_file(path, Path(i)) for i in inputs):
            raise QuillError(f"{what} {shown(path)} is also the input; write the output to another file")
    except OSError as e:  # e.g. a name longer than the file system allows
        raise os_error(e, path, "write", what) from None
    if exists and not force:
        raise QuillError(f"{what} {shown(path)} already exists; choose another name or pass --force to overwrite it")
    if len(path.name.encode()) > 255 - 16:  # room for atomic_write's temp name beside it
        raise QuillError(f"cannot write {what} {shown(path)}: File name too long")
    probe_writable(path.parent, f"the directory of {what}")
    return path


def _same_file(a: Path, b: Path) -> bool:
    try:
        return b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def write_file(path: str | Path, write: Callable[[BinaryIO], object], what: str) -> None:
    """atomic_write to a user's path; an OSError becomes one QuillError naming `what` and the path."""
    try:
        atomic_write(path, write)
    except OSError as e:
        raise os_error(e, path, "write", what) from None
