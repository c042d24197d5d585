"""Log-probabilities of generated tokens, as the OpenAI API reports them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np



@dataclass
class TokenLogprob:
    """One generated token with its log-probability and the top alternatives (from the raw logits)."""

    id: int
    text: str
    bytes: bytes
    logprob: float
    top: list[tuple[int, str, bytes, float]] = field(default_factory=list)


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
