"""The built-in chat templates, for models whose GGUF carries none, by explicit request only.

A GGUF without `tokenizer.chat_template` runs as plain completion (as in llama.cpp): its
vocabulary or its name do not prove that it was trained on a chat format (every Llama 3 base
model has the Llama 3 chat tokens). The user asks for a format by name (`BUILTIN_TEMPLATES`, or
llama.cpp's spelling of the same names, `BUILTIN_ALIASES`). `builtin_template_name` only
*suggests* a name for messages; nothing applies it on its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["BUILTIN_TEMPLATES", "BUILTIN_ALIASES", "builtin_family", "builtin_template_name"]

# Written from each family's documented prompt format. Raw strings: `\n` is a Jinja escape.

# Families without a system role of their own (llama-2, mistral, gemma) take a leading system
# message apart: `system_message` and the `loop_messages` after it.
_SPLIT_SYSTEM = r"""
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system_message = messages[0]['content'] | trim -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system_message = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}

"""


def _each(body: str, over: str = "messages") -> str:
    """Jinja: `body` (lines over `message`) for every message of `over`."""
    return "{%- for message in " + over + " -%}\n" + body + "{%- endfor -%}\n"


def _assistant_header(header: str) -> str:
    """Jinja: the expression `header` when the template is asked for the assistant's turn."""
    return "{%- if add_generation_prompt -%}\n  {{- " + header + " -}}\n{%- endif -%}\n"


_BOS = "{{- bos_token -}}\n"


def _alternating(family: str, with_system: str, user: str, assistant: str) -> str:
    """Jinja of the families whose turns must alternate user/assistant (llama-2, mistral): the
    system text joins the first user turn as `with_system`; `user` and `assistant` are the turns'
    expressions over `content`."""
    return _each(r"""  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('""" + family + r""" chat: roles must alternate user/assistant/user/...') -}}
  {%- endif -%}
  {%- set content = (message['content'] or '') | trim -%}
  {%- if message['role'] == 'user' -%}
    {%- if loop.first and system_message -%}
      {%- set content = """ + with_system + r""" -%}
    {%- endif -%}
    {{- """ + user + r""" -}}
  {%- else -%}
    {{- """ + assistant + r""" -}}
  {%- endif -%}
""", "loop_messages")


_LLAMA2 = _SPLIT_SYSTEM + _alternating("llama-2", r"'<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + content",
                                       "bos_token + '[INST] ' + content + ' [/INST]'", "' ' + content + ' ' + eos_token")

_LLAMA3 = "\n" + _BOS + _each(
    r"""  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + ((message['content'] or '') | trim) + '<|eot_id|>' -}}
""") + _assistant_header(r"'<|start_header_id|>assistant<|end_header_id|>\n\n'")

_CHATML = "\n" + _each(r"""  {{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' -}}
""") + _assistant_header(r"'<|im_start|>assistant\n'")

# Mistral has no system role: the system text opens the first user turn.
_MISTRAL = _SPLIT_SYSTEM + _BOS + _alternating("mistral", r"system_message + '\n\n' + content",
                                               "'[INST] ' + content + ' [/INST]'", "' ' + content + eos_token")

_PHI3 = "\n" + _each(r"""  {%- if message['role'] != 'system' or message['content'] -%}
    {{- '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' -}}
  {%- endif -%}
""") + _assistant_header(r"'<|assistant|>\n'")

# Gemma has no system role either; its assistant role is called "model".
_GEMMA = _SPLIT_SYSTEM + _BOS + _each(r"""  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {%- set content = (message['content'] or '') | trim -%}
  {%- if loop.first and system_message -%}
    {%- set content = system_message + '\n\n' + content -%}
  {%- endif -%}
  {{- '<start_of_turn>' + role + '\n' + content + '<end_of_turn>\n' -}}
""", "loop_messages") + _assistant_header(r"'<start_of_turn>model\n'")

_ZEPHYR = "\n" + _each(r"""  {{- '<|' + message['role'] + '|>\n' + (message['content'] or '') + eos_token + '\n' -}}
""") + _assistant_header(r"'<|assistant|>\n'")

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

#: llama.cpp's names for the same formats (`llama-cli --chat-template llama3`).
BUILTIN_ALIASES: dict[str, str] = {"llama2": "llama-2", "llama3": "llama-3", "phi3": "phi-3"}


def builtin_family(name: str) -> str | None:
    """The family a built-in name (or a llama.cpp alias) stands for, or None for an unknown name."""
    name = name.strip().lower()
    if name in BUILTIN_TEMPLATES:
        return name
    return BUILTIN_ALIASES.get(name)

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
    """A built-in template family that *may* fit a model without its own template, or None.

    Only a suggestion for messages (a hint to try "llama-3"): a base model has the same
    vocabulary and architecture as its instruct sibling, so nothing applies this on its own.
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

