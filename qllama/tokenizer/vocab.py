"""Vocabulary loading: the `tokenizer.ggml.*` arrays of GGUF metadata, checked, as llama.cpp reads
them (llama_vocab::impl::load): token texts, token types -> attributes, SPM scores, BPE merges.

Also the small typed readers of single metadata values that the rest of the package uses.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass
from enum import IntEnum, IntFlag

import numpy as np

from ..errors import QllamaError, QllamaWarning, UnsupportedError

KEY = "tokenizer.ggml."
MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece-style BPE


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(IntFlag):
    """llama.cpp's per-token attributes (llama_token_attr)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8


_TYPE_TO_ATTR = np.zeros(8, dtype=np.int32)  # indexed by TokenType; anything else is UNDEFINED
_TYPE_TO_ATTR[TokenType.UNKNOWN] = TokenAttr.UNKNOWN
_TYPE_TO_ATTR[TokenType.UNUSED] = TokenAttr.UNUSED
_TYPE_TO_ATTR[TokenType.NORMAL] = TokenAttr.NORMAL
_TYPE_TO_ATTR[TokenType.CONTROL] = TokenAttr.CONTROL
_TYPE_TO_ATTR[TokenType.USER_DEFINED] = TokenAttr.USER_DEFINED
_TYPE_TO_ATTR[TokenType.BYTE] = TokenAttr.BYTE
SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN  # cut out before merging
HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # no text unless decoding specials


@dataclass
class Vocab:
    """The token table of one GGUF file. `attrs` starts as the file's token types; specials.py
    then applies llama.cpp's fix-ups to it in place."""

    model: str  # "gpt2" | "llama"
    tokens: list[str]  # (n,) texts as stored (GPT-2 byte form or "▁" form); empty ones renamed
    token_to_id: dict[str, int]
    attrs: np.ndarray  # (n,) int32 TokenAttr bits

    @property
    def n(self) -> int:
        return len(self.tokens)

    def special_ids(self) -> np.ndarray:
        """Ids of control, user-defined and unknown tokens (cut from the text before merging)."""
        return np.flatnonzero(self.attrs & SPECIAL_ATTRS)


def load_vocab(md: dict) -> Vocab:
    """The checked token table of GGUF metadata."""
    model = md.get(KEY + "model")
    if model is None:
        raise QllamaError("this GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    if not isinstance(model, str):
        raise QllamaError("tokenizer.ggml.model must be a string")
    if model not in MODELS:
        raise UnsupportedError(f"tokenizer model {model!r} is not supported (supported: 'gpt2' BPE, "
                               "'llama' SentencePiece)")
    tokens = md.get(KEY + "tokens")
    if not isinstance(tokens, list) or not _all_str(tokens):
        raise QllamaError("tokenizer.ggml.tokens is missing or is not an array of strings")
    n = len(tokens)
    if n == 0:
        raise QllamaError("tokenizer.ggml.tokens is empty")
    if "" in tokens:  # llama.cpp renames empty tokens so that they stay unique and unmatched
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    token_to_id = dict(zip(tokens, range(n)))
    if len(token_to_id) != n:
        dup = next(t for i, t in enumerate(tokens) if token_to_id[t] != i)
        raise QllamaError(f"duplicate token in vocabulary: {dup!r}")
    return Vocab(model, tokens, token_to_id, _attrs_from_types(md.get(KEY + "token_type"), n))


def _attrs_from_types(types, n: int) -> np.ndarray:
    if types is None:
        return np.full(n, TokenAttr.NORMAL, dtype=np.int32)
    types = np.asarray(types)
    if types.ndim != 1 or types.dtype.kind not in "iu" or len(types) < n:
        raise QllamaError("tokenizer.ggml.token_type must be an integer array with one entry per token")
    t = types[:n].astype(np.int64)
    attrs = np.where((t >= 0) & (t < len(_TYPE_TO_ATTR)), _TYPE_TO_ATTR[np.clip(t, 0, 7)], 0)
    return attrs.astype(np.int32)


def load_scores(md: dict, n: int) -> list[float]:
    """SPM token scores (n,), zeros when the file has none."""
    scores = md.get(KEY + "scores")
    if scores is None:
        return [0.0] * n
    scores = np.asarray(scores)
    if scores.ndim != 1 or scores.dtype.kind not in "iuf" or len(scores) < n:
        raise QllamaError("tokenizer.ggml.scores must be a numeric array with one entry per token")
    return scores[:n].astype(np.float32).tolist()


def load_merges(md: dict) -> list[str]:
    """BPE merges ("left right" strings, best first)."""
    merges = md.get(KEY + "merges")
    if merges is None:
        raise QllamaError("cannot find tokenizer merges (tokenizer.ggml.merges) in the model file")
    if not isinstance(merges, list) or not _all_str(merges):
        raise QllamaError("tokenizer.ggml.merges must be an array of strings")
    return merges


def _all_str(items: list) -> bool:
    try:
        "".join(items)  # C-speed element type check
        return True
    except TypeError:
        return False


# -- single metadata values ------------------------------------------------------------------

def md_str(md: dict, key: str) -> str | None:
    v = md.get(key)
    if v is not None and not isinstance(v, str):
        raise QllamaError(f"{key} must be a string")
    return v


def md_bool(md: dict, key: str, default: bool) -> bool:
    v = md.get(key)
    if v is None:
        return default
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):  # some converters wrote 0/1
        return bool(v)
    raise QllamaError(f"{key} must be a boolean")


def md_token_id(md: dict, key: str, default: int | None, n: int) -> int | None:
    """A `tokenizer.ggml.<key>` id; out of range (or a default out of range) means unset, as in llama.cpp."""
    if default is not None and default >= n:
        default = None  # llama.cpp: "default special token out of vocab range, disabling"
    v = md.get(KEY + key)
    if v is None:
        return default
    if isinstance(v, (bool, float, str)) or not isinstance(v, (int, np.integer)):
        raise QllamaError(f"tokenizer.ggml.{key} must be an integer")
    if not 0 <= int(v) < n:
        # llama.cpp: "bad special token ... using default id"
        warnings.warn(f"tokenizer.ggml.{key} = {int(v)} is outside the vocabulary of {n} tokens: "
                      f"ignored ({'using the default id ' + str(default) if default is not None else 'unset'})",
                      QllamaWarning, stacklevel=2)
        return default
    return int(v)
