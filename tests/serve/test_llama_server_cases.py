"""llama.cpp's server tests (tools/server/tests/unit/test_chat_completion.py) that hold for any
OpenAI-compatible server, rewritten against `quill serve` on a tiny run: the shape of a streamed
chat (the role once, one id, finish and usage chunks), logprobs that spell the reply, several
choices, a prompt past the context and malformed messages answered with a 4xx and an error
object. (`json_schema` with `const` and invalid response formats are in test_structured.py.)"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_support import running_server, tiny_run_dir

ASK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, shakespeare_path):
    with running_server(tiny_run_dir(tmp_path_factory.mktemp("run") / "tiny", shakespeare_path)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(server: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_streamed_chat_has_the_role_once_one_id_a_finish_and_usage(server, client):
    body = {"messages": ASK, "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(server, body)
    *chunks, usage = events
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert len({e["id"] for e in events}) == 1 and all(e["object"] == "chat.completion.chunk" for e in events)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    whole = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].message.content and whole.choices[0].finish_reason == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole.usage.completion_tokens == 8
    assert usage["usage"]["prompt_tokens"] == whole.usage.prompt_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_spell_the_reply(client, stream):
    kw = dict(model="tiny", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=10)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    else:
        reply = client.chat.completions.create(**kw)
        text, tokens = reply.choices[0].message.content, reply.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == text and len(tokens) == 5
    for t in tokens:
        assert t.logprob <= 0.0 and bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 10
        assert t.top_logprobs[0].logprob >= t.logprob  # greedy: the chosen token is the most likely
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)


def test_two_choices_each_have_the_assistant_role_and_a_finish(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, n=2, temperature=1.0, seed=1)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 16


@pytest.mark.parametrize(
    "messages",
    [None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}], [{"role": "system", "content": "test"}, {}], []],
)
def test_malformed_messages_are_a_4xx_with_an_error_object(server, messages):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "messages" in (error["param"] or "") + error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_context_is_a_400_before_any_stream(server, stream):
    body = {"messages": ASK * 100, "max_tokens": 4, "stream": stream}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]  # llama.cpp's exceed_context_size_error, in OpenAI's form
    assert error["code"] == "prompt_too_long" and error["param"] == "messages" and "tokens" in error["message"]
