"""BPE pre-tokenizers: how llama.cpp splits text into words before byte-pair merging.

llama.cpp picks a list of regexes by `tokenizer.ggml.pre` (src/llama-vocab.cpp) and applies them
one after another (src/unicode.cpp `unicode_regex_split`): each regex splits every piece left by
the previous one into its matches *and* the unmatched gaps between them, so no text is dropped.
The regexes below are llama.cpp's, in its ECMAScript flavour; `_to_python` turns them into the
`regex` module's syntax with the same meaning:

- `\\s` is Unicode White_Space. llama.cpp replaces every non-ASCII whitespace code point by
  U+000B before running std::regex, so a literal such as U+3000 inside a class never matches a
  space; we do the same replacement (length-preserving) and then `\\s` is ASCII-only.
- `$` means end of the piece (std::regex has no "before a final newline" rule): `\\Z`.
- `\\d` is ASCII [0-9] in ECMAScript.

Some families are a single regex that tiktoken's engine (fancy-regex, where `\\s` is also
White_Space) runs with identical results; those get `tiktoken_pattern` and the fast path.

Each family also carries llama.cpp's per-name flags: `ignore_merges` (a word that is itself a
token is emitted whole), `clean_spaces` (the detokenizer's " ." -> "." clean-up) and `add_bos`
(the BOS default when `tokenizer.ggml.add_bos_token` is absent).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property

import regex

# llama.cpp's White_Space set (scripts/gen-unicode-data.py): ASCII \t..\r and space, plus these.
NON_ASCII_WHITESPACE = "\x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
_WS_TO_VT = {ord(c): 0x0B for c in NON_ASCII_WHITESPACE}
_ASCII_WS = r"\t\n\x0b\x0c\r "

# --- llama.cpp's regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), ECMAScript flavour ----------
# llama.cpp runs this one with a hand-written splitter that also has a final `\s+` branch; with
# the regex alone a lone whitespace before a non-space would be a gap piece, which is the same piece.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LETTERS = (  # llama.cpp's letter class, escaped (NFC would corrupt U+1F7D, U+212A...)
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370"
    "-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-"
    "\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
    "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-"
    "\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a"
    "-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-"
    "\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-"
    "\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-"
    "\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
    "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

# pre-tokenizer type -> (regexes applied in sequence, tiktoken single pattern or None)
_TYPES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), None),
    "llama3": ((_LLAMA3,), _LLAMA3),
    "deepseek-llm": (
        (r"[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", _CJK, r"\p{N}+"),
        None,
    ),
    "deepseek-coder": ((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), None),
    "deepseek-v3": (
        (
            r"\p{N}{1,3}",
            "[一-龥\u3040-ゟ゠-ヿ]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        None,
    ),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), None),
    "starcoder": ((r"\p{N}", _GPT2), None),
    "gpt2": ((_GPT2,), None),
    "qwen2": ((_QWEN2,), None),
    "poro": ((r" ?[^(\s|.,!?…。，、।۔،)]+",), None),
    "viking": ((r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"), None),
    "tekken": ((_TEKKEN,), _TEKKEN),
    "gpt4o": ((_GPT4O,), None),
    "bailingmoe": (
        (
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
        None,
    ),
    "seed-coder": (
        (
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
            r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        None,
    ),
}

# tokenizer.ggml.pre name -> (type, ignore_merges, clean_spaces, add_bos default); llama.cpp's table.
_N, _Y = False, True
_NAMES: dict[str, tuple[str, bool, bool, bool]] = {
    "default": ("default", _N, _Y, _N),
    **{n: ("llama3", _Y, _Y, _Y) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                           "pixtral", "midm-2.0", "lfm2")},
    "deepseek-llm": ("deepseek-llm", _N, _N, _N),
    "deepseek-coder": ("deepseek-coder", _N, _N, _N),
    "deepseek-v3": ("deepseek-v3", _N, _N, _N),
    "falcon": ("falcon", _N, _Y, _N),
    "mpt": ("gpt2", _N, _Y, _N),
    "starcoder": ("starcoder", _N, _Y, _N),
    **{n: ("gpt2", _N, _Y, _N) for n in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                                         "jina-v2-de", "a.x-4.0", "mellum", "exaone4", "jais", "olmo")},
    "refact": ("starcoder", _N, _Y, _N),
    "command-r": ("starcoder", _N, _N, _N),
    "smollm": ("starcoder", _N, _N, _N),
    "codeshell": ("starcoder", _N, _Y, _N),
    "exaone": ("starcoder", _N, _Y, _N),
    "minerva-7b": ("starcoder", _N, _Y, _N),
    **{n: ("qwen2", _N, _N, _N) for n in ("qwen2", "deepseek-r1-qwen", "kormo")},
    "megrez": ("qwen2", _N, _Y, _N),
    "stablelm2": ("qwen2", _N, _Y, _N),
    "dbrx": ("llama3", _N, _Y, _N),
    "smaug-bpe": ("llama3", _N, _Y, _N),
    **{n: ("llama3", _N, _Y, _N) for n in ("glm4", "chatglm-bpe")},  # and no BOS id by default
    "poro-chat": ("poro", _N, _N, _N),
    "bloom": ("poro", _N, _Y, _N),
    "gpt3-finnish": ("poro", _N, _Y, _N),
    "viking": ("viking", _N, _N, _N),
    "tekken": ("tekken", _Y, _N, _Y),
    **{n: ("gpt4o", _N, _N, _N) for n in ("gpt-4o", "llama4")},
    "trillion": ("gpt2", _N, _N, _N),
    **{n: ("bailingmoe", _N, _N, _N) for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "seed-coder": ("seed-coder", _N, _N, _N),
}

_warned: set[str] = set()


def _to_python(expr: str) -> str:
    """Rewrite one llama.cpp (ECMAScript) regex into `regex`-module syntax with the same meaning.

    Run it on text whose non-ASCII whitespace was replaced by U+000B (see `PreTokenizer.split`).
    """
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "\\" and i + 1 < len(expr):
            nxt = expr[i + 1]
            if nxt == "s":
                out.append(_ASCII_WS if in_class else f"[{_ASCII_WS}]")
            elif nxt == "S":
                if in_class:  # never used by llama.cpp's regexes; refuse rather than guess
                    raise ValueError(f"\\S inside a class is not supported: {expr!r}")
                out.append(f"[^{_ASCII_WS}]")
            elif nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            else:
                out.append(expr[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class and expr[i - 1] != "[":
            in_class = False
        elif c == "$" and not in_class:
            c = r"\Z"  # ECMAScript `$` (no multiline): only the end of the piece
        elif c == "(" and not in_class and expr[i + 1 : i + 2] != "?":
            c = "(?:"  # no capture groups: findall must return whole matches
        out.append(c)
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's pre-tokenizer for one `tokenizer.ggml.pre` value."""

    name: str  # the `tokenizer.ggml.pre` value (after fallback)
    type: str  # the llama.cpp pre-tokenizer family it maps to
    regexes: tuple[str, ...]  # llama.cpp's regexes, applied in sequence
    tiktoken_pattern: str | None  # single equivalent pattern for tiktoken, if there is one
    ignore_merges: bool
    clean_spaces: bool
    add_bos: bool

    @cached_property
    def _compiled(self) -> list[regex.Pattern]:
        return [regex.compile(_to_python(r)) for r in self.regexes]

    def split(self, text: str) -> list[str]:
        """Split `text` into words exactly as llama.cpp's `unicode_regex_split` does."""
        if not text:
            return []
        compiled = self._compiled
        if text.isascii() or not _HAS_WIDE_WS(text):
            t = text
        else:
            t = text.translate(_WS_TO_VT)  # same length: pieces of t have the lengths of pieces of text
        pieces = [t]
        for rx in compiled:
            out: list[str] = []
            for seg in pieces:
                words = rx.findall(seg)
                if sum(map(len, words)) == len(seg):  # the matches cover seg: no gaps to keep
                    out.extend(words)
                    continue
                prev = 0
                for m in rx.finditer(seg):
                    s, e = m.span()
                    if s == e:
                        continue
                    if s > prev:
                        out.append(seg[prev:s])  # the unmatched gap is a piece too
                    out.append(seg[s:e])
                    prev = e
                if prev < len(seg):
                    out.append(seg[prev:])
            pieces = out
        return pieces if t is text else _slices(text, pieces)


_HAS_WIDE_WS = regex.compile(f"[{NON_ASCII_WHITESPACE}]").search


def _slices(text: str, words: list[str]) -> list[str]:
    # the pieces of `text` with the lengths of `words`
    out, pos = [], 0
    for w in words:
        out.append(text[pos : pos + len(w)])
        pos += len(w)
    return out


def get_pretokenizer(pre: str | None) -> PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` value.

    A missing value is llama.cpp's 'default' (with a warning, as llama.cpp gives). llama.cpp
    refuses an unknown name; we warn once on stderr and fall back to the same 'default'.
    """
    name = pre or "default"
    if pre is None or pre == "":
        _warn_once("", "tokenizer.ggml.pre is missing; using the 'default' pre-tokenizer "
                       "(generation quality may be degraded, as llama.cpp warns)")
    elif name not in _NAMES:
        _warn_once(name, f"unknown pre-tokenizer {name!r}; falling back to 'default' "
                         "(token ids may differ from the model's own tokenizer)")
        name = "default"
    type_, ignore_merges, clean_spaces, add_bos = _NAMES[name]
    regexes, pattern = _TYPES[type_]
    return PreTokenizer(name, type_, regexes, pattern, ignore_merges, clean_spaces, add_bos)


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"warning: {msg}", file=sys.stderr)


def known_pretokenizers() -> list[str]:
    """Every `tokenizer.ggml.pre` value we implement."""
    return sorted(_NAMES)
