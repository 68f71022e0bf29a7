"""Load test for chat servers: concurrent multi-turn conversations, quill beside llama.cpp's server.

Each conversation opens with one shared system prompt of about 300 tokens and runs --turns turns
(8): a question, the streamed reply, the reply sent back with the next question, as a chat client
does. --conversations (1, 4, 16) of them run at once, for each server in turn:

  --url URL       any running OpenAI-compatible server (loopback only)
  --ckpt RUN      a `quill serve` this script starts (its flags: --quantize, --max-batch, ...)
  --gguf FILE     `python -m llama_cpp.server --model FILE --n_threads N --interrupt_requests
                  False` this script starts (llama-cpp-python and its server extras), --llama-arg
                  for more of its flags. It serves one request at a time; by default a waiting
                  request interrupts the streaming one after its next chunk (a reply of one token
                  that still ends with [DONE]), so here requests queue and every reply is whole.

For each server and number of conversations it reports aggregate completion tokens/s, p50/p99
time to first token (TTFT) per turn, and the median TTFT of turns 2-8 against turn 1's (a prompt
cache makes later turns prefill only their new message; without one every turn re-reads the whole
conversation), side by side. Every turn must stream a reply that ends with a finish_reason and
[DONE], else the exit code is 1. --system long opens each conversation with about 800 tokens
instead (the short prompt and house rules after it). The user messages name their conversation, so no two conversations share more than
the system prompt; the loads run one after another on the same servers, so a server with a prompt
cache finds the system prompt in it from the second load on (the first load's turn 1 is cold).
Run it on a quiet machine: the figures are timings.

    python scripts/load_chat.py --ckpt out/qwen25 --quantize int4 --gguf qwen2.5-0.5b-q4_0.gguf
    python scripts/load_chat.py --url http://127.0.0.1:8000 --conversations 1 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from harness import add_common, load_line, machine_line, serve, skipped, tiny_run

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SYSTEM = (  # about 300 tokens under a BPE tokenizer
    "You are Quill, a patient and precise assistant for a small team that writes and maintains "
    "software for libraries, schools and local archives. Answer in plain English, in short "
    "paragraphs, and prefer concrete steps to general advice. When a question is ambiguous, say "
    "which reading you chose and why, then answer it; do not ask the user to clarify unless the "
    "answer would be useless without it. When you give commands, give the exact command and say "
    "what it changes on the machine. Never invent file names, flags, versions or citations: if "
    "you do not know, say so and suggest how the user could find out. Keep answers under two "
    "hundred words unless the user asks for more. Use lists only for steps that must be done in "
    "order. If the user shares code, read it carefully before you comment, point to the line you "
    "mean, and explain the smallest change that fixes the problem before suggesting larger ones. "
    "If the user seems frustrated, stay calm and practical. Respect privacy: do not repeat "
    "personal data the user shares unless it is needed for the answer. The team works on shared "
    "machines with little memory and few cores, so prefer solutions that are light on resources, "
    "and mention when something will be slow. Today the team is preparing a release, so be brief "
    "and careful, and flag anything that could break an existing installation."
)
HOUSE_RULES = (  # about 500 tokens more (--system long: ~800 tokens in all)
    " House rules for answers about our systems follow. The archive server runs Debian stable "
    "with PostgreSQL for the catalogue, a nightly job that exports the catalogue to CSV, and a "
    "small web application that patrons use to search it. The school laptops run a managed image "
    "that is rebuilt every term; never suggest changes that would survive only until the next "
    "rebuild without saying so. The library kiosks are locked down: users cannot install software "
    "there, so suggest browser-only steps for them. Backups go to an external disk that is rotated "
    "weekly and to an offsite copy that is synchronised on Sundays; restores are tested on the "
    "first Monday of every month on a spare machine in the office. Passwords live in the team's "
    "password manager, never in scripts, configuration files or chat messages, and a secret that "
    "has been pasted anywhere else must be rotated at once. When a user reports an outage, first "
    "ask yourself which of these systems is involved, then give the smallest check that tells "
    "whether it is the network, the disk, the database or the application, in that order, because "
    "that is the order in which failures have been most common here. Write dates as year, month "
    "and day. Give sizes in megabytes or gigabytes, never in blocks. When you suggest a command "
    "that deletes, moves or overwrites data, put a warning line before it and show how to check "
    "what it would touch first, for example with a dry run or a listing. Prefer tools that are "
    "already installed on Debian stable to new packages, and when a new package is needed, name "
    "the Debian package rather than a download from a website. For scripts, prefer POSIX shell "
    "for short jobs and Python 3 for anything that parses data; keep them under a hundred lines "
    "and put a comment at the top that says what the script is for and who to ask about it. "
    "When you are unsure whether a change is safe during the release, recommend waiting until "
    "after it and say what the risk of waiting is. Finally, remember that the people asking are "
    "often librarians and teachers rather than administrators: explain terms the first time you "
    "use them, avoid jargon, and be kind. If a question touches on the law, such as copyright "
    "of digitised material or the retention of patron records, give the general shape of the "
    "answer, say that the team's data protection officer has the final word, and do not guess at "
    "deadlines or fines. If a question is about hardware we do not own, say so, answer for the "
    "general case, and note what might differ. At the end of a long answer, add one line that "
    "says what to do first."
)
QUESTIONS = [
    "How should I back up a small database before an upgrade?",
    "What could go wrong if the disk fills up during the backup?",
    "How do I check the backup is complete?",
    "Which of these steps can I automate?",
    "How often should the automated job run?",
    "What should the job do when it fails?",
    "How do I test a restore without touching production?",
    "Summarise the plan in three sentences.",
]
SMOKE_SYSTEM = "You are a helpful assistant. "


@dataclass
class Load:
    """One server under one number of conversations: each turn's TTFTs, tokens, errors."""

    server: str
    conversations: int
    ttft: dict[int, list[float]] = field(default_factory=dict)  # turn (1-based) → seconds, one per conversation
    cached: dict[int, list[int]] = field(default_factory=dict)  # turn → cached prompt tokens, where usage says
    tokens: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def later_vs_first(self) -> float | None:
        """The median TTFT of turns 2.. over turn 1's."""
        later = [t for turn, ts in self.ttft.items() if turn > 1 for t in ts]
        first = self.ttft.get(1)
        return statistics.median(later) / statistics.median(first) if later and first else None

    def figures(self) -> dict:
        per_turn = {turn: {"p50_ms": 1000 * statistics.median(ts), "p99_ms": 1000 * percentile(ts, 0.99)} for turn, ts in self.ttft.items()}
        cached = {turn: statistics.median(c) for turn, c in self.cached.items() if c}
        rate = self.tokens / self.seconds if self.seconds else 0.0
        head = {"server": self.server, "conversations": self.conversations, "tokens": self.tokens, "seconds": self.seconds}
        return head | {"tokens_per_s": rate, "ttft": per_turn, "later_vs_first": self.later_vs_first(), "cached_tokens": cached}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_turn(http: httpx.AsyncClient, load: Load, turn: int, body: dict) -> str | None:
    """Stream one chat turn: its reply (None: it failed, the error recorded), its TTFT and tokens."""
    t0, first, reply, usage, chunks, done, finish = time.perf_counter(), None, [], None, 0, False, None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                load.errors.append(f"turn {turn}: status {r.status_code}: {(await r.aread())[:200]!r}")
                return None
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    choice = chunk["choices"][0] if chunk.get("choices") else {}
                    text, finish = choice.get("delta", {}).get("content") or "", choice.get("finish_reason") or finish
                    if text:
                        first, chunks = first or time.perf_counter() - t0, chunks + 1
                        reply.append(text)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        load.errors.append(f"turn {turn}: {type(e).__name__}: {e}")
        return None
    if not done or finish is None:
        load.errors.append(f"turn {turn}: the stream ended without " + ("a finish_reason (a reply cut short)" if done else "data: [DONE]"))
        return None
    load.ttft.setdefault(turn, []).append(first if first is not None else time.perf_counter() - t0)
    load.tokens += usage["completion_tokens"] if usage else chunks  # without usage: a content chunk a token
    details = (usage or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        load.cached.setdefault(turn, []).append(details["cached_tokens"])
    return "".join(reply)


async def conversation(http: httpx.AsyncClient, load: Load, c: int, model: str, args: argparse.Namespace) -> None:
    """One conversation's turns, each sending the replies before it back."""
    messages = [{"role": "system", "content": args.system}]
    for turn in range(1, args.turns + 1):
        question = QUESTIONS[(turn - 1) % len(QUESTIONS)]
        messages.append({"role": "user", "content": f"(conversation {load.conversations}-{c}) {question}"})
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0.0, "seed": c}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        reply = await one_turn(http, load, turn, body)
        if reply is None:
            return
        messages.append({"role": "assistant", "content": reply})


async def run_load(url: str, load: Load, args: argparse.Namespace, deadline: float) -> Load:
    """load.conversations conversations at once against url, within the deadline."""
    n = load.conversations
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout), limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        try:
            talks = asyncio.gather(*(conversation(http, load, c, model, args) for c in range(n)))
            await asyncio.wait_for(talks, timeout=max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            load.errors.append("the --time-limit ran out")
        load.seconds = time.perf_counter() - t0
    return load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(gguf: str, threads: int, extra: list[str], wait_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's OpenAI-compatible server on a free loopback port, once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(threads), "--interrupt_requests", "False"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                print(f"llama_cpp.server {gguf} ({threads} threads): {url}", flush=True)
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama_cpp.server did not start for {gguf} (is llama-cpp-python[server] installed?)")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def report(loads: list[Load]) -> None:
    """Per number of conversations, the servers side by side: tokens/s, TTFT p50/p99 per turn,
    and turns 2.. against turn 1."""
    servers = list(dict.fromkeys(load.server for load in loads))
    for n in dict.fromkeys(load.conversations for load in loads):
        row = {load.server: load for load in loads if load.conversations == n}
        print(f"\n{n} conversation(s): TTFT p50 / p99 (ms) per turn")
        print(f"{'':<14}" + "".join(f"{s:>24}" for s in servers))
        turns = sorted({t for load in row.values() for t in load.ttft})
        for turn in turns:
            cells = []
            for s in servers:
                ts = row[s].ttft.get(turn) if s in row else None
                cells.append(f"{1000 * statistics.median(ts):>11.0f} / {1000 * percentile(ts, 0.99):>8.0f}" if ts else f"{'-':>24}")
            print(f"{'turn ' + str(turn):<14}" + "".join(f"{c:>24}" for c in cells))
        ratio = [row[s].later_vs_first() if s in row else None for s in servers]
        print(f"{'2+ vs 1 (p50)':<14}" + "".join(f"{r:>24.2f}" if r is not None else f"{'-':>24}" for r in ratio))
        rates = [row[s].tokens / row[s].seconds if s in row and row[s].seconds else 0.0 for s in servers]
        print(f"{'tokens/s':<14}" + "".join(f"{r:>24.1f}" for r in rates))


def start_servers(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[subprocess.Popen]]:
    """(name, url) of each server to load, and the processes this script started."""
    servers, procs = [], []
    if args.url:
        servers.append(("url", args.url))
    if args.ckpt:
        given = {"--max-batch": args.max_batch, "--device": args.device, "--quantize": args.quantize, "--max-tokens": args.max_tokens}
        if args.prompt_cache_mb is not None:
            given["--prompt-cache-mb"] = args.prompt_cache_mb
        flags = [str(word) for pair in given.items() for word in pair] + ["--compile"] * args.compile
        proc, url, _ = serve(args.ckpt, *flags)
        servers.append(("quill", url))
        procs.append(proc)
    if args.gguf:
        proc, url = start_llama(args.gguf, args.llama_threads, args.llama_arg)
        servers.append(("llama.cpp", url))
        procs.append(proc)
    elif not args.smoke:
        skipped("llama.cpp's server", "no --gguf")
    return servers, procs


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running OpenAI-compatible server on a loopback address")
    p.add_argument("--ckpt", help="run directory or .pt file: start `quill serve` for it")
    p.add_argument("--gguf", help="a GGUF file: start llama-cpp-python's server for it")
    p.add_argument("--conversations", type=int, nargs="+", default=[1, 4, 16], help="conversations at once, one load each")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system", choices=["short", "long"], default="short", help="the shared system prompt: ~300 or ~800 tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each reply")
    p.add_argument("--max-batch", type=int, default=16, help="--max-batch of the quill serve this script starts")
    p.add_argument("--device", default="auto", help="--device of the quill serve this script starts")
    p.add_argument("--quantize", default="none", help="--quantize of the quill serve this script starts")
    p.add_argument("--compile", action="store_true", help="start quill serve with --compile")
    p.add_argument("--prompt-cache-mb", type=int, help="--prompt-cache-mb of the quill serve this script starts (0: off)")
    p.add_argument("--llama-threads", type=int, default=2, help="llama_cpp.server's --n_threads")
    p.add_argument(
        "--llama-arg", action="append", default=[], help="a word more for llama_cpp.server: --llama-arg=--n_ctx --llama-arg=4096"
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one turn may take")
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    add_common(p)
    args = p.parse_args()
    args.system = SYSTEM + HOUSE_RULES if args.system == "long" else SYSTEM
    if args.url is not None and urlparse(args.url).hostname not in LOOPBACK:
        sys.exit(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {args.url}")
    return args


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # a tiny random char model, 1 conversation of 2 short turns
            args.ckpt = str(tiny_run(Path(tmp) / "tiny", block_size=256, pos="rope"))
            args.url, args.gguf, args.conversations, args.turns, args.max_tokens = None, None, [1], 2, 4
            args.system = SMOKE_SYSTEM
        elif not (args.url or args.ckpt or args.gguf):
            sys.exit("error: give --url, --ckpt or --gguf (or --smoke)")
        print(f"{machine_line()}\n{load_line('before')}", flush=True)
        servers, procs = start_servers(args)
        try:
            loads = run_all(servers, args)
        finally:
            for proc in procs:
                stop(proc)
    report(loads)
    errors = [f"{load.server}, {load.conversations} conversation(s): {e}" for load in loads for e in load.errors]
    print(load_line("after"))
    for e in errors[:20]:
        print("error:", e, file=sys.stderr)
    if args.json:
        print(json.dumps({"loads": [load.figures() for load in loads], "errors": len(errors)}))
    sys.exit(1 if errors else 0)


def run_all(servers: list[tuple[str, str]], args: argparse.Namespace) -> list[Load]:
    """A warm-up turn on each server, then each number of conversations on each server in turn."""
    deadline, loads = time.monotonic() + args.time_limit, []
    warm = argparse.Namespace(**{**vars(args), "turns": 1, "max_tokens": 2, "system": "Warm up."})  # shares no prefix
    for name, url in servers:
        asyncio.run(run_load(url, Load(name, 1), warm, deadline))
    for n in args.conversations:
        for name, url in servers:
            loads.append(asyncio.run(run_load(url, Load(name, n), args, deadline)))
    return loads


if __name__ == "__main__":
    main()
