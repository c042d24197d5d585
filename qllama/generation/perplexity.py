"""Perplexity with llama-perplexity's exact chunking.

Tokenize the whole text with BOS (when the vocabulary adds one); cut consecutive chunks of
n_ctx tokens (the first `chunks`); replace each chunk's first token with that BOS; evaluate
each chunk from an empty cache; score positions n_ctx/2 .. n_ctx-2, each predicting the next
token; PPL = exp(mean NLL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import QllamaError


@dataclass
class PerplexityResult:
    ppl: float
    n_ctx: int
    chunks: int
    scored_tokens: int
    nll: float  # mean negative log-likelihood
    chunk_ppls: list[float]  # running estimate after each chunk


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """log-softmax of each row, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def perplexity(model, text: str, n_ctx: int = 512, chunks: int | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    """Perplexity of `model` (a qllama Model) on `text`; `progress(i, n, running_ppl)` after each chunk."""
    if n_ctx < 4:
        raise QllamaError("perplexity needs a context of at least 4 tokens")
    if n_ctx > model.n_ctx:
        raise QllamaError(f"-c {n_ctx} is larger than the model's context {model.n_ctx} (load it with a larger n_ctx)")
    # as llama-perplexity: BOS only when the vocabulary adds one (Qwen has a bos_token_id but adds none)
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    tokens = model.tokenizer.encode(text, add_bos=bos is not None)
    n_avail = len(tokens) // n_ctx
    if n_avail == 0:
        raise QllamaError(f"the text has {len(tokens)} tokens: fewer than one chunk of {n_ctx}")
    n_chunks = n_avail if chunks is None or chunks <= 0 else min(chunks, n_avail)
    first = n_ctx // 2
    total_nll = 0.0
    count = 0
    running: list[float] = []
    for c in range(n_chunks):
        chunk = list(tokens[c * n_ctx : (c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        logits = model.logits(chunk)  # (n_ctx, n_vocab)
        logp = log_softmax_rows(logits[first : n_ctx - 1])
        targets = np.asarray(chunk[first + 1 : n_ctx])
        total_nll -= float(logp[np.arange(targets.size), targets].sum())
        count += targets.size
        running.append(math.exp(total_nll / count))
        if progress:
            progress(c + 1, n_chunks, running[-1])
    return PerplexityResult(math.exp(total_nll / count), n_ctx, n_chunks, count, total_nll / count, running)
