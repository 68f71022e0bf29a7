"""`quill serve` on a loopback port: the official openai client (completions and chat, streamed
and not), the SSE format, continuous batching (overlapping requests = each alone, greedy and
seeded), clients that leave, limits, auth, ≥ 30 hostile bodies (the server keeps answering),
the attention route against viz, the static page, the engine task's stop ids, and the CLI with
SIGINT draining a stream."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serve_support import BLOCK, running_server, tiny_run_dir

from quillgpt.checkpoint import save_checkpoint
from quillgpt.cli import main
from quillgpt.data.chat_template import transcript
from quillgpt.evaluate.attention_views import attention_weights
from quillgpt.inference.driver import TextStream, encode_prompt
from quillgpt.inference.engine import Engine
from quillgpt.inference.generate import generate_text
from quillgpt.runs import load_run
from quillgpt.sampling_params import SamplingParams
from quillgpt.serve.batcher import Batcher, Event, Job
from quillgpt.serve.schemas import ChatMessage

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shakespeare_path):
    return tiny_run_dir(tmp_path_factory.mktemp("serve") / MODEL, shakespeare_path)


@pytest.fixture(scope="module")
def server(run_dir):
    with running_server(run_dir, max_batch=4) as (url, app):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=30, max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=30) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a streamed response, checking the framing of every event."""
    raw = response.read().decode("utf-8")
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


# --- the openai client -------------------------------------------------------------------------


def test_openai_client_completions_stream_and_not(client, run_dir):
    run = load_run(run_dir)
    want, _ = generate_text(run.model, run.tokenizer, "ROMEO:", 30)  # the plain reference path
    got = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0)
    assert got.object == "text_completion" and got.model == MODEL
    assert got.choices[0].text == want[0] and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (6, 30, 36)
    chunks = list(client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want[0]
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_openai_client_chat_stream_and_not(client, run_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak, friend."}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=25, temperature=0.8, seed=7)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    text = got.choices[0].message.content
    run = load_run(run_dir)
    prompt = transcript([{"role": m.role, "content": m.text} for m in map(ChatMessage.model_validate, messages)])
    assert prompt == "System: Be brief.\n\nUser: Speak, friend.\n\nAssistant:"
    assert got.usage.prompt_tokens == len(encode_prompt(run.tokenizer, prompt))
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=25, temperature=0.8, seed=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_models_route_and_wrong_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=2)
    assert "serves 'tiny'" in info.value.body["message"]


def test_raw_sse_format_chat_with_two_choices(http):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "n": 2,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["finish_reason"] is None for c in mine[:-1]) and mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    # choice 1 is seed + 1: the same text as asking alone with seed 2
    texts = [
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
        for i in (0, 1)
    ]
    alone = http.post("/v1/chat/completions", json={**body, "n": 1, "seed": 2, "stream": False}).json()
    assert alone["choices"][0]["message"]["content"] == texts[1]


def test_stop_strings_end_the_text(http):
    full = complete(http, prompt="ROMEO:", max_tokens=40, temperature=0)["choices"][0]["text"]
    stop = full[10:13]
    cut = full[: full.index(stop)]
    got = complete(http, prompt="ROMEO:", max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert got["choices"][0] == {"index": 0, "text": cut, "logprobs": None, "finish_reason": "stop"}
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0, "stop": stop, "stream": True}
    ) as r:
        pieces = [e["choices"][0]["text"] for e in sse_events(r)[:-1]]
    assert "".join(pieces) == cut and not any(stop in p for p in pieces)


@pytest.fixture(scope="module")
def utf8_run_dir(tmp_path_factory, byte_bpe):
    """A byte-level BPE as GPT-2's (conftest's byte_bpe) and a model whose logits ignore the input (ln_f gain 0, bias e0):
    "日" (bytes E6 97 A5) as three single-byte tokens ranked first, then "!". Greedy with a
    strong repetition penalty walks down that ranking: E6, 97, A5, "!"."""
    from quillgpt.config import config_from_dict
    from quillgpt.model.gpt import GPT

    tok = byte_bpe
    byte_id = {tok.decode_bytes([i]): i for i in range(256)}  # its first 256 ids are the bytes
    ranked = [byte_id[b"\xe6"], byte_id[b"\x97"], byte_id[b"\xa5"], byte_id[b"!"]]
    cfg = config_from_dict(
        {
            "model": {
                "n_layer": 1,
                "n_head": 1,
                "n_embd": 8,
                "block_size": 16,
                "bias": True,
                "tie_embeddings": False,
                "vocab_size": tok.vocab_size,
            }
        }
    )
    model = GPT(cfg.model)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        for rank, i in enumerate(ranked):
            model.lm_head.weight[i, 0] = 10.0 - rank
    out = tmp_path_factory.mktemp("utf8") / "bytes"
    out.mkdir()
    state = {"config": cfg.to_dict(), "model": model.state_dict(), "tokenizer": tok.spec(), "step": 0}
    save_checkpoint(state, out / "best.pt")
    return out


def test_a_character_split_across_tokens_streams_whole(utf8_run_dir):
    with running_server(utf8_run_dir, max_batch=2) as (url, _):
        body = {
            "prompt": "a",
            "max_tokens": 4,
            "temperature": 0,
            "repetition_penalty": 100.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            chunks = sse_events(r)[:-1]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "日!" and "\ufffd" not in "".join(texts)
    assert "日" in texts or "日!" in texts  # whole in one chunk: never its first byte or two alone
    assert chunks[-1]["usage"]["completion_tokens"] == 4


# --- continuous batching -----------------------------------------------------------------------

REQUESTS = [  # different prompts, lengths (past block_size too), greedy and seeded
    {"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0},
    {"prompt": "To be, or not to be, that is the question", "max_tokens": 7, "temperature": 0.9, "seed": 11},
    {"prompt": "A", "max_tokens": 23, "temperature": 1.2, "seed": 5, "top_k": 10},
    {"prompt": "KING HENRY", "max_tokens": 3, "temperature": 0},
    {"prompt": "What say you?", "max_tokens": 31, "temperature": 0.7, "top_p": 0.9, "seed": 3},
    {"prompt": "\n", "max_tokens": 12, "temperature": 0, "repetition_penalty": 1.3},
    {"prompt": ["First", "Second"], "max_tokens": 9, "temperature": 0.8, "seed": 0, "n": 2},
]


def test_overlapping_requests_get_exactly_their_tokens_alone(server, http):
    alone = [complete(http, **req)["choices"] for req in REQUESTS]
    results: dict[int, list] = {}

    def ask(i: int) -> None:
        time.sleep(0.01 * i)  # staggered: requests join and leave while others decode
        with httpx.Client(base_url=server, timeout=60) as c:
            results[i] = c.post("/v1/completions", json={"model": MODEL, **REQUESTS[i]}).json()["choices"]

    for _ in range(2):  # twice: rows are reused by later requests
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(REQUESTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [results[i] for i in range(len(REQUESTS))] == alone
    assert [len(c["text"]) for c in alone[0]] == [40]  # char model: one character per token
    assert len({c["text"] for c in alone[6]}) == 4  # two prompts × two seeds: four different texts


def test_client_that_leaves_frees_its_row(server, http, monkeypatch):
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("uvicorn.error")  # (it does not propagate: caplog would not see it)
    monkeypatch.setattr(log, "level", log.level)  # restored afterwards
    log.setLevel(logging.INFO)  # (setLevel, not the attribute: it clears the logger's cache)
    log.addHandler(handler)
    with http.stream("POST", "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "stream": True}) as r:
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]  # a whole stream: logged as it is
    with http.stream("POST", "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2000, "stream": True}) as r:
        for _ in r.iter_lines():
            if http.get("/health").json()["active"] == 1:
                break
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:  # not streamed
        body = json.dumps({"prompt": "ROMEO:", "max_tokens": 2000}).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while (load := http.get("/health").json())["active"] or load["waiting"]:
        assert time.monotonic() < deadline, f"rows still held after the clients left: {load}"
        time.sleep(0.05)
    log.removeHandler(handler)
    lines = [line for line in seen if line.startswith("POST /v1/completions")]
    assert lines[0].startswith("POST /v1/completions 200 ") and "cut" not in lines[0] and "left" not in lines[0]
    assert "(cut: the client left before the end of the stream)" in lines[1], lines  # the stream the client left


def test_a_compiled_server_compiles_before_it_listens_and_answers_as_eager(run_dir):
    """quill serve --compile: make_app compiles the engine's decode step (Engine.warm) before the
    server starts; the batcher's thread then runs that graph, and the replies are the eager ones."""
    run = load_run(run_dir)
    want, _ = generate_text(run.model, run.tokenizer, "ROMEO:", 30)
    with running_server(run_dir, max_batch=2, compile=True) as (url, app), httpx.Client(base_url=url, timeout=60) as http:
        assert app.state.compiled and app.state.compile_s > 0
        for _ in range(2):
            got = complete(http, prompt="ROMEO:", max_tokens=30, temperature=0)
            assert got["choices"][0]["text"] == want[0]


def test_engine_task_stop_ids_and_cancel(run_dir):
    """The batcher alone: a stop id ends a row with finish "stop" (its text not included)."""
    run = load_run(run_dir)
    ids = encode_prompt(run.tokenizer, "ROMEO:")
    want, _ = generate_text(run.model, run.tokenizer, "ROMEO:", 12)
    stop_id = run.tokenizer.encode(want[0][5])[0]
    events: list[Event] = []
    done = threading.Event()

    def emit(e: Event) -> None:
        events.append(e)
        if e.finish:
            done.set()

    batcher = Batcher(Engine(run.model, max_rows=2))
    batcher.start()
    try:
        job = Job(0, ids, SamplingParams(max_new_tokens=12), TextStream(run.tokenizer), emit, stop_ids=(stop_id,))
        batcher.submit([job])
        assert done.wait(10)
        text = "".join(e.text for e in events)
        assert text == want[0][: want[0].index(want[0][5])] and events[-1].finish == "stop"
        assert events[-1].tokens == want[0].index(want[0][5]) + 1  # the stop token is counted
        assert batcher.load()["active"] == 0
    finally:
        batcher.stop()


def test_waiting_jobs_of_one_prompt_length_prefill_together_and_a_bad_one_is_refused_alone(run_dir):
    """Four jobs wait while the engine thread is busy: the three valid ones are admitted in one
    prefill (a request's n choices), each gives its own seeded text as alone; the one whose
    prompt is outside the vocabulary gets its 400 without touching them."""
    run = load_run(run_dir)
    ids = encode_prompt(run.tokenizer, "ROMEO:")
    engine = Engine(run.model, max_rows=4)
    prefills, real = [], engine.prefill_rows
    engine.prefill_rows = lambda rs, prompts, start=0: prefills.append(list(rs)) or real(rs, prompts, start)
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3)]
    want = [generate_text(run.model, run.tokenizer, "ROMEO:", params=p)[0][0] for p in params]
    events: dict[int, list[Event]] = {i: [] for i in range(4)}
    done = threading.Semaphore(0)

    def emit(i: int, e: Event) -> None:
        events[i].append(e)
        if e.finish:
            done.release()

    batcher = Batcher(engine)
    gate = threading.Event()
    batcher.call(gate.wait)  # the engine thread waits here while all four jobs are queued
    batcher.start()
    try:
        jobs = [Job(i, ids, p, TextStream(run.tokenizer), lambda e, i=i: emit(i, e)) for i, p in enumerate(params)]
        jobs.append(Job(3, [10**6], params[0], TextStream(run.tokenizer), lambda e: emit(3, e)))
        batcher.submit(jobs)
        gate.set()
        for _ in range(4):
            assert done.acquire(timeout=10)
        assert prefills == [[0, 1, 2]]
        assert ["".join(e.text for e in events[i]) for i in range(3)] == want
        assert events[3][-1].finish == "error" and events[3][-1].status == 400 and "outside" in events[3][-1].text
    finally:
        batcher.stop()


def test_engine_task_survives_a_failing_step(run_dir, caplog):
    """A step that raises (a bug, out of memory) fails the jobs it held; the next job runs."""
    run = load_run(run_dir)
    want, _ = generate_text(run.model, run.tokenizer, "ROMEO:", 12)
    engine = Engine(run.model, max_rows=2)
    real_step, calls = engine.step, {"n": 0}

    def failing_third_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated out of memory")
        return real_step()

    engine.step = failing_third_step
    batcher = Batcher(engine)
    batcher.start()
    try:
        for expect_error in (True, False):
            events: list[Event] = []
            done = threading.Event()
            job = Job(
                0,
                encode_prompt(run.tokenizer, "ROMEO:"),
                SamplingParams(max_new_tokens=12),
                TextStream(run.tokenizer),
                lambda e, events=events, done=done: (events.append(e), e.finish and done.set()),
            )
            batcher.submit([job])
            assert done.wait(10)
            if expect_error:
                assert events[-1].finish == "error" and events[-1].status == 500 and "logged" in events[-1].text
                assert "simulated out of memory" in caplog.text
            else:
                assert "".join(e.text for e in events) == want[0] and events[-1].finish == "length"
        assert engine.free_rows() == 2
    finally:
        batcher.stop()


# --- limits, auth, hostile input ---------------------------------------------------------------


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    return err


HOSTILE = [  # (body bytes or JSON object, expected status, expected param)
    (b"", 400, None),
    (b"{", 400, None),
    (b"\xff\xfe\x00garbage", 400, None),
    (b'{"prompt": "caf\xc3"}', 400, None),  # invalid UTF-8 inside a string
    (b"[1, 2, 3]", 400, None),
    (b'"just a string"', 400, None),
    (b"null", 400, None),
    (b'{"prompt": "a", "temperature": NaN}', 400, None),
    (b'{"prompt": "a", "temperature": Infinity}', 400, None),
    (b"[" * 100_000 + b"]" * 100_000, 400, None),  # nesting deep enough to break a recursive parser
    ({}, 422, "prompt"),
    ({"prompt": 5}, 422, "prompt"),
    ({"prompt": None}, 422, "prompt"),
    ({"prompt": [1.5, 2.5]}, 422, "prompt.0"),  # token ids are integers
    ({"prompt": [1, 10**9]}, 400, "prompt"),  # outside the vocabulary
    ({"prompt": {"a": 1}}, 422, "prompt"),
    ({"prompt": "a", "max_tokens": "10"}, 422, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1.5}, 422, "max_tokens"),
    (b'{"prompt": "a", "max_tokens": 1e999}', 422, "max_tokens"),  # a float (inf), not an int
    (b'{"prompt": "a", "temperature": -1e999}', 422, "temperature"),  # finite numbers only
    ({"prompt": "a", "temperature": "hot"}, 422, "temperature"),
    ({"prompt": "a", "stream": "yes"}, 422, "stream"),
    ({"prompt": "a", "n": True}, 422, "n"),
    ({"prompt": "a", "stop": 7}, 422, "stop"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, 422, "stream_options.include_usage"),
    ({"prompt": "a", "unknown_field": 1}, 422, "unknown_field"),
    ({"prompt": "a", "ckpt": "/etc/passwd"}, 422, "ckpt"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "a", "min_p": 1}, 400, "min_p"),
    ({"prompt": "a", "top_k": -3}, 400, "top_k"),
    ({"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "a", "seed": -1}, 400, "seed"),
    ({"prompt": "a", "seed": 10**40}, 400, "seed"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**30}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),  # over --max-tokens 2048
    ({"prompt": "a", "n": 0}, 400, "n"),
    ({"prompt": "a", "n": 5}, 400, "n"),  # over --max-batch 4
    ({"prompt": ["a"] * 3, "n": 2}, 400, "n"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "a" * 5000}, 400, "prompt"),  # over 4096 prompt tokens
    ({"prompt": "日本語"}, 400, "prompt"),  # not in the char vocabulary
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "a", "logprobs": 6}, 400, "logprobs"),  # OpenAI's limit: 5
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ({"prompt": "a", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"prompt": "a", "model": "../../etc/passwd"}, 404, "model"),
]


def test_hostile_bodies_get_openai_errors_and_the_server_keeps_answering(http):
    assert len(HOSTILE) >= 30
    for body, status, param in HOSTILE:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post("/v1/completions", content=data, headers={"Content-Type": "application/json"})
        err = error_of(r, status)
        assert err["param"] == param, (body, err)
        assert http.get("/health").status_code == 200
    chat_bad = [
        ({"messages": []}, 422),
        ({"messages": [{"role": "robot", "content": "x"}]}, 422),
        ({"messages": [{"role": "user", "content": 3}]}, 422),
        ({"messages": "hi"}, 422),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400),
    ]
    for body, status in chat_bad:
        error_of(http.post("/v1/chat/completions", json=body), status)
    error_of(http.post("/v1/completions", content=b"x" * (10 << 20)), 413)  # 10 MB, Content-Length known

    def chunks():  # 2 MB sent chunked, with no Content-Length to check up front
        for _ in range(32):
            yield b"y" * (64 << 10)

    error_of(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    error_of(http.get("/v1/nothing-here"), 404)
    error_of(http.get("/v1/completions"), 405)
    assert complete(http, prompt="still here", max_tokens=3)["choices"][0]["finish_reason"] == "length"


def test_no_cors_by_default(http):
    r = http.get("/v1/models", headers={"Origin": "http://elsewhere.test"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_api_key_cors_and_queue_limit(run_dir):
    origin = "http://app.example.test"
    with running_server(run_dir, max_batch=1, api_key=KEY, max_waiting=1, max_tokens=10**6, cors=origin) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/").status_code == 200 and c.get("/health").status_code == 200  # no key needed
            preflight = {
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            }
            r = c.options("/v1/completions", headers=preflight)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            r = c.options("/v1/completions", headers={**preflight, "Origin": "http://evil.test"})
            assert r.headers.get("access-control-allow-origin") != "http://evil.test"
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                err = error_of(c.get("/v1/models", headers=headers), 401)
                assert err["code"] == "invalid_api_key"
            error_of(c.post("/v1/completions", content=b"x" * (10 << 20)), 401)  # refused before reading
            for path in ("/v2/anything", "//v1/models", "/static/../v1/models"):
                assert c.get(path).status_code == 401  # deny by default, not only /v1
            ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
            # one row decoding, one request waiting: the next is told to come back (503)
            auth = {"Authorization": f"Bearer {KEY}"}
            long = {"prompt": "a", "max_tokens": 10**6, "stream": True}  # runs until its client leaves
            with c.stream("POST", "/v1/completions", json=long, headers=auth) as first:
                lines = first.iter_lines()  # kept: a dropped iterator closes the connection
                next(lines)
                with c.stream("POST", "/v1/completions", json=long, headers=auth) as second:
                    assert second.status_code == 200
                    error_of(c.post("/v1/completions", json=long, headers=auth), 503)
            assert ok.completions.create(model=MODEL, prompt="a", max_tokens=2).choices[0].finish_reason == "length"


def test_one_log_line_per_request_with_route_status_tokens_and_time(http):
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("uvicorn.error")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # the test server logs warnings only

    def logged(start: str) -> str:
        deadline = time.monotonic() + 5  # the line is written after the last byte is sent
        while time.monotonic() < deadline:
            found = [line for line in lines if line.startswith(start)]
            if found:
                return found[-1]
            time.sleep(0.02)
        raise AssertionError(f"no log line starting {start!r} in {lines}")

    try:
        complete(http, prompt="ROMEO:", max_tokens=5)
        assert re.fullmatch(r"POST /v1/completions 200 6\+5 tokens \d+\.\d+s", logged("POST /v1/completions 200"))
        lines.clear()
        with http.stream("POST", "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 7, "stream": True}) as r:
            sse_events(r)
        assert re.fullmatch(r"POST /v1/completions 200 6\+7 tokens \d+\.\d+s", logged("POST /v1/completions 200"))
        http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 0})
        assert re.fullmatch(r"POST /v1/completions 400 \d+\.\d+s", logged("POST /v1/completions 400"))
        http.get("/health")
        assert logged("GET /health 200")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


# --- attention and the page --------------------------------------------------------------------


def test_attention_route_matches_viz(http, run_dir):
    run = load_run(run_dir)
    got = http.post("/v1/attention", json={"prompt": "ROMEO: hi"}).json()
    want = attention_weights(run.model, run.tokenizer, "ROMEO: hi")
    assert got["tokens"] == want.tokens == ["R", "O", "M", "E", "O", ":", "␣", "h", "i"]
    assert (got["n_layer"], got["n_head"]) == (2, 2)
    weights = torch.tensor(got["weights"])  # (layer, head, query, key)
    assert weights.shape == (2, 2, 9, 9)
    assert torch.allclose(weights, torch.stack(want.weights), atol=1e-4)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 2, 9), atol=1e-3)
    long = http.post("/v1/attention", json={"prompt": "x" * (BLOCK + 5)}).json()
    assert long["cropped"] == 5 and len(long["tokens"]) == BLOCK
    longer = http.post("/v1/attention", json={"prompt": "ab" * 100}).json()  # past the page's bound: cropped too
    assert longer["cropped"] == 200 - BLOCK and "".join(longer["tokens"]) == ("ab" * 100)[-BLOCK:]
    error_of(http.post("/v1/attention", json={"prompt": ""}), 400)


def test_page_is_served_from_the_package_and_needs_no_network(http):
    page = http.get("/")
    assert page.status_code == 200 and '<canvas id="attn-grid"' in page.text
    for name in ("app.js", "style.css"):
        assert http.get(f"/static/{name}").status_code == 200
    static = Path(__file__).resolve().parents[2] / "quillgpt" / "serve" / "static"
    for f in static.iterdir():
        text = f.read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, f.name
    for path in ("/static/../app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py"):
        assert http.get(path).status_code == 404


# --- the CLI ----------------------------------------------------------------------------------


def test_cli_mistakes_are_one_line(capsys, tmp_path):
    for args, words in [
        (["--ckpt", tmp_path / "nothing"], "checkpoint not found"),
        (["--ckpt", tmp_path, "--max-batch", "0"], "--max-batch"),
        (["--ckpt", tmp_path, "--dtype", "int8"], "--dtype"),
        (["--ckpt", tmp_path, "--quantize", "int3"], "--quantize must be int8, int8-channel, int5, int4, int4-g64, int4-g128 or none"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["serve", *map(str, args)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "stop_signal, flags",
    [(signal.SIGINT, []), (signal.SIGTERM, []), (signal.SIGTERM, ["--quantize", "int8"])],
    ids=["SIGINT", "SIGTERM", "int8"],
)
def test_cli_serves_until_a_signal_and_drains_a_stream(run_dir, monkeypatch, capsys, stop_signal, flags, request):
    """`quill serve` in this process (main thread: uvicorn's signal handlers); a client thread
    starts a stream, then SIGINT or SIGTERM: the stream still ends with [DONE], exit code 0.
    With --quantize int8 the announcement names the int8 kernel it serves through."""
    monkeypatch.setenv("QUILL_API_KEY", KEY)
    kernel = request.getfixturevalue("fixed_int8_kernel") if flags else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen: dict = {}

    def client() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    seen["model"] = c.get("/v1/models").json()["data"][0]["id"]
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            else:
                return  # the server never came up: main() has failed on its own
            body = {"prompt": "ROMEO:", "max_tokens": 300, "temperature": 0, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                os.kill(os.getpid(), stop_signal)  # stop accepting; the running stream may finish
                seen["rest"] = list(lines)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    with pytest.raises(SystemExit) as info:
        main(["serve", "--ckpt", str(run_dir), "--port", str(port), "--device", "cpu", *flags])
    thread.join(30)
    err = capsys.readouterr().err
    assert info.value.code == 0, err
    assert (f"int8 weights (32 per scale), {kernel}" in err) == bool(flags)
    assert f"as model 'tiny': http://127.0.0.1:{port}/" in err and err.rstrip().endswith("stopped")
    assert seen["model"] == MODEL and [line for line in seen["rest"] if line][-1] == "data: [DONE]"
