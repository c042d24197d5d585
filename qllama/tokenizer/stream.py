"""Decoding token by token: `StreamDecoder` turns ids into text chunks as they arrive, and
`clean_up_spaces` is llama.cpp's detokenizer clean-up that both it and `Tokenizer.decode` apply.
"""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .core import Tokenizer


# llama.cpp's clean_up_tokenization_spaces passes, in order (llama_vocab::impl::detokenize)
_CLEAN_1 = re.compile(r" (?=[?!.,])")
_CLEAN_2 = re.compile(r" ' ")
_CLEAN_3 = re.compile(r" '(?=[sm]|[rv]e)")


def clean_up_spaces(text: str) -> str:
    """llama.cpp's detokenizer clean-up: " ?" " !" " ." " ," lose the space, " ' " -> "'",
    " 's" " 'm" " 're" " 've" lose the space."""
    if " " not in text:
        return text
    text = _CLEAN_1.sub("", text)
    text = _CLEAN_2.sub("'", text)
    return _CLEAN_3.sub("'", text)


def _stable_prefix(text: str) -> int:
    """Length of the longest prefix whose clean-up cannot change when more text follows."""
    c = len(text)
    while c > 0:
        last = text[c - 1]
        if last in " '" or (last in "rv" and c >= 2 and text[c - 2] == "'"):
            c -= 1
            continue
        return c
    return 0


class StreamDecoder:
    """Turns token ids into text chunks, holding back incomplete UTF-8 sequences.

    By default the chunks concatenate to `Tokenizer.decode(ids)` of all ids fed (same
    leading-space strip, same clean-up of spaces before punctuation, which needs a few characters
    of look-ahead). With `continuation` they are the plain pieces, as llama.cpp streams them.
    """

    def __init__(self, tokenizer: "Tokenizer", special: bool = False, continuation: bool = False):
        self._tok = tokenizer
        self._special = special
        self._strip = tokenizer.add_space_prefix and not continuation
        self._clean = tokenizer.clean_spaces and not continuation
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""  # decoded text held back for the clean-up look-ahead

    def feed(self, id: int) -> str:
        """Add one token; return the text that became complete."""
        b = self._tok.token_bytes(id, self._special)
        if self._strip:
            self._strip = False  # only the very first token, even if it prints nothing
            if b[:1] == b" ":
                b = b[1:]
        s = self._utf8.decode(b)
        if not self._clean:
            return s
        self._pending += s
        c = _stable_prefix(self._pending)
        if c == 0:
            return ""
        out, self._pending = clean_up_spaces(self._pending[:c]), self._pending[c:]
        return out

    def flush(self) -> str:
        """The rest: held-back text, and U+FFFD for an unfinished UTF-8 sequence."""
        s = self._pending + self._utf8.decode(b"", final=True)
        self._pending = ""
        return clean_up_spaces(s) if self._clean else s
