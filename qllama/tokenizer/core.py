"""The Tokenizer: text <-> token ids over one GGUF vocabulary, with llama.cpp's exact ids
(src/llama-vocab.cpp).

    tok = load_tokenizer("model.gguf")          # works on vocab-only files too
    ids = tok.encode("Hello", add_bos=True)     # BOS only if the model asks for it
    text = tok.decode(ids)

Building one is three steps: the token table (vocab.py), the special ids and end-of-generation
set with llama.cpp's fix-ups (specials.py), and the merge model: byte-level BPE (`gpt2`, bpe.py)
or SentencePiece-style BPE (`llama`, spm.py). Around the merge model, as llama.cpp does:
- special tokens: the text is first cut at special-token texts, longest first. Control and
  unknown tokens are cut only with `parse_special=True`; user-defined tokens are *always* cut
  (llama.cpp follows HF tokenizers there: "User-defined tokens are still pre-tokenized before
  everything else").
- SPM: every raw fragment after a special token (and the first) gets the dummy-prefix space when
  `add_space_prefix` is set (Llama 2, Phi-3; not Gemma); spaces become "▁".
- decoding is llama.cpp's `llama_detokenize(remove_special=false, unparse_special=false)`:
  control and unknown tokens give no text, the first token loses one leading space when
  `add_space_prefix`, and BPE vocabularies with `clean_spaces` get its " ." -> "." clean-up.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterable
from os import PathLike

from ..errors import QllamaError
from .bpe import BPEModel, gpt2_decode
from .pretokenizers import PreTokenizer, get_pretokenizer
from .specials import family_fixups, model_defaults, read_specials
from .spm import SPACE, SPMModel
from .stream import StreamDecoder, clean_up_spaces
from .vocab import HIDDEN_ATTRS, KEY, SPECIAL_ATTRS, TokenAttr, load_merges, load_scores, load_vocab, md_str

__all__ = ["Tokenizer", "load_tokenizer"]

_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(), used by llama.cpp's lstrip/rstrip of special tokens


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
    fim_ids: dict[str, int | None]  # fill-in-the-middle tokens: fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep
    pre: PreTokenizer | None  # BPE only

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf) -> "Tokenizer":
        """The tokenizer stored in an open `qllama.gguf.reader.GGUFFile`."""
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
        vocab = load_vocab(md)
        self.model = vocab.model
        self.n_vocab = vocab.n
        self._tokens = vocab.tokens
        self._t2i = vocab.token_to_id
        self.pre = get_pretokenizer(md_str(md, KEY + "pre")) if vocab.model == "gpt2" else None

        sp = read_specials(md, vocab, model_defaults(vocab.model, self.pre))
        family_fixups(md, vocab)
        self.bos_id, self.eos_id, self.unk_id, self.eot_id, self.eom_id = sp.bos, sp.eos, sp.unk, sp.eot, sp.eom
        self.fim_ids = sp.fim
        self.add_bos, self.add_eos = sp.add_bos, sp.add_eos
        self.add_space_prefix, self.clean_spaces = sp.add_space_prefix, sp.clean_spaces
        self.eog_ids = sp.eog
        self._attrs = vocab.attrs  # (n_vocab,) int32 TokenAttr bits, after the fix-ups
        # special tokens cut from the text, longest (in bytes) first: all of them with
        # parse_special, else only those that are not hidden (user-defined ones)
        order = sorted((int(i) for i in vocab.special_ids()), key=lambda i: -len(vocab.tokens[i].encode("utf-8")))
        cut_all = [(i, vocab.tokens[i], int(vocab.attrs[i])) for i in order]
        self._cuts = {True: _SpecialCuts(cut_all), False: _SpecialCuts([c for c in cut_all if not c[2] & HIDDEN_ATTRS])}

        self._spm: SPMModel | None = None
        self._bpe: BPEModel | None = None
        if vocab.model == "llama":
            self._spm = SPMModel(vocab.tokens, vocab.token_to_id, load_scores(md, vocab.n), self.unk_id,
                                 self.add_space_prefix)
        else:
            self._bpe = BPEModel(vocab.tokens, vocab.token_to_id, (vocab.attrs & TokenAttr.NORMAL) != 0,
                                 load_merges(md), self.pre)
        self._merger = self._spm if self._spm is not None else self._bpe
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
        if not special and attr & HIDDEN_ATTRS:
            return b""
        text = self._tokens[i]
        if attr & SPECIAL_ATTRS:
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
        merger = self._merger
        after_special = True  # the first fragment counts as following a special token
        for frag in self._partition(text, parse_special) if text else ():
            if isinstance(frag, int):
                out.append(frag)
                after_special = True
            else:
                out.extend(merger.encode_fragment(frag, after_special))
                after_special = False
        if add_bos:
            if self.add_bos and not (out and out[0] == self.bos_id):
                out.insert(0, self.bos_id)
            if self.add_eos:
                out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut `text` at special-token texts (llama.cpp's tokenizer_st_partition)."""
        frags: list[str | int] = [text]
        for sid, tok, attr in self._cuts[bool(parse_special)].occurring_in(text):
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

    def clear_caches(self) -> None:
        """Forget the per-word encodings (a benchmark's fresh start; they refill on use)."""
        self._merger.clear_cache()

    def __repr__(self) -> str:
        pre = f", pre={self.pre.name!r}" if self.pre is not None else ""
        return f"Tokenizer(model={self.model!r}{pre}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


class _SpecialCuts:
    """The special tokens (id, text, attributes) that a partition cuts, longest first, and which
    of them occur in a text.

    Few tokens: one substring search each. Many (Gemma has thousands of `<unusedN>`): one regex
    scan for the characters a special text can start with, then a dict lookup per distinct text
    length at each such position, so the cost no longer grows with the number of tokens.
    """

    _MANY = 64

    def __init__(self, cuts: list[tuple[int, str, int]]):
        self.cuts = cuts
        self._rank: dict[str, int] | None = None
        if len(cuts) > self._MANY:
            self._rank = {text: k for k, (_, text, _) in enumerate(cuts)}
            self._lengths = sorted({len(text) for text in self._rank})
            firsts = "".join(sorted({text[0] for text in self._rank}))
            self._starts = re.compile("[" + "".join(map(re.escape, firsts)) + "]")

    def occurring_in(self, text: str) -> list[tuple[int, str, int]]:
        if self._rank is None:
            return [c for c in self.cuts if c[1] in text]
        rank, lengths, found = self._rank, self._lengths, set()
        for m in self._starts.finditer(text):
            p = m.start()
            for n in lengths:
                k = rank.get(text[p : p + n])
                if k is not None:
                    found.add(k)
        return [self.cuts[k] for k in sorted(found)]


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


def load_tokenizer(path: str | PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file (a full model or a vocab-only file)."""
    from ..gguf.reader import GGUFFile

    return Tokenizer.from_gguf(GGUFFile(path))
