"""Numba kernels for the non-matmul parts of a Llama layer: RMSNorm, RoPE, attention, SwiGLU.

Shapes use T for tokens in the batch, H for query heads, Hkv for KV heads, D for head_dim.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, fastmath=True)
def rmsnorm(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight.   x, out: (T, d) float32; weight: (d,)."""
    n_tok, dim = x.shape
    for t in range(n_tok):
        acc = 0.0  # float64 sum, as ggml does
        for i in range(dim):
            v = np.float64(x[t, i])
            acc += v * v
        scale = np.float32(1.0 / math.sqrt(acc / dim + eps))
        for i in range(dim):
            out[t, i] = (x[t, i] * scale) * weight[i]


@njit(cache=True, fastmath=True)
def rope_interleaved(x, positions, cos_table, sin_table):
    """Rotate pairs (x[2i], x[2i+1]) of the first n_rot dims of every head, in place.

    x: (T, H, D) float32; positions: (T,) int64; cos/sin_table: (n_ctx, n_rot/2) float32.
    """
    n_tok, n_heads, _ = x.shape
    half = cos_table.shape[1]
    for t in range(n_tok):
        p = positions[t]
        for h in range(n_heads):
            for i in range(half):
                c = cos_table[p, i]
                s = sin_table[p, i]
                x0 = x[t, h, 2 * i]
                x1 = x[t, h, 2 * i + 1]
                x[t, h, 2 * i] = x0 * c - x1 * s
                x[t, h, 2 * i + 1] = x0 * s + x1 * c


@njit(cache=True, parallel=True, fastmath=True)
def attention(q, k_cache, v_cache, start_pos, n_rep, scale, out):
    """Causal grouped-query attention over the cache.

    q: (T, H, D) float32 (already roped); k_cache, v_cache: (Hkv, n_ctx, D) float32 for one layer,
    holding positions [0, start_pos + T); out: (T, H, D) float32. Token t sees keys 0..start_pos+t.
    """
    n_tok, n_heads, head_dim = q.shape
    for job in prange(n_tok * n_heads):
        t = job // n_heads
        h = job % n_heads
        kvh = h // n_rep
        n_keys = start_pos + t + 1
        scores = np.empty(n_keys, dtype=np.float32)
        best = -np.inf
        for j in range(n_keys):
            acc = np.float32(0.0)
            for d in range(head_dim):
                acc += q[t, h, d] * k_cache[kvh, j, d]
            acc *= scale
            scores[j] = acc
            if acc > best:
                best = acc
        total = 0.0
        for j in range(n_keys):
            e = math.exp(scores[j] - best)  # stable softmax: the largest term is exp(0)
            scores[j] = e
            total += e
        inv = np.float32(1.0 / total)
        for d in range(head_dim):
            out[t, h, d] = 0.0
        for j in range(n_keys):
            w = scores[j] * inv
            for d in range(head_dim):
                out[t, h, d] += w * v_cache[kvh, j, d]


@njit(cache=True, parallel=True, fastmath=True)
def swiglu(gate, up, out):
    """out = silu(gate) * up, all (T, n_ff) float32."""
    n_tok, n_ff = gate.shape
    for k in prange(n_tok * n_ff):
        t = k // n_ff
        i = k % n_ff
        g = gate[t, i]
        out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]
