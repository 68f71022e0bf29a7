"""Sampling settings, in one place for generate, the CLI, the config's `sample:` section and the
server; torch-free, so config.py builds them without importing inference/.

`SamplingParams` validates every field when it is built (a NaN compares False with everything,
so each float is checked finite before its range); a bad value raises `InvalidParam`, whose
`.param` is the bare field name so each caller names it its own way (`--top-p`, `sample.top_p`,
an OpenAI `param`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quillgpt.errors import QuillError

MAX_SEED = 2**32 - 1  # every seed quill takes (train.seed, sampling seeds): numpy's seed range, so one value seeds every generator
# A prompt read from a stream or file (sample's --prompt - and --prompt-file, chat's piped lines): far
# beyond any model's context, and a bound, so /dev/zero or an endless pipe is refused, not read until
# memory runs out. UTF-8 needs at most 4 bytes a character.
MAX_PROMPT_CHARS = 1 << 24
MAX_PROMPT_BYTES = 4 * MAX_PROMPT_CHARS


class InvalidParam(QuillError):
    """A sampling setting out of range: `param` is the field name, `rule` what it must be."""

    def __init__(self, param: str, rule: str, value: object) -> None:
        self.param, self.rule, self.value = param, rule, value
        super().__init__(self.message(param))

    def message(self, name: str) -> str:
        """The one-line error with the setting called `name` (e.g. "--top-p", "sample.top_p")."""
        value = str(self.value)
        return f"{name} {self.rule}, got {value if len(value) <= 60 else value[:57] + '...'}"


def _float(name: str, value: object, ok, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParam(name, "must be a number", repr(value))
    if not math.isfinite(value) or not ok(value):
        raise InvalidParam(name, rule, value)
    return float(value)


def _int(name: str, value: object, lo: int, hi: int, rule: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(name, "must be a whole number", repr(value))
    if value < lo:
        raise InvalidParam(name, rule, value)
    if value > hi:
        raise InvalidParam(name, f"must be at most {hi}", value)
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one row continues its prompt; validated on construction (see InvalidParam)."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # None = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: drawn from torch's global generator (repeatable under torch.manual_seed)
    stop: tuple[str, ...] = ()  # stop strings (text level; the engine ignores them)

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        put("max_new_tokens", _int("max_new_tokens", self.max_new_tokens, 0, 2**62, "must be ≥ 0"))
        put("temperature", _float("temperature", self.temperature, lambda t: t >= 0, "must be ≥ 0 (0 = greedy)"))
        if self.top_k is not None:
            _int("top_k", self.top_k, 1, 2**62, "must be at least 1")
        put("top_p", _float("top_p", self.top_p, lambda p: 0 < p <= 1, "must be in (0, 1]"))
        put("min_p", _float("min_p", self.min_p, lambda p: 0 <= p < 1, "must be in [0, 1)"))
        put("repetition_penalty", _float("repetition_penalty", self.repetition_penalty, lambda r: r > 0, "must be > 0 (1 = off)"))
        if self.seed is not None:
            _int("seed", self.seed, 0, MAX_SEED, "must be ≥ 0")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise InvalidParam("stop", "must be non-empty strings (a stop string must not be empty)", repr(stop))
        put("stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def offset_seed(seed: int, k: int) -> int:
    """The seed of the k-th of several rows seeded `seed` (seed + k, wrapping past MAX_SEED, so
    any valid seed gives valid row seeds)."""
    return (seed + k) % (MAX_SEED + 1)
