"""Figures without global state: matplotlib is optional (`pip install -e ".[plot]"`), imported
only when drawing, and only through `matplotlib.figure.Figure`, never pyplot: nothing global
such as the backend changes, PNGs are rendered by Agg and no display is needed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quillgpt.errors import QuillError
from quillgpt.files import check_output_file, write_file

INSTALL_HINT = 'plotting needs matplotlib, the optional "plot" extra: pip install -e ".[plot]"'


IMAGE_FORMATS = ("png", "svg")


def save_figure(fig: Any, out: Path, fmt: str, dpi: int, force: bool = False) -> None:
    """Write a figure whole or not at all; a path that cannot be written, or a file there that
    is not an image of this format (a run's checkpoint...) without `force`, is one QuillError."""
    check_output_file(out, "--out", kind=fmt, force=force)  # makes the directory too
    write_file(out, lambda f: fig.savefig(f, format=fmt, dpi=dpi), "--out")


@contextlib.contextmanager
def matplotlib_figure() -> Iterator[Any]:
    """matplotlib's Figure class, imported on first use, with text drawn literally.

    Token labels and run names may contain '$', which matplotlib would parse as TeX (and fail
    on); `text.parse_math` is read when each text is created, so drawing happens inside.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise QuillError(f"{INSTALL_HINT} (or use --format text, which needs nothing)") from None
    with matplotlib.rc_context({"text.parse_math": False}):
        yield Figure
