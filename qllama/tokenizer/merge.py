"""The two steps BPE and SPM share: encoding a fragment word by word through a cache, and the
merge loop that splices adjacent symbols together, best pair first.

Both llama.cpp tokenizers (llm_tokenizer_bpe_session, llm_tokenizer_spm_session) are the same
loop over a doubly linked list of symbols with a priority queue of adjacent pairs; they differ
only in how a pair is ranked:
- BPE: the index of the merge "left right" in `tokenizer.ggml.merges` (depends on the split);
- SPM: minus the score of the token "leftright" (depends only on the concatenation).
Lower rank wins; among equal ranks, the leftmost pair.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import chain

WORD_CACHE_MAX = 1 << 17  # words; a cache is cleared when it grows past this
_SHORT = 12  # up to this many symbols, rescanning all pairs beats a heap


def encode_words(words: list[str], cache: dict[str, list[int]], encode_word: Callable[[str], list[int]]) -> list[int]:
    """Token ids of consecutive words, each encoded once (`cache` maps word -> ids)."""
    lists = list(map(cache.get, words))  # cached ids per word, None if new
    if None in lists:
        for i, ids in enumerate(lists):
            if ids is None:
                word = words[i]
                ids = cache.get(word)  # may have been added a few words ago
                if ids is None:
                    ids = encode_word(word)
                    if len(cache) >= WORD_CACHE_MAX:
                        cache.clear()
                    cache[word] = ids
                lists[i] = ids
    return list(chain.from_iterable(lists))


def merge_symbols(syms: list[str], ranks: dict, by_pair: bool) -> list[str]:
    """Merge adjacent symbols, lowest rank first (leftmost on ties), until no pair has a rank.

    `ranks` is keyed by the pair `(left, right)` when `by_pair` (BPE merges), else by the
    concatenation `left + right` (SPM token scores). `syms` is consumed.
    """
    n = len(syms)
    if n < 2:
        return syms
    if n <= _SHORT:
        while len(syms) > 1:
            best, best_i = None, -1
            for i in range(len(syms) - 1):
                r = ranks.get((syms[i], syms[i + 1]) if by_pair else syms[i] + syms[i + 1])
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            syms[best_i : best_i + 2] = [syms[best_i] + syms[best_i + 1]]
        return syms
    # linked list over the positions + heap of (rank, left position, merged text); an entry is
    # stale when its left symbol was absorbed or either side grew (the text no longer matches)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap: list[tuple] = []
    for i in range(n - 1):
        a, b = syms[i], syms[i + 1]
        r = ranks.get((a, b) if by_pair else a + b)
        if r is not None:
            heap.append((r, i, a + b))
    heapq.heapify(heap)
    while heap:
        _, left, text = heapq.heappop(heap)
        right = nxt[left]
        if not syms[left] or right < 0 or syms[left] + syms[right] != text:
            continue
        syms[left] = text
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        for a, b in ((prv[left], left), (left, nxt[left])):
            if a >= 0 and b >= 0:
                sa, sb = syms[a], syms[b]
                r = ranks.get((sa, sb) if by_pair else sa + sb)
                if r is not None:
                    heapq.heappush(heap, (r, a, sa + sb))
    return [s for s in syms if s]
