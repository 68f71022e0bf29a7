"""Writing files so that a crash never leaves half of one: temp file, fsync, rename."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

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
    """One line for an OSError on a user's path: 'cannot read data.path /x: Permission denied';
    a full disk names the file system: 'no space left on /data (...)'."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return QuillError(
            f"cannot {action} {what} {shown(path)}: no space left on {mount_point(path)} (the file "
            "system it is on); free disk space or write elsewhere, then run again"
        )
    reason = e.strerror or str(e) or type(e).__name__
    return QuillError(f"cannot {action} {what} {shown(path)}: {reason}")


def mount_point(path: str | Path) -> str:
    """The mount point of the file system `path` is (or would be) on, e.g. /data."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        dev = p.stat().st_dev
        while p != p.parent and p.parent.stat().st_dev == dev:
            p = p.parent
    except OSError:
        pass
    return shown(p)


SPECIAL_FILES = {stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket"}


def check_input(path: str | Path, what: str, directory: bool = False) -> os.stat_result:
    """The one check where a path the user names as an input enters: a regular file (or, with
    `directory`, a directory). A device, FIFO or socket is refused by name: /dev/zero never ends
    and a FIFO waits for a writer, so reading either would hang. Raises FileNotFoundError for a
    missing path (the caller words it) and other OSErrors as they come."""
    path = Path(path)
    if "\0" in str(path):  # no file system has such a name (os.stat raises ValueError for it)
        name = shown(str(path).replace("\0", "\\0"))
        raise QuillError(f"{what} {name} has a NUL byte in its name, which no file has: is the name damaged?")
    st = path.stat()  # follows symlinks: a link to /dev/zero is /dev/zero
    kind = SPECIAL_FILES.get(stat.S_IFMT(st.st_mode))
    if kind is not None:
        raise QuillError(f"{what} {shown(path)} is {kind}, not a file; pass a file")
    if stat.S_ISDIR(st.st_mode) and not directory:
        raise QuillError(f"{what} {shown(path)} is a directory; pass a file")
    return st


def input_file(path: str | Path, what: str) -> bool:
    """Whether an input file is there (False: nothing at `path`); a device, FIFO, socket or
    directory there is refused by name, an unreadable path is one QuillError."""
    try:
        check_input(path, what)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise os_error(e, path, "read", what) from None
    return True


def read_bytes(path: str | Path, what: str = "file", hint: str = "", limit: int | None = None) -> bytes:
    """The whole file, or a QuillError naming `what` (e.g. '--config'), the path and the reason.

    `hint` follows the "does not exist" message (how to get the file); a file longer than
    `limit` bytes is refused after reading limit + 1 bytes; a device or FIFO is refused unread.
    """
    path = Path(path).expanduser()
    try:
        check_input(path, what)
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


def read_json(path: str | Path, what: str = "file", limit: int = 1 << 26, kind: str = "valid JSON", hint: str = "") -> Any:
    """A JSON file's value, or one QuillError naming the file: unreadable, over `limit` bytes,
    not UTF-8, not JSON, or nested too deeply (`kind` says what it should have been)."""
    text = read_text(path, what, hint, limit)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError is a ValueError; so is an integer of over 4,300 digits)
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:100]
        why = why if isinstance(e, (json.JSONDecodeError, RecursionError)) else f"a number too long to read: {why[:60]}"
        raise QuillError(f"{shown(path)} is not {kind} ({why})") from None


def read_json_object(path: str | Path, what: str = "file", limit: int = 1 << 26) -> dict[str, Any]:
    """read_json of a file that must hold a JSON object."""
    data = read_json(path, what, limit)
    if not isinstance(data, dict):
        raise QuillError(f"{shown(path)} must be a JSON object")
    return data


def output_path(path: str | Path, what: str) -> Path:
    """An output's path as the user gave it, refused when it is empty or only whitespace (Path("")
    is the current directory: `-o ''` would write there). Every output check starts here."""
    if isinstance(path, str) and not path.strip():
        raise QuillError(f"{what} is {'empty' if not path else 'only whitespace'}; give a file or directory name")
    return Path(path)


def probe_writable(directory: str | Path, what: str = "output directory", create: bool = True) -> Path:
    """Create `directory` if needed and prove a file can be written there, before long work starts.

    Uses an unnamed temp file: nothing to clean up after a kill, no clash with another process.
    With create=False a missing directory is not made: its nearest existing parent is probed
    instead, and the names still to be made are checked for length (a failed command leaves nothing).
    """
    directory = output_path(directory, what)
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


@contextlib.contextmanager
def made_dir(directory: Path, what: str = "--out") -> Iterator[None]:
    """Create `directory` for the writes in the `with` body; when they fail (a full disk...), the
    directories this made are removed again: a failed command leaves no empty output behind."""
    path = Path(os.path.abspath(directory))
    try:
        existing = _existing_parent(path)
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, directory, "create", what) from None
    created = None if existing == path else existing / path.relative_to(existing).parts[0]  # the highest one made
    try:
        yield
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


# --- outputs: a path quill writes never replaces what it must not -----------------------------
# Every output names its kind; an existing file at its path is replaced only when it is of that
# kind (an earlier output of the same command), not a file of a run, a dataset or an HF model,
# and not the command's own input, unless the user passes --force.

HEAD_BYTES = 1 << 20  # how much of an existing file its kind is told from


def _json_head(head: bytes, marker: bytes) -> bool:
    return head.lstrip().startswith(b"{") and marker in head


OUTPUT_KINDS: dict[str, tuple[str, Callable[[bytes], bool]]] = {  # kind → (what it is, does a file's head look like it)
    "png": ("a PNG image", lambda head: head.startswith(b"\x89PNG\r\n\x1a\n")),
    "svg": ("an SVG image", lambda head: b"<svg" in head[:4096]),
    "heads-json": ("a head summary of quill attention", lambda head: _json_head(head, b'"heads": [')),
    "tokenizer": ("a quill tokenizer file", lambda head: _json_head(head[:512], b'"format": "quillgpt-tokenizer"')),
    "config": ("a quill config", lambda head: re.search(rb"^(?:data|model|train|sample):", head, re.M) is not None),
    "metrics": ("a metrics log", lambda head: head.lstrip().startswith(b"{")),
    "checkpoint": ("a checkpoint", lambda head: head.startswith(b"PK\x03\x04")),
    "lm-eval-results": ("lm-eval's results of quill eval --tasks", lambda head: _json_head(head, b'"results":')),
    "manifest": ("a prepared dataset's meta.json", lambda head: _json_head(head, b'"shards"') or _json_head(head, b'"train_tokens"')),
}

# Directories whose files are someone's work: (files that mark one, the names it owns).
DATASET_LOCK = ".prepare.lock"  # a prepare holds it while it writes (data/prepare.py)
DATASET_STATE = ".prepare-state.json"  # a prepare in progress: plan, tokenizer, finished shards, cursor
SHARD_FILE = re.compile(r"(?:train|val)(?:-\d{6})?(?:\.flags)?\.bin")  # token shards and their chat flags

OWNERS: dict[str, tuple[tuple[str, ...], re.Pattern[str]]] = {
    "run": (
        ("ckpt.pt", "best.pt", "metrics.jsonl"),
        re.compile(r"ckpt\.pt|best\.pt|config\.yaml|tokenizer\.json|metrics\.jsonl|\.lock|events\.out\.tfevents\..*"),
    ),
    "dataset": (
        ("meta.json", DATASET_STATE),
        re.compile(rf"meta\.json|{re.escape(DATASET_STATE)}|{re.escape(DATASET_LOCK)}|{SHARD_FILE.pattern}"),
    ),
    "HF model": (
        ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"),
        re.compile(
            r"config\.json|generation_config\.json|.*\.safetensors|pytorch_model.*\.bin|.*\.index\.json|"
            r"tokenizer(?:_config)?\.json|vocab\.json|merges\.txt|special_tokens_map\.json|quill_tokenizer\.json"
        ),
    ),
}


def owner(path: str | Path) -> str | None:
    """'run', 'dataset' or 'HF model' when `path` is one of the files such a directory owns;
    None for any other path."""
    path = Path(path)
    for name, (marks, owned) in OWNERS.items():
        if owned.fullmatch(path.name) and any(os.path.isfile(path.parent / m) for m in marks):
            return name
    return None


def of_kind(path: str | Path, kind: str) -> bool:
    """Whether the existing file at `path` is of output kind `kind` (an empty file is of any)."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    return head == b"" or OUTPUT_KINDS[kind][1](head)


def check_output_file(
    path: str | Path, what: str, kind: str | None = None, force: bool = False, inputs: tuple[str | Path, ...] = (), fresh: bool = False
) -> Path:
    """Refuse, before long work starts, an output file that cannot or must not be written: a
    directory, a device or pipe, one of the command's `inputs`, a name the file system refuses, a
    directory that cannot be written; and without `force`, an existing file of a run, a dataset
    or an HF model, one that is not of the output's `kind` (None: any existing file), or with
    `fresh` any existing file. Creates the directory."""
    path = output_path(path, what)
    try:
        exists = path.exists() or path.is_symlink()
        if path.is_dir():
            raise QuillError(f"{what} {shown(path)} is a directory; pass a file name")
        if exists and not stat.S_ISREG(path.stat().st_mode):  # /dev/zero, a FIFO: renaming over it replaces it
            raise QuillError(f"{what} {shown(path)} is not a regular file (a device, pipe or socket); pass a file name")
        refuse_onto_inputs([path], inputs, what)
        if exists and not force:
            _check_replaceable(path, what, kind, fresh)
    except OSError as e:  # e.g. a name longer than the file system allows
        raise os_error(e, path, "write", what) from None
    if len(path.name.encode()) > 255 - 16:  # room for atomic_write's temp name beside it
        raise QuillError(f"cannot write {what} {shown(path)}: File name too long")
    probe_writable(path.parent, f"the directory of {what}")
    return path


def check_output_dir(
    directory: str | Path, what: str, own: str, writes: dict[str, str | None], force: bool, how: str = "pass --force"
) -> None:
    """Refuse, before long work starts, a directory output (a run, a dataset: `own`) holding
    files it would replace that are not its own: a file another kind of directory owns (an HF
    model's tokenizer.json given as a run's), or, in a directory not yet marked as `own`, a file
    that is not of its kind. `writes`: the names the command writes (regular expressions) →
    their output kind (None: told by the directory only). `how`: the user's way to force it."""
    directory = output_path(directory, what)
    if force or not os.path.isdir(directory):
        return
    marks = OWNERS[own][0]
    ours = any(os.path.isfile(directory / m) for m in marks)
    for entry in sorted(os.listdir(directory)):
        kind = next((k for name, k in writes.items() if re.fullmatch(name, entry)), "-")
        path = directory / entry
        if kind == "-" or not os.path.isfile(path):
            continue
        held = owner(path)
        if held not in (None, own) or (not ours and (kind is None or not of_kind(path, kind))):
            whose = f"a file of the {held} there" if held not in (None, own) else f"not a {own}'s file"
            raise QuillError(f"{what} {shown(directory)} holds {entry}, {whose}; choose another {what}, or {how} to replace it")


def _check_replaceable(path: Path, what: str, kind: str | None, fresh: bool) -> None:
    held = owner(path)
    if held is not None:
        raise QuillError(
            f"{what} {shown(path)} is a file of the {held} in {shown(path.parent)}; write elsewhere, or pass --force to replace it"
        )
    if fresh:
        raise QuillError(f"{what} {shown(path)} already exists; choose another name or pass --force to overwrite it")
    if kind is None or not of_kind(path, kind):
        shape = f"not {OUTPUT_KINDS[kind][0]}" if kind is not None else "not an output of this command"
        raise QuillError(f"{what} {shown(path)} exists and is {shape}; choose another name, or pass --force to replace it")


def refuse_onto_inputs(outputs: Iterable[str | Path], inputs: Iterable[str | Path], what: str) -> None:
    """--force replaces an earlier output, never what the same command reads: an output that is
    one of `inputs` (paths resolved, symbolic and hard links followed) is refused before anything
    is written. Every command with an output and --force calls this with the files it writes."""
    inputs = [Path(i) for i in inputs]
    for out in outputs:
        same = next((i for i in inputs if _same_file(Path(out), i)), None)
        if same is not None:
            it = "it" if os.path.abspath(out) == os.path.abspath(same) else f"it as {shown(same)}"
            raise QuillError(
                f"{what} {shown(out)} is also the input; write the output to another file (this command reads {it}; "
                "--force never replaces a command's own input)"
            )


def _same_file(a: Path, b: Path) -> bool:
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, ValueError):  # ValueError: a NUL in a name
        return False


def write_file(path: str | Path, write: Callable[[BinaryIO], object], what: str) -> None:
    """atomic_write to a user's path; an OSError becomes one QuillError naming `what` and the path."""
    try:
        atomic_write(path, write)
    except OSError as e:
        raise os_error(e, path, "write", what) from None
