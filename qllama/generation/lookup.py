"""Prompt-lookup decoding: more than one token per pass over the weights.

Text that copies from its prompt (a fixed function, a quoted passage, a reformatted list) can
be guessed cheaply: find an earlier occurrence of the last tokens in the prompt and the
generated history, the one whose match reaches furthest back, and propose the tokens that
followed it (`NgramDrafter`). One batched forward evaluates [last token + drafts] with the logits
of every row; row j is the model's next-token distribution after drafts 1..j, so the longest
prefix of drafts the model agrees with is accepted, plus one token of the model's own from the
first row it disagrees with (or from the last row). The KV cache is then rewound past the
rejected drafts (`KVCache.rewind`; a sliding-window ring keeps window + batch slots, so the
positions a rewind needs are never overwritten by one verify batch).

What is emitted does not change:

- greedy: a draft is accepted iff it is the argmax of its row, so the tokens are plain greedy's
  as long as a batched row has the same logits as a one-token decode. They are bit-identical
  when every matrix of the model runs the int8-activation kernels or is f32 (one kernel
  serves 1 and n tokens, row by row; attention, norms and RoPE are per row); tests check it per
  family. On the float path for quantized types (int8 disabled, or no AVX2) the one-token
  mat-vec and the batched mat-mat round differently, so greedy lookup falls back to one-token
  decoding there (`batch_matches_decode`), and the timings say so.
- sampling: standard speculative sampling for a deterministic draft x: accept x with
  probability p(x) under the sampler chain's final distribution p (penalty, top-k, top-p,
  min-p, temperature); on rejection draw from p with x removed and renormalised. Each emitted
  token then has P(x) = p(x) + 0 and P(y) = (1 - p(x)) p(y) / (1 - p(x)) = p(y): the same
  distribution as plain sampling (not the same draws for a seed).

It pays only where a batched forward of T tokens costs well under T one-token forwards, so
`LookupSteps` drafts only from a match of at least `MIN_MATCH` tokens (otherwise it takes a plain
one-token step: the session's decode, fused kernels, adaptive thread count); drafts no more
tokens than the match is long, and no more than the current limit, which halves (down to a token
group's 3 drafts) after a refused draft and doubles (up to N) after one taken whole;
and cuts a batch longer than `TOKEN_GROUP` to a multiple of it (the mat-mul kernels' token group). The measurements behind this policy are in
docs/measurements.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection

import numpy as np

from ..errors import QllamaError

if TYPE_CHECKING:
    from .session import Session, Timings
    from .sampling import Sampler

NGRAM_MAX = 4  # longest n-gram looked up (llama.cpp's LLAMA_NGRAM_MAX)
MIN_MATCH = 4  # LookupSteps drafts only from a match of at least this many tokens
MATCH_CAP = 64  # a match is measured up to this many tokens back
CANDIDATES = 8  # occurrences of an n-gram compared (the latest ones)
# The int8 mat-mul kernels take tokens 4 at a time (one weight unpacking for 4 tokens, then 1 by
# 1 for the rest): a batch of 4g + 1 to 4g + 3 tokens costs more per token than one of 4g
# (measured CPU time, SmolLM2 Q4_1, 1 thread: 9 tokens 4.9 one-token steps, 8 tokens 4.1, 7
# tokens 4.6), and one of 2 or 3 about as much as one of 4 (2.0-2.5, 2.4-3.4, 2.4-3.7 steps;
# `tools/bench_lookup.py --costs`). Verify batches longer than this are cut to a multiple of it,
# and the draft limit never falls below TOKEN_GROUP - 1 (a match has MIN_MATCH >= 3 tokens).
TOKEN_GROUP = 4


class NgramDrafter:
    """Drafts from the token history: the tokens that followed an earlier occurrence of its last
    n tokens, for the longest n <= ngram_max that occurs. Among the latest `CANDIDATES`
    occurrences it takes the one whose match reaches furthest back (the most recent on a tie):
    text the model copies from the prompt matches it over many tokens, a phrase that merely
    recurs in its own output over a few, and the longer match predicts better (measured on
    SmolLM2 fixing a 30-line function, 350 tokens: the draft's first token was the model's for
    15% of 1-token matches, 33% of 2-token, 50% of 3-token, 64% of 4-token, 97-100% of 16+).

    `_next[n]` maps an n-gram to the indices of the tokens that followed its occurrences, oldest
    first; an n-gram enters it only once its follower is known, so the history's own suffix
    never matches itself. min_match: n-grams shorter than this are not indexed (they could not
    make a long enough match).
    """

    def __init__(self, history: list[int], ngram_max: int = NGRAM_MAX, min_match: int = 1):
        if ngram_max < 1:
            raise QllamaError(f"the n-gram size must be >= 1, got {ngram_max}")
        self.ngram_max = ngram_max
        self.min_match = max(1, min_match)
        self._n_min = min(self.min_match, ngram_max)  # shortest n-gram indexed
        self.history: list[int] = []
        self._next: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(ngram_max + 1)]  # [n]: n-gram -> follower indices
        self.match = 0  # length of the match behind the last draft (0: none)
        for t in history:
            self.append(t)

    def append(self, token: int) -> None:
        h = self.history
        h.append(int(token))
        i = len(h) - 1  # the new token follows the n-grams ending at i - 1
        for n in range(self._n_min, min(self.ngram_max, i) + 1):
            self._next[n].setdefault(tuple(h[i - n : i]), []).append(i)

    def find(self) -> tuple[int, int]:
        """(index of the token that followed the best match, match length); (-1, 0) when the
        history's suffix matches nothing of at least `min_match` tokens."""
        h = self.history
        end = len(h)
        for n in range(min(self.ngram_max, end), self._n_min - 1, -1):
            found = self._next[n].get(tuple(h[end - n :]))
            if found is None:
                continue
            best, best_len = -1, 0
            for f in reversed(found[-CANDIDATES:]):  # most recent first: it wins a tie
                m = n  # h[f - m : f] == h[end - m : end]; extend it back
                while m < MATCH_CAP and m < f and h[f - 1 - m] == h[end - 1 - m]:
                    m += 1
                if m > best_len:
                    best, best_len = f, m
            return (best, best_len) if best_len >= self.min_match else (-1, 0)
        return -1, 0

    def draft(self, n_draft: int, limit_by_match: bool = False) -> list[int]:
        """Up to n_draft tokens that would continue the history (empty: no match long enough).
        limit_by_match: no more tokens than the match is long (a short match is weak evidence
        for a long copy)."""
        self.match = 0
        if n_draft <= 0:
            return []
        f, m = self.find()
        if f < 0:
            return []
        self.match = m
        if limit_by_match:
            n_draft = min(n_draft, m)
        h = self.history
        # copy what followed; past the end of the history the copy continues from its own
        # drafts (a repeating pattern of period len(h) - f)
        out: list[int] = []
        for k in range(n_draft):
            j = f + k
            out.append(h[j] if j < len(h) else out[j - len(h)])
        return out


def batch_matches_decode(model) -> bool:
    """Whether a batched forward gives each row the same logits, bit for bit, as a one-token
    forward: every matrix runs the int8-activation path (one kernel for any token count) or is
    f32 (the same dot loop in mat-vec and mat-mat). Quantized matrices on the float path use a
    fused mat-vec that rounds differently from the tiled mat-mat, and f16/bf16 ones convert on
    the fly in mat-vec but through a scratch row in mat-mat (measured: last bits differ)."""
    from ..gguf.types import F32
    from ..qtensor import QTensor, int8_activations

    fast = int8_activations() | {F32}
    w = model.weights
    mats = [w.output]
    for layer in w.layers:
        mats += [v for v in vars(layer).values() if isinstance(v, QTensor)]
    return all(m.type_id in fast for m in mats)


def accept_draft(ids: np.ndarray, probs: np.ndarray, draft: int, rng: np.random.Generator) -> int:
    """Speculative sampling with a deterministic draft: `draft` with probability p(draft), else a
    draw from p without it (renormalised). ids (K,) candidate ids, probs (K,) float64 summing to 1."""
    hit = ids == draft
    p_draft = float(probs[hit].sum())
    if rng.random() < p_draft:
        return int(draft)
    rest = np.where(hit, 0.0, probs)
    total = rest.sum()
    if total <= 0.0:  # p(draft) is 1 up to rounding: nothing else can be drawn
        return int(draft)
    return int(ids[rng.choice(ids.shape[0], p=rest / total)])


class LookupSteps:
    """The token source of `stream_generate` with prompt lookup: hands out tokens one at a time,
    evaluating [last token + drafts] in one forward whenever its queue of decided tokens is empty.

    Invariant: the session's cache (and `session.tokens`) holds every handed-out token but the
    last (`_last`), as in plain decoding, plus at most the accepted drafts still queued.
    """

    def __init__(self, session: "Session", sampler: "Sampler", logits: np.ndarray, prompt_ids: list[int],
                 n_draft: int, eog: Collection[int], max_tokens: int, timings: "Timings",
                 ngram_max: int = NGRAM_MAX, min_match: int | None = None):
        if n_draft < 0:
            raise QllamaError(f"the number of lookup drafts must be >= 0, got {n_draft}")
        self.session = session
        self.sampler = sampler
        self.eog = eog
        self.max_tokens = max_tokens
        self.timings = timings
        self.greedy = sampler.params.temperature <= 0.0
        if self.greedy and not batch_matches_decode(session.model):
            n_draft = 0  # batched rows would round differently from plain greedy's one-token decode
            timings.lookup_note = "off: this model's batched kernels round differently from one-token decode"
        self.n_draft = n_draft
        self._span = n_draft  # the current draft length limit (`_adapt`)
        timings.lookup = n_draft
        self.drafter = NgramDrafter(list(prompt_ids), ngram_max, MIN_MATCH if min_match is None else min_match)
        self._logits: np.ndarray | None = logits  # (n_vocab,) the next row when known (after the prefill)
        self._queue: list[int] = []  # decided tokens not yet handed out
        self._last: int | None = None  # the latest handed-out token (not in the cache yet)
        self._given = 0  # tokens handed out
        self._pos = len(prompt_ids) - 1  # cache position of the latest handed-out token

    @property
    def full(self) -> bool:
        """The latest token has no position left in the context (plain decoding's `session.full`)."""
        return self._pos >= self.session.n_ctx

    def next_token(self) -> int:
        if not self._queue:
            if self._logits is not None:  # the first token: from the prompt's logits
                self._queue.append(self._choose(self._logits, None))
                self._logits = None
            else:
                self._verify()
        token = self._queue.pop(0)
        self._last = token
        self._given += 1
        self._pos += 1
        self.drafter.append(token)
        return token

    def advance(self, token: int) -> None:
        """Nothing to do: the next `next_token` evaluates the token (with drafts) when it is needed."""

    # -- internals --

    def _choose(self, row: np.ndarray, draft: int | None) -> int:
        """The token for one row of logits (n_vocab,), given the draft for it (or None); recorded in
        the sampler (repeat penalty) before the next row is decided."""
        s = self.sampler
        if draft is None or self.greedy:
            token = s.sample(row)
        else:
            ids, probs = s.distribution(row)
            token = accept_draft(ids, probs, draft, s.rng)
        s.accept(token)
        return token

    def _adapt(self, n_drafts: int, accepted: int) -> None:
        """The next draft length limit: doubled (up to n_draft) after a draft taken whole, halved
        (down to one token group's drafts) after a refused one: every refused draft costs about
        half a one-token step, but a batch of 2 or 3 tokens costs as much as one of 4."""
        if n_drafts == 0:
            return
        if accepted == n_drafts:
            self._span = min(self.n_draft, 2 * self._span)
        else:
            self._span = min(self.n_draft, max(TOKEN_GROUP - 1, self._span // 2))

    def _forward(self, batch: list[int]) -> np.ndarray:
        """Logits of every token of batch (T, n_vocab), appended to the session's cache and tokens.
        One token takes the session's decode step (the fused one-token kernels, the adaptive
        thread count); more run as a short batch."""
        session = self.session
        if len(batch) == 1:
            return session.decode(batch[0]).reshape(1, -1)

        def step(n_threads=None):
            return session.model.forward(batch, session.cache, all_logits=True, n_threads=n_threads)

        threads = getattr(session, "threads", None)
        rows = step() if threads is None else threads.run_batch(len(batch), step)
        session.tokens.extend(batch)
        return rows

    def _verify(self) -> None:
        session, cache = self.session, self.session.cache
        assert self._last is not None and cache.n_past == self._pos
        room = min(self.max_tokens - self._given - 1,  # tokens past max_tokens would be thrown away
                   session.n_ctx - cache.n_past - 1,  # the last token and the drafts need positions
                   cache.max_batch - 1,
                   self._span)
        # no draft (no match of min_match tokens): a plain one-token step, the cheapest forward
        drafts = self.drafter.draft(room, limit_by_match=True) if room > 0 else []
        if len(drafts) >= TOKEN_GROUP:  # a batch of 1 + len(drafts) tokens, cut to whole groups
            del drafts[(1 + len(drafts)) // TOKEN_GROUP * TOKEN_GROUP - 1 :]
        base = cache.n_past
        batch = [self._last] + drafts
        rows = self._forward(batch)  # (1 + len(drafts), n_vocab)
        t = self.timings
        t.gen_forwards += 1
        t.draft_forwards += len(drafts) > 0
        t.draft_tokens += len(drafts)
        accepted = 0
        for j in range(len(batch)):
            draft = drafts[j] if j < len(drafts) else None
            token = self._choose(rows[j], draft)
            self._queue.append(token)
            if token != draft or token in self.eog:
                break
            accepted += 1
        t.draft_accepted += accepted
        self._adapt(len(drafts), accepted)
        if accepted == len(drafts):
            return  # nothing to rewind
        keep = base + 1 + accepted  # the last token and the accepted drafts
        if cache.rewind(keep) != keep:  # cannot happen: a verify batch fits the ring's spare slots
            raise QllamaError("prompt lookup: the KV cache could not keep the accepted tokens")
        del session.tokens[keep:]
