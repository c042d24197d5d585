"""A mixture of experts' router after its mat-mul, in one Numba call per layer: the k experts of
each token, their weights, and the tokens grouped by expert (llama.cpp's `build_moe_ffn` from
the logits on, and the ids `mul_mat_id` groups by).

Why a kernel: in NumPy these were ~15 array operations per layer (softmax, a stable argsort,
gathers, the renormalising sum, `np.unique`), ~0.3 ms of Python per layer and token, a fifth
of a decoded token's time on a 2-layer Qwen3-30B-A3B shape at two threads.

Two gating orders, as llama.cpp's:
- `softmax_top_k` (qwen3moe, olmoe, Mixtral, granitemoe, qwen2moe): p = softmax(logits) over
  all experts (exp(x - max) in float32, the sum in float64, times its float32 reciprocal); the k
  largest p, ties to the lower id, NaN last; w = those p, divided by their sum (in float64, then
  float32, at least WEIGHT_SUM_MIN) when `norm`, then times `scale` when it is not 0.
- `top_k_softmax` (gpt-oss): the k largest logits (same order), then w = softmax over those k.

A hook may force the experts (`forced`, (T, k) int64 already checked; (0, 0): none): the weights
are then those experts' p (or the softmax of their logits). Every token's row is computed alone,
so a token's experts and weights do not depend on its batch.
"""

from __future__ import annotations

import numpy as np

from .jit import kernel

_NOPY = dict(boundscheck=False)


@kernel(inline="always", **_NOPY)
def _top_k(v, k, out):
    """out[:k] = the indices of v's k largest values, best first, ties to the lower index, NaN
    after every number (as a stable argsort of -v). k <= v.size."""
    n = v.shape[0]
    taken = np.zeros(n, np.bool_)
    for s in range(k):
        best = -1
        for i in range(n):
            if taken[i] or not (v[i] == v[i]):
                continue
            if best < 0 or v[i] > v[best]:
                best = i
        if best < 0:  # only NaN left: the lowest unused index
            for i in range(n):
                if not taken[i]:
                    best = i
                    break
        taken[best] = True
        out[s] = best


@kernel(inline="always", **_NOPY)
def _softmax(v, out):
    """out = softmax(v): exp(v - max) in float32, the sum in float64, times the float32 reciprocal."""
    m = -np.inf
    nan = False
    for i in range(v.shape[0]):
        if not (v[i] == v[i]):
            nan = True
        elif v[i] > m:
            m = v[i]
    if nan:  # (as NumPy's max: a NaN logit makes every probability NaN)
        m = np.nan
    m = np.float32(m)
    s = 0.0
    for i in range(v.shape[0]):
        out[i] = np.exp(v[i] - m)
        s += np.float64(out[i])
    r = np.float32(1.0 / s)
    for i in range(v.shape[0]):
        out[i] = out[i] * r


@kernel(**_NOPY)
def softmax_top_k(logits, k, forced, norm, scale, sum_min):
    """logits (T, n_expert) float32 -> (experts (T, k) int64, w (T, k) float32); see the module
    docstring. forced: (T, k) int64 experts or a (0, 0) array; scale: 0 for none."""
    n_tok, n = logits.shape
    experts = np.empty((n_tok, k), np.int64)
    w = np.empty((n_tok, k), np.float32)
    p = np.empty(n, np.float32)  # (n_expert,) one token's probabilities
    for t in range(n_tok):
        _softmax(logits[t], p)
        if forced.shape[0]:
            for s in range(k):
                experts[t, s] = forced[t, s]
        else:
            _top_k(p, k, experts[t])
        for s in range(k):
            w[t, s] = p[experts[t, s]]
        if norm:
            s64 = 0.0
            for s in range(k):
                s64 += np.float64(w[t, s])
            d = max(np.float32(s64), sum_min)
            for s in range(k):
                w[t, s] = w[t, s] / d
        if scale != 0:
            for s in range(k):
                w[t, s] = w[t, s] * scale
    return experts, w


@kernel(**_NOPY)
def top_k_softmax(logits, k, forced):
    """gpt-oss's order: (experts (T, k) int64, w (T, k) float32 = softmax over the k chosen logits)."""
    n_tok = logits.shape[0]
    experts = np.empty((n_tok, k), np.int64)
    w = np.empty((n_tok, k), np.float32)
    sel = np.empty(k, np.float32)  # (k,) one token's chosen logits
    for t in range(n_tok):
        if forced.shape[0]:
            for s in range(k):
                experts[t, s] = forced[t, s]
        else:
            _top_k(logits[t], k, experts[t])
        for s in range(k):
            sel[s] = logits[t, experts[t, s]]
        _softmax(sel, w[t])
    return experts, w


@kernel(**_NOPY)
def group_by_expert(experts, n_expert):
    """experts (T, k) int64 -> (ids (G,) the chosen experts ascending, bounds (G + 1,), order (T k,)):
    expert ids[j]'s flat positions t * k + slot, in increasing order, are order[bounds[j]:bounds[j + 1]]
    (a stable argsort of the flat ids and their unique values, by counting)."""
    flat = experts.reshape(-1)
    count = np.zeros(n_expert + 1, np.int64)
    for e in flat:
        count[e + 1] += 1
    g = 0
    for e in range(n_expert):
        if count[e + 1]:
            g += 1
        count[e + 1] += count[e]  # count[e]: where expert e's positions start
    ids = np.empty(g, np.int64)
    bounds = np.empty(g + 1, np.int64)
    j = 0
    for e in range(n_expert):
        if count[e + 1] > count[e]:
            ids[j] = e
            bounds[j] = count[e]
            j += 1
    bounds[g] = flat.shape[0]
    order = np.empty(flat.shape[0], np.int64)
    for i in range(flat.shape[0]):
        e = flat[i]
        order[count[e]] = i
        count[e] += 1
    return ids, bounds, order
