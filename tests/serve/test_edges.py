"""The server's edges: JSON bodies only (a page's text/plain or form "simple request" cannot reach
the model), an empty QUILL_API_KEY refused like --api-key '', clients that close mid-upload,
stall their body or trickle half their headers (bounded, no tracebacks), a shutdown that ends
the streams it cuts with an error event and [DONE] (one log line), and a request checked whole
before its stream starts (a prefix-LM's room, seeds with n, neutral OpenAI fields)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_support import running_server, tiny_run_dir

from quillgpt.cli import main
from quillgpt.sampling_params import MAX_SEED
from quillgpt.serve import connections as serve_http

MODEL = "tiny"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shakespeare_path):
    return tiny_run_dir(tmp_path_factory.mktemp("edges") / MODEL, shakespeare_path)


@pytest.fixture(scope="module")
def prefix_dir(tmp_path_factory, shakespeare_path):
    return tiny_run_dir(tmp_path_factory.mktemp("edges_prefix") / "prefix", shakespeare_path, attention="prefix", block_size=48)


@pytest.fixture(scope="module")
def server(run_dir):
    with running_server(run_dir, max_batch=2, body_timeout_s=1.0, head_timeout_s=1.0) as (url, _):
        yield url


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "Traceback" not in r.text
    return err


# --- JSON only ----------------------------------------------------------------------------------

MEDIA = st.one_of(
    st.sampled_from(
        [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
            "application/json",
            "application/json; charset=utf-8",
            "APPLICATION/JSON",
            "application/json ;x=1",
            "application/jsonx",
            "text/json",
            "application/ld+json",
            "application/json, text/plain",
            "*/*",
        ]
    ),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
)


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(media=MEDIA)
def test_only_json_bodies_reach_the_model(server, media):
    """Browsers send text/plain, forms and multipart cross-origin without a preflight: refused."""
    media = media.strip()  # (a header value cannot start or end with a space)
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1}).encode()
    headers = {} if media == "" else {"Content-Type": media}
    r = httpx.post(server + "/v1/completions", content=body, headers=headers, timeout=30)
    if media.split(";")[0].strip().lower() == "application/json":
        assert r.status_code == 200, r.text
    else:
        assert error_of(r, 415)["code"] == "unsupported_media_type"
    assert httpx.get(server + "/health", timeout=30).status_code == 200


def test_an_empty_api_key_variable_is_refused_like_the_flag(run_dir, monkeypatch, capsys):
    for env, flag in ((" ", None), ("", None), (None, "")):
        if env is None:
            monkeypatch.delenv("QUILL_API_KEY", raising=False)
        else:
            monkeypatch.setenv("QUILL_API_KEY", env)
        args = ["serve", "--ckpt", str(run_dir), "--port", "0", *(["--api-key", flag] if flag is not None else [])]
        with pytest.raises(SystemExit) as info:
            main(args)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and "API key" in err and "QUILL_API_KEY" in err, err


# --- clients that stall or leave -----------------------------------------------------------------


def raw(url: str, data: bytes, wait: float = 5.0) -> bytes:
    """Send bytes on a fresh connection and read until the server closes it (or `wait` passes)."""
    with socket.create_connection(("127.0.0.1", port(url)), timeout=wait) as s:
        s.sendall(data)
        got, deadline = b"", time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                return got
            got += chunk
        raise AssertionError(f"the server kept the connection open for {wait} s: {got[:200]!r}")


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    "data", [b"", b"POST /v1/comp", HEAD, HEAD + b"Content-Length: 10"], ids=["nothing", "half-a-line", "no-blank-line", "half-a-header"]
)
def test_a_half_sent_head_is_closed_within_the_head_timeout(server, data):
    t0 = time.monotonic()
    assert raw(server, data, wait=5.0) == b""  # closed, nothing to answer
    assert time.monotonic() - t0 < 4.0


def test_a_trickled_head_is_closed_however_slowly_it_comes(server):
    """A byte every 0.1 s restarts uvicorn's keep-alive timer each time; the head deadline holds."""
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as s:
        s.settimeout(0.1)
        t0 = time.monotonic()
        for byte in HEAD * 10:  # 70 s of trickling if nobody stopped it
            try:
                s.sendall(bytes([byte]))
                if s.recv(1) == b"":
                    break  # closed by the server
            except TimeoutError:
                continue
            except OSError:
                break
        assert time.monotonic() - t0 < 4.0


def test_a_stalled_body_is_answered_408(server):
    reply = raw(server, HEAD + b'Content-Length: 100\r\n\r\n{"prompt": ', wait=5.0)
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply


def refused_upload(url: str) -> socket.socket:
    """A client announcing a body over the cap and sending 1 MB of it: read the whole reply, then
    the server's half-close; the socket is left open for the caller to go on with."""
    s = socket.create_connection(("127.0.0.1", port(url)), timeout=5)
    s.sendall(HEAD + b"Content-Length: 100000000\r\n\r\n" + b"x" * (1 << 20))
    reply = b""
    while chunk := s.recv(65536):  # EOF right after the reply
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and reply.endswith(b"}}"), reply[:200]
    return s


def closes_within(s: socket.socket, seconds: float, chunk: bytes) -> bool:
    """Whether sending `chunk` again and again meets the server's reset within `seconds`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            s.sendall(chunk)
        except OSError:
            return True
        time.sleep(0.01)
    return False


def test_a_refused_upload_gets_its_whole_reply_then_a_bounded_linger(server, monkeypatch):
    """A 413 for a declared body over the cap goes out while the client is still uploading.
    Closing then would reset the connection under the reply; the server half-closes after it and
    drops what still comes, until a pause of LINGER_IDLE_S or LINGER_MAX_S after the reply."""
    monkeypatch.setattr(serve_http, "LINGER_IDLE_S", 1.0)
    monkeypatch.setattr(serve_http, "LINGER_MAX_S", 3.0)
    with refused_upload(server) as s:  # the client pauses: closed after the idle time
        time.sleep(0.5)
        assert not closes_within(s, 0.3, b"x")  # still draining 0.5 s after the reply, and the sends restart it
        time.sleep(1.5)
        assert closes_within(s, 1.0, b"x")
    with refused_upload(server) as s:  # the client never pauses: closed at the cap
        t0 = time.monotonic()
        assert closes_within(s, 8.0, b"x" * 65536)
        assert 2.5 < time.monotonic() - t0 < 5.0


def test_a_client_gone_mid_upload_logs_no_traceback(server, caplog):
    caplog.set_level(logging.INFO)
    for sent in (b"", b'{"prompt": "a", ', b"x" * 5000):
        with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as s:
            s.sendall(HEAD + b"Content-Length: 100000\r\n\r\n" + sent)
            time.sleep(0.2)
    time.sleep(0.5)
    assert "Traceback" not in caplog.text and "internal error" not in caplog.text
    assert caplog.text.count("\n") <= 3  # at most one line per client
    assert httpx.get(server + "/health", timeout=30).status_code == 200


# --- shutdown -------------------------------------------------------------------------------------


def test_shutdown_ends_the_streams_it_cuts_with_an_error_and_done(run_dir, caplog):
    caplog.set_level(logging.INFO)
    with running_server(run_dir, max_batch=2, drain_s=1.0, max_tokens=10**6) as (url, app):
        seen: dict[int, list[str]] = {}
        started = threading.Barrier(3)

        def stream(i: int) -> None:
            body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 10**6, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                seen[i] = [next(lines)]
                started.wait(10)
                seen[i] += list(lines)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        started.wait(10)
        app.state.server.should_exit = True  # what SIGINT/SIGTERM do
        for t in threads:
            t.join(20)
    for lines in seen.values():
        data = [line[6:] for line in lines if line]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["code"] == "generation_failed" and "shutting down" in error["message"]
    assert "CancelledError" not in caplog.text and "Traceback" not in caplog.text
    cut = [r for r in caplog.records if "drain" in r.getMessage()]
    assert len(cut) == 1 and "2 reply(ies)" in cut[0].getMessage()


# --- checked whole before a reply starts ---------------------------------------------------------


def test_a_prefix_lm_request_too_long_is_refused_before_its_stream_starts(prefix_dir):
    with running_server(prefix_dir, max_batch=2) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        for stream in (False, True):
            body = {"model": "prefix", "prompt": "ROMEO:", "max_tokens": 50, "stream": stream}
            err = error_of(c.post("/v1/completions", json=body), 400)
            assert err["param"] == "max_tokens" and "lower max_tokens to 42" in err["message"]
            assert "--max-new-tokens" not in err["message"]
        reply = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text  # the default max_tokens (2048) shrinks to the room
        assert reply.json()["usage"]["prompt_tokens"] + reply.json()["usage"]["completion_tokens"] <= 48


def test_seeds_with_n_neutral_fields_and_lone_surrogates(server):
    with httpx.Client(base_url=server, timeout=30) as c:
        two = c.post("/v1/completions", json={"prompt": "A", "max_tokens": 8, "temperature": 1.0, "n": 2, "seed": MAX_SEED}).json()[
            "choices"
        ]
        first = c.post("/v1/completions", json={"prompt": "A", "max_tokens": 8, "temperature": 1.0, "seed": MAX_SEED}).json()["choices"][0]
        wrapped = c.post("/v1/completions", json={"prompt": "A", "max_tokens": 8, "temperature": 1.0, "seed": 0}).json()["choices"][0]
        assert [ch["text"] for ch in two] == [first["text"], wrapped["text"]]  # choice k: seed + k, wrapping
        err = error_of(c.post("/v1/completions", json={"prompt": "A", "n": 2, "seed": MAX_SEED + 1}), 400)
        assert err["param"] == "seed" and str(MAX_SEED + 1) in err["message"] and str(MAX_SEED + 2) not in err["message"]
        assert c.post("/v1/completions", json={"prompt": "A", "max_tokens": 1, "logit_bias": {"1": 0}}).status_code == 200
        assert error_of(c.post("/v1/completions", json={"prompt": "A", "logit_bias": {"1": 3}}), 400)["param"] == "logit_bias"
        for raw_body in (b'{"prompt": "a", "\\ud800": 1}', b'{"prompt": "\\udfff"}', b'{"\\ud800x": {"y": 1}}'):
            err = error_of(c.post("/v1/completions", content=raw_body, headers={"Content-Type": "application/json"}), 400)
            assert "surrogate" in err["message"] and not err["message"].startswith("None")
