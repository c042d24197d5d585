"""Token sampling with llama.cpp's chain and defaults.

Order (llama.cpp's default sampler chain): repeat penalty -> top-k -> top-p -> min-p ->
temperature -> draw. A temperature <= 0 is greedy (argmax), as in llama.cpp.
Each step works on a candidate set (ids, logits) that only shrinks; the Sampler owns its RNG.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import QllamaError


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults (common/common.h)."""

    temperature: float = 0.8
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # window of recent tokens the penalty looks at (0: off, -1: whole context)
    seed: int | None = None  # None: a fresh random seed

    def validate(self) -> None:
        if not np.isfinite(self.temperature):
            raise QllamaError("temperature must be a finite number")
        if not 0.0 <= self.top_p <= 1.0:
            raise QllamaError(f"top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise QllamaError(f"min-p must be in [0, 1], got {self.min_p}")
        if not self.repeat_penalty > 0.0:
            raise QllamaError(f"repeat penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise QllamaError(f"repeat-last-n must be >= -1, got {self.repeat_last_n}")


def sampling_params(base: "SamplingParams | None" = None, **fields) -> SamplingParams:
    """`base` (default: llama.cpp's defaults) with some fields replaced, An unknown
    field name is a TypeError, as an unknown keyword argument would be."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(SamplingParams)}
    if unknown:
        raise TypeError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
    return dataclasses.replace(base or SamplingParams(), **fields)  # (the Sampler validates)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable softmax in float64."""
    z = logits.astype(np.float64) - np.max(logits)
    e = np.exp(z)
    return e / e.sum()


def apply_repeat_penalty(logits: np.ndarray, recent: np.ndarray, penalty: float) -> None:
    """llama.cpp's repetition penalty, in place: for each distinct recent token,
    a positive logit is divided by the penalty and a negative one multiplied by it."""
    if penalty == 1.0 or recent.size == 0:
        return
    ids = np.unique(recent)
    vals = logits[ids]
    logits[ids] = np.where(vals > 0, vals / penalty, vals * penalty)


def top_k_filter(ids: np.ndarray, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the k largest logits, sorted in descending order (ties keep the lower id first)."""
    n = logits.shape[0]
    if k <= 0 or k >= n:
        order = np.argsort(-logits, kind="stable")
    else:
        part = np.argpartition(-logits, k - 1)[:k]
        order = part[np.lexsort((ids[part], -logits[part]))]
    return ids[order], logits[order]


def top_p_filter(ids: np.ndarray, logits: np.ndarray, p: float, min_keep: int = 1):
    """Keep the smallest prefix (of logits sorted descending) whose probability mass reaches p."""
    if p >= 1.0:
        return ids, logits
    probs = softmax(logits)
    cum = np.cumsum(probs)
    # llama.cpp: include tokens until the cumulative probability is >= p
    last = int(np.searchsorted(cum, p, side="left")) + 1
    last = max(last, min_keep)
    return ids[:last], logits[:last]


def min_p_filter(ids: np.ndarray, logits: np.ndarray, p: float, min_keep: int = 1):
    """Keep tokens whose probability is at least p times the top token's probability."""
    if p <= 0.0 or logits.size == 0:
        return ids, logits
    threshold = np.max(logits) + np.log(p)  # p_i >= p * p_max  <=>  l_i >= l_max + log p
    keep = logits >= threshold
    if keep.sum() < min_keep:
        order = np.argsort(-logits, kind="stable")[:min_keep]
        keep = np.zeros_like(keep)
        keep[order] = True
    return ids[keep], logits[keep]


class Sampler:
    """Picks the next token from a logits vector. Owns its RNG, so a seed reproduces a run."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.params.validate()
        self.rng = np.random.default_rng(self.params.seed)
        n = self.params.repeat_last_n
        self.recent: deque[int] = deque(maxlen=None if n < 0 else n)

    def accept(self, token: int) -> None:
        """Record a token (prompt or generated) for the repeat penalty window."""
        if self.recent.maxlen != 0:
            self.recent.append(int(token))

    def reset(self) -> None:
        self.recent.clear()

    def sample(self, logits: np.ndarray) -> int:
        """Choose a token id from logits (n_vocab,) float32; does not modify its input."""
        ids, probs = self.distribution(logits)
        if self.params.temperature <= 0.0:
            return int(ids[0])  # greedy: no draw
        return int(ids[self.rng.choice(probs.shape[0], p=probs)])

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chain's final distribution for logits (n_vocab,): (candidate ids (K,), their
        probabilities (K,) float64 summing to 1); tokens outside `ids` have probability 0.
        Greedy (temperature <= 0) is the argmax with probability 1."""
        prm = self.params
        logits = np.array(logits, dtype=np.float32)  # copy: penalties write into it
        if prm.repeat_penalty != 1.0 and self.recent:
            apply_repeat_penalty(logits, np.fromiter(self.recent, dtype=np.int64), prm.repeat_penalty)
        if prm.temperature <= 0.0:
            return np.array([np.argmax(logits)]), np.ones(1)
        ids = np.arange(logits.shape[0])
        ids, cand = top_k_filter(ids, logits, prm.top_k)
        ids, cand = top_p_filter(ids, cand, prm.top_p)
        ids, cand = min_p_filter(ids, cand, prm.min_p)
        return ids, softmax(cand / prm.temperature)
