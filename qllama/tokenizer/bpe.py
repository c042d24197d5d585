"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with llama.cpp's exact merge semantics.

Tokens are stored GPT-2 style: every byte is shown as one printable code point (`bytes_to_unicode`),
so "Ġthe" is b" the". Encoding a word (one pre-tokenizer piece) as llama.cpp does
(llm_tokenizer_bpe_session):
1. with `ignore_merges`, a word that is itself a token is that token;
2. otherwise start from single bytes and repeatedly merge the adjacent pair whose merge
   (`tokenizer.ggml.merges`, "left right") has the lowest index, leftmost first;
3. a final symbol that is not a token becomes its single-byte tokens (a byte with no token
   is dropped).

Two engines give those ids:
- `_ExactBPE`: the algorithm above in Python (merge.py's loop, shared with SPM), with a per-word
  cache. Used for every family, e.g. Qwen 2/2.5/3 (`qwen2` pre-tokenizer), GPT-2, StarCoder.
- tiktoken, for families whose pre-tokenizer is one regex fancy-regex runs identically and
  whose words are looked up whole (`ignore_merges`: Llama 3, Tekken). tiktoken merges the pair
  whose *result* has the lowest rank and also emits a whole-word token directly; with a token's
  rank = the index of the first merge that creates it (single bytes first), that is llama.cpp's
  result on the test vectors and on text corpora (checked in tests/test_tokenizer.py).
"""

from __future__ import annotations

from itertools import accumulate, compress
from operator import ne

import numpy as np

from .merge import encode_words, merge_symbols
from .pretokenizers import PreTokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable code point map (also llama.cpp's unicode_byte_to_utf8)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


BYTE_TO_UNICODE: dict[int, str] = _bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}
# str.translate tables: latin-1 text (one char per byte) <-> GPT-2 code points
_ENCODE_TABLE = {b: ord(c) for b, c in BYTE_TO_UNICODE.items()}
_DECODE_TABLE = {ord(c): b for b, c in BYTE_TO_UNICODE.items()}


def gpt2_encode(text: str) -> str:
    """UTF-8 bytes of `text` in GPT-2's printable form (llama.cpp's unicode_byte_encoding_process)."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1").translate(_ENCODE_TABLE)


def gpt2_decode(token: str) -> bytes:
    """Bytes of a GPT-2-form token (llama.cpp's llama_decode_text, with its marker for stray code points)."""
    try:
        return token.translate(_DECODE_TABLE).encode("latin-1")
    except UnicodeEncodeError:
        out = bytearray()
        for ch in token:
            b = UNICODE_TO_BYTE.get(ch)
            if b is not None:
                out.append(b)
            else:  # llama.cpp writes this marker for a code point outside the byte map
                utf8 = ch.encode("utf-8", "surrogatepass")
                out += b"[UNK_BYTE_0x" + utf8.hex().encode() + token.encode("utf-8", "surrogatepass") + b"]"
        return bytes(out)


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after position 0 (a part may itself be " ")
    pos = merge.find(" ", 1)
    if pos < 0:
        return "", ""  # llama.cpp stores an (empty, empty) pair, which never matches
    return merge[:pos], merge[pos + 1 :]


class _ExactBPE:
    """llama.cpp's BPE merge loop over one GPT-2-form word (the cache is filled by `BPEModel`)."""

    def __init__(self, token_to_id: dict[str, int], merges: list[str], ignore_merges: bool):
        self.token_to_id = token_to_id
        self.ignore_merges = ignore_merges
        ranks: dict[tuple[str, str], int] = {}
        for i, m in enumerate(merges):
            ranks.setdefault(_split_merge(m), i)  # emplace: the first occurrence wins
        self.ranks = ranks
        self.byte_ids = [token_to_id.get(BYTE_TO_UNICODE[b], -1) for b in range(256)]
        self.cache: dict[str, list[int]] = {}

    def encode_word(self, word: str) -> list[int]:
        """Token ids of one pre-tokenizer word (raw text, not cached)."""
        return self._encode(gpt2_encode(word))

    def _encode(self, word: str) -> list[int]:
        t2i = self.token_to_id
        if self.ignore_merges:
            tid = t2i.get(word)
            if tid is not None:
                return [tid]
        out: list[int] = []
        for s in merge_symbols(list(word), self.ranks, by_pair=True):
            tid = t2i.get(s)
            if tid is not None:
                out.append(tid)
            else:  # not a token: its bytes one by one (bytes without a token vanish, as in llama.cpp)
                for ch in s:
                    b = UNICODE_TO_BYTE.get(ch)
                    bid = t2i.get(ch) if b is None else self.byte_ids[b]
                    if bid is not None and bid >= 0:
                        out.append(bid)
        return out


class BPEModel:
    """Encodes raw text (no special tokens) with one GGUF BPE vocabulary."""

    def __init__(self, tokens: list[str], token_to_id: dict[str, int], is_normal: np.ndarray,
                 merges: list[str], pre: PreTokenizer):
        self.pre = pre
        self._tokens = tokens
        self._token_to_id = token_to_id
        self._merges = merges
        self._exact: _ExactBPE | None = None
        self._tiktoken = None
        self._rank_to_id: list[int] | None = None
        if pre.tiktoken_pattern is not None and pre.ignore_merges:
            self._build_tiktoken(tokens, is_normal, merges)

    # -- engines -----------------------------------------------------------------------
    @property
    def exact(self) -> _ExactBPE:
        """The Python reference engine (built on first use)."""
        if self._exact is None:
            self._exact = _ExactBPE(self._token_to_id, self._merges, self.pre.ignore_merges)
        return self._exact

    @property
    def uses_tiktoken(self) -> bool:
        return self._tiktoken is not None

    def _build_tiktoken(self, tokens: list[str], is_normal: np.ndarray, merges: list[str]) -> None:
        import tiktoken

        t2i = self._token_to_id
        # The result of merge i is "left right" without its space. GPT-2-form text has no raw space
        # or newline, so one join/replace/split does all merges at C speed.
        joined = "\n".join(merges)
        if joined.count(" ") != len(merges) or joined.count("\n") != len(merges) - 1:
            return  # unusual merges: leave them to the exact engine
        results = joined.replace(" ", "").split("\n")
        byte_ids = [t2i.get(BYTE_TO_UNICODE[b], -1) for b in range(256)]
        # Distinct results in order of their first merge give the tiktoken rank order. Common case
        # (Llama 3, GPT-2): merges are grouped by result and the results are tokens 256, 257, ...
        # in id order; checking that needs no hashing.
        keep = [True, *map(ne, results[1:], results[:-1])]  # first of each run of equal results
        order = list(compress(results, keep))
        n_ranked = 256 + len(order)
        if sorted(byte_ids) == list(range(256)) and order == tokens[256:n_ranked]:
            order_ids = None  # identity: rank = id
        else:
            order = list(dict.fromkeys(results))
            n_ranked = 256 + len(order)
            order_ids = list(map(t2i.get, order))
            if None in order_ids:
                return  # a merge that makes no token: only the exact engine reproduces llama.cpp
        # ignore_merges looks words up among all tokens: every normal token must be reachable
        if int(np.count_nonzero(is_normal)) > 256 + len(order):
            reachable = set(order) | {BYTE_TO_UNICODE[b] for b in range(256)}
            if any(ok and t not in reachable for t, ok in zip(tokens, is_normal)):
                return
        merged_bytes = _gpt2_decode_many(order)
        if order_ids is None:
            # ids already follow the merge order (Llama 3, GPT-2): rank = id, no mapping needed
            ranks = dict(zip(merged_bytes, range(256, n_ranked)))
            ranks.update((bytes([b]), byte_ids[b]) for b in range(256))
            rank_to_id = None
        else:
            ranks = dict(zip(merged_bytes, range(256, n_ranked)))
            ranks.update((bytes([b]), b) for b in range(256))  # a byte without a token maps to -1: dropped
            rank_to_id = byte_ids + order_ids
        if len(ranks) != n_ranked:
            return  # two tokens with the same bytes
        self._tiktoken = tiktoken.Encoding(
            name="qllama-bpe", pat_str=self.pre.tiktoken_pattern, mergeable_ranks=ranks, special_tokens={}
        )
        self._rank_to_id = rank_to_id

    # -- encoding ------------------------------------------------------------------------
    def encode_fragment(self, text: str, after_special: bool) -> list[int]:
        """Token ids of raw text between special tokens (BPE adds no prefix after specials)."""
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of one raw-text fragment (llama.cpp's llm_tokenizer_bpe_session::tokenize)."""
        if not text:
            return []
        if self._tiktoken is not None:
            ids = self._tiktoken.encode_ordinary(text)
            r2i = self._rank_to_id
            if r2i is not None:
                ids = [r2i[r] for r in ids]
                if -1 in ids:
                    ids = [i for i in ids if i >= 0]
            return ids
        exact = self.exact
        return encode_words(self.pre.split(text), exact.cache, exact.encode_word)

    def encode_exact(self, text: str) -> list[int]:
        """The Python reference engine on `text`, whatever the fast path (for tests)."""
        exact = self.exact
        return [i for word in self.pre.split(text) for i in exact.encode_word(word)]

    def clear_cache(self) -> None:
        """Forget the encoded words (benchmarks start each run from an empty cache)."""
        if self._exact is not None:
            self._exact.cache.clear()


def _gpt2_decode_many(tokens: list[str]) -> list[bytes]:
    """`gpt2_decode` of many tokens at once (one table lookup over all code points, then slices)."""
    cps = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32)  # (total chars,)
    if cps.size and int(cps.max()) >= len(_CP_TO_BYTE) or (cps.size and (_CP_TO_BYTE[cps] < 0).any()):
        return [gpt2_decode(t) for t in tokens]  # a code point outside the byte map somewhere
    big = _CP_TO_BYTE[cps].astype(np.uint8).tobytes()
    offs = list(accumulate(map(len, tokens), initial=0))  # one byte per code point
    return [big[a:b] for a, b in zip(offs, offs[1:])]


# code point of the GPT-2 form -> byte (-1: not in the map)
_CP_TO_BYTE = np.full(max(map(ord, UNICODE_TO_BYTE)) + 1, -1, dtype=np.int16)
for _c, _b in UNICODE_TO_BYTE.items():
    _CP_TO_BYTE[ord(_c)] = _b
