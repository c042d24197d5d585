"""Chat templates: render a conversation into the prompt text an instruct model expects.

A chat template is a Jinja2 program that comes from a downloaded file (the GGUF key
`tokenizer.chat_template`), so it is *untrusted code*. We render it the way Hugging Face does
(`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`, `raise_exception`,
`strftime_now`, a `tojson` without HTML escaping) and add what the sandbox lacks:

- any access to an unsafe attribute (`__class__`, `__globals__`, `_TemplateReference__context`,
  ...) raises at once instead of rendering as an empty string;
- a wall-clock limit, checked on every loop iteration, call, operator, filter and output chunk
  (the template AST is rewritten so that `for` loops, `~` and every output pass through guards);
- a size limit on every string the template builds, checked *before* a single big operation
  runs (`'a' * 10**9`, `'x'.ljust(10**9)`, `'%999999999d' % 1`, `join`, `replace`, `indent`,
  `tojson(indent=...)`, ...), because one C-level operation cannot be interrupted afterwards.

Every failure is a `TemplateError` with a one-line message.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import string
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from qllama.errors import QllamaError

__all__ = [
    "TemplateError",
    "RenderLimits",
    "ChatTemplate",
    "BUILTIN_TEMPLATES",
    "builtin_template_name",
    "alternative_template_names",
    "strip_leading_bos",
]


class TemplateError(QllamaError):
    """A chat template is missing, malformed, unsafe, too slow or produced too much text."""


# --------------------------------------------------------------------------------------------
# Jinja2 version gate
# --------------------------------------------------------------------------------------------

#: First Jinja2 release with the known sandbox escapes fixed (CVE-2024-56326, CVE-2025-27516).
MIN_JINJA2 = (3, 1, 6)


def _check_jinja2_version(version: str) -> None:
    """Raise `TemplateError` when `version` is older than `MIN_JINJA2` (or unparsable)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise TemplateError(f"cannot parse the Jinja2 version {version!r}; jinja2>=3.1.6 is required")
    found = tuple(int(g or 0) for g in m.groups())
    if found < MIN_JINJA2:
        raise TemplateError(
            f"Jinja2 {version} has known sandbox escapes (CVE-2024-56326, CVE-2025-27516); "
            "chat templates need jinja2>=3.1.6: pip install -U 'jinja2>=3.1.6'"
        )


def _installed_jinja2_version() -> str:
    try:
        from importlib.metadata import version

        return version("jinja2")
    except Exception:  # metadata missing (vendored copy): fall back to the module attribute
        return str(getattr(jinja2, "__version__", "0"))


_check_jinja2_version(_installed_jinja2_version())


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
# Filters: HF's tojson, and size guards around Jinja's own filters
# --------------------------------------------------------------------------------------------


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    """`tojson` as Hugging Face defines it: plain `json.dumps`, no HTML escaping, non-ASCII kept."""
    b = _budget()
    if isinstance(indent, int) and not isinstance(indent, bool):
        if indent > 64:
            raise TemplateError(f"chat template {b.label}: tojson indent {indent} is too large (limit 64)")
    elif isinstance(indent, str):
        if len(indent) > 64:
            raise TemplateError(f"chat template {b.label}: tojson indent string is too long (limit 64)")
    elif indent is not None:
        raise TemplateError(f"chat template {b.label}: tojson indent must be an int or a string")
    n = b.check_value(value, "a tojson() argument")
    if indent is not None:  # each nested line gets at most depth*indent extra chars; bound loosely
        b.check_len(n * (1 + (indent if isinstance(indent, int) else len(indent))), "a tojson() result")
    if separators is not None:
        b.check_value(separators, "tojson separators")
        sep_len = sum(len(s) for s in separators if isinstance(s, str))
        b.check_len(n * (1 + sep_len), "a tojson() result")
    try:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    except (TypeError, ValueError) as e:
        raise TemplateError(f"chat template {b.label}: tojson failed: {e}") from None


def _chk_center(b: _Budget, value: Any, width: Any = 80) -> None:
    b.check_int_arg(width, "center")
    if isinstance(width, int):
        b.check_len(width, "a center() result")


def _chk_indent(b: _Budget, s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    prefix = width if isinstance(width, str) else (width if isinstance(width, int) else 0)
    plen = len(prefix) if isinstance(prefix, str) else prefix
    b.check_int_arg(plen, "indent")
    lines = str(s).count("\n") + 1 if isinstance(s, str) else 1
    b.check_len(len(s) + lines * plen if isinstance(s, str) else plen, "an indent() result")


def _chk_format(b: _Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    _check_percent_format(b, value, kwargs or args)


def _chk_replace(b: _Budget, s: Any, old: Any, new: Any, count: Any = None) -> None:
    _check_replace(b, s, old, new, -1 if count is None else count)


def _chk_batch(b: _Budget, value: Any, linecount: Any, fill_with: Any = None) -> None:
    b.check_int_arg(linecount, "batch")


def _chk_slice(b: _Budget, value: Any, slices: Any, fill_with: Any = None) -> None:
    b.check_int_arg(slices, "slice")


# textwrap is superlinear (1M chars take seconds in one uninterruptible call): cap its input.
_WORDWRAP_MAX_CHARS = 20_000


def _chk_wordwrap(b: _Budget, s: Any, width: Any = 79, break_long_words: bool = True, wrapstring: Any = None, break_on_hyphens: bool = True) -> None:
    if isinstance(s, str) and len(s) > _WORDWRAP_MAX_CHARS:
        raise TemplateError(f"chat template {b.label}: wordwrap of {len(s)} characters (limit {_WORDWRAP_MAX_CHARS})")
    if isinstance(s, str) and isinstance(wrapstring, str):
        b.check_len(len(s) * (1 + len(wrapstring)), "a wordwrap() result")


def _chk_sum(b: _Budget, iterable: Any, attribute: Any = None, start: Any = 0) -> None:
    # summing lists is quadratic in C: bound (number of terms) x (total items)
    if isinstance(start, (list, tuple)) and isinstance(iterable, (list, tuple)):
        total = len(start) + sum(len(x) for x in iterable if isinstance(x, (list, tuple)))
        if total > b.limits.max_items or total * len(iterable) > 100 * b.limits.max_items:
            raise TemplateError(f"chat template {b.label}: sum() of lists is too large")


# Filters with a specific pre-check (called with the filter's own arguments, minus the pass_* one).
_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "center": _chk_center,
    "indent": _chk_indent,
    "format": _chk_format,
    "replace": _chk_replace,
    "batch": _chk_batch,
    "slice": _chk_slice,
    "wordwrap": _chk_wordwrap,
    "sum": _chk_sum,
}
# Not offered to templates: unbounded generators of text that no chat template needs.
_REMOVED_FILTERS = ("urlize",)
_REMOVED_GLOBALS = ("lipsum",)


def _guard_filter(name: str, func: Callable) -> Callable:
    """Wrap a Jinja filter: deadline check, size check of its inputs and output."""
    passes_ctx = getattr(func, "jinja_pass_arg", None) is not None
    check = _FILTER_CHECKS.get(name)

    @functools.wraps(func)  # also copies `jinja_pass_arg`, so Jinja keeps passing the context
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        real = args[1:] if passes_ctx else args
        for a in real:
            if not _is_lazy(a):
                b.check_value(a, f"the input of filter {name!r}")
        for a in kwargs.values():
            b.check_value(a, f"an argument of filter {name!r}")
        if name == "join" and real:
            # materialize, measure, then join the list
            items = _materialize(b, real[0])
            sep = real[1] if len(real) > 1 else kwargs.get("d", "")
            _check_join(b, sep, items)
            args = (args[0], items, *real[1:]) if passes_ctx else (items, *real[1:])
        elif check is not None:
            check(b, *real, **kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, (str, bytes)):
            b.check_len(len(out), f"the result of filter {name!r}")
        return out

    return guarded


def _is_lazy(x: Any) -> bool:
    """Generators/iterators from other filters: their items are checked where they are consumed."""
    return not isinstance(x, (str, bytes, Mapping, list, tuple, set, frozenset, int, float, Namespace))


# Internal filters that the AST rewrite inserts. `pass_context` keeps Jinja from
# constant-folding them at compile time.
_ITER_FILTER = "_qllama_guard_iter"
_OUT_FILTER = "_qllama_guard_output"
_CONCAT_FILTER = "_qllama_guard_concat"


@jinja2.pass_context
def _guard_iter(context: Any, iterable: Any) -> Iterable:
    """Every `for` loop iterates through this: a deadline check per iteration."""
    b = _budget()
    b.tick()
    if isinstance(iterable, Undefined):
        return iterable  # let Jinja raise/iterate its undefined as usual

    def gen():
        for item in iterable:
            b.tick()
            yield item

    return gen()


@jinja2.pass_context
def _guard_output(context: Any, value: Any) -> Any:
    """Every `{{ ... }}` and template text passes here: size and total-text accounting."""
    b = _budget()
    b.tick()
    n = b.check_value(value, "an output value")
    b.add_output(n)
    return value


@jinja2.pass_context
def _guard_concat(context: Any, parts: list) -> str:
    """The `~` operator: measure the parts before joining them."""
    b = _budget()
    b.tick()
    total = sum(_render_len(p, b.limits.max_chars) for p in parts)
    b.check_len(total, "a ~ concatenation")
    return "".join(str(p) for p in parts)


class _GuardTransformer(NodeTransformer):
    """Route loops, outputs and `~` through the guard filters."""

    @staticmethod
    def _wrap(node: nodes.Expr, name: str) -> nodes.Filter:
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self._wrap(node.iter, _ITER_FILTER)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        node = self.generic_visit(node)
        node.nodes = [self._wrap(child, _OUT_FILTER) for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return self._wrap(nodes.List(node.nodes, lineno=node.lineno), _CONCAT_FILTER)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return [nodes.Scope(body, lineno=lineno)]


# --------------------------------------------------------------------------------------------
# The sandbox
# --------------------------------------------------------------------------------------------

# Keyword arguments that Jinja itself adds to calls; not template data.
_INTERNAL_KWARGS = frozenset({"caller", "_loop_vars", "_block_vars"})


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox plus hard failures on unsafe access and resource limits on every operation."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, limits: RenderLimits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        self.limits = limits
        for name in _REMOVED_FILTERS:
            self.filters.pop(name, None)
        for name in _REMOVED_GLOBALS:
            self.globals.pop(name, None)
        self.filters["tojson"] = _tojson
        for name, func in list(self.filters.items()):
            self.filters[name] = _guard_filter(name, func)
        self.filters[_ITER_FILTER] = _guard_iter
        self.filters[_OUT_FILTER] = _guard_output
        self.filters[_CONCAT_FILTER] = _guard_concat
        self.globals["range"] = self._range

    # -- parsing: insert the guards ----------------------------------------------------------
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        tree = _GuardTransformer().visit(tree)
        tree.set_environment(self)
        return tree

    # -- attribute access ---------------------------------------------------------------------
    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        # The stock sandbox returns an Undefined that renders as "" until used further; a
        # template that reaches for internals is hostile, so fail loudly at the first attempt.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    # -- operators ----------------------------------------------------------------------------
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.tick()
        lim = self.limits
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
                size = len(seq) * max(n, 0)
                if isinstance(seq, (list, tuple)):
                    if size > lim.max_items:
                        raise TemplateError(f"chat template {b.label} would build a list of {size} items (limit {lim.max_items})")
                else:
                    b.check_len(size, "a repeated string")
            elif isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > lim.max_int_bits:
                    raise TemplateError(f"chat template {b.label}: integer product too large")
        elif operator == "+":
            if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
                b.check_len(len(left) + len(right), "a concatenated string")
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                if len(left) + len(right) > lim.max_items:
                    raise TemplateError(f"chat template {b.label} would build a list of more than {lim.max_items} items")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if right * math.log2(abs(left)) > lim.max_int_bits:
                    raise TemplateError(f"chat template {b.label}: integer power too large")
        elif operator == "%":
            if isinstance(left, (str, bytes)):
                _check_percent_format(b, left, right)
        return super().call_binop(context, operator, left, right)

    # -- calls --------------------------------------------------------------------------------
    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _budget()
        b.tick()
        for a in args:
            b.check_int_arg(a, "a call")
            if not _is_lazy(a):
                b.check_value(a, "a call argument")
        for k, a in kwargs.items():
            if k in _INTERNAL_KWARGS:
                continue
            b.check_int_arg(a, "a call")
            if not _is_lazy(a):
                b.check_value(a, "a call argument")
        # str.format reaches us wrapped by the sandbox (`__wrapped__`); other methods are bound
        target = getattr(__obj, "__wrapped__", __obj)
        if isinstance(getattr(target, "__self__", None), (str, bytes)) and hasattr(target, "__name__"):
            args = _check_str_method(b, target, args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        if isinstance(out, (str, bytes)):
            b.check_len(len(out), "a call result")
        return out

    def _range(self, *args: Any) -> range:
        """`range` with a length cap."""
        rng = range(*args)
        if len(rng) > self.limits.max_range:
            raise TemplateError(f"range() of {len(rng)} items is too large (limit {self.limits.max_range})")
        return rng


# --------------------------------------------------------------------------------------------
# Built-in templates (used when a model carries none)
# --------------------------------------------------------------------------------------------
# Written from each family's documented prompt format. Raw strings: `\n` is a Jinja escape.

_LLAMA2 = r"""
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system_message = messages[0]['content'] | trim -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system_message = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('llama-2 chat: roles must alternate user/assistant/user/...') -}}
  {%- endif -%}
  {%- set content = (message['content'] or '') | trim -%}
  {%- if message['role'] == 'user' -%}
    {%- if loop.first and system_message -%}
      {%- set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + content -%}
    {%- endif -%}
    {{- bos_token + '[INST] ' + content + ' [/INST]' -}}
  {%- else -%}
    {{- ' ' + content + ' ' + eos_token -}}
  {%- endif -%}
{%- endfor -%}
"""

_LLAMA3 = r"""
{{- bos_token -}}
{%- for message in messages -%}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + ((message['content'] or '') | trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

_CHATML = r"""
{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Mistral has no system role: the system text opens the first user turn.
_MISTRAL = r"""
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system_message = messages[0]['content'] | trim -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system_message = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{{- bos_token -}}
{%- for message in loop_messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('mistral chat: roles must alternate user/assistant/user/...') -}}
  {%- endif -%}
  {%- set content = (message['content'] or '') | trim -%}
  {%- if message['role'] == 'user' -%}
    {%- if loop.first and system_message -%}
      {%- set content = system_message + '\n\n' + content -%}
    {%- endif -%}
    {{- '[INST] ' + content + ' [/INST]' -}}
  {%- else -%}
    {{- ' ' + content + eos_token -}}
  {%- endif -%}
{%- endfor -%}
"""

_PHI3 = r"""
{%- for message in messages -%}
  {%- if message['role'] != 'system' or message['content'] -%}
    {{- '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>\n' -}}
{%- endif -%}
"""

# Gemma has no system role either; its assistant role is called "model".
_GEMMA = r"""
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system_message = messages[0]['content'] | trim -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system_message = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{{- bos_token -}}
{%- for message in loop_messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {%- set content = (message['content'] or '') | trim -%}
  {%- if loop.first and system_message -%}
    {%- set content = system_message + '\n\n' + content -%}
  {%- endif -%}
  {{- '<start_of_turn>' + role + '\n' + content + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

_ZEPHYR = r"""
{%- for message in messages -%}
  {{- '<|' + message['role'] + '|>\n' + (message['content'] or '') + eos_token + '\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>\n' -}}
{%- endif -%}
"""

#: Built-in template sources by family name.
BUILTIN_TEMPLATES: dict[str, str] = {
    "llama-2": _LLAMA2,
    "llama-3": _LLAMA3,
    "chatml": _CHATML,
    "mistral": _MISTRAL,
    "phi-3": _PHI3,
    "gemma": _GEMMA,
    "zephyr": _ZEPHYR,
}

# Vocabulary tokens that identify a chat format, most specific first.
_TOKEN_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|im_start|>", "<|im_end|>"), "chatml"),
    (("<|start_header_id|>", "<|eot_id|>"), "llama-3"),
    (("<start_of_turn>", "<end_of_turn>"), "gemma"),
    (("<|user|>", "<|end|>"), "phi-3"),
    (("<|user|>",), "zephyr"),
    (("[INST]", "[/INST]"), "mistral"),
)
_ARCH_HINTS = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi-3", "qwen2": "chatml"}
_PRE_HINTS = {"qwen2": "chatml", "llama-bpe": "llama-3", "llama3": "llama-3"}


def _metadata_names(md: Mapping[str, Any]) -> str:
    parts = [md.get(k) for k in ("general.name", "general.basename", "general.finetune")]
    return " ".join(p for p in parts if isinstance(p, str)).lower()


def builtin_template_name(md: Mapping[str, Any]) -> str | None:
    """The built-in template family that fits a model without its own template, or None.

    Signals, in order: a name that says "base"; chat control tokens in the vocabulary; the
    model's name (llama-2 chat, mistral/zephyr which share a plain SPM vocabulary); the
    architecture and `tokenizer.ggml.pre` when the vocabulary also has the turn tokens.
    """
    names = _metadata_names(md)
    if re.search(r"\bbase\b", names):
        return None
    tokens = md.get("tokenizer.ggml.tokens")
    vocab: set[str] = set()
    if isinstance(tokens, (list, tuple)):
        wanted = {t for hint, _ in _TOKEN_HINTS for t in hint}
        vocab = {t for t in tokens if t in wanted}
    for hint, family in _TOKEN_HINTS:
        if all(t in vocab for t in hint):
            return family
    if "zephyr" in names:
        return "zephyr"
    if re.search(r"mi[sx]tral", names) and "instruct" in names:
        return "mistral"
    if re.search(r"llama[- ]?2", names) and "chat" in names:
        return "llama-2"
    # weaker hints: only for instruct-looking names (a base model has the same arch/pre-tokenizer)
    if re.search(r"instruct|chat|\bit\b", names):
        arch = md.get("general.architecture")
        if isinstance(arch, str) and arch in _ARCH_HINTS:
            return _ARCH_HINTS[arch]
        pre = md.get("tokenizer.ggml.pre")
        if isinstance(pre, str) and pre in _PRE_HINTS:
            return _PRE_HINTS[pre]
    return None


def alternative_template_names(md: Mapping[str, Any]) -> list[str]:
    """Names of the named templates `tokenizer.chat_template.<name>` (e.g. "tool_use"), sorted."""
    prefix = "tokenizer.chat_template."
    names = {k[len(prefix):] for k in md if isinstance(k, str) and k.startswith(prefix)}
    listed = md.get("tokenizer.chat_templates")  # older files also list the names in an array
    if isinstance(listed, (list, tuple)):
        names.update(n for n in listed if isinstance(n, str) and n != "default" and prefix + n in md)
    return sorted(names)


def strip_leading_bos(text: str, bos_token: str) -> tuple[str, bool]:
    """Remove one BOS text from the start of `text`; return (rest, whether it was there).

    For "BOS exactly once": tokenize `rest` with `add_bos = model_wants_bos or had_bos`, so a
    template that writes `{{ bos_token }}` and a tokenizer that adds BOS give one BOS, not two.
    """
    if bos_token and text.startswith(bos_token):
        return text[len(bos_token):], True
    return text, False


# --------------------------------------------------------------------------------------------
# ChatTemplate
# --------------------------------------------------------------------------------------------


def _one_line(msg: Any, limit: int = 300) -> str:
    s = " ".join(str(msg).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _validate_messages(messages: Any) -> list:
    if not isinstance(messages, (list, tuple)):
        raise TemplateError(f"messages must be a list of {{'role', 'content'}} dicts, not {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateError(f"message {i} must be a dict with 'role' and 'content', not {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise TemplateError(f"message {i} has no 'role' string")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise TemplateError(f"message {i}: 'content' must be a string, a list or None")
    return list(messages)


class ChatTemplate:
    """A compiled, sandboxed chat template.

    `source` is the Jinja text; `name` says where it came from: "gguf", "gguf:<name>",
    "builtin:<family>" or "file:<path>". `limits` bounds each render; `clock` supplies the time
    that `strftime_now` formats (tests pin it).
    """

    def __init__(
        self,
        source: str,
        name: str = "custom",
        *,
        limits: RenderLimits | None = None,
        clock: Callable[[], datetime] | None = None,
    ):
        self.source = source
        self.name = name
        self.limits = limits or RenderLimits()
        self._clock = clock or datetime.now
        if not isinstance(source, str):
            raise TemplateError(f"chat template {name} is not text ({type(source).__name__})")
        if len(source) > self.limits.max_source_chars:
            raise TemplateError(
                f"chat template {name} is {len(source)} characters long (limit {self.limits.max_source_chars})"
            )
        self._env = _ChatSandbox(self.limits)
        self._env.globals["raise_exception"] = self._raise_exception
        self._env.globals["strftime_now"] = self._strftime_now
        token = _budget_var.set(_Budget(self.limits, name))  # constant folding runs under limits too
        try:
            self._template = self._env.from_string(source)
        except TemplateSyntaxError as e:
            raise TemplateError(f"chat template {name} has a syntax error at line {e.lineno}: {_one_line(e.message)}") from None
        except TemplateError:
            raise
        except Exception as e:  # anything else the compiler raises on hostile input
            raise TemplateError(f"chat template {name} cannot be compiled: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _budget_var.reset(token)

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"

    # -- template globals ----------------------------------------------------------------------
    def _raise_exception(self, message: Any = "") -> None:
        raise TemplateError(f"chat template {self.name} raised: {_one_line(message)}")

    def _strftime_now(self, fmt: Any) -> str:
        if not isinstance(fmt, str) or len(fmt) > 200:
            raise TemplateError(f"chat template {self.name}: strftime_now needs a short format string")
        for w in _STRFTIME_WIDTH_RE.findall(fmt):  # glibc widths such as %999999999Y
            if len(w) > 2:
                raise TemplateError(f"chat template {self.name}: strftime_now width {w} is too large")
        return self._clock().strftime(fmt)

    # -- construction from a model -----------------------------------------------------------
    @classmethod
    def builtin(cls, family: str, **opts: Any) -> "ChatTemplate":
        """The built-in template of a family (see `BUILTIN_TEMPLATES`)."""
        if family not in BUILTIN_TEMPLATES:
            raise TemplateError(f"no built-in chat template {family!r}; known: {', '.join(BUILTIN_TEMPLATES)}")
        return cls(BUILTIN_TEMPLATES[family], f"builtin:{family}", **opts)

    @classmethod
    def from_file(cls, path: str | Path, **opts: Any) -> "ChatTemplate":
        """A template read from a text file (`--chat-template FILE`)."""
        p = Path(path)
        limit = (opts.get("limits") or RenderLimits()).max_source_chars
        try:
            if p.stat().st_size > 4 * limit:
                raise TemplateError(f"chat template file {p} is too large")
            source = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TemplateError(f"chat template file {p} is not UTF-8 text") from None
        except OSError as e:
            raise TemplateError(f"cannot read chat template file {p}: {e.strerror or e}") from None
        return cls(source, f"file:{p}", **opts)

    @classmethod
    def from_metadata(
        cls,
        md: Mapping[str, Any],
        override_path: str | Path | None = None,
        name: str | None = None,
        **opts: Any,
    ) -> "ChatTemplate | None":
        """The template for a model: override file > GGUF template (or a named one) > built-in.

        `name` selects `tokenizer.chat_template.<name>` (or "builtin:<family>"). Returns None for
        a model with no template and no chat tokens: callers then use raw completion.
        """
        if override_path is not None:
            return cls.from_file(override_path, **opts)
        if name is not None and name.startswith("builtin:"):
            return cls.builtin(name[len("builtin:"):], **opts)
        if name is not None and name != "default":
            key = f"tokenizer.chat_template.{name}"
            if key not in md:
                known = alternative_template_names(md)
                raise TemplateError(
                    f"the model has no chat template named {name!r}"
                    + (f"; it has: {', '.join(known)}" if known else "; it has no named templates")
                )
            return cls(_metadata_source(md, key), f"gguf:{name}", **opts)
        if "tokenizer.chat_template" in md:
            return cls(_metadata_source(md, "tokenizer.chat_template"), "gguf", **opts)
        family = builtin_template_name(md)
        return cls.builtin(family, **opts) if family is not None else None

    # -- rendering ----------------------------------------------------------------------------
    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        bos_token: str = "",
        eos_token: str = "",
        *,
        tools: list | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation to prompt text under the sandbox and the limits.

        `extra` adds template variables (e.g. `date_string`, `enable_thinking`).
        """
        messages = _validate_messages(messages)
        context = {
            **extra,
            "messages": messages,
            "add_generation_prompt": bool(add_generation_prompt),
            "bos_token": bos_token,
            "eos_token": eos_token,
            "tools": tools,
        }
        budget = _Budget(self.limits, self.name)
        token = _budget_var.set(budget)
        chunks: list[str] = []
        n = 0
        gen = None
        try:
            # stream so that the output size and the clock are checked between chunks
            gen = self._template.generate(**context)
            for chunk in gen:
                n += len(chunk)
                if n > self.limits.max_chars:
                    raise TemplateError(
                        f"chat template {self.name} output exceeds {self.limits.max_chars} characters"
                    )
                budget.tick()
                chunks.append(chunk)
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(f"chat template {self.name} was blocked by the sandbox: {_one_line(e)}") from None
        except RecursionError:
            raise TemplateError(f"chat template {self.name} recursed too deeply") from None
        except MemoryError:
            raise TemplateError(f"chat template {self.name} ran out of memory") from None
        except Exception as e:
            raise TemplateError(f"chat template {self.name} failed: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            if gen is not None:
                gen.close()
            _budget_var.reset(token)
        return "".join(chunks)


def _metadata_source(md: Mapping[str, Any], key: str) -> str:
    value = md[key]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise TemplateError(f"{key} is not UTF-8 text") from None
    if not isinstance(value, str):
        raise TemplateError(f"{key} is not a string ({type(value).__name__})")
    return value
