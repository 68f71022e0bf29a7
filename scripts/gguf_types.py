#!/usr/bin/env python
"""What each GGUF type of `quill export-gguf` costs: file size and loss against the run's own.

    python scripts/gguf_types.py RUN --text ../shared/data/tinyshakespeare.txt --chars 8000

For each --type (f32, f16, bf16, q8_0) the run is exported, imported back with `quill import-gguf`
(dequantized, as llama.cpp computes with them) and scored on the first --chars characters of the
text (`evaluate_text`, windows of the run's block size or --block); prints one markdown table: MB,
nats/token and the change against the run itself. Files go to a temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import add_common, text_path, tiny_run

from quillgpt.evaluate.scores import evaluate_text
from quillgpt.interop.gguf_family import WRITE_TYPES
from quillgpt.interop.gguf_read import import_gguf
from quillgpt.interop.gguf_write import export_gguf
from quillgpt.runs import load_run


def loss(run_dir: Path, text: str, which: str, stride: int | None) -> float:
    run = load_run(run_dir, which=which)
    r = evaluate_text(run.model, run.tokenizer, text, stride=stride)
    return r.nats / r.tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, nargs="?", help="a quill run (--smoke: a tiny random one)")
    p.add_argument("--chars", type=int, default=8000)
    p.add_argument("--which", default="latest")
    p.add_argument("--stride", type=int, default=None)
    p.add_argument("--types", nargs="+", default=list(WRITE_TYPES))
    add_common(p, text=True)
    a = p.parse_args()
    text = text_path(a.text).read_text()[: a.chars]
    with tempfile.TemporaryDirectory() as tmp:
        if a.smoke:
            a.run, a.which = tiny_run(Path(tmp) / "tiny", text), "latest"
        elif a.run is None:
            raise SystemExit("error: name a RUN, or --smoke")
        own = loss(a.run, text, a.which, a.stride)
        print(f"| type | MB | nats/token | change vs the run ({own:.5f}) |\n|---|---:|---:|---:|")
        for kind in a.types:
            path = export_gguf(a.run, Path(tmp) / f"{kind}.gguf", kind=kind, which=a.which).path
            mb = path.stat().st_size / 1e6
            import_gguf(path, Path(tmp) / kind)
            got = loss(Path(tmp) / kind, text, "latest", a.stride)
            print(f"| {kind} | {mb:.1f} | {got:.5f} | {100 * (got - own) / own:+.3f}% |", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
