"""`quill serve`'s prompt cache through the openai client: a 3-turn chat (a system prompt, each
turn sending the replies before it back) gets the same replies with the cache on and off, streamed
and not; usage.prompt_tokens_details.cached_tokens says how much of each prompt the cache held;
/health shows the cache's size and hits; prompts admitted together share their system prompt; int8
rows alike; --prompt-cache-mb's mistakes."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_support import running_server, tiny_run_dir

from quillgpt.cli import main
from quillgpt.inference.engine import Engine
from quillgpt.quant import quantize

MODEL = "tiny"
SYSTEM = "You are a careful assistant who answers in the words of the plays. " * 2
QUESTIONS = ["Who is Romeo?", "And Juliet?", "What became of them?"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shakespeare_path):
    """RoPE, block 512: three turns fit without cropping."""
    return tiny_run_dir(tmp_path_factory.mktemp("cache") / MODEL, shakespeare_path, block_size=512, pos="rope")


def chat(url: str, stream: bool = False) -> list[tuple[str, int, int]]:
    """The 3 turns, greedy: (reply, prompt tokens, cached prompt tokens) of each."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        args = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
            reply, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        else:
            got = client.chat.completions.create(**args)
            reply, usage = got.choices[0].message.content, got.usage
        out.append((reply, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": reply})
    return out


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()["prompt_cache"]


@pytest.fixture(scope="module")
def uncached(run_dir):
    with running_server(run_dir, max_batch=2, prompt_cache_mb=0) as (url, _):
        assert health(url) == {"enabled": False, "note": "off"}
        yield chat(url)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_gets_the_same_replies_with_the_cache_and_reads_its_earlier_turns_from_it(run_dir, uncached, stream):
    with running_server(run_dir, max_batch=2) as (url, _):
        cached = chat(url, stream)
        stats = health(url)
    assert [r for r, _, _ in cached] == [r for r, _, _ in uncached]
    assert all(c == 0 for _, _, c in uncached)
    prompts = [p for _, p, _ in cached]
    hits = [c for _, _, c in cached]
    assert hits[0] == 0 and all(0 < hits[i] < prompts[i] for i in (1, 2))
    # the turn before's prompt (quill's transcript renders a reply after "Assistant: ", a space the
    # model did not write: a template that renders the reply as generated matches it too, below)
    assert hits[1] >= prompts[0] and hits[2] >= prompts[1]
    assert stats["enabled"] and stats["hits"] == 2 and stats["cached_tokens"] == sum(hits)
    assert 0 < stats["bytes"] <= stats["budget_bytes"] and stats["entries"] >= 1


def test_a_prompt_that_continues_an_earlier_prompt_and_its_reply_reads_both(run_dir):
    with running_server(run_dir, max_batch=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        first = client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=10, temperature=0)
        again = client.completions.create(model=MODEL, prompt=SYSTEM + first.choices[0].text + " Go on.", max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the reply's last token was drawn, never run: its KV is not there
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 10 - 1


def test_a_shared_system_prompt_serves_another_user(run_dir):
    with running_server(run_dir, max_batch=2, prompt_cache_mb=64) as (url, _):
        first = chat(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who is Tybalt?"}]
        usage = client.chat.completions.create(model=MODEL, messages=other, max_tokens=4, temperature=0).usage
        assert health(url)["budget_bytes"] == 64 * 2**20
    assert len(SYSTEM) <= usage.prompt_tokens_details.cached_tokens < first[0][1]  # a char model: a token a character


def test_prompts_admitted_together_share_their_system_prompt(run_dir):
    """One request of several prompts (admitted in one step, as a burst of users is) on a cold
    server: the first prefills the system prompt, the others read it."""
    prompts = [SYSTEM + q for q in [*QUESTIONS, "Where is Verona?"]]
    with running_server(run_dir, max_batch=len(prompts)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        usage = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0).usage
        stats = health(url)
    assert usage.prompt_tokens_details.cached_tokens >= (len(prompts) - 1) * len(SYSTEM)  # a char model
    assert stats["hits"] == len(prompts) - 1 and stats["cached_tokens"] == usage.prompt_tokens_details.cached_tokens


def test_int8_rows_read_the_cache_alike(run_dir, uncached, fixed_int8_kernel):
    def quantized(budget):
        return lambda model: Engine(quantize(model, "int8"), 2, prompt_cache=budget)

    with running_server(run_dir, engine=quantized(0)) as (url, _):
        off = chat(url)
    with running_server(run_dir, engine=quantized(None)) as (url, _):
        on = chat(url)
    assert [r for r, _, _ in on] == [r for r, _, _ in off]
    assert sum(c for _, _, c in on) > 0


def test_prompt_cache_mb_below_zero_is_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--ckpt", str(tmp_path), "--prompt-cache-mb", "-1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and "--prompt-cache-mb" in err and err.count("\n") == 1
