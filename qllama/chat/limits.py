"""Resource limits for rendering an untrusted chat template, and the checks that enforce them.

`RenderLimits` says how much one render may cost; `_Budget` (one per render, found through a
context variable) holds its deadline and the text produced so far. The `_check_*` functions
bound the size of one operation's result *before* it runs, because a single C-level operation
(`'a' * 10**9`, `'x'.ljust(10**9)`, `'%999999999d' % 1`) cannot be interrupted afterwards.
The sandbox (`sandbox.py`) calls them from its guards; every failure is a `TemplateError`.
"""

from __future__ import annotations

import contextvars
import math
import re
import string
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2.runtime import Undefined
from jinja2.utils import Namespace

from qllama.errors import QllamaError


class TemplateError(QllamaError):
    """A chat template is missing, malformed, unsafe, too slow or produced too much text."""


# --------------------------------------------------------------------------------------------
# Limits and the per-render budget
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenderLimits:
    """Resource limits for one render of an untrusted template."""

    timeout_s: float = 5.0  # wall clock for the whole render
    max_chars: int = 1_000_000  # the output, and any single string/int argument built on the way
    max_work_factor: int = 4  # all text produced (incl. macro bodies, set blocks) <= factor*max_chars
    max_items: int = 1_000_000  # elements of a list built by `+`/`*`
    max_range: int = 100_000  # len(range(...))
    max_int_bits: int = 100_000  # size of an integer built by `*`/`**`
    max_source_chars: int = 1_000_000  # the template source itself


_budget_var: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("qllama_chat_budget", default=None)


class _Budget:
    """Deadline and size accounting for the render in progress (one per render call)."""

    __slots__ = ("limits", "deadline", "produced", "label")

    def __init__(self, limits: RenderLimits, label: str, timed: bool = True):
        self.limits = limits
        self.label = label
        self.deadline = time.monotonic() + limits.timeout_s if timed else math.inf
        self.produced = 0  # chars emitted by any output node so far

    def tick(self) -> None:
        """Stop the render when the wall-clock limit has passed."""
        if time.monotonic() > self.deadline:
            raise TemplateError(
                f"chat template {self.label} exceeded the time limit of {self.limits.timeout_s:g} s"
            )

    def fail_size(self, n: int, what: str) -> None:
        raise TemplateError(
            f"chat template {self.label} would build {what} of about {n} characters "
            f"(limit {self.limits.max_chars})"
        )

    def check_len(self, n: int, what: str) -> None:
        if n > self.limits.max_chars:
            self.fail_size(n, what)

    def check_value(self, obj: Any, what: str) -> int:
        """Bound the length of `str(obj)` before anything converts it; return the estimate."""
        n = _render_len(obj, self.limits.max_chars)
        self.check_len(n, what)
        return n

    def check_int_arg(self, value: Any, what: str) -> None:
        """Reject an integer argument large enough to make a size/count explode."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.limits.max_chars:
            raise TemplateError(
                f"chat template {self.label}: argument {value} to {what} is too large "
                f"(limit {self.limits.max_chars})"
            )

    def add_output(self, n: int) -> None:
        self.produced += n
        cap = self.limits.max_chars * self.limits.max_work_factor
        if self.produced > cap:
            raise TemplateError(f"chat template {self.label} produced more than {cap} characters of text")


def _budget() -> _Budget:
    """The active budget; outside a render (Jinja's compile-time constant folding) a default one."""
    b = _budget_var.get()
    return b if b is not None else _Budget(RenderLimits(), "(compile)", timed=False)


def _render_len(obj: Any, limit: int) -> int:
    """Upper-bound-ish estimate of `len(str(obj))`, giving up as soon as it passes `limit`.

    Containers are walked iteratively (a list that holds itself many times, `[l]*1000`, is
    cheap in memory but enormous as text); the walk stops early so it costs O(limit) at most.
    """
    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            total += len(o)
        elif isinstance(o, (bytes, bytearray)):
            total += 4 * len(o) + 3  # repr escapes up to 4 chars per byte
        elif o is None or isinstance(o, bool):
            total += 5
        elif isinstance(o, int):
            total += o.bit_length() // 3 + 2  # decimal digits <= bits * log10(2) + 1
        elif isinstance(o, float):
            total += 24
        elif isinstance(o, Undefined):
            pass
        elif isinstance(o, Mapping):
            total += 2 + 4 * len(o)
            if total > limit:
                return total
            for k, v in o.items():
                stack.append(k)
                stack.append(v)
        elif isinstance(o, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(o)
            if total > limit:
                return total
            stack.extend(o)
        elif isinstance(o, Namespace):
            total += 14
            stack.append(getattr(o, "_Namespace__attrs", {}))  # its repr shows every attribute
        else:
            total += 64  # functions, loop objects, generators: a short repr
        if total > limit:
            return total
    return total


# --------------------------------------------------------------------------------------------
# Size pre-checks for operations whose output can be much larger than their input
# --------------------------------------------------------------------------------------------

# printf-style directive: %[(key)][flags][width][.precision]type
_PERCENT_RE = re.compile(r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<prec>\*|\d*))?[hlL]?(?P<type>.)", re.S)
# strftime directive with a (glibc) width: %[flags][width]X
_STRFTIME_WIDTH_RE = re.compile(r"%[-_0^#]*(\d+)")
_WIDTH_RE = re.compile(r"\d+")


def _check_percent_format(b: _Budget, fmt: Any, args: Any) -> None:
    """Bound `fmt % args` (also the `format` filter) before it runs."""
    if isinstance(fmt, (bytes, bytearray)):
        fmt = bytes(fmt).decode("latin-1")
    if not isinstance(fmt, str):
        return
    bound = len(fmt)
    n_fields = 0
    for m in _PERCENT_RE.finditer(fmt):
        if m.group("type") == "%":
            continue
        n_fields += 1
        for part in (m.group("width"), m.group("prec")):
            if part == "*":
                raise TemplateError(f"chat template {b.label}: '*' widths in % formatting are not allowed")
            if part:
                if len(part) > 9 or int(part) > b.limits.max_chars:
                    b.fail_size(int(part[:12]), "a % formatted field")
                bound += int(part)
    if isinstance(args, Mapping):
        # a mapping can be reused by every field: %(a)s%(a)s...
        biggest = max((b.check_value(v, "a % format argument") for v in args.values()), default=0)
        bound += n_fields * biggest
    else:
        bound += b.check_value(args, "a % format argument")
    b.check_len(bound, "a % formatted string")


def _check_str_format(b: _Budget, fmt: str, args: tuple, kwargs: Mapping) -> None:
    """Bound `fmt.format(*args, **kwargs)` before it runs (fields may repeat one argument)."""
    biggest = 0
    for v in list(args) + list(kwargs.values()):
        biggest = max(biggest, b.check_value(v, "a str.format argument"))
    bound = len(fmt)
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError as e:
        raise TemplateError(f"chat template {b.label}: bad format string: {e}") from None
    for _literal, field, spec, _conv in parsed:
        if field is None:
            continue
        spec = spec or ""
        if "{" in spec:
            raise TemplateError(f"chat template {b.label}: nested fields in str.format are not allowed")
        for w in _WIDTH_RE.findall(spec):
            if len(w) > 9 or int(w) > b.limits.max_chars:
                b.fail_size(int(w[:12]), "a str.format field")
            bound += int(w)
        bound += biggest
    b.check_len(bound, "a str.format result")


def _check_replace(b: _Budget, s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if not isinstance(s, (str, bytes)) or not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return
    n = s.count(old) if old else len(s) + 1  # replacing '' inserts between every character
    if isinstance(count, int) and count is not None and count >= 0:
        n = min(n, count)
    b.check_len(len(s) + n * max(0, len(new) - len(old)), "a replace() result")


def _materialize(b: _Budget, iterable: Any) -> list:
    """A list of the items (so that a generator can be measured and then still be used)."""
    items = []
    for x in iterable:
        items.append(x)
        if len(items) > b.limits.max_items:
            raise TemplateError(f"chat template {b.label}: more than {b.limits.max_items} items to join")
        if len(items) & 1023 == 0:
            b.tick()
    return items


def _check_join(b: _Budget, sep: Any, items: list) -> None:
    total = sum(_render_len(x, b.limits.max_chars) for x in items)
    total += len(sep) * max(0, len(items) - 1) if isinstance(sep, (str, bytes)) else 0
    b.check_len(total, "a join() result")


def _check_str_method(b: _Budget, method: Any, args: tuple, kwargs: dict) -> tuple:
    """Pre-check a bound str/bytes method that can grow its input; may return new args."""
    s = method.__self__
    name = method.__name__
    if name in ("ljust", "rjust", "center", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        if isinstance(width, int):
            b.check_len(width, f"a str.{name}() result")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            b.check_len(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tab, 0), "an expandtabs() result")
    elif name == "replace":
        _check_replace(b, s, *args, **kwargs)
    elif name == "join" and args:
        items = _materialize(b, args[0])
        _check_join(b, s, items)
        args = (items,) + tuple(args[1:])
    elif name == "translate":
        table = args[0] if args else None
        grow = 1
        if isinstance(table, Mapping):
            grow = max((len(v) if isinstance(v, (str, bytes)) else 1 for v in table.values()), default=1)
        b.check_len(len(s) * max(grow, 1), "a translate() result")
    elif name in ("format", "format_map") and isinstance(s, str):
        if name == "format_map":
            _check_str_format(b, s, (), args[0] if args and isinstance(args[0], Mapping) else {})
        else:
            _check_str_format(b, s, args, kwargs)
    return args


# --------------------------------------------------------------------------------------------
# Size pre-checks for Jinja's own filters (the sandbox wraps every filter; see _guard_filter)
# --------------------------------------------------------------------------------------------


def _check_filter_center(b: _Budget, value: Any, width: Any = 80) -> None:
    b.check_int_arg(width, "center")
    if isinstance(width, int):
        b.check_len(width, "a center() result")


def _check_filter_indent(b: _Budget, s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    prefix = width if isinstance(width, str) else (width if isinstance(width, int) else 0)
    plen = len(prefix) if isinstance(prefix, str) else prefix
    b.check_int_arg(plen, "indent")
    lines = str(s).count("\n") + 1 if isinstance(s, str) else 1
    b.check_len(len(s) + lines * plen if isinstance(s, str) else plen, "an indent() result")


def _check_filter_format(b: _Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    _check_percent_format(b, value, kwargs or args)


def _check_filter_replace(b: _Budget, s: Any, old: Any, new: Any, count: Any = None) -> None:
    _check_replace(b, s, old, new, -1 if count is None else count)


def _check_filter_batch(b: _Budget, value: Any, linecount: Any, fill_with: Any = None) -> None:
    b.check_int_arg(linecount, "batch")


def _check_filter_slice(b: _Budget, value: Any, slices: Any, fill_with: Any = None) -> None:
    b.check_int_arg(slices, "slice")


# textwrap is superlinear (1M chars take seconds in one uninterruptible call): cap its input.
_WORDWRAP_MAX_CHARS = 20_000


def _check_filter_wordwrap(b: _Budget, s: Any, width: Any = 79, break_long_words: bool = True, wrapstring: Any = None, break_on_hyphens: bool = True) -> None:
    if isinstance(s, str) and len(s) > _WORDWRAP_MAX_CHARS:
        raise TemplateError(f"chat template {b.label}: wordwrap of {len(s)} characters (limit {_WORDWRAP_MAX_CHARS})")
    if isinstance(s, str) and isinstance(wrapstring, str):
        b.check_len(len(s) * (1 + len(wrapstring)), "a wordwrap() result")


def _check_filter_sum(b: _Budget, iterable: Any, attribute: Any = None, start: Any = 0) -> None:
    # summing lists is quadratic in C: bound (number of terms) x (total items)
    if isinstance(start, (list, tuple)) and isinstance(iterable, (list, tuple)):
        total = len(start) + sum(len(x) for x in iterable if isinstance(x, (list, tuple)))
        if total > b.limits.max_items or total * len(iterable) > 100 * b.limits.max_items:
            raise TemplateError(f"chat template {b.label}: sum() of lists is too large")


# Filters with a specific pre-check (called with the filter's own arguments, minus the pass_* one).
_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "center": _check_filter_center,
    "indent": _check_filter_indent,
    "format": _check_filter_format,
    "replace": _check_filter_replace,
    "batch": _check_filter_batch,
    "slice": _check_filter_slice,
    "wordwrap": _check_filter_wordwrap,
    "sum": _check_filter_sum,
}
