"""The int8-activation path (as llama.cpp runs quantized mat-vecs), for q4_K, q6_K and q8_0.

Activations are quantized once per call (or once for several matrices, see
`qllama.quants.quantize_activation`) in ggml's formats:

- q8_K (for k-quant weights): per 256 elements a float32 scale d = max/-127 of the signed
  value of largest magnitude, int8 quants round(x/d) (ties to even), and int32 sums of every
  16 quants ("bsums", used for the min / offset terms).
- q8_0 (for q8_0 weights): per 32 elements d = amax/127, quants round(x/d) (ties away from 0).
  ggml stores this d as fp16; we keep float32 (slightly more precise).

Weight blocks are then dotted with integer arithmetic (`_x86.py`): exact integer sums times
float scales, so the only error versus float is the rounding of x to 8 bits, like llama.cpp
(measured: max|y - y64| / max|y64| around 1e-2 on random data; see tests).

Each mat-mul kernel takes x as (n_tok, ne0) and serves both decode (n_tok = 1) and prefill:
rows are split over threads (`prange` over chunks of ROWS_PER_TASK rows); for each tile of
TOKEN_TILE tokens each weight block is read once and applied to every token of the tile.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._fp16 import f16_at
from ._x86 import dot_mins_q4_k, dot_q4_k, dot_q6_k, dot_q8_0

_NOPY = dict(cache=True, boundscheck=False)
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
QK_K = 256
QK8_0 = 32
ROWS_PER_TASK = 8
TOKEN_TILE = 32


@njit(parallel=True, **_NOPY)
def quantize_q8_k(x, xq, xd, xs):
    """x: float32 (n_tok, n) -> xq int8 (n_tok, n), xd float32 (n_tok, n/256), xs int32 (n_tok, n/16).

    A block holding NaN/Inf gets d = NaN (so results are NaN, not garbage).
    """
    n_tok, n = x.shape
    for t in prange(n_tok):
        for b in range(n // QK_K):
            o = b * QK_K
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            finite = True
            for j in range(QK_K):
                v = x[t, o + j]
                a = abs(v)
                if not (a <= np.float32(3.0e38)):
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
                    q = min(127, int(np.rint(iscale * x[t, o + 16 * k + j])))
                    xq[t, o + 16 * k + j] = q
                    s += q
                xs[t, b * 16 + k] = s
            xd[t, b] = np.float32(1.0) / iscale


@njit(parallel=True, **_NOPY)
def quantize_q8_0(x, xq, xd):
    """x: float32 (n_tok, n) -> xq int8 (n_tok, n), xd float32 (n_tok, n/32)."""
    n_tok, n = x.shape
    for t in prange(n_tok):
        for b in range(n // QK8_0):
            o = b * QK8_0
            amax = np.float32(0.0)
            finite = True
            for j in range(QK8_0):
                a = abs(x[t, o + j])
                if not (a <= np.float32(3.0e38)):
                    finite = False
                amax = max(amax, a)
            d = amax / np.float32(127.0)
            idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            for j in range(QK8_0):
                v = x[t, o + j] * idv if finite else np.float32(0.0)
                xq[t, o + j] = int(np.floor(abs(v) + np.float32(0.5))) * (1 if v >= 0 else -1)
            xd[t, b] = d if finite else np.float32(np.nan)


@njit(**_NOPY)
def _u32(row, o):
    return np.int64(row[o]) | (np.int64(row[o + 1]) << 8) | (np.int64(row[o + 2]) << 16) | (np.int64(row[o + 3]) << 24)


@njit(inline="always", **_NOPY)
def _q4_k_scales(row, o):
    """The 8 six-bit scales and 8 mins of the q4_K/q5_K block at row[o:], one per byte of two int64."""
    u0 = _u32(row, o + 4)
    u1 = _u32(row, o + 8)
    u2 = _u32(row, o + 12)
    sc = (u0 & 0x3F3F3F3F) | (((u2 & 0x0F0F0F0F) | (((u0 >> 6) & 0x03030303) << 4)) << 32)
    mn = (u1 & 0x3F3F3F3F) | ((((u2 >> 4) & 0x0F0F0F0F) | (((u1 >> 6) & 0x03030303) << 4)) << 32)
    return sc, mn


@njit(inline="always", **_NOPY)
def _q4_k_block(row, o, d, dmin, sc, mn, xqt, xdt, xst, b):
    """Contribution of q4_K super-block b (at row[o:]) to the dot with one q8_K token."""
    isum = dot_q4_k(row, o + 16, xqt, b * QK_K, sc)
    msum = dot_mins_q4_k(mn, xst, b * 16)
    return (xdt[b] * d) * np.float32(isum) - (xdt[b] * dmin) * np.float32(msum)


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matmul_q4_k(raw, xq, xd, xs, tab, out):
    """out[t, r] = row r . x[t] with x in q8_K form. raw: uint8 (n_rows, nb*144); out: float32 (n_tok, n_rows)."""
    n_rows = raw.shape[0]
    n_tok = xq.shape[0]
    nb = raw.shape[1] // 144
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        r0 = task * ROWS_PER_TASK
        r1 = min(n_rows, r0 + ROWS_PER_TASK)
        if n_tok == 1:  # decode: keep the sum in a register
            for r in range(r0, r1):
                row = raw[r]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 144
                    sc, mn = _q4_k_scales(row, o)
                    acc += _q4_k_block(row, o, f16_at(row, o, tab), f16_at(row, o + 2, tab), sc, mn, xq[0], xd[0], xs[0], b)
                out[0, r] = acc
            continue
        for t0 in range(0, n_tok, TOKEN_TILE):
            t1 = min(n_tok, t0 + TOKEN_TILE)
            for r in range(r0, r1):
                row = raw[r]
                for t in range(t0, t1):
                    out[t, r] = 0.0
                for b in range(nb):
                    o = b * 144
                    d = f16_at(row, o, tab)
                    dmin = f16_at(row, o + 2, tab)
                    sc, mn = _q4_k_scales(row, o)
                    for t in range(t0, t1):
                        out[t, r] += _q4_k_block(row, o, d, dmin, sc, mn, xq[t], xd[t], xs[t], b)


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matmul_q6_k(raw, xq, xd, xs, tab, out):
    """As matmul_q4_k for q6_K weights (210-byte blocks)."""
    n_rows = raw.shape[0]
    n_tok = xq.shape[0]
    nb = raw.shape[1] // 210
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        r0 = task * ROWS_PER_TASK
        r1 = min(n_rows, r0 + ROWS_PER_TASK)
        if n_tok == 1:
            for r in range(r0, r1):
                row = raw[r]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 210
                    isum = dot_q6_k(row, o, xq[0], b * QK_K, xs[0], b * 16)
                    acc += (xd[0, b] * f16_at(row, o + 208, tab)) * np.float32(isum)
                out[0, r] = acc
            continue
        for t0 in range(0, n_tok, TOKEN_TILE):
            t1 = min(n_tok, t0 + TOKEN_TILE)
            for r in range(r0, r1):
                row = raw[r]
                for t in range(t0, t1):
                    out[t, r] = 0.0
                for b in range(nb):
                    o = b * 210
                    d = f16_at(row, o + 208, tab)
                    for t in range(t0, t1):
                        isum = dot_q6_k(row, o, xq[t], b * QK_K, xs[t], b * 16)
                        out[t, r] += (xd[t, b] * d) * np.float32(isum)


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matmul_q8_0(raw, xq, xd, tab, out):
    """out[t, r] = row r . x[t] with x in q8_0 form (xd: (n_tok, ne0/32)). raw: uint8 (n_rows, nb*34)."""
    n_rows = raw.shape[0]
    n_tok = xq.shape[0]
    nb = raw.shape[1] // 34
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        r0 = task * ROWS_PER_TASK
        r1 = min(n_rows, r0 + ROWS_PER_TASK)
        if n_tok == 1:
            for r in range(r0, r1):
                row = raw[r]
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 34
                    acc += (xd[0, b] * f16_at(row, o, tab)) * np.float32(dot_q8_0(row, o + 2, xq[0], b * QK8_0))
                out[0, r] = acc
            continue
        for t0 in range(0, n_tok, TOKEN_TILE):
            t1 = min(n_tok, t0 + TOKEN_TILE)
            for r in range(r0, r1):
                row = raw[r]
                for t in range(t0, t1):
                    out[t, r] = 0.0
                for b in range(nb):
                    o = b * 34
                    d = f16_at(row, o, tab)
                    for t in range(t0, t1):
                        out[t, r] += (xd[t, b] * d) * np.float32(dot_q8_0(row, o + 2, xq[t], b * QK8_0))
