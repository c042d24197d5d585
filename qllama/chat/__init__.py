"""Chat: render a conversation into the prompt an instruct model expects, and keep its history.

| module | job |
|---|---|
| `limits.py` | `TemplateError`, `RenderLimits`, the per-render budget, size pre-checks (`_check_*`) |
| `sandbox.py` | the sandboxed Jinja2 environment: guards (`_guard_*`), HF's globals and filters |
| `builtin_templates.py` | built-in templates by family name (used only when asked for), a family hint |
| `template.py` | `ChatTemplate`: compile, render, where a model's template comes from |
| `conversation.py` | `Conversation` (history), `fit` (drop old turns), `prompt_ids` (KV-cache reuse) |
"""

from .builtin_templates import BUILTIN_ALIASES, BUILTIN_TEMPLATES, builtin_family, builtin_template_name
from .conversation import Conversation, ConversationTooLongError, aligned_prefix, answer_room, fit, prompt_ids
from .limits import RenderLimits, TemplateError
from .template import ChatTemplate, NoChatTemplateError, PromptFormat, alternative_template_names, strip_leading_bos

__all__ = [
    "TemplateError",
    "NoChatTemplateError",
    "PromptFormat",
    "RenderLimits",
    "ChatTemplate",
    "BUILTIN_TEMPLATES",
    "BUILTIN_ALIASES",
    "builtin_family",
    "builtin_template_name",
    "alternative_template_names",
    "strip_leading_bos",
    "Conversation",
    "ConversationTooLongError",
    "fit",
    "prompt_ids",
    "aligned_prefix",
    "answer_room",
]
