"""Chat templates: a conversation → the text a model continues, and where each turn ends.

A model imported from Hugging Face brings its own template (Jinja, in tokenizer_config.json or
chat_template.jinja). It is untrusted code from the Hub, so it is rendered as transformers renders
it: a sandboxed, immutable Jinja environment with trim_blocks and lstrip_blocks, loop controls,
the `{% generation %}` tag, and the same helpers (tojson, raise_exception, strftime_now, dict,
namespace), given the messages, add_generation_prompt and the special tokens (bos_token,
eos_token). The reply ends at the template's end-of-turn token (a stop id). A request's tools
reach the template as apply_chat_template(tools=...) passes them; `tools_refusal` says when a
template cannot take them (it never reads `tools`, or writes calls in a format quill does not parse).

quill's own models are base models (trained to continue text), so their chat is a transcript:

    System: <content>

    User: <content>

    Assistant:

and the reply ends where the model starts the next turn (TRANSCRIPT_STOPS, never part of it).

Training on conversations (`data.format: chat`) needs to know which of a conversation's tokens are
the assistant's (`conversation_tokens`): the loss is taken on those only. A template with
`{% generation %}` tags marks them itself: every token overlapping a tagged span, as
transformers' apply_chat_template(return_assistant_tokens_mask=True) finds them. Otherwise, for
each assistant turn, the conversation up to it is rendered with the generation prompt (the
prompt the model answers at inference) and through it: the turn's tokens are those between the
two (up to the template's end-of-turn token, which they include), provided both are token for
token the start of the whole conversation's ids. A template
that renders a turn differently once more follows (not prefix-stable), or whose tokens merge
across a turn's edge, is refused: its assistant tokens cannot be found exactly. In the
transcript, an assistant turn runs through its blank line and the next turn's header ("User:",
or "System:"): what makes a reply stop at inference is part of what the assistant learns to write.
"""

from __future__ import annotations

import re
import sys
import time
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from quillgpt.errors import QuillError

if TYPE_CHECKING:
    from collections.abc import Callable

    from quillgpt.data.tokenizer import Tokenizer

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
TRANSCRIPT_STOPS = ("\nUser:", "\nSystem:")
Message = dict[str, Any]  # {"role": ..., "content": ...} (an assistant's may carry tool_calls, a tool's a tool_call_id)
Tool = dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")  # Hermes / Qwen2.5: each call a JSON object between these
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
TEMPLATE_NAME = "the model's chat template"
RENDER_SECONDS = 10.0  # a rendering past this is stopped (a template's loop that never ends)
RENDER_CHARS = 1 << 24  # a rendering longer than this is stopped (a value inside it: template_sandbox.MAX_CHARS)
TRACE_EVERY = 64  # the time limit is checked every this many of the template's lines and calls


class TemplateRefused(QuillError):
    """The template refused the conversation (raise_exception, a field it needs): the messages' fault."""


class TemplateFailed(QuillError):
    """The template itself fails (syntax, an exception, a loop past the time or size limit): the model's fault."""


class _Refused(Exception):
    """What a template's raise_exception() raises."""


def transcript(messages: list[Message], add_generation_prompt: bool = True) -> str:
    """quill's template: each turn as `Role: content` and a blank line; then `Assistant:`."""
    turns = "".join(f"{ROLE_NAMES[m['role']]}: {m['content']}\n\n" for m in messages)
    return turns + ("Assistant:" if add_generation_prompt else "")


def _compiled(template: str, name: str = TEMPLATE_NAME) -> Any:
    """The template compiled, or one TemplateFailed naming it and what is wrong (syntax, or any
    other failure of the compiler: recursion on a deeply nested expression, memory)."""
    try:
        return _compile(template)
    except Exception as e:  # noqa: BLE001 - untrusted code: every failure is the template's
        raise TemplateFailed(f"{name} does not compile: {_what(e)}; fix or replace the template") from None


def _what(e: BaseException) -> str:
    """An exception as one short line: its type (the plain ones need it: ZeroDivisionError) and message."""
    import jinja2

    from quillgpt.data.template_sandbox import Stopped

    text = " ".join(str(e).split())[:200]
    if isinstance(e, Stopped):
        return text
    if isinstance(e, jinja2.TemplateSyntaxError) and e.lineno:
        text = f"{text} (line {e.lineno})"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The template compiled in transformers' sandbox (see the module docstring)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    from quillgpt.data.template_sandbox import Sandbox

    class Generation(Extension):
        """`{% generation %}…{% endgeneration %}` marks the assistant's text; rendered as is. While
        a render is tracked (render_spans), each block's place in the text is recorded."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.tracked: ContextVar[tuple[list[str], list] | None] = ContextVar("generation_spans", default=None)
            environment.extend(generation_spans=self.tracked)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            text = caller()
            if (tracked := self.tracked.get()) is not None:
                blocks, spans = tracked  # the text rendered so far, in blocks
                start = sum(map(len, blocks))
                spans.append((start, start + len(text), text))
            return text

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")
            super().__setitem__(name, value)

    class Dict:
        """dict() and dict.fromkeys() for templates, and nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise _Refused(message)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])  # tojson: its own
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt), dict=Dict(), namespace=Namespace
    )
    return env.from_string(template)


def guarded(template: str, run: Callable[[Any], list[str]], name: str = TEMPLATE_NAME, seconds: float | None = None) -> str:
    """run(compiled template) → its text, as one guard around untrusted code: the template is
    compiled, and rendered under a line tracer (this thread's) that stops it past `seconds`, even
    in a loop that calls nothing and writes nothing. Every failure is one QuillError naming the
    template and the error: TemplateRefused when the template refused the conversation
    (raise_exception, a value it needs), TemplateFailed for anything else."""
    import jinja2

    from quillgpt.data.template_sandbox import Stopped

    compiled = _compiled(template, name)
    seconds = RENDER_SECONDS if seconds is None else seconds
    deadline, count = time.monotonic() + seconds, 0

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        if count % TRACE_EVERY == 0 and time.monotonic() > deadline:
            raise Stopped(f"the rendering took longer than {seconds:g} s")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:  # the template's own frames are traced line by line
        on_line(frame, event, arg)
        return on_line if frame.f_code.co_filename == "<template>" else None

    before = sys.gettrace()
    sys.settrace(on_call)
    try:
        return "".join(run(compiled))
    except (jinja2.UndefinedError, _Refused) as e:
        raise TemplateRefused(f"{name} refused the conversation: {' '.join(str(e).split())[:200]}") from None
    except Exception as e:  # noqa: BLE001 - untrusted code: every failure is the template's
        raise TemplateFailed(f"{name} failed while rendering: {_what(e)}; fix or replace the template") from None
    finally:
        sys.settrace(before)


def _capped(pieces: Any, out: list[str]) -> list[str]:
    """A rendering's pieces appended to `out` as they come (the {% generation %} tracker reads
    it), stopped once they pass `limit` characters."""
    from quillgpt.data.template_sandbox import Stopped

    size, limit = 0, RENDER_CHARS
    for piece in pieces:
        size += len(piece)
        if size > limit:
            raise Stopped(f"the rendering is longer than {limit:,} characters")
        out.append(piece)
    return out


def render(
    template: str,
    messages: list[Message],
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    name: str = TEMPLATE_NAME,
    tools: list[Tool] | None = None,
) -> str:
    """The conversation as the model's template writes it (what apply_chat_template(tokenize=False,
    tools=tools) gives)."""
    return render_spans(template, messages, add_generation_prompt, bos_token, eos_token, name, tools)[0]


def render_spans(
    template: str,
    messages: list[Message],
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    name: str = TEMPLATE_NAME,
    tools: list[Tool] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the [start, end) characters of each {% generation %} block in it),
    tracked as transformers tracks them: by the text rendered before each block."""
    blocks: list[str] = []
    spans: list[tuple[int, int, str]] = []

    def run(compiled: Any) -> list[str]:
        token = compiled.environment.generation_spans.set((blocks, spans))
        try:
            pieces = compiled.generate(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                tools=tools,
                documents=None,
            )
            return _capped(pieces, blocks)
        finally:
            compiled.environment.generation_spans.reset(token)

    guarded(template, run, name)
    text = "".join(blocks)
    if any(text[start:end] != block for start, end, block in spans):  # rendered inside a buffer (a macro, a set block)
        raise QuillError(
            "the chat template's {% generation %} blocks are not where their text lands in the rendering; "
            "keep them at the template's top level"
        )
    return text, [(start, end) for start, end, _ in spans]


def end_of_turn(template: str, special_tokens: list[str], bos_token: str | None = None, eos_token: str | None = None) -> str | None:
    """The special token the template writes right after an assistant's reply (<|im_end|>,
    <|eot_id|>, ...): where a reply generated from this template ends. None if there is none."""
    probe = "quill-end-of-turn-probe"
    try:
        text = render(
            template,
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
            add_generation_prompt=False,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except QuillError:
        return None
    after = text[text.find(probe) + len(probe) :] if probe in text else ""
    return next((t for t in sorted(special_tokens, key=len, reverse=True) if after.lstrip(" ").startswith(t)), None)


# ---------------------------------------------------------------------------------------------
# a conversation → the ids a model trains on, and which of them are the assistant's


def template_messages(messages: list[Message]) -> list[Message]:
    """The messages as a template gets them: OpenAI's "developer" is the templates' "system"."""
    return [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]


def conversation_ids(
    tokenizer: Tokenizer, messages: list[Message], add_generation_prompt: bool, tools: list[Tool] | None = None
) -> list[int]:
    """The ids of a conversation as the model reads it: its template's rendering (special tokens
    read as such, nothing added: templates write their own BOS), or quill's transcript after the
    tokenizer's BOS, as every prompt starts. `tools`: given to the template (check tools_refusal first)."""
    if tokenizer.chat_template is not None:
        text = render(
            tokenizer.chat_template,
            template_messages(messages),
            add_generation_prompt,
            getattr(tokenizer, "bos_token", None),
            getattr(tokenizer, "eos_token", None),
            tools=tools,
        )
        return tokenizer.encode(text)
    return _bos(tokenizer) + tokenizer.encode(transcript(messages, add_generation_prompt))


def tools_refusal(template: str | None) -> str | None:
    """Why tools cannot be given to a model with this template (None: they can). It must read the
    `tools` variable (a template without a tools section would drop them silently) and write calls
    as TOOL_CALL_TAGS, the format quill parses back into tool calls."""
    if template is None:
        return (
            "this model has no chat template (quill's transcript has no tools section); "
            "serve a model whose template renders tools, such as Qwen2.5's"
        )
    import jinja2.meta

    if "tools" not in jinja2.meta.find_undeclared_variables(_compiled(template).environment.parse(template)):
        return "the model's chat template has no tools section (it never reads `tools`), so the model cannot be shown tools"
    if TOOL_CALL_TAGS[0] not in template:
        return (
            "the model's chat template writes tool calls in a format quill does not parse "
            f"(quill reads {TOOL_CALL_TAGS[0]}{{json}}{TOOL_CALL_TAGS[1]}, as Qwen2.5's)"
        )
    return None


def _bos(tokenizer: Tokenizer) -> list[int]:
    return [] if tokenizer.bos_id is None else [tokenizer.bos_id]


def _turn_end(messages: list[Message], i: int) -> str:
    """What the transcript's assistant turn i learns to write after its blank line: the header of
    the turn that follows (a user's when none does), which the chat's stop strings catch."""
    after = messages[i + 1]["role"] if i + 1 < len(messages) else "user"
    return "" if after == "assistant" else f"{ROLE_NAMES[after]}:"


def _transcript_through(tokenizer: Tokenizer, messages: list[Message], i: int) -> list[int]:
    return _bos(tokenizer) + tokenizer.encode(transcript(messages[: i + 1], False) + _turn_end(messages, i))


def conversation_tokens(tokenizer: Tokenizer, messages: list[Message], limit: int | None = None) -> tuple[list[int], list[bool]]:
    """(ids of the whole conversation, True for each id that is the assistant's): see the module
    docstring. One QuillError when the assistant's tokens cannot be found exactly. With `limit`,
    only the first `limit` ids' flags are found (a training row is cut there): the assistant turns
    that start at or past it are neither rendered on their own nor marked, so the time is linear in
    the conversation's length, not quadratic (each turn's check renders the conversation up to it)."""
    template = tokenizer.chat_template
    if template is not None and GENERATION_TAG.search(template):
        return _tagged_tokens(tokenizer, messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if template is None:
        last = len(messages) - 1
        ids = _transcript_through(tokenizer, messages, last) if last in turns else conversation_ids(tokenizer, messages, False)
    else:
        ids = conversation_ids(tokenizer, messages, False)
    mask = [False] * len(ids)
    for n, i in enumerate(turns, 1):
        before = conversation_ids(tokenizer, messages[:i], True)
        if limit is not None and len(before) >= limit and before[:limit] == ids[:limit]:  # this turn and later ones start past it
            break
        if i == len(messages) - 1:  # the last turn: through it is the whole conversation
            through = ids
        elif template is None:
            through = _transcript_through(tokenizer, messages, i)
        else:
            through = conversation_ids(tokenizer, messages[: i + 1], False)
        if ids[: len(before)] != before or ids[: len(through)] != through or len(through) <= len(before):
            raise QuillError(
                f"the chat template does not render assistant turn {n} as the start of the whole conversation, token "
                "for token (not prefix-stable), so the assistant's tokens cannot be found exactly; a template with "
                "{% generation %} tags marks them itself"
            )
        end = _reply_end(through, len(before), tokenizer.stop_ids)
        mask[len(before) : end] = [True] * (end - len(before))
    return ids, mask


def _reply_end(ids: list[int], start: int, stop_ids: tuple[int, ...]) -> int:
    """Where an assistant turn ids[start:] ends: right after its last end-of-turn id, where it has
    one (what a template writes after that token, e.g. ChatML's newline, is never generated)."""
    ends = [i + 1 for i in range(start, len(ids)) if ids[i] in stop_ids]
    return ends[-1] if ends else len(ids)


def _tagged_tokens(tokenizer: Tokenizer, messages: list[Message]) -> tuple[list[int], list[bool]]:
    """The {% generation %} spans as tokens: every token overlapping a span (transformers' rule)."""
    text, spans = render_spans(
        tokenizer.chat_template,
        template_messages(messages),
        False,
        getattr(tokenizer, "bos_token", None),
        getattr(tokenizer, "eos_token", None),
    )
    ids, offsets = tokenizer.encode_offsets(text)
    mask = [any(start < hi and end > lo for lo, hi in spans) for start, end in offsets]
    return ids, mask
