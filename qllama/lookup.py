"""Prompt-lookup decoding: more than one token per pass over the weights.

Text that copies from its prompt (a fixed function, a quoted passage, a reformatted list) can
be guessed cheaply: find the most recent earlier occurrence of the last n tokens (n from
`ngram_max` down to 1) in the prompt and the generated history, and propose the tokens that
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

It pays only where a batched forward of T tokens costs well under T one-token forwards: the
weights are read once, but every row's integer dot products are still computed. Measured on a
busy AVX2 host (1 thread, 576 x 1536 matrix): T = 9 costs 4.7x T = 1 for q4_K and q6_K, but 7x
for q4_1 and q8_0, whose mat-mat does not share the weight unpacking between tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection

import numpy as np

from .errors import QllamaError

if TYPE_CHECKING:
    from .generate import Session, Timings
    from .sampling import Sampler

NGRAM_MAX = 4  # longest n-gram matched (llama.cpp's LLAMA_NGRAM_MAX)


class NgramDrafter:
    """Drafts from the token history: the tokens that followed the most recent earlier
    occurrence of its last n tokens, for the longest n <= ngram_max that occurs.

    `_next[n]` maps an n-gram to the index of the token that followed its latest occurrence;
    an n-gram enters it only once its follower is known, so the history's own suffix never
    matches itself.
    """

    def __init__(self, history: list[int], ngram_max: int = NGRAM_MAX):
        if ngram_max < 1:
            raise QllamaError(f"the n-gram size must be >= 1, got {ngram_max}")
        self.ngram_max = ngram_max
        self.history: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram_max + 1)]  # [n]: n-gram -> follower index
        for t in history:
            self.append(t)

    def append(self, token: int) -> None:
        h = self.history
        h.append(int(token))
        i = len(h) - 1  # the new token follows the n-grams ending at i - 1
        for n in range(1, min(self.ngram_max, i) + 1):
            self._next[n][tuple(h[i - n : i])] = i

    def draft(self, n_draft: int) -> list[int]:
        """Up to n_draft tokens that would continue the history (empty: no n-gram matches)."""
        h = self.history
        if n_draft <= 0:
            return []
        for n in range(min(self.ngram_max, len(h)), 0, -1):
            f = self._next[n].get(tuple(h[-n:]))
            if f is None:
                continue
            # copy what followed; past the end of the history the copy continues from its own
            # drafts (a repeating pattern of period len(h) - f)
            out: list[int] = []
            for k in range(n_draft):
                j = f + k
                out.append(h[j] if j < len(h) else out[j - len(h)])
            return out
        return []


def batch_matches_decode(model) -> bool:
    """Whether a batched forward gives each row the same logits, bit for bit, as a one-token
    forward: every matrix runs the int8-activation path (one kernel for any token count) or is
    f32 (the same dot loop in mat-vec and mat-mat). Quantized matrices on the float path use a
    fused mat-vec that rounds differently from the tiled mat-mat, and f16/bf16 ones convert on
    the fly in mat-vec but through a scratch row in mat-mat (measured: last bits differ)."""
    from .ggml_types import F32
    from .qtensor import QTensor, int8_activations

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
                 ngram_max: int = NGRAM_MAX):
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
        timings.lookup = n_draft
        self.drafter = NgramDrafter(list(prompt_ids), ngram_max)
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

    def _verify(self) -> None:
        session, cache = self.session, self.session.cache
        assert self._last is not None and cache.n_past == self._pos
        room = min(self.max_tokens - self._given - 1,  # tokens past max_tokens would be thrown away
                   session.n_ctx - cache.n_past - 1,  # the last token and the drafts need positions
                   cache.max_batch - 1)
        drafts = self.drafter.draft(min(self.n_draft, room)) if room > 0 else []
        base = cache.n_past
        batch = [self._last] + drafts
        rows = session.model.forward(batch, cache, all_logits=True)  # (1 + len(drafts), n_vocab)
        session.tokens.extend(batch)
        t = self.timings
        t.gen_forwards += 1
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
        keep = base + 1 + accepted  # the last token and the accepted drafts
        if cache.rewind(keep) != keep:  # cannot happen: a verify batch fits the ring's spare slots
            raise QllamaError("prompt lookup: the KV cache could not keep the accepted tokens")
        del session.tokens[keep:]
