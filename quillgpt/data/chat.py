"""Chat templates: a conversation → the text a model continues, and where each turn ends.

A model imported from Hugging Face brings its own template (Jinja, in tokenizer_config.json or
chat_template.jinja). It is untrusted code from the Hub, so it is rendered as transformers renders
it: a sandboxed, immutable Jinja environment with trim_blocks and lstrip_blocks, loop controls,
the `{% generation %}` tag, and the same helpers (tojson, raise_exception, strftime_now, dict,
namespace), given the messages, add_generation_prompt and the special tokens (bos_token,
eos_token). The reply ends at the template's end-of-turn token (a stop id).

quill's own models are base models (trained to continue text), so their chat is a transcript:

    System: <content>

    User: <content>

    Assistant:

and the reply ends where the model starts the next turn (TRANSCRIPT_STOPS, never part of it).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from quillgpt.errors import QuillError

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
TRANSCRIPT_STOPS = ("\nUser:", "\nSystem:")
Message = dict[str, str]  # {"role": ..., "content": ...}


def transcript(messages: list[Message], add_generation_prompt: bool = True) -> str:
    """quill's template: each turn as `Role: content` and a blank line; then `Assistant:`."""
    turns = "".join(f"{ROLE_NAMES[m['role']]}: {m['content']}\n\n" for m in messages)
    return turns + ("Assistant:" if add_generation_prompt else "")


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """The template compiled in transformers' sandbox (see the module docstring)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}…{% endgeneration %}` marks the assistant's text; rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

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
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)


def render(template: str, messages: list[Message], add_generation_prompt: bool = True,
           bos_token: str | None = None, eos_token: str | None = None) -> str:
    """The conversation as the model's template writes it (what apply_chat_template(tokenize=False) gives)."""
    import jinja2

    try:
        return _compiled(template).render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                          bos_token=bos_token, eos_token=eos_token, tools=None, documents=None)
    except jinja2.TemplateError as e:
        raise QuillError(f"the model's chat template refused the conversation: {str(e)[:200]}") from None


def end_of_turn(template: str, special_tokens: list[str], bos_token: str | None = None,
                eos_token: str | None = None) -> str | None:
    """The special token the template writes right after an assistant's reply (<|im_end|>,
    <|eot_id|>, ...): where a reply generated from this template ends. None if there is none."""
    probe = "quill-end-of-turn-probe"
    try:
        text = render(template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                      add_generation_prompt=False, bos_token=bos_token, eos_token=eos_token)
    except QuillError:
        return None
    after = text[text.find(probe) + len(probe):] if probe in text else ""
    return next((t for t in sorted(special_tokens, key=len, reverse=True) if after.lstrip(" ").startswith(t)), None)
