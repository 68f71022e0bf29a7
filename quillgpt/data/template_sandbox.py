"""The sandbox a chat template runs in: transformers' (Jinja's immutable sandbox), with every
operation that can make a value much bigger than its inputs checked before it runs.

The rendering's own output is capped as it streams (data/chat_template.py), but a value built
inside one expression is built in C, past any time limit and before any output: `s ~ s` doubled
thirty times, `'x'|center(10**9)`, `'%999999999s' % x`, `'{:>999999999}'.format(x)`,
`[s] * 100000|join`, `'x'.ljust(10**9)`, `tojson(indent=10**9)`. So `*`, `**`, `+`, `%` and `~`,
the filters and string methods that take a width or repeat their input, str.format, the buffers
of macros and `{% set %}` blocks, and every value written out are checked against MAX_CHARS
first (the size a value writes out: every reference counted, since str([s] * 100) writes s 100
times), and refused with Stopped instead of being built out of memory. Constant folding is off,
so nothing of a template is evaluated while it compiles.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jinja2 import filters as jinja_filters
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

MAX_CHARS = 1 << 24  # the largest value (and rendering) a template may make, in characters
DIGITS = re.compile(r"\d+")
PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+|\*)?(?:\.(\d+|\*))?")  # a %-field's width and precision
FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")  # a str.format field's spec (after the colon)
NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # str.format's {:{width}}


class Stopped(Exception):
    """Raised inside a rendering that passed its time or size limit."""


def size(value: Any, limit: int = MAX_CHARS) -> int:
    """About how many characters `value` writes out: a string's length, a container's items
    summed (each reference counted), anything else 1; counting stops once past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
            continue
        if isinstance(v, Namespace):  # it writes out its attributes (read past its own __getattribute__)
            v = object.__getattribute__(v, "_Namespace__attrs")
        if isinstance(v, dict):
            total += len(v) + 1
            if total <= limit:
                stack.append([*v.keys(), *v.values()])
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v) + 1
            if total > limit:
                break
            if set(map(type, v)) <= {str, bytes}:  # a list of strings, counted in C (millions in well under a second)
                total += sum(map(len, v))
            else:
                stack += [x for x in v if not isinstance(x, (int, float, type(None)))]
        else:
            total += 1
    return total


def bounded(chars: int, what: str) -> None:
    if chars > MAX_CHARS:
        raise Stopped(f"{what} would make a value of over {MAX_CHARS:,} characters")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse a `*` that repeats a sequence past MAX_CHARS, a `**` whose result has more than
    MAX_CHARS bits, a `+` of two sequences longer than that together, and a `%` format whose
    widths or arguments would write more (Python would compute each in C, past any time limit)."""
    ints = [isinstance(v, int) and not isinstance(v, bool) for v in (left, right)]
    if operator == "*" and ints[0] != ints[1]:
        seq, times = (right, left) if ints[0] else (left, right)
        if isinstance(seq, (str, bytes, list, tuple)) and len(seq) * max(times, 0) > MAX_CHARS:
            raise Stopped(f"`*` would make a value of {len(seq):,} × {times:,} items (the limit is {MAX_CHARS:,})")
    if operator == "**" and all(ints) and right > 0 and abs(left) > 1 and abs(left).bit_length() * right > MAX_CHARS:
        raise Stopped(f"`**` would make a number of about {abs(left).bit_length() * right:,} bits")
    if operator == "+" and all(isinstance(v, (str, bytes, list, tuple)) for v in (left, right)):
        bounded(len(left) + len(right), "`+`")
    if operator == "%" and isinstance(left, str):
        check_format(left, right if isinstance(right, tuple) else (right,), {}, "`%`")


def check_format(text: str, args: Any, kwargs: Any, what: str) -> None:
    """A %-format (`%`, |format) or a str.format of `text`: the widths and precisions of its
    fields, those its arguments may give (`*`, nested fields), and its arguments written out as
    often as it has fields."""
    specs = FORMAT_SPEC.findall(text) if what == "str.format" else [" ".join(m) for m in PERCENT_SPEC.findall(text)]
    widths = [int(w) if len(w) < 12 else 10**12 for spec in specs for w in DIGITS.findall(spec)]
    if any("*" in spec or "{" in spec for spec in specs) or NESTED_FIELD.search(text):  # a width from the arguments
        widths += [_int(a) for a in (*args, *kwargs.values())]
    fields = len(specs) + text.count("{") + 1
    bounded(len(text) + (max(widths, default=0) + size(args) + size(kwargs)) * fields, what)


def check_call(obj: Any, args: tuple, kwargs: dict) -> tuple:
    """A string method called from a template: its result's size checked first (the widths of
    ljust/rjust/center/zfill, expandtabs, replace, translate, join); the arguments it should get
    (join's iterable, read once)."""
    target = getattr(obj, "__wrapped__", obj)
    s, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if not isinstance(s, (str, bytes)):
        return args
    if name in ("ljust", "rjust", "center", "zfill"):
        bounded(max(_int(args[0] if args else kwargs.get("width")), len(s)), f"str.{name}")
    elif name == "expandtabs":
        bounded(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * _int(args[0] if args else kwargs.get("tabsize", 8)), name)
    elif name == "replace" and len(args) >= 2:
        bounded(_replaced(s, args[0], args[1]), "str.replace")
    elif name == "translate" and args and isinstance(args[0], dict):
        bounded(len(s) * max([size(v) for v in args[0].values()] + [1]), "str.translate")
    elif name == "join" and args:
        items = list(args[0])
        bounded(size(items) + len(s) * len(items), "str.join")
        return (items, *args[1:])
    return args


def _replaced(s: Any, old: Any, new: Any) -> int:
    if not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return len(s)
    count = len(s) + 1 if not old else s.count(old)
    return len(s) + count * max(len(new) - len(old), 0)


def _width_of(value: Any) -> int:
    return len(value) if isinstance(value, str) else _int(value)


def _checked_filters() -> dict[str, Any]:
    """Jinja's filters that take a width or repeat their input, each checked before it runs (the
    same parameters, so a template may name them)."""
    f = jinja_filters

    def indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> Any:
        bounded(size(s), "indent")
        bounded(size(s) + (str(s).count("\n") + 2) * _width_of(width), "indent")
        return f.do_indent(s, width, first, blank)

    @f.pass_environment
    def wordwrap(environment: Any, s: Any, width: int = 79, break_long_words: bool = True, wrapstring: Any = None, **kw: Any) -> Any:
        bounded(size(s) * (1 + size(wrapstring or "\n")), "wordwrap")
        return f.do_wordwrap(environment, s, width, break_long_words, wrapstring, **kw)

    @f.pass_eval_context
    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> Any:
        items = list(value)
        bounded(size(items) + size(d) * len(items), "join")
        return f.sync_do_join(eval_ctx, items, d, attribute)

    @f.pass_environment
    def sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:  # (Jinja's name)
        items = list(iterable)
        bounded(size(items) + size(start), "sum")
        return f.sync_do_sum(environment, items, attribute, start)

    def batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
        bounded(_int(linecount) if fill_with is not None else 0, "batch")
        return f.do_batch(value, linecount, fill_with)

    def slice(value: Any, slices: int, fill_with: Any = None) -> Any:  # (Jinja's name)
        bounded(_int(slices), "slice")
        return f.sync_do_slice(value, slices, fill_with)

    def center(value: Any, width: int = 80) -> str:
        bounded(max(size(value), _int(width)), "center")
        return f.do_center(value, width)

    def format(value: Any, *args: Any, **kwargs: Any) -> str:  # (Jinja's name)
        bounded(size(value), "format")
        check_format(str(value), args, kwargs, "format")
        return f.do_format(value, *args, **kwargs)

    @f.pass_eval_context
    def replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        bounded(size(s) + size(old) + size(new), "replace")
        bounded(_replaced(str(s), str(old), str(new)), "replace")
        return f.do_replace(eval_ctx, s, old, new, count)

    checked = dict(indent=indent, wordwrap=wordwrap, join=join, sum=sum, batch=batch, slice=slice, center=center, format=format)
    return checked | dict(replace=replace, string=_written_as("string"), pprint=_written_as("pprint"), tojson=_tojson)


def _written_as(name: str) -> Any:
    """A filter that writes its value out (string, pprint), checked by the value's size first."""

    def run(value: Any, *args: Any, **kwargs: Any) -> Any:
        bounded(size(value), name)
        return jinja_filters.FILTERS[name](value, *args, **kwargs)

    return run


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' tojson (json.dumps, not Jinja's HTML-safe one), its indent's growth checked first."""
    bounded((size(x) + 1) * (1 + (_width_of(indent) if indent is not None else 0)), "tojson")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    bounded(_int(n) * _int(max) * 16, "lipsum")
    return generate_lorem_ipsum(n, html, min, max)


class _Buffer(list):
    """What a macro, a `{% set %}` block or a call block writes, stopped once past MAX_CHARS."""

    chars = 0

    def append(self, piece: Any) -> None:
        self.chars += len(piece)
        bounded(self.chars, "a block's text")
        super().append(piece)

    def extend(self, pieces: Any) -> None:
        for piece in pieces:
            self.append(piece)


class _Codegen(CodeGenerator):
    """`a ~ b` compiled as environment.checked_concat((a, b)): sizes checked before str() of each;
    a macro's or a block's buffer as a _Buffer."""

    def buffer(self, frame: Any) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _concat(pieces: Any) -> str:
    """environment.concat: what a macro, a `{% set %}` block or a call block wrote, joined."""
    pieces = list(pieces)
    bounded(sum(map(len, pieces)), "a block's text")
    return "".join(pieces)


def _written(value: Any) -> Any:
    """finalize: each `{{ value }}` checked before str() writes it out."""
    bounded(size(value), "writing a value")
    return value


class Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with everything that can build a large value checked first (see the
    module docstring): refused before it is built, never built out of memory."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _Codegen
    concat = staticmethod(_concat)

    def __init__(self, **options: Any) -> None:
        super().__init__(optimized=False, finalize=_written, **options)
        self.filters.update(_checked_filters())
        self.globals["lipsum"] = lipsum

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # (Jinja's own signature)
        args = check_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        text = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            check_format(text, args, kwargs, "str.format")
            return fmt(*args, **kwargs)

        return checked

    new_buffer = _Buffer

    @staticmethod
    def checked_concat(pieces: tuple) -> str:
        bounded(sum(size(p) for p in pieces), "`~`")
        return "".join(map(str, pieces))
