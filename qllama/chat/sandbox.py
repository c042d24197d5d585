"""The sandboxed Jinja2 environment that renders untrusted chat templates.

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

Naming: a `_guard_*` function wraps an operation (a filter, a loop, an output, `~`) and runs
the `_check_*` pre-checks of `limits.py` around it. Every failure is a `TemplateError` with a
one-line message.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from .limits import (
    _FILTER_CHECKS,
    RenderLimits,
    TemplateError,
    _budget,
    _check_join,
    _check_percent_format,
    _check_str_method,
    _materialize,
    _render_len,
)

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

