"""OpenAI logprobs from `quill serve`: /v1/completions (logprobs N, echo, max_tokens 0, token-id
prompts) and /v1/chat/completions (logprobs, top_logprobs), streamed and not, against the model's
own log-softmax; bad values refused naming the field; and lm-eval's `local-completions` against a
served model gives the task results of `quill eval --tasks` on the same run."""

import json
import re

import httpx
import pytest
import torch

pytest.importorskip("transformers")

from harness_support import responses, write_tasks  # noqa: E402
from hf_support import CORPUS, make_hf_model  # noqa: E402
from serve_support import running_server  # noqa: E402

from quillgpt.interop.convert import import_hf  # noqa: E402
from quillgpt.runs import load_run  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    hf_dir = make_hf_model(root / "hf", "smollm2")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    import_hf(hf_dir, root / "run")
    run = load_run(root / "run")
    with running_server(root / "run", max_batch=4) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as http:
            yield hf_dir, root / "run", run, url, http


def post(http, route, **body):
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(http, route, **body):
    with http.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


def log_softmax(run, ids):
    with torch.no_grad():
        logits, _ = run.model(torch.tensor([ids]), all_logits=True)
    return torch.log_softmax(logits[0].float(), dim=-1)  # (T, V)


def test_echo_and_logprobs_are_the_models_log_softmax(setup):
    _, _, run, _, http = setup
    text = CORPUS[0][:60]
    ids = run.tokenizer.encode(text)
    got = post(http, "/v1/completions", prompt=text, echo=True, logprobs=3, max_tokens=4, temperature=0)["choices"][0]
    lp = got["logprobs"]
    assert got["text"].startswith(text) and len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = log_softmax(run, ids)
    for pos in range(1, len(ids) + 4):  # the token at pos, given the tokens before it
        chosen, top = lp["token_logprobs"][pos], list(lp["top_logprobs"][pos].values())
        assert top == sorted(top, reverse=True) and 1 <= len(top) <= 3  # a dict: two ids of one text share a key
        if pos < len(ids):
            assert chosen == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
            assert top[0] == pytest.approx(ref[pos - 1].max().item(), abs=1e-4)
        else:  # greedy: each generated token is the most likely one
            assert chosen == pytest.approx(top[0], abs=1e-6)
    assert max(lp["top_logprobs"][len(ids)].values()) == pytest.approx(ref[-1].max().item(), abs=1e-4)  # the prefill's logits
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_token_prompts_score_only_with_max_tokens_zero(setup):
    _, _, run, _, http = setup
    ids = run.tokenizer.encode(CORPUS[1][:50])
    got = post(http, "/v1/completions", prompt=[ids, ids[:5]], echo=True, logprobs=1, max_tokens=0)["choices"]
    ref = log_softmax(run, ids)
    assert [c["finish_reason"] for c in got] == ["length", "length"]
    assert got[0]["logprobs"]["token_logprobs"][1:] == pytest.approx([ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)], abs=1e-4)
    assert len(got[1]["logprobs"]["tokens"]) == 5


def test_streamed_logprobs_equal_unstreamed(setup):
    _, _, _, _, http = setup
    body = dict(prompt=CORPUS[3][:40], echo=True, logprobs=2, max_tokens=6, temperature=0)
    whole = post(http, "/v1/completions", **body)["choices"][0]
    chunks = [c["choices"][0] for c in streamed(http, "/v1/completions", **body) if c["choices"]]
    parts = [c["logprobs"] for c in chunks if c["logprobs"]]
    joined = {k: sum((p[k] for p in parts), []) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == whole["logprobs"] and "".join(c["text"] for c in chunks) == whole["text"]
    chat = dict(messages=[{"role": "user", "content": "Hello"}], logprobs=True, top_logprobs=4, max_tokens=5, temperature=0)
    reply = post(http, "/v1/chat/completions", **chat)["choices"][0]
    content = reply["logprobs"]["content"]
    assert len(content) >= 1 and all(len(c["top_logprobs"]) == 4 for c in content)
    assert all(c["logprob"] == pytest.approx(c["top_logprobs"][0]["logprob"], abs=1e-6) for c in content)  # greedy
    assert bytes(b for c in content for b in c["bytes"]).decode(errors="replace").startswith(reply["message"]["content"])
    pieces = [c["choices"][0]["logprobs"] for c in streamed(http, "/v1/chat/completions", **chat) if c["choices"]]
    assert sum((p["content"] for p in pieces if p), []) == content


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 1.5}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_logprob_values_are_refused_naming_the_field(setup, route, body, param):
    _, _, _, _, http = setup
    r = http.post(route, json=body)
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["param"] == param


def test_lm_eval_local_completions_gives_quill_evals_results(setup, tmp_path):
    """The same multiple-choice and generate_until tasks through lm-eval's OpenAI-API backend on
    the served run and through `quill eval --tasks` on the run: the same per-request results."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from quillgpt.evaluate.harness import evaluate_tasks

    hf_dir, run_dir, _, url, _ = setup
    tasks = write_tasks(tmp_path / "tasks")
    names = ["tiny_mc", "tiny_gen"]
    ours = evaluate_tasks(run_dir, names, batch_size=2, include_path=tasks, log_samples=True)
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={hf_dir},max_length=33,model=run",
        tasks=names,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0,
    )
    mine, theirs = responses(ours), responses(served)
    got = [r[0][0] for r in mine["tiny_mc"]]
    assert got == pytest.approx([r[0][0] for r in theirs["tiny_mc"]], abs=1e-4)
    assert [r[0][1] for r in mine["tiny_mc"]] == [r[0][1] for r in theirs["tiny_mc"]]
    # the same tokens; bytes that end cut (a random model's) are one U+FFFD in the server's UTF-8
    # stream, one per byte in tokenizers' decode (which quill eval --tasks uses, as lm-eval's hf does)
    one = lambda rs: [re.sub("\ufffd+", "\ufffd", r[0]) for r in rs]
    assert one(mine["tiny_gen"]) == one(theirs["tiny_gen"]) and any(one(mine["tiny_gen"]))
    assert ours["results"]["tiny_mc"]["acc,none"] == served["results"]["tiny_mc"]["acc,none"]
