"""Exceptions that the CLI turns into a one-line `error:` message."""


class QllamaError(Exception):
    """Base class for every error that is the user's input, not a bug of ours."""


class GGUFError(QllamaError):
    """A file is not a valid GGUF file (bad magic, truncated, inconsistent sizes...)."""


class UnsupportedError(QllamaError):
    """Valid input that qllama cannot run (an architecture, a tensor type, a tokenizer...)."""


class ContextSizeError(QllamaError):
    """A context size that cannot be used: its KV cache would not fit in memory."""


class ContextOverflowError(QllamaError):
    """A prompt does not fit in the context window."""


class OutputExistsError(QllamaError):
    """A command would overwrite an existing file without being told to."""


class QllamaWarning(UserWarning):
    """Something works but is probably not what the user wants (e.g. a context beyond training)."""
