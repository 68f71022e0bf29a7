"""Request bodies of the OpenAI routes, parsed strictly: one clear error per bad field.

The body is read by hand (UTF-8, JSON, an object) and then validated by pydantic in strict mode
(no "5" for 5, no NaN, no unknown fields), so every way a body can be wrong maps to one
`APIError`: 400 for a body that is not a JSON object, 422 for a field of the wrong type or an
unknown field. Value ranges of the sampling settings are checked once, by `SamplingParams`.
OpenAI fields quill does not implement are accepted only at their neutral value. Logprobs are
OpenAI's: `logprobs` N ≤ 5 and `echo` for completions, `logprobs` + `top_logprobs` N ≤ 20 for chat.
`response_format`, `tools` and `tool_choice` are OpenAI's shapes (serve/structured.py gives them meaning).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quillgpt.serve.errors import APIError

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (None = the default)."""

    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # quill extra (0 or null = off)
    min_p: float | None = None  # quill extra
    repetition_penalty: float | None = None  # quill extra
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as a label for the caller's own logs
    presence_penalty: float | None = None  # neutral only (0)
    frequency_penalty: float | None = None  # neutral only (0)
    logit_bias: dict[str, float] | None = None  # neutral only (empty)


MAX_LOGPROBS = {"completions": 5, "chat": 20}  # OpenAI's limits on the alternatives per token


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # accepted: quill always holds the reply to the schema


class ResponseFormat(BaseModel):
    """OpenAI's response_format; json_object may carry a `schema` (llama.cpp's extension)."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, or token ids (as lm-eval sends them)
    echo: bool | None = None  # the prompt's tokens (and with logprobs their logprobs) before the completion
    logprobs: int | None = None  # each token's logprob and the top N alternatives (0..5)
    response_format: ResponseFormat | None = None  # the completion held to JSON (a schema)
    suffix: str | None = None  # neutral only (null)
    best_of: int | None = None  # neutral only (null or n)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @property
    def text(self) -> str:
        """The content as text: a string, or its text parts joined."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each reply token's logprob
    top_logprobs: int | None = None  # and the top N alternatives (0..20; needs logprobs: true)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced call is one call


class AttentionRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, schema: type[Body]) -> Body:
    """Raw request bytes → a validated request, or the APIError that says what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 (invalid byte at offset {e.start})", code="invalid_body") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        detail = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_body")
    try:  # a \ud800 escape decodes to a lone surrogate, which no text (and no tokenizer) can hold
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"the request body has a lone UTF-16 surrogate ({e.object[e.start]!a}) in a string or field name; send valid Unicode",
            code="invalid_body",
        ) from None
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _field_error(e) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _field_error(e: ValidationError) -> APIError:
    """One pydantic error as one line naming the field (e.g. messages.0.content): of a union's
    alternatives, the one that got furthest into the value."""
    located = [(".".join(str(p) for p in err["loc"] if not _is_type_tag(p)), err) for err in e.errors(include_url=False)]
    param, err = max(located, key=lambda pe: pe[0].count(".") + bool(pe[0]))
    param = param or None
    if param is None:  # the body as a whole (pydantic names no field)
        return APIError(422, f"the request body: {err['msg']}", code="invalid_body")
    if err["type"] == "extra_forbidden":
        return APIError(
            422,
            f"unknown field {param!r}; quill accepts OpenAI's fields and top_k, min_p, repetition_penalty",
            param=param,
            code="unknown_field",
        )
    if err["type"] == "missing":
        return APIError(422, f"{param} is required", param=param, code="missing_field")
    return APIError(422, f"{param}: {err['msg']}", param=param, code="invalid_type")


def _is_type_tag(part: Any) -> bool:
    """pydantic names the union member in the location (e.g. 'list[str]'); drop it from the path."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"})


def reject_unsupported(req: SamplingFields) -> None:
    """OpenAI features quill does not have are refused unless they are at their neutral value."""
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0}
    for name, value in neutral.items():
        got = getattr(req, name)
        if got is not None and got != value:
            raise APIError(400, f"{name} is not supported by quill (use repetition_penalty)", param=name, code="unsupported")
    checks = {
        "logit_bias": any(bias != 0 for bias in (req.logit_bias or {}).values()),  # {"1": 0} changes nothing
        "suffix": bool(getattr(req, "suffix", None)),
        "best_of": getattr(req, "best_of", None) not in (None, req.n or 1),
    }
    for name, used in checks.items():
        if used:
            raise APIError(400, f"{name} is not supported by quill", param=name, code="unsupported")


def logprob_count(req: CompletionRequest | ChatRequest) -> int | None:
    """How many alternatives each token reports (None: no logprobs), checked against OpenAI's limits."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        name, n = "top_logprobs", (req.top_logprobs or 0) if req.logprobs else None
        got = req.top_logprobs
    else:
        name, n, got = "logprobs", req.logprobs, req.logprobs
    most = MAX_LOGPROBS["chat" if isinstance(req, ChatRequest) else "completions"]
    if got is not None and not 0 <= got <= most:
        raise APIError(400, f"{name} must be between 0 and {most}, got {got}", param=name, code="invalid_value")
    return n


def stop_strings(stop: str | list[str] | None, max_count: int = 4, max_chars: int = 256) -> tuple[str, ...]:
    """`stop` as a tuple: at most `max_count` non-empty strings (OpenAI's limit is 4)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > max_count:
        raise APIError(400, f"stop takes at most {max_count} strings, got {len(stops)}", param="stop")
    for s in stops:
        if not s or len(s) > max_chars:
            raise APIError(400, f"each stop string must have 1 to {max_chars} characters", param="stop")
    return tuple(stops)
