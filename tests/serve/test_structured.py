"""response_format and tools on `quill serve`, against a tiny imported Qwen2-style model whose chat
template has a tools section (as Qwen2.5's): every reply held to a JSON schema parses and
validates, streamed = unstreamed, a named or required tool call always parses, bad schemas and
templates without tools are 400s naming what is wrong. Ported from llama.cpp's server tests
(tools/server/tests/unit/test_chat_completion.py, test_tool_call.py): `const` schemas and invalid
response formats refused with an error object."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from hf_support import make_hf_model  # noqa: E402
from serve_support import running_server  # noqa: E402

from quillgpt.interop.convert import import_hf  # noqa: E402
from quillgpt.serve.errors import APIError  # noqa: E402
from quillgpt.serve.schemas import ChatRequest  # noqa: E402
from quillgpt.serve.structured import parse_tool_calls, request_tools  # noqa: E402

# A Qwen2.5-shaped template (tools listed in the system turn, calls as <tool_call>{json}</tool_call>)
QWEN_TOOLS = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions. Their signatures are within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each call, return a JSON object with its name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "ok": {"type": "boolean"},
        },
        "required": ["colour", "score", "ok"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "const": {"const": "42"},
    "list_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "kind": {"const": "item"}},
            "required": ["id", "kind"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Tell me about the weather."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    hf_dir = make_hf_model(root / "hf", "qwen2")
    (hf_dir / "chat_template.jinja").write_text(QWEN_TOOLS)
    import_hf(hf_dir, root / "run")
    with running_server(root / "run", max_batch=4) as (url, _):
        yield url


class Chat:
    """The openai client's chat.completions.create on the served model."""

    def __init__(self, url):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def create(self, **body):
        return self.client.chat.completions.create(model=self.model, **body)


@pytest.fixture(scope="module")
def client(server):
    return Chat(server)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def stream_text(client, **body):
    """A streamed chat reply: (its content, its finish reason, its tool calls as the deltas built them)."""
    text, finish, calls = "", None, {}
    for chunk in client.create(stream=True, **body):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                got = calls.setdefault(call.index, {"name": "", "arguments": ""})
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
    return text, finish, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_reply_validates_and_streams_the_same(client, name):
    schema = SCHEMAS[name]
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        body = dict(messages=ASK, response_format=schema_format(schema), max_tokens=120, **settings)
        whole = client.create(**body).choices[0]
        assert whole.finish_reason == "stop", whole
        jsonschema.validate(json.loads(whole.message.content), schema)
        text, finish, _ = stream_text(client, **body)
        assert (text, finish) == (whole.message.content, "stop")


def test_a_free_reply_beside_a_constrained_one_is_the_one_it_gets_alone(client):
    free = dict(messages=[{"role": "user", "content": "Say something."}], max_tokens=40, temperature=0.9, seed=5)
    alone = client.create(**free).choices[0].message.content
    held = dict(messages=ASK, response_format=schema_format(SCHEMAS["nested"]), max_tokens=120, temperature=0.9, seed=5)
    with ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(client.create, **held)
        beside = pool.submit(client.create, **free)
        assert beside.result().choices[0].message.content == alone
        jsonschema.validate(json.loads(constrained.result().choices[0].message.content), SCHEMAS["nested"])


def test_const_schema_as_llama_cpp_tests_it(client):
    reply = client.create(messages=ASK, response_format=schema_format({"const": "foooooo"}), max_tokens=10)
    assert reply.choices[0].message.content == '"foooooo"'
    reply = client.create(messages=ASK, response_format={"type": "json_object", "schema": {"const": "42"}}, max_tokens=6)
    assert reply.choices[0].message.content == '"42"'


def test_json_object_is_an_object(client):
    reply = client.create(messages=ASK, response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # a random model's object may outrun max_tokens; when it ends, it is whole
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


def test_completions_take_a_response_format(server):
    body = {"prompt": "A colour:", "max_tokens": 40, "temperature": 0, "response_format": schema_format(SCHEMAS["enum_and_bounds"])}
    got = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    jsonschema.validate(json.loads(got["text"]), SCHEMAS["enum_and_bounds"])


@pytest.mark.parametrize(
    "fmt,status,names",
    [
        ({"type": "sound"}, 422, "response_format.type"),
        ({"type": "json_object", "schema": 123}, 422, "response_format.schema"),
        ({"type": "json_object", "schema": {"type": 123}}, 400, "type must be"),
        ({"type": "json_object", "schema": {"type": "hiccup"}}, 400, "hiccup"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(?<=a)b"}}}, 400, "look-around"),
        ({"type": "json_schema"}, 400, "json_schema"),
    ],
)
def test_invalid_response_formats_are_refused_naming_what_is_wrong(server, fmt, status, names):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": ASK, "response_format": fmt}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert names in error["message"] + (error["param"] or "") and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_tool_call_always_parses(client, choice):
    for seed in range(3):
        body = dict(messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, temperature=1.0, seed=seed, max_tokens=200)
        reply = client.create(**body).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        (call,) = reply.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if choice != "required":
            assert call.function.name == "get_weather"
        text, finish, calls = stream_text(client, **body)
        assert finish == "tool_calls" and calls == [{"name": call.function.name, "arguments": call.function.arguments}]
        assert text == (reply.message.content or "")


def test_a_conversation_with_tool_calls_and_results(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = client.create(messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_errors(server):
    bad = [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": [WEATHER, WEATHER]}, "share a function name"),
        ({"tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "hiccup"}}}], "tool_choice": "required"}, "hiccup"),
    ]
    for extra, says in bad:
        r = httpx.post(server + "/v1/chat/completions", json={"messages": ASK, **extra}, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("template", [None, "{% for m in messages %}{{ m.content }}{% endfor %}"])
def test_a_template_without_tools_is_a_400(template):
    req = ChatRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    with pytest.raises(APIError) as info:
        request_tools(req, template)
    assert info.value.status == 400 and info.value.param == "tools" and "tools" in info.value.message


def test_tool_calls_are_parsed_from_the_reply():
    names = frozenset({"get_weather"})
    content, calls = parse_tool_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', names
    )
    assert content == "Let me look." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    for text in ("no call here", '<tool_call>{"name": "other", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>"):
        assert parse_tool_calls(text, names) == (text, [])
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {}}', names)  # cut by its end of turn
    assert len(calls) == 1
    for bare in (
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',
    ):
        content, calls = parse_tool_calls(bare, names)  # the whole reply one call, without the tags
        assert content is None and calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    text = 'Here: {"name": "get_weather", "arguments": {}} and more'
    assert parse_tool_calls(text, names) == (text, [])


def test_the_extra_missing_is_a_400_naming_it(server, monkeypatch):
    from quillgpt.errors import QuillError
    from quillgpt.inference import constraint

    def missing():
        raise QuillError(f"structured output (response_format, tools) needs the llguidance library: {constraint.INSTALL}")

    monkeypatch.setattr(constraint, "_llguidance", missing)
    r = httpx.post(server + "/v1/chat/completions", json={"messages": ASK, "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 400 and "quillgpt[structured]" in r.json()["error"]["message"]
