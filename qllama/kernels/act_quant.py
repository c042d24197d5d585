"""Activations rounded to 8 bits in ggml's formats, for the int8 mat-muls (`int8.py`).

- q8_K (for the k-quants): per 256 elements a float32 scale d = max/-127 of the signed value
  of largest magnitude, int8 quants round(x/d) (ties to even), and int32 sums of every 16
  quants ("bsums", used for the min / offset terms).
- q8_0 (for q8_0, q4_0, q5_0): per 32 elements d = amax/127 rounded to fp16 as ggml stores it,
  quants round-half-even(x * 127/amax), and their int32 sum;
- q8_1 (for q4_1, q5_1): as q8_0, with s = fp16(d * sum of quants) instead of the sum (ggml's
  q8_1 `s`, for the min term m * s).

Each takes x float32 (n_tok, n) and fills preallocated outputs (`qtensor.Activation` owns them).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .jit import kernel
from .quantize_k import fp16_round

_NOPY = dict(boundscheck=False)
QK_K = 256
QK8_0 = 32

_FLT_MAX = np.float32(3.4028234663852886e38)


@kernel(inline="always", **_NOPY)
def _to_int8(v):
    """A rounded float to an int in [-127, 127]; NaN (from a 0 * inf scale) gives 0.

    Tiny blocks can make the inverse scale overflow to inf; clamping keeps the quants defined
    (their scale d is then ~0, as is the true product).
    """
    if not (v == v):
        return 0
    return int(min(np.float32(127.0), max(np.float32(-127.0), v)))


@kernel(**_NOPY)
def q8_k_row(x, t, xq, xd, xs):
    """Token t (int64) of x in q8_K form (shapes as `quantize_q8_k`), on the calling thread.

    A separate function, not the body of quantize_q8_k's loop: the parallel loop stays small
    (its lowering is what costs compile time), and fused.py's one-token step calls the same
    compiled code. A block holding NaN/Inf gets d = NaN (so results are NaN, not garbage).
    """
    n = x.shape[1]
    for b in range(n // QK_K):
        o = b * QK_K
        amax = np.float32(0.0)
        vmax = np.float32(0.0)
        finite = True
        for j in range(QK_K):
            v = x[t, o + j]
            a = abs(v)
            if not (a <= _FLT_MAX):
                finite = False
            if a > amax:
                amax = a
                vmax = v
        if not finite or amax == 0:
            xd[t, b] = np.float32(np.nan) if not finite else np.float32(0.0)
            for j in range(QK_K):
                xq[t, o + j] = 0
            for k in range(QK_K // 16):
                xs[t, b * 16 + k] = 0
            continue
        iscale = np.float32(-127.0) / vmax
        for k in range(QK_K // 16):
            s = 0
            for j in range(16):
                q = _to_int8(np.rint(iscale * x[t, o + 16 * k + j]))
                xq[t, o + 16 * k + j] = q
                s += q
            xs[t, b * 16 + k] = s
        xd[t, b] = np.float32(1.0) / iscale


@kernel(parallel=True, **_NOPY)
def quantize_q8_k(x, xq, xd, xs):
    """x: float32 (n_tok, n) -> xq int8 (n_tok, n), xd float32 (n_tok, n/256), xs int32 (n_tok, n/16)."""
    for t in prange(x.shape[0]):
        q8_k_row(x, np.int64(t), xq, xd, xs)


@kernel(**_NOPY)
def _as_fp16(v):
    """v rounded to fp16 as ggml stores a q8_0/q8_1 scale; beyond fp16's range (|v| > 65504, where
    ggml's scale would be inf) v itself, so that extreme activations stay finite."""
    r = fp16_round(v)
    return r if abs(r) != np.inf else v


@kernel(**_NOPY)
def _q8_block(x, t, o, xq):
    """One 32-element block as llama.cpp's AVX2 quantize_row_q8_0/q8_1: d = amax/127,
    q = round-half-even(x * 127/amax). Returns (d unrounded, sum of q); d NaN if x is not finite."""
    amax = np.float32(0.0)
    finite = True
    for j in range(QK8_0):
        a = abs(x[t, o + j])
        if not (a <= _FLT_MAX):
            finite = False
        amax = max(amax, a)
    d = amax / np.float32(127.0)
    idv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
    s = 0
    for j in range(QK8_0):
        q = _to_int8(np.rint(x[t, o + j] * idv)) if finite else 0
        xq[t, o + j] = q
        s += q
    return (d if finite else np.float32(np.nan)), s


@kernel(parallel=True, **_NOPY)
def quantize_q8_0(x, xq, xd, xs):
    """x: float32 (n_tok, n) -> xq int8 (n_tok, n), xd float32 (n_tok, n/32) = fp16(d) as ggml
    stores it, xs int32 (n_tok, n/32) sums of xq."""
    n_tok, n = x.shape
    for t in prange(n_tok):
        for b in range(n // QK8_0):
            d, s = _q8_block(x, t, b * QK8_0, xq)
            xd[t, b] = _as_fp16(d)
            xs[t, b] = s


@kernel(parallel=True, **_NOPY)
def quantize_q8_1(x, xq, xd, xs):
    """As quantize_q8_0, but xs float32 (n_tok, n/32) = fp16(d * sum of xq), ggml's q8_1 `s`
    (the activation form of q4_1 and q5_1: their min term is m * s)."""
    n_tok, n = x.shape
    for t in prange(n_tok):
        for b in range(n // QK8_0):
            d, s = _q8_block(x, t, b * QK8_0, xq)
            xd[t, b] = _as_fp16(d)
            xs[t, b] = _as_fp16(d * np.float32(s))
