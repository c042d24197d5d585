"""Generated token ids -> text chunks (stop strings, whole UTF-8 characters) and log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..generation.session import held_back


@dataclass
class TokenLogprob:
    """One generated token with its log-probability and the top alternatives (from the raw logits)."""

    id: int
    text: str
    bytes: bytes
    logprob: float
    top: list[tuple[int, str, bytes, float]] = field(default_factory=list)


class TextOutput:
    """Token ids -> text chunks: multi-byte characters are never split, and text that may be
    the start of a stop string waits until it is known not to be one."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.decoder = tokenizer.stream_decoder(continuation=True)  # ids continue the prompt
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.pending_lp: list[TokenLogprob] = []

    def feed(self, token: int, lp: TokenLogprob | None) -> tuple[str, list[TokenLogprob], bool]:
        """Add one token: (text that can be sent now, its logprobs, whether a stop string appeared)."""
        self.pending += self.decoder.feed(token)
        if lp is not None:
            self.pending_lp.append(lp)
        if self.stops:
            hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
            if hits:  # the text before the stop string, and the end
                text, self.pending = self.pending[: min(hits)], ""
                lps, self.pending_lp = self.pending_lp, []
                return text, lps, True
        return self.take(len(self.pending) - held_back(self.pending, self.stops)) + (False,)

    def take(self, n: int) -> tuple[str, list[TokenLogprob]]:
        """The first n pending characters, with the logprobs of every token fed so far (when n > 0)."""
        text, self.pending = self.pending[:n], self.pending[n:]
        lps: list[TokenLogprob] = []
        if n > 0:
            lps, self.pending_lp = self.pending_lp, []
        return text, lps

    def finish(self) -> tuple[str, list[TokenLogprob]]:
        """The rest of the text (at an end of generation or the length limit)."""
        self.pending += self.decoder.flush()
        text, lps = self.pending, self.pending_lp
        self.pending, self.pending_lp = "", []
        return text, lps


def token_logprob(tokenizer, logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """log softmax of the raw logits (n_vocab,) at `token`, with the n_top most likely tokens.

    As llama.cpp's server does (post_sampling_probs off): the model's distribution before
    penalties, top-k/p and temperature.
    """
    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top = []
    if n_top > 0:
        ids = np.argpartition(-x, min(n_top, x.size - 1))[:n_top]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        for i in ids:
            b = tokenizer.token_bytes(int(i), special=True)
            top.append((int(i), b.decode("utf-8", "replace"), b, float(x[i] - lse)))
    b = tokenizer.token_bytes(int(token), special=True)
    return TokenLogprob(int(token), b.decode("utf-8", "replace"), b, float(x[token] - lse), top)
