"""How fast `quill prepare` tokenizes a corpus of many files, and how much memory it needs.

Writes a synthetic corpus (English-like words; half .jsonl, half .parquet files) of --size under
--dir, runs `prepare` on it with the GPT-2 tokenizer in a child process, and reports from the same
run its throughput (UTF-8 text MB per second of wall time: reading, tokenizing, writing), the peak
RSS of its process tree (the sampled sum, each process's own peak) and the baseline: tiktoken's
batch encoder (encode_ordinary_batch) in this process on a sample of the same documents. Targets:
peak RSS < 1 GB whatever the size; throughput ≥ 1.6 × the baseline on 2 cores. --keep keeps the corpus.

    python scripts/bench_prepare.py --size 1GB
    python scripts/bench_prepare.py --size 50MB --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import ROOT, add_common, load_line, machine_line, proc_status_kb

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will more about can said time people "
    "into them only other new some could these two may then do first any like now my such over also our made "
    "after years well where most through back much before must between under never world government because "
    "against during without however another great place system school small number water house children state "
    "October 1987 3.14 don't it's naïve café résumé 2024-05-01 http://example.com/a?b=c (see below) — “quoted” "
    "function return value index error data model training token language research university report city"
).split()
PARQUET_ROWS = 2048


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size like 50MB or 1GB, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])


def documents(rng: np.random.Generator, n_bytes: int):
    """Documents of 200-12,000 words (FineWeb-like lengths) until about n_bytes of UTF-8."""
    words = np.array(WORDS + [w + ".\n\n" for w in WORDS], dtype=object)  # second half: a paragraph ends
    done = 0
    while done < n_bytes:
        n = int(rng.integers(200, 12_000 if rng.random() < 0.1 else 1_500))
        idx = rng.integers(0, len(WORDS), n)
        idx[rng.random(n) < 0.02] += len(WORDS)  # a paragraph now and then
        doc = " ".join(words[idx].tolist())
        done += len(doc.encode("utf-8"))
        yield doc


def write_corpus(root: Path, total: int, file_bytes: int, seed: int) -> tuple[int, int, list[str]]:
    """(text bytes, documents, a sample of documents for the baseline); files alternate jsonl/parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    text_bytes, n_docs, sample, batch, index = 0, 0, [], [], 0
    gen = documents(rng, total)

    def flush() -> None:
        nonlocal batch, index
        if not batch:
            return
        if index % 2 == 0:
            with open(root / f"part-{index:04d}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": d, "id": f"{index}-{i}"}, ensure_ascii=False) + "\n" for i, d in enumerate(batch))
        else:
            pq.write_table(pa.table({"text": batch}), root / f"part-{index:04d}.parquet", row_group_size=PARQUET_ROWS)
        batch, index = [], index + 1

    size = 0
    for doc in gen:
        b = len(doc.encode("utf-8"))
        batch.append(doc)
        text_bytes, n_docs, size = text_bytes + b, n_docs + 1, size + b
        if sum(map(len, sample)) < 32_000_000 and n_docs % 3 == 0:
            sample.append(doc)
        if size >= file_bytes:
            flush()
            size = 0
    flush()
    return text_bytes, n_docs, sample


CHILD = """
import json, sys, time
from quillgpt.config import DataConfig
from quillgpt.data.prepare import prepare
cfg = DataConfig(path=sys.argv[1], tokenizer="gpt2", out_dir=sys.argv[2], workers=json.loads(sys.argv[3]))
t0 = time.perf_counter()
meta = prepare(cfg, force=True, progress=sys.argv[4] == "1").meta
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": meta["train_tokens"] + meta["val_tokens"],
                  "shards": sum(len(v) for v in meta["shards"].values())}))
"""


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_watched(cmd: list[str]) -> tuple[str, float, dict[int, int]]:
    """Run cmd; (stdout, peak of the summed RSS of its process tree in MB, {pid: peak RSS in MB}).
    The sum is sampled every 50 ms; each process's own peak is the kernel's VmHWM (exact).
    (ru_maxrss is no use here: Linux carries the parent's peak into a spawned child.)"""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    peak_sum, hwm = 0.0, {}
    while proc.poll() is None:
        pids = _tree(proc.pid)
        peak_sum = max(peak_sum, sum(proc_status_kb("VmRSS", p) or 0 for p in pids) / 1024)
        for p in pids:
            hwm[p] = max(hwm.get(p, 0), (proc_status_kb("VmHWM", p) or 0) / 1024)
        time.sleep(0.05)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"prepare failed with exit code {proc.returncode}")
    return out, peak_sum, hwm


def baseline(sample: list[str]) -> tuple[float, float]:
    """(MB/s, CPU seconds per MB) of tiktoken's batch encoder in this process on the sample."""
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    mb = sum(len(d.encode("utf-8")) for d in sample) / 1e6
    enc.encode_ordinary_batch(sample[:4])  # warm up
    t0, c0 = time.perf_counter(), time.process_time()
    enc.encode_ordinary_batch(sample)
    return mb / (time.perf_counter() - t0), (time.process_time() - c0) / mb


def bench(args: argparse.Namespace, work: Path, cores: int) -> None:
    """Write the corpus under `work`, time the baseline, then `prepare` in a child process; print it all."""
    corpus = work / "corpus"
    corpus.mkdir()
    t0 = time.perf_counter()
    text_bytes, n_docs, sample = write_corpus(corpus, args.size, args.file_size, args.seed)
    files = sorted(corpus.iterdir())
    disk, mb = sum(p.stat().st_size for p in files), text_bytes / 1e6
    print(
        f"corpus: {mb:,.1f} MB of text in {n_docs:,} documents, {len(files)} files "
        f"({disk / 1e6:,.1f} MB on disk) written in {time.perf_counter() - t0:.1f}s under {work}"
    )
    base_mbs, base_cpu = baseline(sample)
    sample_mb = sum(map(len, sample)) / 1e6
    print(f"baseline: tiktoken encode_ordinary_batch, one process: {base_mbs:.2f} MB/s (on {sample_mb:.1f} MB of the same documents)")
    cpu0 = _children_cpu()
    cmd = [sys.executable, "-c", CHILD, str(corpus), str(work / "tokens"), json.dumps(args.workers), "1" if args.progress else "0"]
    out_text, peak_sum, hwm = run_watched(cmd)
    r = json.loads(out_text.strip().splitlines()[-1])
    cpu, mbs, peaks = (_children_cpu() - cpu0) / mb, mb / r["seconds"], sorted(hwm.values(), reverse=True)
    print(
        f"prepare: {r['seconds']:.1f}s, {mbs:.2f} MB/s of text ({r['tokens']:,} tokens, {r['shards']} shards), "
        f"{cores} cores, workers={args.workers or cores}"
    )
    print(
        f"peak RSS: all processes together {peak_sum:,.0f} MB (sampled every 50 ms); per process "
        f"{', '.join(f'{m:,.0f}' for m in peaks[:6])} MB ({len(peaks)} processes)"
    )
    print(
        f"CPU per MB: prepare {cpu:.3f}s (all processes), baseline {base_cpu:.3f}s: on {cores} idle cores "
        f"prepare could reach {cores * base_cpu / cpu:.2f}x the baseline (a check that does not depend on load)"
    )
    ratio, ok_rss = mbs / base_mbs, peak_sum < 1024 and sum(peaks) < 1024
    print(
        f"targets: peak RSS < 1 GB (all processes together): {'PASS' if ok_rss else 'FAIL'}; "
        f"throughput {ratio:.2f}x the baseline (target ≥ 1.6x on 2 cores): {'PASS' if ratio >= 1.6 else 'FAIL'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GB"), help="corpus text size, e.g. 50MB, 1GB")
    ap.add_argument("--file-size", type=parse_size, default=parse_size("32MB"), help="text per file")
    ap.add_argument("--workers", type=int, default=None, help="data.workers (default: every core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the temporary corpus goes")
    ap.add_argument("--keep", action="store_true", help="keep the corpus and the shards")
    ap.add_argument("--progress", action="store_true", help="show prepare's progress bar")
    add_common(ap)
    args = ap.parse_args()
    if args.smoke:
        args.size, args.file_size, args.workers = parse_size("300KB"), parse_size("100KB"), 1
    print(f"{machine_line()}\n{load_line('before')}", flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    work = Path(tempfile.mkdtemp(prefix="quill_bench_prepare_", dir=args.dir))
    try:
        bench(args, work, cores)
        print(load_line("after"))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
