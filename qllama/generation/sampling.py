"""Token sampling with llama.cpp's chain and defaults.

Order (llama.cpp's default sampler chain): logit bias -> penalties (repeat, frequency,
presence: llama.cpp's penalties sampler) -> top-k -> top-p -> min-p -> temperature -> draw.
A temperature <= 0 is greedy (argmax), as in llama.cpp.
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
    # llama.cpp's penalties sampler, over the same window as the repeat penalty: a token seen c
    # times there loses c * frequency_penalty + presence_penalty from its logit (0.0: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # added to the logits before anything else (llama.cpp's logit-bias sampler); -inf bans a token.
    # A dict {token id: bias} or pairs; stored as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # end-of-generation tokens are never sampled (their logits are -inf, as llama.cpp's
    # --ignore-eos); the generation loop (session.stream_generate, the server) applies it
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            pairs = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise QllamaError("logit_bias must map token ids to numbers") from None
        object.__setattr__(self, "logit_bias", pairs)

    def validate(self) -> None:
        if not np.isfinite(self.temperature):
            raise QllamaError("temperature must be a finite number")
        for name in ("presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise QllamaError(f"{name.replace('_', ' ')} must be a finite number")
        for t, b in self.logit_bias:
            if t < 0:
                raise QllamaError(f"logit bias: {t} is not a token id")
            if b != b or b == float("inf"):
                raise QllamaError(f"logit bias of token {t} must be a number or -inf, got {b}")
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


def apply_penalties(logits: np.ndarray, recent: np.ndarray, repeat: float, frequency: float, presence: float) -> None:
    """llama.cpp's penalties sampler (llama_sampler_penalties), in place, in float32: for each
    distinct token of `recent` seen c times, a logit <= 0 is multiplied by `repeat` and a positive
    one divided by it, then c * frequency + presence is subtracted."""
    if recent.size == 0 or (repeat == 1.0 and frequency == 0.0 and presence == 0.0):
        return
    ids, counts = np.unique(recent, return_counts=True)
    vals = logits[ids]
    if repeat != 1.0:
        vals = np.where(vals <= 0, vals * np.float32(repeat), vals / np.float32(repeat)).astype(np.float32)
    if frequency != 0.0 or presence != 0.0:
        vals = vals - (counts.astype(np.float32) * np.float32(frequency) + np.float32(presence))
    logits[ids] = vals


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
        self.suppressed = np.zeros(0, dtype=np.int64)  # ids never sampled (see `suppress`)
        self._bias = (np.array([t for t, _ in self.params.logit_bias], dtype=np.int64),
                      np.array([b for _, b in self.params.logit_bias], dtype=np.float32))

    def suppress(self, ids) -> None:
        """Never sample these ids (their logits become -inf): the end-of-generation tokens, for
        `ignore_eos`."""
        self.suppressed = np.array(sorted(set(int(i) for i in ids)), dtype=np.int64)

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
        logits = np.array(logits, dtype=np.float32)  # copy: bias and penalties write into it
        bias_ids, bias = self._bias
        if bias_ids.size:
            if bias_ids[-1] >= logits.shape[0]:
                raise QllamaError(f"logit bias: token id {bias_ids[-1]} is out of range [0, {logits.shape[0]})")
            logits[bias_ids] += bias
        if self.suppressed.size:
            logits[self.suppressed[self.suppressed < logits.shape[0]]] = -np.inf
        if self.recent and (prm.repeat_penalty != 1.0 or prm.frequency_penalty != 0.0 or prm.presence_penalty != 0.0):
            apply_penalties(logits, np.fromiter(self.recent, dtype=np.int64), prm.repeat_penalty,
                            prm.frequency_penalty, prm.presence_penalty)
        if prm.temperature <= 0.0:
            return np.array([np.argmax(logits)]), np.ones(1)
        ids = np.arange(logits.shape[0])
        ids, cand = top_k_filter(ids, logits, prm.top_k)
        ids, cand = top_p_filter(ids, cand, prm.top_p)
        ids, cand = min_p_filter(ids, cand, prm.min_p)
        return ids, softmax(cand / prm.temperature)
