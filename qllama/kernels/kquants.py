"""Block decoders of the k-quants (256-element super-blocks): q2_K, q3_K, q4_K, q5_K, q6_K.

Same convention as `legacy.py`: `decode_<type>(row, bo, tab, out, oo)` writes the 256 floats of
the super-block at byte `bo` of `row` into `out[oo:oo + 256]`, in float32 with gguf-py's order
of operations (bit-exact). Layouts (ggml-common.h), fields in file order:

    q2_K (84 B):  scales[16] (lo nibble: scale, hi: min) | qs[64] (2 bits) | d | dmin
                  element e = 128n + 32s + l: q = (qs[32n+l] >> 2s) & 3, sub-block e//16
                  x = (d*sc)*q - dmin*m
    q3_K (110 B): hmask[32] | qs[64] (2 low bits) | scales[12] (16 x 6 bits) | d
                  low bits as q2_K; high bit of e = 32i + l is (hmask[l] >> i) & 1;
                  q = low - 4*(1 - high); x = (d*(sc-32))*q
    q4_K (144 B): d | dmin | scales[12] (8 x 6-bit scale, 8 x 6-bit min) | qs[128]
                  e = 64j + 32h + l: q = (qs[32j+l] >> 4h) & 15, sub-block 2j+h (32 elements)
                  x = (d*sc)*q - dmin*m
    q5_K (176 B): d | dmin | scales[12] | qh[32] | qs[128]; q = q4_K nibble | bit_{e//32}(qh[e%32]) << 4
    q6_K (210 B): ql[128] | qh[64] | scales[16] (int8) | d
                  e = 128n + 64h + l (l<64): low = (ql[64n+l] >> 4h) & 15
                  e = 128n + 32s + l (l<32): high = (qh[32n+l] >> 2s) & 3
                  x = (d*sc[e//16])*((low | high<<4) - 32)
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._fp16 import f16_at

QK_K = 256
_NOPY = dict(cache=True, boundscheck=False)


@njit(**_NOPY)
def scale_min_k4(row, so, j):
    """The 6-bit (scale, min) pair of sub-block j (0..7) from the 12 bytes at row[so:so+12] (q4_K, q5_K)."""
    if j < 4:
        sc = np.int32(row[so + j] & 63)
        m = np.int32(row[so + j + 4] & 63)
    else:
        sc = np.int32((row[so + j + 4] & 15) | ((row[so + j - 4] >> 6) << 4))
        m = np.int32((row[so + j + 4] >> 4) | ((row[so + j] >> 6) << 4))
    return sc, m


@njit(**_NOPY)
def scale_q3_k(row, so, i):
    """The signed scale (-32..31) of sub-block i (0..15) from the 12 bytes at row[so:so+12] (q3_K)."""
    lo = (np.int32(row[so + i]) & 15) if i < 8 else (np.int32(row[so + i - 8]) >> 4)
    hi = (np.int32(row[so + 8 + (i & 3)]) >> (2 * (i >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit(**_NOPY)
def decode_q2_k(row, bo, tab, out, oo):
    d = f16_at(row, bo + 80, tab)
    dmin = f16_at(row, bo + 82, tab)
    for k in range(16):  # sub-blocks of 16
        sc = row[bo + k]
        dl = d * np.float32(sc & 15)
        ml = dmin * np.float32(sc >> 4)
        n = k >> 3  # 128-element half
        s = (k >> 1) & 3  # shift group
        qo = bo + 16 + 32 * n + 16 * (k & 1)
        for l in range(16):
            q = (np.int32(row[qo + l]) >> (2 * s)) & 3
            out[oo + 16 * k + l] = dl * np.float32(q) - ml


@njit(**_NOPY)
def decode_q3_k(row, bo, tab, out, oo):
    d = f16_at(row, bo + 108, tab)
    for k in range(16):
        dl = d * np.float32(scale_q3_k(row, bo + 96, k))
        n = k >> 3
        s = (k >> 1) & 3
        i = k >> 1  # hmask bit of this 32-element group
        lo = 16 * (k & 1)
        for l in range(16):
            q = (np.int32(row[bo + 32 + 32 * n + lo + l]) >> (2 * s)) & 3
            h = (np.int32(row[bo + lo + l]) >> i) & 1
            out[oo + 16 * k + l] = dl * np.float32(q - ((h ^ 1) << 2))


@njit(**_NOPY)
def decode_q4_k(row, bo, tab, out, oo):
    d = f16_at(row, bo, tab)
    dmin = f16_at(row, bo + 2, tab)
    for j in range(4):
        sc0, m0 = scale_min_k4(row, bo + 4, 2 * j)
        sc1, m1 = scale_min_k4(row, bo + 4, 2 * j + 1)
        d0 = d * np.float32(sc0)
        d1 = d * np.float32(sc1)
        dm0 = dmin * np.float32(m0)
        dm1 = dmin * np.float32(m1)
        for l in range(32):
            b = row[bo + 16 + 32 * j + l]
            out[oo + 64 * j + l] = d0 * np.float32(b & 15) - dm0
            out[oo + 64 * j + 32 + l] = d1 * np.float32(b >> 4) - dm1


@njit(**_NOPY)
def decode_q5_k(row, bo, tab, out, oo):
    d = f16_at(row, bo, tab)
    dmin = f16_at(row, bo + 2, tab)
    for j in range(4):
        sc0, m0 = scale_min_k4(row, bo + 4, 2 * j)
        sc1, m1 = scale_min_k4(row, bo + 4, 2 * j + 1)
        d0 = d * np.float32(sc0)
        d1 = d * np.float32(sc1)
        dm0 = dmin * np.float32(m0)
        dm1 = dmin * np.float32(m1)
        for l in range(32):
            b = np.int32(row[bo + 48 + 32 * j + l])
            h = np.int32(row[bo + 16 + l])
            q0 = (b & 15) | (((h >> (2 * j)) & 1) << 4)
            q1 = (b >> 4) | (((h >> (2 * j + 1)) & 1) << 4)
            out[oo + 64 * j + l] = d0 * np.float32(q0) - dm0
            out[oo + 64 * j + 32 + l] = d1 * np.float32(q1) - dm1


@njit(**_NOPY)
def decode_q6_k(row, bo, tab, out, oo):
    d = f16_at(row, bo + 208, tab)
    for k in range(16):
        s8 = np.int32(row[bo + 192 + k])
        dl = d * np.float32(s8 - ((s8 & 128) << 1))  # int8 scale
        n = k >> 3
        s = (k >> 1) & 3  # 32-element group inside the 128-half
        lq = bo + 64 * n + 32 * (s & 1) + 16 * (k & 1)  # ql byte of this sub-block
        hq = bo + 128 + 32 * n + 16 * (k & 1)
        sh = 4 * (s >> 1)
        for l in range(16):
            lo = (np.int32(row[lq + l]) >> sh) & 15
            hi = (np.int32(row[hq + l]) >> (2 * s)) & 3
            out[oo + 16 * k + l] = dl * np.float32((lo | (hi << 4)) - 32)
