"""response_format and tools: a request's fields → the template's tools, a grammar, tool calls back.

`response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
...}}) holds every choice to JSON (matching the schema) by constrained decoding
(inference/constraint.py, the `structured` extra): the reply is whole JSON and ends there.
`tools` are rendered by the model's own chat template (one that reads `tools` and writes calls
as <tool_call>{json}</tool_call>, as Qwen2.5's; any other is refused with a 400). With
tool_choice "auto" (the default with tools) the reply's calls are parsed back into tool_calls;
"required" or a named function constrains the reply to one call, so it always parses (a forced
call takes precedence over response_format); "none" shows the tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from quillgpt.data.chat_template import TOOL_CALL_TAGS, Message, Tool, tools_refusal
from quillgpt.data.tokenizer import Tokenizer
from quillgpt.errors import QuillError
from quillgpt.inference.constraint import Grammar, InvalidGrammar, json_grammar, tool_call_grammar
from quillgpt.serve.errors import APIError
from quillgpt.serve.schemas import ChatMessage, ChatRequest, CompletionRequest, ResponseFormat

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
OPEN, CLOSE = TOOL_CALL_TAGS
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)  # the last may be cut by its end of turn
BARE = re.compile(r"^```(?:json)?\s*|\s*```$")  # a fence around a bare call
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tools:
    """A request's tools as its template gets them, and whether the reply's calls are parsed."""

    tools: list[Tool]
    names: frozenset[str]
    parse: bool  # tool_choice is not "none"
    forced: str | None  # "required", a function's name, or None (auto / none)


def template_message(m: ChatMessage) -> Message:
    """A request's message as chat templates take it (transformers' shape: a call's arguments as a
    mapping where they parse as one, so templates can write them with tojson)."""
    out: Message = {"role": m.role, "content": m.text}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def request_tools(req: ChatRequest, template: str | None) -> Tools | None:
    """The request's tools, checked (names, tool_choice, the template's support), or None without any."""
    uses_tools = any(m.role == "tool" or m.tool_calls for m in req.messages)
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools: give the functions in tools", param="tool_choice", code="invalid_value")
        if uses_tools and (why := tools_refusal(template)) is not None:
            raise APIError(400, f"the messages hold tool calls or results, but {why}", param="messages", code="unsupported")
        return None
    names = [t.function.name for t in req.tools]
    for i, name in enumerate(names):
        if not FUNCTION_NAME.fullmatch(name):
            raise APIError(
                400, f"tools.{i}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", param=f"tools.{i}.function.name"
            )
    if len(set(names)) < len(names):
        raise APIError(400, "two tools share a function name; each needs its own", param="tools", code="invalid_value")
    why = tools_refusal(template)
    if why is not None:
        raise APIError(400, f"tools are not supported: {why}", param="tools", code="unsupported")
    choice = req.tool_choice or "auto"
    forced = choice if choice == "required" else None if isinstance(choice, str) else choice.function.name
    if forced is not None and forced != "required" and forced not in names:
        raise APIError(400, f"tool_choice names {forced!r}, which is not among the tools ({', '.join(names)})", param="tool_choice")
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
    return Tools(tools, frozenset(names), choice != "none", forced)


def request_grammar(req: ChatRequest | CompletionRequest, tools: Tools | None, tokenizer: Tokenizer, vocab_size: int) -> Grammar | None:
    """The grammar every choice is held to (None: free text): a forced tool call, else the
    response_format. Slow the first time (llguidance reads the vocabulary): run it off the event loop."""
    forced = tools is not None and tools.forced is not None
    schema, param = (None, "tools") if forced else _format_schema(req.response_format)
    if param is None:
        return None
    try:
        if forced:
            return _call_grammar(req, tools, tokenizer, vocab_size)
        return Grammar.compile(json_grammar(schema), tokenizer, vocab_size, what=f"the schema in {param}")
    except InvalidGrammar as e:
        raise APIError(400, str(e), param=param, code="invalid_schema") from None
    except QuillError as e:  # the structured extra is not installed
        raise APIError(400, str(e), param=param, code="unsupported") from None


def _format_schema(fmt: ResponseFormat | None) -> tuple[dict[str, Any] | None, str | None]:
    """(the schema, the field that holds it) of a response_format; param None: free text."""
    if fmt is None or fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return fmt.schema_, "response_format.schema" if fmt.schema_ is not None else "response_format"
    if fmt.json_schema is None:
        raise APIError(
            400,
            'response_format of type json_schema needs a "json_schema": {"name": ..., "schema": {...}}',
            param="response_format.json_schema",
        )
    return fmt.json_schema.schema_, "response_format.json_schema.schema"


def _call_grammar(req: ChatRequest, tools: Tools, tokenizer: Tokenizer, vocab_size: int) -> Grammar:
    """One call of the forced function (or of any tool, "required"), in the template's wrapper:
    {"name": its name, "arguments": its parameters schema}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or NO_ARGUMENTS},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in req.tools
        if tools.forced in ("required", t.function.name)
    ]
    what = "the tools' parameters schemas" if len(calls) > 1 else "the function's parameters schema"
    return Grammar.compile(tool_call_grammar(OPEN + "\n", "\n" + CLOSE, calls), tokenizer, vocab_size, what=what)


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """A reply's text → (its content without the calls, None if nothing is left; the calls in
    OpenAI's shape). A call whose JSON does not parse, or names no tool, stays in the content. A
    reply that is nothing but one call's JSON, without the tags (in a ```json fence or not), is that
    call: small models write them bare (Qwen2.5-Coder-0.5B does, for every call it makes)."""
    bare = _call(BARE.sub("", text.strip()), names)
    if bare is not None:
        return None, [bare]
    calls, kept, at = [], [], 0
    for match in CALL.finditer(text):
        call = _call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else text, calls


def _call(body: str, names: frozenset[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": value["name"], "arguments": arguments}}
