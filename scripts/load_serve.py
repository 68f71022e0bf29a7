"""Load test for `quill serve`: concurrent streaming clients on the loopback interface.

Starts `quill serve` on 127.0.0.1 (a free port) for --ckpt, or uses a running server given by
--url (loopback addresses only), then runs three phases with the same sampling settings:

  1 client      one client, --requests-per-client requests of --tokens tokens, one after another
  16 clients    16 clients doing the same at once: aggregate tokens/s vs 1 client (target ≥ 3×)
  32 mixed      32 clients, mixed prompts and max_tokens (1/8 .. 3/4 of block_size, at most 256)

Requests stay within block_size, where every decode step is one batched step (past it a
learned-position model re-prefills each row every step, which batching does not speed up).
Every response must be a well-formed stream (status 200, `data:` JSON events with one id,
finish_reason null until the last chunk, a usage chunk, `data: [DONE]`) with as many tokens as
its usage says, else the exit code is 1. Each phase reports requests/s, aggregate completion
tokens/s and p50/p95 time to first token; the whole run is bounded by --time-limit.

    python scripts/load_serve.py --ckpt out/shakespeare_char_cpu
    python scripts/load_serve.py --ckpt out/shakespeare_char_cpu --quantize int8   # int8 linears
    python scripts/load_serve.py --ckpt out/smollm2 --quantize int8 --compile --tokens 64 --max-batch 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from harness import add_common, load_line, machine_line, serve, tiny_run

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROMPTS = [
    "ROMEO:",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "To be, or not to be",
    "KING HENRY:\nOnce more unto the breach",
    "\n",
    "JULIET:\nO Romeo, Romeo!",
]
MIXED_FRACTIONS = [1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4]  # of block_size, for the mixed phase
MAX_MIXED_TOKENS = 256


@dataclass
class Phase:
    name: str
    clients: int
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> str:
        p50 = 1000 * statistics.median(self.ttft) if self.ttft else float("nan")
        p95 = 1000 * _percentile(self.ttft, 0.95) if self.ttft else float("nan")
        return (
            f"{self.name:<12} {self.clients:>7} {self.requests:>8} {self.tokens:>8} {self.seconds:>8.1f} "
            f"{self.requests / self.seconds:>7.2f} {self.tokens / self.seconds:>9.1f} {p50:>9.0f} {p95:>9.0f}"
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def figures(self) -> dict:
        p50, p95 = (1000 * f(self.ttft) if self.ttft else None for f in (statistics.median, lambda t: _percentile(t, 0.95)))
        counts = {"name": self.name, "clients": self.clients, "requests": self.requests, "tokens": self.tokens}
        return counts | {"seconds": self.seconds, "tokens_per_s": self.tokens_per_s, "ttft_p50_ms": p50, "ttft_p95_ms": p95}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_request(http: httpx.AsyncClient, phase: Phase, body: dict) -> None:
    """Stream one completion, check it is well-formed, record its tokens and time to first token."""
    t0, first, ids, finishes, usage, events = time.perf_counter(), None, set(), [], None, []
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                phase.errors.append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                return
            buffer = ""
            async for text in r.aiter_text():
                buffer += text
                *done, buffer = buffer.split("\n\n")
                for event in done:
                    events.append(event)
                    if not event.startswith("data: {"):
                        continue
                    chunk = json.loads(event[6:])
                    ids.add(chunk["id"])
                    if chunk["choices"]:
                        finishes.append(chunk["choices"][0]["finish_reason"])
                        if first is None and chunk["choices"][0]["text"]:
                            first = time.perf_counter() - t0
                    else:
                        usage = chunk["usage"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        phase.errors.append(f"{type(e).__name__}: {e}")
        return
    problems = []
    if not events or events[-1] != "data: [DONE]" or buffer:
        problems.append("the stream does not end with data: [DONE]")
    if any(not e.startswith("data: ") for e in events):
        problems.append("an event that is not a data: line")
    if len(ids) != 1:
        problems.append(f"{len(ids)} ids in one stream")
    if not finishes or any(f is not None for f in finishes[:-1]) or finishes[-1] not in ("stop", "length"):
        problems.append(f"finish_reason sequence ends {finishes[-3:]}")
    if usage is None or not 0 < usage["completion_tokens"] <= body["max_tokens"]:
        problems.append(f"usage {usage}")
    elif finishes and finishes[-1] == "length" and usage["completion_tokens"] != body["max_tokens"]:
        problems.append(f"length finish after {usage['completion_tokens']} of {body['max_tokens']} tokens")
    if problems:
        phase.errors.append("; ".join(problems))
        return
    phase.requests += 1
    phase.tokens += usage["completion_tokens"]
    phase.ttft.append(first if first is not None else time.perf_counter() - t0)


async def run_phase(url: str, phase: Phase, bodies: list[list[dict]], deadline: float) -> Phase:
    """bodies[c] = the requests client c sends one after another; all clients start together."""
    limits = httpx.Limits(max_connections=phase.clients + 4, max_keepalive_connections=phase.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as http:

        async def client(mine: list[dict]) -> None:
            for body in mine:
                await one_request(http, phase, body)

        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(client(b) for b in bodies)), timeout=max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            phase.errors.append("the --time-limit ran out during this phase")
        phase.seconds = time.perf_counter() - t0
    return phase


def bodies_for(clients: int, per_client: int, tokens: int | None, rng: random.Random, model: dict) -> list[list[dict]]:
    """Requests of each client. tokens None: mixed prompts and lengths, each request kept within
    the model's context (prompt characters + max_tokens ≤ block_size; BPE prompts are shorter)."""
    block, out = model["block_size"], []
    for c in range(clients):
        mine = []
        for i in range(per_client):
            prompt = PROMPTS[0] if tokens is not None else rng.choice(PROMPTS)
            n = tokens if tokens is not None else rng.choice(MIXED_FRACTIONS) * block
            n = max(4, min(int(n), MAX_MIXED_TOKENS, block - len(prompt)))
            sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 1000 * c + i}
            stream = {"stream": True, "stream_options": {"include_usage": True}}
            mine.append({"model": model["id"], "prompt": prompt, "max_tokens": n} | sampling | stream)
        out.append(mine)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--ckpt", help="run directory or .pt file: start `quill serve` on 127.0.0.1 for it")
    where.add_argument("--url", help="a running server on a loopback address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--max-batch", type=int, default=32, help="--max-batch of the server this script starts")
    parser.add_argument("--device", default="auto", help="--device of the server this script starts")
    parser.add_argument("--quantize", default="none", help="--quantize of the server this script starts (int8, int8-channel, int4 or none)")
    parser.add_argument("--compile", action="store_true", help="start the server with --compile (its decode step compiled)")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--tokens", type=int, help="max_tokens in the 1- and 16-client phases (default: half the model's block_size)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole run")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    add_common(parser)
    args = parser.parse_args()
    if args.url is not None and urlparse(args.url).hostname not in LOOPBACK:
        sys.exit(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {args.url}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # a tiny random run served, one short request a client
            args.ckpt, args.url, args.requests_per_client, args.tokens = str(tiny_run(Path(tmp) / "tiny", block_size=64)), None, 1, 4
        elif args.ckpt is None and args.url is None:
            sys.exit("error: --ckpt RUN or --url URL is needed, or --smoke")
        print(f"{machine_line()}\n{load_line('before')}", flush=True)
        flags = ["--max-batch", str(args.max_batch), "--device", args.device, "--quantize", args.quantize] + ["--compile"] * args.compile
        proc, url, _ = serve(args.ckpt, *flags) if args.ckpt is not None else (None, args.url, [])
        try:
            warm, phases = run_phases(url, args)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    sys.exit(report(warm, phases, args))


def run_phases(url: str, args: argparse.Namespace) -> tuple[Phase, list[Phase]]:
    """The warm-up, then the three phases, within --time-limit."""
    deadline = time.monotonic() + args.time_limit
    warm = Phase("warm-up", 2)
    phases = [Phase("1 client", 1), Phase("16 clients", 16), Phase("32 mixed", 32)]
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    rng = random.Random(0)
    asyncio.run(run_phase(url, warm, bodies_for(2, 1, 16, rng, model), deadline))
    n = args.requests_per_client
    tokens = args.tokens or model["block_size"] // 2
    plans = [bodies_for(1, n, tokens, rng, model), bodies_for(16, n, tokens, rng, model), bodies_for(32, n, None, rng, model)]
    for phase, plan in zip(phases, plans):
        asyncio.run(run_phase(url, phase, plan, deadline))
    return warm, phases


def report(warm: Phase, phases: list[Phase], args: argparse.Namespace) -> int:
    """The table (and --json's object); 1 if any response was malformed."""
    print(
        f"{'phase':<12} {'clients':>7} {'requests':>8} {'tokens':>8} {'seconds':>8} {'req/s':>7} "
        f"{'tokens/s':>9} {'ttft p50':>9} {'ttft p95':>9}  (ms)"
    )
    for phase in phases:
        print(phase.row())
    speedup = phases[1].tokens_per_s / phases[0].tokens_per_s if phases[0].tokens_per_s else float("nan")
    print(f"aggregate tokens/s, 16 clients vs 1 client: {speedup:.2f}x (target ≥ 3x); {load_line('after')}")
    errors = [f"{p.name}: {e}" for p in [warm, *phases] for e in p.errors]
    for e in errors[:20]:
        print("error:", e, file=sys.stderr)
    if args.json:
        print(json.dumps({"phases": [p.figures() for p in phases], "speedup_16_vs_1": speedup, "errors": len(errors)}))
    return 1 if errors else 0


if __name__ == "__main__":
    main()
