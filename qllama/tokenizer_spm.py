"""SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`): Llama 2, TinyLlama, Mistral 7B, Phi-3.

llama.cpp's algorithm (llm_tokenizer_spm_session), on text whose spaces are already "▁":
start from single code points, and repeatedly merge the adjacent pair whose concatenation is a
token with the highest score (ties: the leftmost); a final symbol that is not a token becomes its
UTF-8 bytes as `<0xNN>` tokens (byte fallback).

Speed: merges never cross a point where a "▁" follows another character when no token has a
"▁" after a non-"▁" character (true of SentencePiece vocabularies, which split on whitespace;
checked per vocabulary). So the text is cut into words "▁▁word" that are encoded separately,
each once (a word cache), which gives exactly the whole-text result.
"""

from __future__ import annotations

import heapq
import re
from itertools import chain

SPACE = "\u2581"  # ▁, SentencePiece's visible space
_WORDS = re.compile(f"{SPACE}*[^{SPACE}]+|{SPACE}+")
_WORD_CACHE_MAX = 1 << 17


class SPMModel:
    """Encodes one escaped fragment ("▁" for spaces) with a GGUF SPM vocabulary."""

    def __init__(self, tokens: list[str], token_to_id: dict[str, int], scores: list[float],
                 unk_id: int | None):
        self._t2i = token_to_id
        self._scores = scores
        self._unk = unk_id
        # byte fallback: <0xNN>, else the one-byte token itself (llama_vocab::byte_to_token)
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = token_to_id.get(f"<0x{b:02X}>")
            if tid is None:
                tid = token_to_id.get(chr(b)) if b < 0x80 else None
            self._byte_ids.append(tid)
        self.word_split = not any(SPACE in t.lstrip(SPACE) for t in tokens)
        self.cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (already escaped with "▁")."""
        if not text:
            return []
        if not self.word_split:
            return self._encode(text)
        cache = self.cache
        words = _WORDS.findall(text)
        lists = list(map(cache.get, words))  # cached ids per word, None if new
        if None in lists:
            for i, ids in enumerate(lists):
                if ids is None:
                    word = words[i]
                    ids = cache.get(word)  # may have been added a few words ago
                    if ids is None:
                        ids = self._encode(word)
                        if len(cache) >= _WORD_CACHE_MAX:
                            cache.clear()
                        cache[word] = ids
                    lists[i] = ids
        return list(chain.from_iterable(lists))

    def _encode(self, text: str) -> list[int]:
        t2i = self._t2i
        tid = t2i.get(text)
        if tid is not None and len(text) == 1:
            return [tid]
        scores = self._scores
        syms = list(text)  # one symbol per code point
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # max-heap on (score, -left): entries (-score, left, right, text)
        heap: list[tuple[float, int, int, str]] = []
        for i in range(n - 1):
            t = syms[i] + syms[i + 1]
            tid = t2i.get(t)
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, t))
        heapq.heapify(heap)
        while heap:
            _, left, right, t = heapq.heappop(heap)
            # outdated if either side was merged since (llama.cpp compares sizes)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != t or nxt[left] != right:
                continue
            syms[left] = t
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            for a, b in ((prv[left], left), (left, nxt[left])):
                if a >= 0 and b >= 0:
                    tt = syms[a] + syms[b]
                    tid = t2i.get(tt)
                    if tid is not None:
                        heapq.heappush(heap, (-scores[tid], a, b, tt))
        out: list[int] = []
        i = 0
        while i != -1:
            s = syms[i]
            tid = t2i.get(s)
            if tid is not None:
                out.append(tid)
            else:
                for byte in s.encode("utf-8", "surrogatepass"):
                    bid = self._byte_ids[byte]
                    if bid is None:
                        bid = self._unk  # llama.cpp throws here; we emit <unk> (or nothing without one)
                    if bid is not None:
                        out.append(bid)
            i = nxt[i]
        return out
