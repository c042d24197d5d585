"""Block decoders of the legacy 32-element quant types: q4_0, q4_1, q5_0, q5_1, q8_0.

Each `decode_<type>(row, bo, tab, out, oo)` writes the 32 floats of the block that starts at
byte `bo` of `row` (uint8) into `out[oo:oo + 32]` (float32). The float arithmetic is done in
float32 in the same order as gguf-py's NumPy reference (`gguf.quants`), so results are equal
bit for bit (NaN/Inf in the fp16 fields propagate). `tab` is `_fp16.FP16_TO_F32`.

Layouts (ggml-common.h); d, m are fp16:
    q4_0: d | qs[16]              x[l] = d*((qs[l]&15)-8),  x[l+16] = d*((qs[l]>>4)-8)
    q4_1: d | m | qs[16]          x = d*q + m
    q5_0: d | qh[4] | qs[16]      q = nibble | bit_i(qh)<<4, x = d*(q-16)   (qh is a LE uint32)
    q5_1: d | m | qh[4] | qs[16]  x = d*q + m
    q8_0: d | qs[32] (int8)       x = qs*d
"""

from __future__ import annotations

import numpy as np

from .jit import kernel

from ._fp16 import f16_at

QK = 32  # elements per legacy block
_NOPY = dict(boundscheck=False)


@kernel(**_NOPY)
def decode_q4_0(row, bo, tab, out, oo):
    d = f16_at(row, bo, tab)
    for l in range(16):
        b = row[bo + 2 + l]
        out[oo + l] = d * np.float32(np.int32(b & 15) - 8)
        out[oo + 16 + l] = d * np.float32(np.int32(b >> 4) - 8)


@kernel(**_NOPY)
def decode_q4_1(row, bo, tab, out, oo):
    d = f16_at(row, bo, tab)
    m = f16_at(row, bo + 2, tab)
    for l in range(16):
        b = row[bo + 4 + l]
        out[oo + l] = d * np.float32(b & 15) + m
        out[oo + 16 + l] = d * np.float32(b >> 4) + m


@kernel(**_NOPY)
def _qh32(row, o):
    """The little-endian uint32 of high bits at row[o:o+4]."""
    return np.int64(row[o]) | (np.int64(row[o + 1]) << 8) | (np.int64(row[o + 2]) << 16) | (np.int64(row[o + 3]) << 24)


@kernel(**_NOPY)
def decode_q5_0(row, bo, tab, out, oo):
    d = f16_at(row, bo, tab)
    qh = _qh32(row, bo + 2)
    for l in range(16):
        b = np.int64(row[bo + 6 + l])
        q0 = (b & 15) | (((qh >> l) & 1) << 4)
        q1 = (b >> 4) | (((qh >> (l + 16)) & 1) << 4)
        out[oo + l] = d * np.float32(q0 - 16)
        out[oo + 16 + l] = d * np.float32(q1 - 16)


@kernel(**_NOPY)
def decode_q5_1(row, bo, tab, out, oo):
    d = f16_at(row, bo, tab)
    m = f16_at(row, bo + 2, tab)
    qh = _qh32(row, bo + 4)
    for l in range(16):
        b = np.int64(row[bo + 8 + l])
        q0 = (b & 15) | (((qh >> l) & 1) << 4)
        q1 = (b >> 4) | (((qh >> (l + 16)) & 1) << 4)
        out[oo + l] = d * np.float32(q0) + m
        out[oo + 16 + l] = d * np.float32(q1) + m


@kernel(**_NOPY)
def decode_q8_0(row, bo, tab, out, oo):
    d = f16_at(row, bo, tab)
    for l in range(32):
        v = np.int32(row[bo + 2 + l])
        out[oo + l] = np.float32(v - ((v & 128) << 1)) * d  # uint8 -> int8


# -- fused float mat-vec (the portable decode path) ---------------------------------------------
# y[r] = sum_blocks d * sum_l q_l x_l (+ m * sum_l x_l): the block is never written anywhere; the
# inner loops are reductions in int32 -> float32 lanes, which LLVM vectorises (vcvtdq2ps + FMA).
# xs: float32 (ne0/16,) sums of x over 16 elements (for the min terms).

# `_dot_<type>(row, o, b, qk, x, xs, tab)`: the dot of block b (at byte o of row) with x, inlined
# into `block_matvec.MATVEC[type]` (which loops over the rows and blocks, with its fast-math flags).
# The inner loops run over `qk` = bytes of quants per block, computed from the row size at run
# time: with a constant trip count LLVM unrolls them and vectorises across blocks instead
# (gathers), which is 3-5x slower.

_INLINE = dict(inline="always", boundscheck=False)


@kernel(**_INLINE)
def _q4_sum(row, qo, qk, x, xo, off):
    """sum_l (nibble - off) * x over the qk bytes of nibbles at row[qo:] (x from xo)."""
    s = np.float32(0.0)
    for l in range(qk):
        q = np.int32(row[qo + l])
        s += np.float32(np.int32((q & 15) - off)) * x[xo + l] + np.float32(np.int32((q >> 4) - off)) * x[xo + 16 + l]
    return s


@kernel(**_INLINE)
def _q5_sum(row, ho, qo, qk, x, xo, off):
    """As _q4_sum with the 5th bits of the little-endian uint32 at row[ho:ho+4]."""
    qh = _qh32(row, ho)
    s = np.float32(0.0)
    for l in range(qk):
        q = np.int32(row[qo + l])
        h0 = np.int32((qh >> l) & 1) << 4
        h1 = np.int32((qh >> (l + 16)) & 1) << 4
        s += np.float32(np.int32(((q & 15) | h0) - off)) * x[xo + l]
        s += np.float32(np.int32(((q >> 4) | h1) - off)) * x[xo + 16 + l]
    return s


@kernel(**_INLINE)
def _dot_q4_0(row, o, b, qk, x, xs, tab):
    return f16_at(row, o, tab) * _q4_sum(row, o + 2, qk, x, b * 32, 8)


@kernel(**_INLINE)
def _dot_q4_1(row, o, b, qk, x, xs, tab):
    return f16_at(row, o, tab) * _q4_sum(row, o + 4, qk, x, b * 32, 0) + f16_at(row, o + 2, tab) * (xs[2 * b] + xs[2 * b + 1])


@kernel(**_INLINE)
def _dot_q5_0(row, o, b, qk, x, xs, tab):
    return f16_at(row, o, tab) * _q5_sum(row, o + 2, o + 6, qk, x, b * 32, 16)


@kernel(**_INLINE)
def _dot_q5_1(row, o, b, qk, x, xs, tab):
    return f16_at(row, o, tab) * _q5_sum(row, o + 4, o + 8, qk, x, b * 32, 0) + f16_at(row, o + 2, tab) * (xs[2 * b] + xs[2 * b + 1])


@kernel(**_INLINE)
def _dot_q8_0(row, o, b, qk, x, xs, tab):
    s = np.float32(0.0)
    for l in range(qk):
        s += np.float32(np.int8(row[o + 2 + l])) * x[b * 32 + l]
    return f16_at(row, o, tab) * s
