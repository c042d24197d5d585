"""Tokenizers from GGUF metadata, giving llama.cpp's token ids (src/llama-vocab.cpp).

    tok = load_tokenizer("model.gguf")          # works on vocab-only files too
    ids = tok.encode("Hello", add_bos=True)     # BOS only if the model asks for it
    text = tok.decode(ids)

Two models: byte-level BPE (`gpt2`, see tokenizer_bpe.py) and SentencePiece-style BPE (`llama`,
see tokenizer_spm.py). Around them, as llama.cpp does:
- special tokens: the text is first cut at special-token texts, longest first. Control and
  unknown tokens are cut only with `parse_special=True`; user-defined tokens are *always* cut
  (llama.cpp follows HF tokenizers there: "User-defined tokens are still pre-tokenized before
  everything else").
- SPM: every raw fragment after a special token (and the first) gets the dummy-prefix space when
  `add_space_prefix` is set; spaces become "▁".
- token attributes are the GGUF token types, adjusted by llama.cpp's rules (end-of-turn and FIM
  texts become control tokens, control tokens named "unused" are unused, Phi-3 strips spaces
  after special tokens).
- decoding is llama.cpp's `llama_detokenize(remove_special=false, unparse_special=false)`:
  control and unknown tokens give no text, the first token loses one leading space when
  `add_space_prefix`, and BPE vocabularies with `clean_spaces` get its " ." -> "." clean-up.
"""

from __future__ import annotations

import codecs
import gc
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from os import PathLike

import numpy as np

from .errors import QllamaError, UnsupportedError
from .pretokenizers import PreTokenizer, get_pretokenizer
from .tokenizer_bpe import BPEModel, check_merges, gpt2_decode
from .tokenizer_spm import SPACE, SPMModel

__all__ = ["Tokenizer", "StreamDecoder", "load_tokenizer", "TokenType", "TokenAttr"]

KEY = "tokenizer.ggml."


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
_SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
_HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # no text unless decoding specials

# Texts llama.cpp recognizes (llama_vocab::impl::load). The first present one becomes eot/eom/fim;
# every token with one of them becomes a control token.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Every token with one of these texts ends generation (llama.cpp's special_eog_ids).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(), used by llama.cpp's lstrip/rstrip of special tokens


@dataclass(frozen=True)
class _Defaults:
    bos: int | None
    eos: int | None
    unk: int | None
    add_bos: bool
    add_space_prefix: bool
    clean_spaces: bool


class Tokenizer:
    """A GGUF tokenizer with llama.cpp's exact ids. Build it with `from_gguf` or `load_tokenizer`."""

    model: str  # "gpt2" | "llama"
    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    eog_ids: frozenset[int]
    pre: PreTokenizer | None  # BPE only

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf) -> "Tokenizer":
        """The tokenizer stored in an open `qllama.gguf.GGUFFile`."""
        return cls.from_metadata(gf.metadata)

    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        """The tokenizer described by GGUF metadata (`tokenizer.ggml.*` keys)."""
        self = cls.__new__(cls)
        gc_was_on = gc.isenabled()
        gc.disable()  # building makes ~10^5 small objects and no cycles: skip the collector passes
        try:
            self._init(md)
        finally:
            if gc_was_on:
                gc.enable()
        return self

    def _init(self, md: dict) -> None:
        model = md.get(KEY + "model")
        if model is None:
            raise QllamaError("this GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        if not isinstance(model, str):
            raise QllamaError("tokenizer.ggml.model must be a string")
        if model not in ("gpt2", "llama"):
            raise UnsupportedError(f"tokenizer model {model!r} is not supported (supported: 'gpt2' BPE, "
                                   "'llama' SentencePiece)")
        self.model = model
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
        self.n_vocab = n
        self._tokens = tokens
        self._t2i = token_to_id

        types = md.get(KEY + "token_type")
        if types is None:
            attrs = np.full(n, TokenAttr.NORMAL, dtype=np.int32)
        else:
            types = np.asarray(types)
            if types.ndim != 1 or types.dtype.kind not in "iu" or len(types) < n:
                raise QllamaError("tokenizer.ggml.token_type must be an integer array with one entry per token")
            t = types[:n].astype(np.int64)
            attrs = np.where((t >= 0) & (t < len(_TYPE_TO_ATTR)), _TYPE_TO_ATTR[np.clip(t, 0, 7)], 0)
            attrs = attrs.astype(np.int32)

        pre = None
        if model == "llama":
            d = _Defaults(bos=1, eos=2, unk=0, add_bos=True, add_space_prefix=True, clean_spaces=False)
        else:
            pre = get_pretokenizer(_opt_str(md, KEY + "pre"))
            d = _Defaults(bos=11, eos=11, unk=None, add_bos=pre.add_bos, add_space_prefix=False,
                          clean_spaces=pre.clean_spaces)
            if pre.name in ("glm4", "chatglm-bpe"):
                d = _Defaults(None, d.eos, d.unk, d.add_bos, d.add_space_prefix, d.clean_spaces)
        self.pre = pre
        self.add_space_prefix = _opt_bool(md, KEY + "add_space_prefix", d.add_space_prefix)
        self.clean_spaces = d.clean_spaces

        def special(key: str, default: int | None) -> int | None:
            if default is not None and default >= n:
                default = None  # llama.cpp: "default special token out of vocab range, disabling"
            v = md.get(KEY + key)
            if v is None:
                return default
            if isinstance(v, (bool, float, str)) or not isinstance(v, (int, np.integer)):
                raise QllamaError(f"tokenizer.ggml.{key} must be an integer")
            return int(v) if 0 <= int(v) < n else default

        self.bos_id = special("bos_token_id", d.bos)
        self.eos_id = special("eos_token_id", d.eos)
        self.unk_id = special("unknown_token_id", d.unk)
        self.eot_id = special("eot_token_id", None)
        self.eom_id = special("eom_token_id", None)
        fim = {k: special(f"{k}_token_id", None) for k in _FIM_TEXTS}
        for k, legacy in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
            if md.get(KEY + f"{k}_token_id") is None:
                fim[k] = special(f"{legacy}_token_id", None)
        self.add_bos = _opt_bool(md, KEY + "add_bos_token", d.add_bos)
        self.add_eos = _opt_bool(md, KEY + "add_eos_token", False)
        if self.add_bos and self.bos_id is None:
            raise QllamaError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if self.add_eos and self.eos_id is None:
            raise QllamaError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

        # llama.cpp's text-based fix-ups of ids and attributes
        def force_control(tid: int) -> None:
            attrs[tid] |= TokenAttr.CONTROL

        def detect(current: int | None, texts: tuple[str, ...]) -> int | None:
            if current is not None:  # set by the metadata: llama.cpp looks no further
                return current
            for text in texts:  # llama.cpp takes the first one its hash map yields; we take list order
                tid = token_to_id.get(text)
                if tid is not None:
                    force_control(tid)
                    return tid
            return None

        self.eot_id = detect(self.eot_id, _EOT_TEXTS)
        self.eom_id = detect(self.eom_id, _EOM_TEXTS)
        for k, texts in _FIM_TEXTS.items():
            fim[k] = detect(fim[k], texts)
        for tid in np.flatnonzero(attrs & TokenAttr.CONTROL):
            if "unused" in tokens[tid]:
                attrs[tid] |= TokenAttr.UNUSED
        eog = {fim[k] for k in ("fim_pad", "fim_rep", "fim_sep") if fim[k] is not None}
        for text in _EOG_TEXTS:
            tid = token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                force_control(tid)
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always shown
            tid = token_to_id.get(text)
            if tid is not None:
                attrs[tid] = TokenAttr.USER_DEFINED
        eog |= {t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None}
        texts_in_eog = {tokens[t] for t in eog}
        if "<|end|>" in texts_in_eog and (
            ("<|return|>" in texts_in_eog and ({"<|call|>", "<|calls|>"} & texts_in_eog))
            or ({"<|call|>", "<|calls|>"} & texts_in_eog and "<|flush|>" in texts_in_eog)
        ):  # harmony / solar-open: <|end|> is not the end of generation there
            end_id = token_to_id["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = TokenAttr.USER_DEFINED
        if "<|tool_response>" in texts_in_eog and "</s>" in texts_in_eog:
            s_id = token_to_id["</s>"]
            eog.discard(s_id)
            attrs[s_id] = TokenAttr.NORMAL
        self.eog_ids = frozenset(int(t) for t in eog)

        # per-model attributes (llama.cpp sets them by name)
        name = str(md.get("general.name", "")).lower()
        arch = str(md.get("general.architecture", ""))
        pre_name = str(md.get(KEY + "pre", ""))
        special_ids = np.flatnonzero(attrs & _SPECIAL_ATTRS)
        if any(s in pre_name for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
                s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in token_to_id:
                attrs[token_to_id["<mask>"]] |= TokenAttr.LSTRIP
        elif "phi-3" in name or "phi3" in name:
            attrs[special_ids] |= TokenAttr.RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in token_to_id:
                    tid = token_to_id[text]
                    attrs[tid] = (attrs[tid] | TokenAttr.RSTRIP) if on else (attrs[tid] & ~TokenAttr.RSTRIP)
        self._attrs = attrs
        # special tokens for partitioning, longest (in bytes) first
        self._specials = sorted((int(i) for i in special_ids), key=lambda i: -len(tokens[i].encode("utf-8")))

        if model == "llama":
            scores = md.get(KEY + "scores")
            if scores is None:
                score_list = [0.0] * n
            else:
                scores = np.asarray(scores)
                if scores.ndim != 1 or scores.dtype.kind not in "iuf" or len(scores) < n:
                    raise QllamaError("tokenizer.ggml.scores must be a numeric array with one entry per token")
                score_list = scores[:n].astype(np.float32).tolist()
            self._spm = SPMModel(tokens, token_to_id, score_list, self.unk_id)
            self._bpe = None
        else:
            merges = md.get(KEY + "merges")
            if merges is None:
                raise QllamaError("cannot find tokenizer merges (tokenizer.ggml.merges) in the model file")
            self._bpe = BPEModel(tokens, token_to_id, (attrs & TokenAttr.NORMAL) != 0, check_merges(merges), pre)
            self._spm = None
        self._piece_cache: dict[int, bytes] = {}

    # -- token properties ------------------------------------------------------------------
    def attr(self, id: int) -> TokenAttr:
        """llama.cpp's attributes of a token."""
        return TokenAttr(int(self._attrs[self._check_id(id)]))

    def is_control(self, id: int) -> bool:
        """True for control tokens (BOS, EOS, <|eot_id|>...), which decode to no text by default."""
        return bool(self._attrs[self._check_id(id)] & TokenAttr.CONTROL)

    def is_eog(self, id: int) -> bool:
        """True if generation ends on this token."""
        return id in self.eog_ids

    def token_text(self, id: int) -> str:
        """The token as stored in the vocabulary (GPT-2 byte form or "▁" form)."""
        return self._tokens[self._check_id(id)]

    def token_id(self, text: str) -> int | None:
        """The id of the token stored as `text`, if any."""
        return self._t2i.get(text)

    def _check_id(self, id) -> int:
        i = int(id)
        if not 0 <= i < self.n_vocab:
            raise QllamaError(f"token id {i} is out of range (vocabulary of {self.n_vocab})")
        return i

    def token_bytes(self, id: int, special: bool = False) -> bytes:
        """The bytes one token contributes to decoded text (llama.cpp's token_to_piece, lstrip=0).

        Control and unknown tokens give b"" unless `special`.
        """
        i = self._check_id(id)
        if not special:
            b = self._piece_cache.get(i)
            if b is None:
                b = self._piece(i, False)
                self._piece_cache[i] = b
            return b
        return self._piece(i, True)

    def _piece(self, i: int, special: bool) -> bytes:
        attr = int(self._attrs[i])
        if not special and attr & _HIDDEN_ATTRS:
            return b""
        text = self._tokens[i]
        if attr & _SPECIAL_ATTRS:
            return _raw_bytes(text)
        if attr & TokenAttr.NORMAL:
            if self.model == "llama":
                return _raw_bytes(text.replace(SPACE, " "))
            return gpt2_decode(text)
        if attr & TokenAttr.BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""  # unused / undefined tokens print nothing, as in llama.cpp

    def piece(self, id: int) -> str:
        """Display form of one token (special tokens shown; bytes that are not UTF-8 as \\xNN)."""
        return self.token_bytes(id, special=True).decode("utf-8", "backslashreplace")

    # -- encoding ----------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize.

        `add_bos` is llama.cpp's `add_special`: it prepends BOS only if the model's `add_bos` is set
        (and appends EOS if its `add_eos` is), and never a second BOS when `text` already starts
        with one (llama.cpp would add it and warn). `parse_special` also matches control tokens
        such as "<|eot_id|>" in the text; user-defined tokens are always matched.
        """
        if not isinstance(text, str):
            raise QllamaError(f"text to encode must be a str, not {type(text).__name__}")
        text = _no_surrogates(text)
        out: list[int] = []
        fragments = self._partition(text, parse_special) if text else []
        if self._spm is not None:
            prev_special = True  # the first fragment gets the dummy prefix too
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm.encode(frag.replace(" ", SPACE)))
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._bpe.encode(frag))
        if add_bos:
            if self.add_bos and not (out and out[0] == self.bos_id):
                out.insert(0, self.bos_id)
            if self.add_eos:
                out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut `text` at special-token texts (llama.cpp's tokenizer_st_partition)."""
        frags: list[str | int] = [text]
        attrs = self._attrs
        for sid in self._specials:
            attr = int(attrs[sid])
            if not parse_special and attr & _HIDDEN_ATTRS:
                continue
            tok = self._tokens[sid]
            if tok not in text:  # cheap: most special tokens never occur
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok)
                for k, part in enumerate(parts):
                    if k > 0:
                        new.append(sid)
                    if attr & TokenAttr.LSTRIP and k < len(parts) - 1:
                        part = part.rstrip(_ASCII_SPACE)  # spaces before the token go
                    if attr & TokenAttr.RSTRIP and k > 0:
                        part = part.lstrip(_ASCII_SPACE)  # spaces after the token go
                    if part:
                        new.append(part)
            frags = new
        return frags

    # -- decoding ----------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of a whole token sequence (llama.cpp's llama_detokenize, remove_special=false).

        `special=True` also renders control tokens. Invalid UTF-8 becomes U+FFFD.
        """
        pieces = [self.token_bytes(i, special) for i in ids]
        if pieces and self.add_space_prefix and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]  # llama.cpp strips one leading space from the first token
        text = b"".join(pieces).decode("utf-8", "replace")
        return clean_up_spaces(text) if self.clean_spaces else text

    def stream_decoder(self, special: bool = False, continuation: bool = False, *,
                       strip_leading_space: bool | None = None) -> "StreamDecoder":
        """A decoder fed one id at a time; its chunks concatenate to `decode(all ids)`.

        `continuation=True` is for ids that continue earlier text, e.g. tokens generated after a
        prompt: the chunks are then what llama.cpp prints while generating (the pieces as they
        are, without the first token's leading-space strip and without the clean-up of spaces).
        `strip_leading_space=False` is an older spelling of `continuation=True`.
        """
        if strip_leading_space is not None:
            continuation = not strip_leading_space
        return StreamDecoder(self, special, continuation)

    def __repr__(self) -> str:
        pre = f", pre={self.pre.name!r}" if self.pre is not None else ""
        return f"Tokenizer(model={self.model!r}{pre}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


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

    def __init__(self, tokenizer: Tokenizer, special: bool = False, continuation: bool = False):
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


def _no_surrogates(text: str) -> str:
    # Lone surrogates have no UTF-8 form (they come from surrogateescape'd bytes): U+FFFD each.
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


def _raw_bytes(text: str) -> bytes:
    """The file's bytes of a token string (the GGUF reader keeps invalid UTF-8 as surrogateescape)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _all_str(items: list) -> bool:
    try:
        "".join(items)  # C-speed element type check
        return True
    except TypeError:
        return False


def _opt_str(md: dict, key: str) -> str | None:
    v = md.get(key)
    if v is not None and not isinstance(v, str):
        raise QllamaError(f"{key} must be a string")
    return v


def _opt_bool(md: dict, key: str, default: bool) -> bool:
    v = md.get(key)
    if v is None:
        return default
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):  # some converters wrote 0/1
        return bool(v)
    raise QllamaError(f"{key} must be a boolean")


def load_tokenizer(path: str | PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file (a full model or a vocab-only file)."""
    from .gguf import GGUFFile

    return Tokenizer.from_gguf(GGUFFile(path))
