"""qllama: a GGUF-reading, quantized LLM runtime for the CPU, in Python with NumPy and Numba.

    import qllama
    model = qllama.load("model.gguf")
    for chunk in model.generate("Once upon a time", max_tokens=64):
        print(chunk, end="", flush=True)

Importing qllama has no side effects and does not import numba; the heavy modules load on
first use of `load`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["load", "load_tokenizer", "Model", "Tokenizer", "GGUFFile", "QllamaError", "__version__"]

from .errors import QllamaError
from .gguf.reader import GGUFFile

if TYPE_CHECKING:  # pragma: no cover
    from .api import Model, load
    from .tokenizer import Tokenizer, load_tokenizer


def __getattr__(name: str) -> Any:
    # Lazy: `qllama.load` pulls in numba only when first used.
    if name in ("load", "Model"):
        from . import api

        return getattr(api, name)
    if name in ("load_tokenizer", "Tokenizer"):
        from . import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module 'qllama' has no attribute {name!r}")
