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

from .jit import kernel

from ._fp16 import f16_at

QK_K = 256
_NOPY = dict(boundscheck=False)


@kernel(**_NOPY)
def scale_min_k4(row, so, j):
    """The 6-bit (scale, min) pair of sub-block j (0..7) from the 12 bytes at row[so:so+12] (q4_K, q5_K)."""
    if j < 4:
        sc = np.int32(row[so + j] & 63)
        m = np.int32(row[so + j + 4] & 63)
    else:
        sc = np.int32((row[so + j + 4] & 15) | ((row[so + j - 4] >> 6) << 4))
        m = np.int32((row[so + j + 4] >> 4) | ((row[so + j] >> 6) << 4))
    return sc, m


@kernel(**_NOPY)
def scale_q3_k(row, so, i):
    """The signed scale (-32..31) of sub-block i (0..15) from the 12 bytes at row[so:so+12] (q3_K)."""
    lo = (np.int32(row[so + i]) & 15) if i < 8 else (np.int32(row[so + i - 8]) >> 4)
    hi = (np.int32(row[so + 8 + (i & 3)]) >> (2 * (i >> 2))) & 3
    return (lo | (hi << 4)) - 32


@kernel(**_NOPY)
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


@kernel(**_NOPY)
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


@kernel(inline="always", **_NOPY)
def _k4_scales(row, bo, tab, j):
    """(d * scale, dmin * min) of sub-blocks 2j and 2j + 1 of the q4_K/q5_K super-block at bo:
    (d0, dm0, d1, dm1)."""
    d = f16_at(row, bo, tab)
    dmin = f16_at(row, bo + 2, tab)
    sc0, m0 = scale_min_k4(row, bo + 4, 2 * j)
    sc1, m1 = scale_min_k4(row, bo + 4, 2 * j + 1)
    return d * np.float32(sc0), dmin * np.float32(m0), d * np.float32(sc1), dmin * np.float32(m1)


@kernel(**_NOPY)
def decode_q4_k(row, bo, tab, out, oo):
    for j in range(4):
        d0, dm0, d1, dm1 = _k4_scales(row, bo, tab, j)
        for l in range(32):
            b = row[bo + 16 + 32 * j + l]
            out[oo + 64 * j + l] = d0 * np.float32(b & 15) - dm0
            out[oo + 64 * j + 32 + l] = d1 * np.float32(b >> 4) - dm1


@kernel(**_NOPY)
def decode_q5_k(row, bo, tab, out, oo):
    for j in range(4):
        d0, dm0, d1, dm1 = _k4_scales(row, bo, tab, j)
        for l in range(32):
            b = np.int32(row[bo + 48 + 32 * j + l])
            h = np.int32(row[bo + 16 + l])
            q0 = (b & 15) | (((h >> (2 * j)) & 1) << 4)
            q1 = (b >> 4) | (((h >> (2 * j + 1)) & 1) << 4)
            out[oo + 64 * j + l] = d0 * np.float32(q0) - dm0
            out[oo + 64 * j + 32 + l] = d1 * np.float32(q1) - dm1


@kernel(**_NOPY)
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


# -- fused float mat-vec (the portable decode path) ---------------------------------------------
# As in legacy.py: per sub-block, a float reduction sum_l q_l x_l over int32 -> float32 lanes,
# scaled by d*sc; min terms use xs, the float32 sums of x over 16 elements (ne0/16,).
# `_dot_<type>(row, o, b, qk, x, xs, tab)`: the dot of super-block b (at byte o of row) with x
# (qk: unused), inlined into `block_matvec.MATVEC[type]`.

_INLINE = dict(inline="always", boundscheck=False)


@kernel(**_INLINE)
def _dot_q2_k(row, o, b, qk, x, xs, tab):
    sq = np.float32(0.0)
    for n in range(2):
        for hf in range(2):  # sub-blocks k = 8n + 2s + hf, shifts 2s written out (constant)
            s0 = s1 = s2 = s3 = np.float32(0.0)
            xo = b * 256 + 128 * n + 16 * hf
            for l in range(16):
                q = np.int32(row[o + 16 + 32 * n + 16 * hf + l])
                s0 += np.float32(np.int32(q & 3)) * x[xo + l]
                s1 += np.float32(np.int32((q >> 2) & 3)) * x[xo + 32 + l]
                s2 += np.float32(np.int32((q >> 4) & 3)) * x[xo + 64 + l]
                s3 += np.float32(np.int32(q >> 6)) * x[xo + 96 + l]
            k = o + 8 * n + hf
            sq += (np.float32(row[k] & 15) * s0 + np.float32(row[k + 2] & 15) * s1
                   + np.float32(row[k + 4] & 15) * s2 + np.float32(row[k + 6] & 15) * s3)
    sm = np.float32(0.0)
    for k in range(16):
        sm += np.float32(row[o + k] >> 4) * xs[b * 16 + k]
    return f16_at(row, o + 80, tab) * sq - f16_at(row, o + 82, tab) * sm


@kernel(**_INLINE)
def _dot_q3_k(row, o, b, qk, x, xs, tab):
    """q = low2 - 4 + 4*hbit: sum q x = sum low2 x - 4 sum x + 4 sum_{hbit} x (exact in float)."""
    sq = np.float32(0.0)
    for n in range(2):
        for hf in range(2):
            s0 = s1 = s2 = s3 = np.float32(0.0)
            h0 = h1 = h2 = h3 = np.float32(0.0)
            m0 = np.int32(1 << (4 * n))  # hmask bit of group s is 4n + s
            xo = b * 256 + 128 * n + 16 * hf
            for l in range(16):
                q = np.int32(row[o + 32 + 32 * n + 16 * hf + l])
                h = np.int32(row[o + 16 * hf + l])
                s0 += np.float32(np.int32(q & 3)) * x[xo + l]
                s1 += np.float32(np.int32((q >> 2) & 3)) * x[xo + 32 + l]
                s2 += np.float32(np.int32((q >> 4) & 3)) * x[xo + 64 + l]
                s3 += np.float32(np.int32(q >> 6)) * x[xo + 96 + l]
                h0 += np.float32(np.int32(h & m0)) * x[xo + l]
                h1 += np.float32(np.int32(h & (m0 << 1))) * x[xo + 32 + l]
                h2 += np.float32(np.int32(h & (m0 << 2))) * x[xo + 64 + l]
                h3 += np.float32(np.int32(h & (m0 << 3))) * x[xo + 96 + l]
            f = np.float32(4.0) / np.float32(m0)  # 4 * hbit = 4 * (h & m) / m
            k = 8 * n + hf
            x16 = b * 16 + k
            sq += np.float32(scale_q3_k(row, o + 96, k)) * (s0 + f * h0 - np.float32(4.0) * xs[x16])
            sq += np.float32(scale_q3_k(row, o + 96, k + 2)) * (s1 + f * np.float32(0.5) * h1 - np.float32(4.0) * xs[x16 + 2])
            sq += np.float32(scale_q3_k(row, o + 96, k + 4)) * (s2 + f * np.float32(0.25) * h2 - np.float32(4.0) * xs[x16 + 4])
            sq += np.float32(scale_q3_k(row, o + 96, k + 6)) * (s3 + f * np.float32(0.125) * h3 - np.float32(4.0) * xs[x16 + 6])
    return f16_at(row, o + 108, tab) * sq


@kernel(**_INLINE)
def _dot_k4(row, o, b, x, xs, tab, five):
    """The dot of a q4_K (five False) or q5_K super-block: per 64 elements j, the sums of the low
    and high nibbles times x, q5_K's 5th bit entering as 16 * (h & m) / m (exact in float,
    avoiding variable shifts); then scales and mins (`scale_min_k4`). `five` is a constant of
    the caller, so each type compiles only its own loop."""
    qo = 48 if five else 16  # the nibbles (q5_K: after its 32 bytes of 5th bits)
    sq = np.float32(0.0)
    sm = np.float32(0.0)
    for j in range(4):
        s0 = s1 = h0 = h1 = np.float32(0.0)
        m = np.int32(1 << (2 * j))
        xo = b * 256 + 64 * j
        for l in range(32):
            q = np.int32(row[o + qo + 32 * j + l])
            s0 += np.float32(np.int32(q & 15)) * x[xo + l]
            s1 += np.float32(np.int32(q >> 4)) * x[xo + 32 + l]
            if five:
                h = np.int32(row[o + 16 + l])
                h0 += np.float32(np.int32(h & m)) * x[xo + l]
                h1 += np.float32(np.int32(h & (m << 1))) * x[xo + 32 + l]
        if five:
            f = np.float32(16.0) / np.float32(m)
            s0 = s0 + f * h0
            s1 = s1 + f * np.float32(0.5) * h1
        sc0, m0 = scale_min_k4(row, o + 4, 2 * j)
        sc1, m1 = scale_min_k4(row, o + 4, 2 * j + 1)
        sq += np.float32(sc0) * s0 + np.float32(sc1) * s1
        x16 = b * 16 + 4 * j
        sm += np.float32(m0) * (xs[x16] + xs[x16 + 1]) + np.float32(m1) * (xs[x16 + 2] + xs[x16 + 3])
    return f16_at(row, o, tab) * sq - f16_at(row, o + 2, tab) * sm


@kernel(**_INLINE)
def _dot_q4_k(row, o, b, qk, x, xs, tab):
    return _dot_k4(row, o, b, x, xs, tab, False)


@kernel(**_INLINE)
def _dot_q5_k(row, o, b, qk, x, xs, tab):
    return _dot_k4(row, o, b, x, xs, tab, True)


@kernel(**_INLINE)
def _dot_q6_k(row, o, b, qk, x, xs, tab):
    sq = np.float32(0.0)
    for n in range(2):
        for hf in range(2):  # sub-blocks k = 8n + 2s + hf; shifts written out (constant)
            s0 = s1 = s2 = s3 = np.float32(0.0)
            t0 = t1 = t2 = t3 = np.float32(0.0)  # high 2 bits, weighted by 16 after the loop
            xo = b * 256 + 128 * n + 16 * hf
            for l in range(16):
                a = np.int32(row[o + 64 * n + 16 * hf + l])
                c = np.int32(row[o + 64 * n + 32 + 16 * hf + l])
                h = np.int32(row[o + 128 + 32 * n + 16 * hf + l])
                x0, x1, x2, x3 = x[xo + l], x[xo + 32 + l], x[xo + 64 + l], x[xo + 96 + l]
                s0 += np.float32(np.int32(a & 15)) * x0
                s1 += np.float32(np.int32(c & 15)) * x1
                s2 += np.float32(np.int32(a >> 4)) * x2
                s3 += np.float32(np.int32(c >> 4)) * x3
                t0 += np.float32(np.int32(h & 3)) * x0
                t1 += np.float32(np.int32((h >> 2) & 3)) * x1
                t2 += np.float32(np.int32((h >> 4) & 3)) * x2
                t3 += np.float32(np.int32(h >> 6)) * x3
            c16 = np.float32(16.0)
            s0 += c16 * t0
            s1 += c16 * t1
            s2 += c16 * t2
            s3 += c16 * t3
            k = o + 192 + 8 * n + hf
            x16 = b * 16 + 8 * n + hf
            c32 = np.float32(32.0)  # the quants' offset, applied through the sums of x
            sq += (np.float32(np.int8(row[k])) * (s0 - c32 * xs[x16])
                   + np.float32(np.int8(row[k + 2])) * (s1 - c32 * xs[x16 + 2])
                   + np.float32(np.int8(row[k + 4])) * (s2 - c32 * xs[x16 + 4])
                   + np.float32(np.int8(row[k + 6])) * (s3 - c32 * xs[x16 + 6]))
    return f16_at(row, o + 208, tab) * sq
