"""The `--chat-template NAME|FILE` option of `run` and `chat`, and how they report the prompt format.

The library's messages name no options; this module adds them: the `--verbose` line that says
which format a prompt got and why, and the hint on a model that has no chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from ..chat import BUILTIN_TEMPLATES, NoChatTemplateError, PromptFormat, builtin_template_name
from ..errors import QllamaError

chat_template_option = click.option(
    "--chat-template", "chat_template", metavar="NAME|FILE",
    help=f"Chat format: a built-in name ({', '.join(BUILTIN_TEMPLATES)}) or a Jinja file. "
         "Default: the GGUF's own template; a GGUF without one runs as plain completion.")


def use_hint(metadata: Mapping[str, Any]) -> str:
    """How to chat with a model that has no template, naming a built-in its vocabulary suggests."""
    family = builtin_template_name(metadata)
    if family is not None:
        return f"use --chat-template NAME (e.g. {family}, which fits its vocabulary) or --chat-template FILE"
    return f"use --chat-template NAME ({', '.join(BUILTIN_TEMPLATES)}) or --chat-template FILE"


def describe(fmt: PromptFormat, metadata: Mapping[str, Any]) -> str:
    """The prompt format for `--verbose`, with the option that changes it."""
    if fmt.reason == "raw":
        return "completion (--raw)"
    if fmt.reason == "none":
        return f"{fmt}; to chat, {use_hint(metadata)}"
    if fmt.reason == "requested":
        return f"chat template {fmt.template.name} (--chat-template)"
    return str(fmt)


def no_template_error(e: NoChatTemplateError, metadata: Mapping[str, Any]) -> QllamaError:
    """The library's error, with the option that fixes it."""
    return QllamaError(f"{e.what} needs a chat template and the model has none (its GGUF has no "
                       f"tokenizer.chat_template): {use_hint(metadata)}")
