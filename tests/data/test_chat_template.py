"""The chat template guard: an untrusted template fails only as one QuillError naming it, within a
time and size limit; a good template renders exactly as plain Jinja renders it."""

from __future__ import annotations

import time

import pytest

import quillgpt.data.chat_template as ct
from quillgpt.data.chat_template import TemplateFailed, TemplateRefused, render, render_spans

HI = [{"role": "user", "content": "hi"}]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    "template",
    [
        "{{ 1/0 }}",
        "{{ 10|divisibleby(0) }}",
        "{{ range(10**9)|list }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{% include 'x' %}",
        "{% import 'x' as y %}",
        "{% extends 'x' %}",
        "{{ strftime_now(None) }}",
        "{{ 1 + 'a' }}",
        "{{ {1: 2, 'a': 3}|tojson(sort_keys=true) }}",
        "{{ ['a'] * 10**9 }}",
        "{{ 'a' * 10**9 }}",
        "{{ 7 ** 100000000 }}",
        "{% for %}",
        "{{ x",
    ],
)
def test_every_failure_of_a_template_is_one_quill_error_naming_it(template):
    with pytest.raises(TemplateFailed, match=r"^the model's chat template (does not compile|failed while rendering): \S+"):
        render(template, HI)


def test_raise_exception_is_a_refusal_of_the_conversation():
    with pytest.raises(TemplateRefused, match="refused the conversation: no system message"):
        render("{{ raise_exception('no system message') }}", HI)


@pytest.mark.parametrize("body", ["", "{{ 'x' }}"])
def test_a_loop_that_never_ends_is_stopped_at_the_time_limit(monkeypatch, body):
    """Nested loops that call nothing and write nothing are stopped too (the line tracer)."""
    monkeypatch.setattr(ct, "RENDER_SECONDS", 0.3)
    t0 = time.monotonic()
    with pytest.raises(TemplateFailed, match="took longer than 0.3 s"):
        render(NESTED.replace("{% endfor %}{% endfor %}", body + "{% endfor %}{% endfor %}"), HI)
    assert time.monotonic() - t0 < 3


def test_a_rendering_past_the_size_limit_is_stopped(monkeypatch):
    monkeypatch.setattr(ct, "RENDER_CHARS", 1000)
    with pytest.raises(TemplateFailed, match="longer than 1,000 characters"):
        render("{% for i in range(2000) %}x{% endfor %}", HI)
    assert render("{% for i in range(1000) %}x{% endfor %}", HI) == "x" * 1000


def test_the_tracer_before_a_rendering_is_put_back():
    import sys

    seen = []

    def tracer(frame, event, arg):
        seen.append(event)

    sys.settrace(tracer)
    try:
        render(CHATML, HI)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_a_good_template_renders_as_plain_jinja_does():
    """The guarded rendering against the template rendered plainly in the same sandbox."""
    messages = [{"role": r, "content": f"turn {i} ü"} for i, r in enumerate(["system", "user", "assistant", "user"])]
    for prompt in (True, False):
        plain = "".join(ct._compile(CHATML).generate(messages=messages, add_generation_prompt=prompt))
        assert render(CHATML, messages, prompt) == plain


def test_generation_spans_are_still_found_while_the_rendering_is_capped():
    template = "{% for m in messages %}{{ m.role }}: {% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}"
    text, spans = render_spans(template, [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cde"}], False)
    assert [text[a:b] for a, b in spans] == ["ab", "cde"]


BOMBS = [  # each builds a huge value inside one expression, in C, before any output
    "{% set ns = namespace(x='x') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}",
    "{% set ns = namespace(x=['x']) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x|length }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'|center(width=10**9) }}",
    "{{ '%999999999s'|format('x') }}",
    "{{ '%*s' % (999999999, 'x') }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ '{:>{w}}'.format('x', w=999999999) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ '\t'.expandtabs(10**9) }}",
    "{{ ('x' * 10000).replace('', 'y' * 10000) }}",
    "{{ ('x' * 10000)|replace('x', 'y' * 10000) }}",
    "{{ (['y' * 1000000] * 1000)|join }}",
    "{{ ''.join(['y' * 1000000] * 1000) }}",
    "{{ ['y' * 1000000] * 1000 }}",
    "{{ (['y' * 1000000] * 1000)|tojson }}",
    "{{ [1]|tojson(indent=10**9) }}",
    "{{ 'a\nb'|indent(10**9) }}",
    "{{ [1]|batch(10**9, 0)|list }}",
    "{{ lipsum(10**6) }}",
    "{% set b %}{% for i in range(1000) %}{{ 'y' * 1000000 }}{% endfor %}{% endset %}{{ b|length }}",
    "{% set ns = namespace(a='y' * 1000000) %}{{ [ns] * 1000 }}",
]


@pytest.mark.parametrize("template", BOMBS)
def test_a_value_too_big_to_build_is_refused_before_it_is_built(template):
    """One TemplateFailed within the limits, and the memory never near the value's size (the
    values above would take 1 to 10**9 GB; a list of 16M items, the largest allowed, takes 128 MB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TemplateFailed, match="would make a value of over 16,777,216 characters; fix or replace"):
            render(template, HI)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 300 << 20 and time.monotonic() - t0 < 5


CHECKED = (  # every checked filter, method and operator, on values of an ordinary size
    "{{ 'ab'|center(9) }}|{{ 'a\nb'|indent(2, first=true) }}|{{ '%5s-%.2f'|format('x', 1.5) }}|{{ '%-4d' % 7 }}|"
    "{{ '{:>6}{}'.format('r', 1) }}|{{ 'x'.ljust(4) }}{{ 'y'.zfill(3) }}|{{ 'a\tb'.expandtabs(4) }}|{{ 'aXa'.replace('a', 'bb') }}|"
    "{{ 'aXa'|replace('X', '--') }}|{{ [1, 'b']|join('+') }}|{{ '/'.join(['p', 'q']) }}|{{ 'one two three'|wordwrap(5) }}|"
    "{{ [[1], [2]]|sum(start=[]) }}|{{ [1, 2, 3]|batch(2, 0)|list }}|{{ [1, 2, 3]|slice(2)|list }}|{{ [1, {'a': 'b'}]|string }}|"
    "{{ {'k': [1, 2]}|tojson(indent=2) }}|{{ {'k': 1}|pprint }}|{{ 'a' ~ 1 ~ none }}|{{ 'a' + 'b' }}{{ [1] + [2] }}|"
    "{% macro m(x) %}<{{ x }}>{% endmacro %}{{ m('z') }}|{% set b %}{{ 'in' }}{% endset %}{{ b }}|{{ lipsum(1, false, 3, 4)|length > 0 }}|"
    "{{ undefined }}{{ undefined ~ 'u' }}{{ [undefined]|length }}{{ undefined|default('d') }}|{% set ns = namespace(a=1) %}{{ ns.a }}"
)


def test_the_checked_operations_give_what_plain_jinja_gives():
    """The sandbox's checks against transformers' plain sandbox (the same tojson) on ordinary values."""
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    assert render(CHECKED, HI) == plain.from_string(CHECKED).render(messages=HI)
