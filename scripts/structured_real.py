"""response_format and tools on a real model through `quill serve`: does every reply hold?

Starts `quill serve` on 127.0.0.1 for --ckpt (an imported chat model whose template renders tools:
Qwen2.5-Coder-0.5B-Instruct, `quill import-gguf qwen2.5-coder-0.5b.gguf -o RUN`), then

  schemas   10 JSON schemas of everyday shapes (nested objects, enums, arrays, required fields,
            numbers with bounds, const) × 3 prompts, greedy: every reply must parse and validate
            (jsonschema), and the streamed reply must equal the unstreamed one
  named     the weather tool requested by name on 5 prompts: every call must parse and validate
  auto      the weather tool offered with tool_choice "auto" on 5 prompts (3 ask for the weather,
            2 do not): how often the model calls it where asked, and where not

The exit code is 1 when a schema reply or a named call fails (auto is a count, not a check).
--smoke runs 3 schemas × 1 prompt on a tiny random char model, whose transcript has no tools
section: its tools request must be a 400.

    python scripts/structured_real.py --ckpt out/qwen-coder
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx
import jsonschema
from harness import add_common, machine_line, serve, skipped, tiny_run


def obj(properties: dict, required: list[str] | None = None) -> dict:
    """An object schema with these properties, all required unless said, nothing else allowed."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


TEXT = {"type": "string", "maxLength": 40}  # bounded strings and decimals (multipleOf): a small model may go on writing
SCHEMAS = {
    "person": obj({"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": TEXT}),
    "address": obj({"name": TEXT, "address": obj({"street": TEXT, "city": TEXT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    "weather": obj(
        {
            "city": TEXT,
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "temperature": {"type": "number", "minimum": -60, "maximum": 60, "multipleOf": 0.1},
        }
    ),
    "todo": obj({"title": TEXT, "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}}),
    "shopping": obj(
        {
            "items": {
                "type": "array",
                "items": obj({"name": TEXT, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}),
                "minItems": 1,
                "maxItems": 5,
            }
        }
    ),
    "book": obj(
        {
            "title": TEXT,
            "author": TEXT,
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "tags": {"type": "array", "items": TEXT, "maxItems": 4},
        },
        ["title", "author", "year"],
    ),
    "rating": obj(
        {"product": TEXT, "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": {"type": "string", "maxLength": 80}}
    ),
    "event": obj(
        {
            "name": TEXT,
            "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]},
            "attendees": {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 4},
        }
    ),
    "api": obj(
        {
            "version": {"const": "v1"},
            "status": {"enum": ["ok", "error"]},
            "data": obj(
                {
                    "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}, "maxItems": 5},
                }
            ),
        }
    ),
    "point": obj(
        {
            "x": {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.01},
            "y": {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.01},
            "label": TEXT,
        },
        ["x", "y"],
    ),
}
PROMPTS = [
    "Give me an example {name} as JSON.",
    "Make up a realistic {name} record for a test database. Reply with JSON only.",
    "I need sample data: one {name}, in JSON.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": obj({"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    },
}
ASKS = [  # (prompt, does it ask for the weather)
    ("What's the weather like in Paris right now?", True),
    ("Is it raining in Tokyo today? Please check.", True),
    ("How warm is it in Berlin at the moment, in celsius?", True),
    ("Write a Python function that reverses a string.", False),
    ("What is 17 times 23?", False),
]


def chat(http: httpx.Client, body: dict) -> tuple[int, dict]:
    r = http.post("/v1/chat/completions", json=body)
    return r.status_code, r.json()


def streamed(http: httpx.Client, body: dict) -> tuple[str, str | None, list[dict]]:
    """A streamed chat reply: its content, finish reason and tool calls (name, arguments) as the deltas built them."""
    text, finish, calls = "", None, {}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice["delta"]
                text += delta.get("content") or ""
                finish = choice["finish_reason"] or finish
                for call in delta.get("tool_calls") or []:
                    got = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    got["name"] += call["function"].get("name") or ""
                    got["arguments"] += call["function"].get("arguments") or ""
    return text, finish, [calls[i] for i in sorted(calls)]


def check_schema(http: httpx.Client, name: str, schema: dict, prompt: str, max_tokens: int) -> list[str]:
    """One schema × prompt, unstreamed and streamed: what went wrong (nothing: [])."""
    body = {"messages": [{"role": "user", "content": prompt.format(name=name)}], "temperature": 0, "max_tokens": max_tokens}
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    status, got = chat(http, body)
    if status != 200:
        return [f"HTTP {status}: {got}"]
    choice, wrong = got["choices"][0], []
    text = choice["message"]["content"]
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        wrong.append(f"invalid ({choice['finish_reason']}): {str(e).splitlines()[0][:100]}: {text[:120]!r}")
    s_text, s_finish, _ = streamed(http, body)
    if (s_text, s_finish) != (text, choice["finish_reason"]):
        wrong.append(f"streamed differs: {s_text[:80]!r} ({s_finish}) vs {text[:80]!r} ({choice['finish_reason']})")
    return wrong


def run_schemas(http: httpx.Client, names: list[str], prompts: list[str], max_tokens: int) -> int:
    failures = 0
    print(f"\n{'schema':<10} {'valid':>6} {'stream=':>8}  first reply", flush=True)
    for name in names:
        results = [check_schema(http, name, SCHEMAS[name], p, max_tokens) for p in prompts]
        bad = [w for ws in results for w in ws]
        failures += len(bad)
        valid = sum(not any(w.startswith(("invalid", "HTTP")) for w in ws) for ws in results)
        same = sum(not any(w.startswith("streamed") for w in ws) for ws in results)
        print(f"{name:<10} {valid:>4}/{len(prompts)} {same:>6}/{len(prompts)}  {'; '.join(bad)[:160]}", flush=True)
    return failures


def run_tools(http: httpx.Client, max_tokens: int) -> int:
    """The named call on every prompt (must parse), then auto (counted)."""
    failures, params = 0, WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    print("\nnamed get_weather:", flush=True)
    for prompt, _ in ASKS:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "tools": [WEATHER],
            "tool_choice": named,
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        status, got = chat(http, body)
        calls = got["choices"][0]["message"].get("tool_calls") or [] if status == 200 else []
        try:
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), params)
            _, s_finish, s_calls = streamed(http, body)
            ok = s_finish == "tool_calls" and s_calls == [{k: calls[0]["function"][k] for k in ("name", "arguments")}]
        except (IndexError, ValueError, jsonschema.ValidationError):
            ok = False
        failures += not ok
        print(f"  {'ok ' if ok else 'BAD'} {prompt[:50]:<50} {calls[0]['function']['arguments'] if calls else got}", flush=True)
    print("\nauto:", flush=True)
    hits = {True: 0, False: 0}
    for prompt, asks in ASKS:
        body = {"messages": [{"role": "user", "content": prompt}], "tools": [WEATHER], "temperature": 0, "max_tokens": max_tokens}
        status, got = chat(http, body)
        message = got["choices"][0]["message"] if status == 200 else {}
        called = bool(message.get("tool_calls"))
        hits[asks] += called
        shown = message["tool_calls"][0]["function"] if called else (message.get("content") or str(got))[:60]
        print(f"  {'asks ' if asks else 'other'} {'called' if called else 'text  '} {prompt[:50]:<50} {shown}", flush=True)
    asked = sum(a for _, a in ASKS)
    print(f"auto: called where asked {hits[True]}/{asked}, where not asked {hits[False]}/{len(ASKS) - asked}", flush=True)
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--ckpt", help="an imported chat model whose template renders tools (Qwen2.5)")
    p.add_argument("--max-tokens", type=int, default=300, help="per reply")
    p.add_argument("--quantize", help="passed to quill serve (e.g. int8)")
    args = p.parse_args()
    if not args.smoke and not args.ckpt:
        raise SystemExit("error: --ckpt RUN is needed, or --smoke")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_run(Path(tmp) / "tiny") if args.smoke else args.ckpt
        flags = ["--max-batch", "2"] + (["--quantize", args.quantize] if args.quantize else [])
        print(machine_line(), flush=True)
        proc, url, _ = serve(ckpt, *flags)
        try:
            with httpx.Client(base_url=url, timeout=1800) as http:
                names, prompts = (["todo", "api", "point"], PROMPTS[:1]) if args.smoke else (list(SCHEMAS), PROMPTS)
                failures = run_schemas(http, names, prompts, args.max_tokens)
                if args.smoke:
                    status, _ = chat(http, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
                    failures += status != 400
                    skipped("tools", f"the smoke model has no chat template: its tools request is a {status}")
                else:
                    failures += run_tools(http, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\n{'all replies held' if not failures else f'{failures} failure(s)'}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
