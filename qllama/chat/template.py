"""`ChatTemplate`: a compiled, sandboxed chat template, and where a model's template comes from.

The prompt format follows the file, as in llama.cpp: the GGUF's `tokenizer.chat_template`
(or a named `tokenizer.chat_template.<name>`) when it has one; otherwise none, and the model
runs as plain completion. A built-in template or a Jinja file is used only when asked for
(`ChatTemplate.from_spec`: a built-in name or a path).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import SecurityError, TemplateSyntaxError

from .builtin_templates import BUILTIN_ALIASES, BUILTIN_TEMPLATES, builtin_family
from .limits import _STRFTIME_WIDTH_RE, RenderLimits, TemplateError, _Budget, _budget_var
from .sandbox import _ChatSandbox


class NoChatTemplateError(TemplateError):
    """The model has no chat template and none was asked for, but `what` needs one."""

    def __init__(self, what: str = "chat"):
        self.what = what
        super().__init__(f"{what} needs a chat template and the model has none (its GGUF has no "
                         "tokenizer.chat_template): ask for a built-in one by name or give a Jinja file")


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt is given to the model, and why: a chat template, or plain completion.

    `reason` is "gguf" (the file's own template), "requested" (a built-in or a file asked for),
    "raw" (completion asked for) or "none" (the file has no template: completion).
    """

    template: "ChatTemplate | None"
    reason: str

    @property
    def chat(self) -> bool:
        return self.template is not None

    def __str__(self) -> str:
        if self.template is not None:
            why = "the GGUF's own" if self.reason == "gguf" else "requested"
            return f"chat template {self.template.name} ({why})"
        return "completion (raw)" if self.reason == "raw" else "completion (no chat template): the GGUF has none"


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

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def builtin(cls, family: str, **opts: Any) -> "ChatTemplate":
        """The built-in template of a family (see `BUILTIN_TEMPLATES`; llama.cpp's aliases work too)."""
        name = builtin_family(family)
        if name is None:
            raise TemplateError(f"no built-in chat template {family!r}; known: {', '.join(BUILTIN_TEMPLATES)}")
        return cls(BUILTIN_TEMPLATES[name], f"builtin:{name}", **opts)

    @classmethod
    def from_file(cls, path: str | Path, **opts: Any) -> "ChatTemplate":
        """A template read from a UTF-8 text file of Jinja source."""
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
    def from_spec(cls, spec: str | os.PathLike, **opts: Any) -> "ChatTemplate":
        """The template a user asked for: a built-in name (`llama-3`, `chatml`, ...) or a Jinja file.

        A built-in name wins over a file of the same name in the working directory; anything
        else must be a readable file. Both failures list the built-in names.
        """
        text = os.fspath(spec)
        if isinstance(spec, str) and builtin_family(text) is not None:  # a Path is always a file
            return cls.builtin(text, **opts)
        p = Path(text)
        if not p.is_file():
            names = ", ".join([*BUILTIN_TEMPLATES, *BUILTIN_ALIASES])
            looks_like_path = p.suffix or "/" in text or "\\" in text
            what = f"no such chat template file: {text}" if looks_like_path else \
                f"unknown chat template {text!r}: neither a built-in name nor a file"
            raise TemplateError(f"{what} (built-in names: {names})")
        return cls.from_file(p, **opts)

    @classmethod
    def from_metadata(
        cls,
        md: Mapping[str, Any],
        override_path: str | Path | None = None,
        name: str | None = None,
        **opts: Any,
    ) -> "ChatTemplate | None":
        """The template for a model: override file > the GGUF's template (or a named one) > None.

        `name` selects `tokenizer.chat_template.<name>` (or "builtin:<family>"). Returns None for
        a model without `tokenizer.chat_template`, whatever its vocabulary or name suggest:
        callers then use plain completion.
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
        return None

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
