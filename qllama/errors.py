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


class NonFiniteError(QllamaError):
    """A forward pass produced NaN or Inf. `point` names where it first appeared (e.g.
    "blk.0.attn_q"; None if a re-run could not reproduce it), `layer` its block, `position` the
    first position of the step."""

    def __init__(self, message: str, point: str | None, layer: int | None, position: int):
        super().__init__(message)
        self.point, self.layer, self.position = point, layer, position


class QllamaWarning(UserWarning):
    """Something works but is probably not what the user wants (e.g. a context beyond training)."""
