"""A model's chat template is untrusted code: the server renders it in a worker thread under the
template guard, so a slow one fails only its own request (a 500 error object), a refusal is a 400,
and /health and other requests are answered meanwhile."""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest
from serve_support import running_server, tiny_run_dir

import quillgpt.data.chat_template as ct

TEMPLATE = (
    "{% if messages[0].content == 'slow' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0].content == 'refuse' %}{{ raise_exception('no such turn') }}"
    "{% elif messages[0].content == 'zero' %}{{ 1/0 }}{% endif %}"
    "{% for m in messages %}{{ m.content }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, shakespeare_path):
    run_dir = tiny_run_dir(tmp_path_factory.mktemp("template") / "tiny", shakespeare_path)
    module = sys.modules[running_server.__module__]
    real = module.load_run

    def with_template(path):
        run = real(path)
        run.tokenizer.chat_template = TEMPLATE
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "load_run", with_template)
        mp.setattr(ct, "RENDER_SECONDS", 4.0)
        with running_server(run_dir, max_batch=2) as (url, _):
            yield url


def chat(url: str, content: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_a_slow_template_fails_only_its_own_request(server, caplog):
    slow: dict = {}
    thread = threading.Thread(target=lambda: slow.update(r=chat(server, "slow")))
    thread.start()
    time.sleep(0.3)
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    ok = chat(server, "hi")
    assert ok.status_code == 200 and thread.is_alive(), ok.text  # answered while the slow one still renders
    thread.join(30)
    r = slow["r"]
    assert r.status_code == 500 and "Traceback" not in r.text
    err = r.json()["error"]
    assert err["code"] == "chat_template_failed" and "took longer than 4 s" in err["message"]
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    ("content", "status", "text"), [("refuse", 400, "refused the conversation: no such turn"), ("zero", 500, "ZeroDivisionError")]
)
def test_a_template_failure_is_an_error_object(server, content, status, text):
    r = chat(server, content)
    assert r.status_code == status and text in r.json()["error"]["message"], r.text
