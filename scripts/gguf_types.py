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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quillgpt.evaluate.scores import evaluate_text  # noqa: E402
from quillgpt.interop.gguf_family import WRITE_TYPES  # noqa: E402
from quillgpt.interop.gguf_read import import_gguf  # noqa: E402
from quillgpt.interop.gguf_write import export_gguf  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402


def loss(run_dir: Path, text: str, which: str, stride: int | None) -> float:
    run = load_run(run_dir, which=which)
    r = evaluate_text(run.model, run.tokenizer, text, stride=stride)
    return r.nats / r.tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--chars", type=int, default=8000)
    p.add_argument("--which", default="latest")
    p.add_argument("--stride", type=int, default=None)
    p.add_argument("--types", nargs="+", default=list(WRITE_TYPES))
    a = p.parse_args()
    text = a.text.read_text()[: a.chars]
    own = loss(a.run, text, a.which, a.stride)
    print(f"| type | MB | nats/token | change vs the run ({own:.5f}) |\n|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.types:
            path = export_gguf(a.run, Path(tmp) / f"{kind}.gguf", kind=kind, which=a.which).path
            mb = path.stat().st_size / 1e6
            import_gguf(path, Path(tmp) / kind)
            got = loss(Path(tmp) / kind, text, "latest", a.stride)
            print(f"| {kind} | {mb:.1f} | {got:.5f} | {100 * (got - own) / own:+.3f}% |", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
