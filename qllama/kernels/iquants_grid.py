"""int8 mat-muls of the grid i-quants (iq3_s, iq3_xxs, iq2_xxs, iq2_xs, iq2_s, iq1_s, iq1_m) times
q8_K activations, computing exactly what ggml's AVX2 `ggml_vec_dot_<type>_q8_K` computes.

Each super-block is decoded once into signed integer weights w (256: grid value times sign; iq1:
the grid's -1/0/1) and integer scales per 16 elements (2*ls + 1); per token, the int32 lane sums
of ggml's vectors (lane l of 32-element chunk c holds elements 32c+4l..32c+4l+3; lanes 0-3 take
the chunk's first 16-element scale, 4-7 its second) are exact integers, converted to float32 and
accumulated with one fma per lane (`fma32`) of d = fp16(d_w) * d_x; the row's value is ggml's
hsum_float_8 of the 8 lanes, times the type's constant (iq2: 0.125, iq3_xxs: 0.25, iq3_s: 1).
iq1_s adds 0.125 * (a scalar fma chain of d * the delta term from the activations' 16-element
sums); iq1_m keeps its delta term in a second 8-lane accumulator (0.125 * its hsum).

iq3_s, iq2_xxs, iq3_xxs and iq2_s run whole-row vector intrinsics instead (`_x86_iq.row_dot_iq3_s`,
`row_dot_iq2_xxs`, `row_dot_iq3_xxs`, `row_dot_iq2_s`, through `iquants.ROWS_INT8`). For the others the block's decoding is scalar Numba; its signs (`_x86_iq.apply_signs`) and the per-token
products (`_x86_iq.block_isums`: `pmaddubsw(|w|, sign(x, w))` + `pmaddwd` by the scales, ggml's
lanes) are vector intrinsics. Grids: `qllama.dequant.iq_grids.grid` (frozen into the compiled
code as constants).
"""

from __future__ import annotations

import numpy as np

from ..dequant.iq_grids import KSIGNS_IQ2XS, grid
from ._fp16 import f16_at
from ._x86_iq import apply_signs, block_isums, fma32
from .jit import Variants, kernel

IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M, TQ1_0, TQ2_0 = 16, 17, 18, 19, 21, 22, 29, 34, 35
GRID_INT8_TYPES = (IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0)
BLOCK_BYTES = {IQ2_XXS: 66, IQ2_XS: 74, IQ3_XXS: 98, IQ1_S: 50, IQ3_S: 110, IQ2_S: 82, IQ1_M: 56, TQ1_0: 54, TQ2_0: 66}
TOKEN_TILE = 64
_NOPY = dict(boundscheck=False)

_G2XXS = grid(IQ2_XXS)  # (256, 8) int8
_G2XS = grid(IQ2_XS)  # (512, 8)
_G2S = grid(IQ2_S)  # (1024, 8)
_G3XXS = grid(IQ3_XXS)  # (256, 4)
_G3S = grid(IQ3_S)  # (512, 4)
_G1S = grid(IQ1_S)  # (2048, 8), values -1, 0, 1
_KS = KSIGNS_IQ2XS  # (128,) uint8
# the grids as one uint64 (8 values) or uint32 (4 values) per entry, so an entry is copied at once
_G2XXS64 = np.ascontiguousarray(_G2XXS).view(np.uint64).reshape(-1)  # (256,)
_G2XS64 = np.ascontiguousarray(_G2XS).view(np.uint64).reshape(-1)  # (512,)
_G2S64 = np.ascontiguousarray(_G2S).view(np.uint64).reshape(-1)  # (1024,)
_G1S64 = np.ascontiguousarray(_G1S).view(np.uint64).reshape(-1)  # (2048,)
_G3XXS32 = np.ascontiguousarray(_G3XXS).view(np.uint32).reshape(-1)  # (256,)
_G3S32 = np.ascontiguousarray(_G3S).view(np.uint32).reshape(-1)  # (512,)


@kernel(**_NOPY)
def _u16(row, o):
    return np.int64(row[o]) | (np.int64(row[o + 1]) << 8)


@kernel(**_NOPY)
def _u32(row, o):
    return _u16(row, o) | (_u16(row, o + 2) << 16)


@kernel(**_NOPY)
def _tq1_digit(b, p):
    """Base-3 digit of byte b at power p (1, 3, 9, 27, 81) as ggml's AVX2 code extracts it: q = b * p
    mod 256, q' = q -sat 1, the top 2 bits of avg(q', avg(q', 0)) (3q/4 without a multiply)."""
    q = (b * p) & 255
    q1 = max(q - 1, 0)
    r = (q1 + ((q1 + 1) >> 1) + 1) >> 1
    return (r >> 6) & 3


@kernel(**_NOPY)
def _nibble_scales(byte, sc, c):
    """iq2_xs / iq2_s: the scale byte of chunk c -> sc[2c], sc[2c + 1] = 2 * nibble + 1."""
    s = np.int64(byte)
    sc[2 * c] = 2 * (s & 15) + 1
    sc[2 * c + 1] = 2 * (s >> 4) + 1


@kernel(**_NOPY)
def decode_block(type_id, row, o, tab, wb, w64, w32, sb, sc, dl):
    """The super-block at row[o:] -> wb int8 (256) grid values (w64 / w32: the same bytes as uint64 /
    uint32, a grid entry copied at once), sb uint8 (32) sign bits per 8 elements (bit j: element j
    negative; `apply_signs` applies them), sc int32 (16) scales per 16 elements, dl int32 (32) iq1
    delta signs per 8 elements (+1 / -1). Returns the block's fp16 d as float32."""
    if type_id == IQ2_XXS:
        for c in range(8):
            a0, a1 = _u32(row, o + 2 + 8 * c), _u32(row, o + 6 + 8 * c)
            sc[2 * c] = sc[2 * c + 1] = 2 * (a1 >> 28) + 1
            for k in range(4):
                w64[4 * c + k] = _G2XXS64[(a0 >> (8 * k)) & 255]
                sb[4 * c + k] = _KS[(a1 >> (7 * k)) & 127]
        return f16_at(row, o, tab)
    if type_id == IQ2_XS:
        for c in range(8):
            _nibble_scales(row[o + 66 + c], sc, c)
            for k in range(4):
                q = _u16(row, o + 2 + 8 * c + 2 * k)
                w64[4 * c + k] = _G2XS64[q & 511]
                sb[4 * c + k] = _KS[q >> 9]
        return f16_at(row, o, tab)
    if type_id == IQ2_S:
        for c in range(8):
            _nibble_scales(row[o + 74 + c], sc, c)
            qh = np.int64(row[o + 66 + c])
            for k in range(4):
                w64[4 * c + k] = _G2S64[np.int64(row[o + 2 + 4 * c + k]) | (((qh >> (2 * k)) & 3) << 8)]
                sb[4 * c + k] = row[o + 34 + 4 * c + k]
        return f16_at(row, o, tab)
    if type_id == IQ3_XXS:
        for c in range(8):
            a = _u32(row, o + 66 + 4 * c)
            sc[2 * c] = sc[2 * c + 1] = 2 * (a >> 28) + 1
            for k in range(4):
                sb[4 * c + k] = _KS[(a >> (7 * k)) & 127]
            for k in range(8):
                w32[8 * c + k] = _G3XXS32[row[o + 2 + 8 * c + k]]
        return f16_at(row, o, tab)
    if type_id == IQ3_S:
        for c in range(8):
            s = (np.int64(row[o + 106 + c // 2]) >> (4 * (c & 1))) & 15
            sc[2 * c] = sc[2 * c + 1] = 2 * s + 1
            qh = np.int64(row[o + 66 + c])
            for k in range(4):
                sb[4 * c + k] = row[o + 74 + 4 * c + k]
            for k in range(8):
                w32[8 * c + k] = _G3S32[np.int64(row[o + 2 + 8 * c + k]) | (((qh >> k) & 1) << 8)]
        return f16_at(row, o, tab)
    sb[:] = 0  # (iq1, tq: no sign bits)
    if type_id == TQ2_0:  # wb: the unsigned 2-bit values (ggml subtracts 1 through the activations' sums)
        sc[:] = 1
        for h in range(2):
            for s in range(4):
                for l in range(32):
                    wb[128 * h + 32 * s + l] = (np.int64(row[o + 32 * h + l]) >> (2 * s)) & 3
        return f16_at(row, o + 64, tab)
    if type_id == TQ1_0:  # wb: the unsigned base-3 digits
        sc[:] = 1
        p = 1
        for n in range(5):
            for l in range(32):
                wb[32 * n + l] = _tq1_digit(np.int64(row[o + l]), p)
            for l in range(16):
                wb[160 + 32 * (n // 2) + 16 * (n % 2) + l] = _tq1_digit(np.int64(row[o + 32 + l]), p)
            p *= 3
        for m in range(16):
            wb[240 + m] = _tq1_digit(np.int64(row[o + 48 + m % 4]), (1, 3, 9, 27)[m // 4])
        return f16_at(row, o + 52, tab)
    if type_id == IQ1_S:
        for c in range(8):
            qh = _u16(row, o + 34 + 2 * c)
            sc[2 * c] = sc[2 * c + 1] = 2 * ((qh >> 12) & 7) + 1
            for k in range(4):
                dl[4 * c + k] = -1 if qh & 0x8000 else 1
                w64[4 * c + k] = _G1S64[np.int64(row[o + 2 + 4 * c + k]) | (((qh >> (3 * k)) & 7) << 8)]
        return f16_at(row, o, tab)
    # IQ1_M: qs[32], qh[16], scales: 4 uint16 (3-bit scales; top nibbles: the fp16 d)
    s0, s1, s2, s3 = _u16(row, o + 48), _u16(row, o + 50), _u16(row, o + 52), _u16(row, o + 54)
    dbits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)
    for k in range(16):
        s = _u16(row, o + 48 + 2 * (k // 4))
        sc[k] = 2 * ((s >> (3 * (k % 4))) & 7) + 1
    for g in range(32):
        h = (np.int64(row[o + 32 + g // 2]) >> (4 * (g & 1))) & 15
        dl[g] = -1 if h & 8 else 1
        w64[g] = _G1S64[np.int64(row[o + g]) | ((h & 7) << 8)]
    return tab[dbits]


@kernel(**_NOPY)
def _hsum8(a):
    """ggml's hsum_float_8 of a float32 (8,)."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def _rows_of(type_id: int):
    """The int8 row kernel of one grid type (type_id a closure constant): out[t, r] for rows r0..r1-1."""
    bb = BLOCK_BYTES[type_id]
    c_final = {IQ2_XXS: 0.125, IQ2_XS: 0.125, IQ2_S: 0.125, IQ3_XXS: 0.25, IQ3_S: 1.0, IQ1_S: 1.0, IQ1_M: 1.0, TQ1_0: 1.0, TQ2_0: 1.0}[type_id]
    iq1s, iq1m = type_id == IQ1_S, type_id == IQ1_M
    tq = type_id == TQ1_0 or type_id == TQ2_0

    def rows(raw, xq, xd, xs, tab, out, r0, r1):
        n_tok, nb = xq.shape[0], raw.shape[1] // bb
        wb = np.empty(256, np.int8)  # one super-block's signed weights
        w64, w32 = wb.view(np.uint64), wb.view(np.uint32)  # (the same bytes)
        sb = np.empty(32, np.uint8)  # its sign bits per 8 elements
        sc = np.empty(16, np.int32)  # its scales per 16
        dl = np.empty(32, np.int32)  # iq1 delta signs per 8
        p8 = np.empty(8, np.int32)  # per token: the block's 8 lane sums (`block_isums`)
        x4 = np.empty(64, np.int32)  # iq1_m: sums of 4 activations
        acc = np.empty((TOKEN_TILE, 8), np.float32)  # (tokens, lanes)
        acc2 = np.empty((TOKEN_TILE, 8), np.float32)  # iq1_m: the delta lanes
        s1 = np.empty(TOKEN_TILE, np.float32)  # iq1_s: the scalar delta chain
        for t0 in range(0, n_tok, TOKEN_TILE):
            t1 = min(n_tok, t0 + TOKEN_TILE)
            for r in range(r0, r1):
                row = raw[r]
                acc[:] = 0
                acc2[:] = 0
                s1[:] = 0
                for b in range(nb):
                    dw = decode_block(type_id, row, b * bb, tab, wb, w64, w32, sb, sc, dl)
                    apply_signs(wb, sb)
                    for t in range(t0, t1):
                        x = xq[t, 256 * b:256 * b + 256]
                        d = dw * xd[t, b]  # (ggml: fp16(x.d) * y.d; iq1: y.d * fp16(x.d), the same product)
                        block_isums(wb, sc, xq[t], 256 * b, p8)  # lane l of chunk c: elements 32c+4l..+3
                        if iq1m:
                            for q in range(64):
                                e = 4 * q
                                x4[q] = np.int32(x[e]) + np.int32(x[e + 1]) + np.int32(x[e + 2]) + np.int32(x[e + 3])
                        for l in range(8):
                            isum = p8[l]
                            isum2 = np.int32(0)
                            if iq1m:
                                for c in range(8):  # scale of sub-block 2c + l // 4
                                    isum2 += sc[2 * c + l // 4] * dl[4 * c + l // 2] * x4[8 * c + l]
                            if tq:  # ggml: (q - 1) . x as q . x - the 16-element sums, lane l taking sums 2l, 2l+1
                                isum -= xs[t, 16 * b + l]  # (q8_K sum slot l: b_2l + b_2l+1, act_quant.Q8K_SUMS)
                            # (tq: ggml's mul + add, which its compiler contracts to this fma)
                            acc[t - t0, l] = fma32(d, np.float32(isum), acc[t - t0, l])
                            if iq1m:
                                acc2[t - t0, l] = fma32(d, np.float32(isum2), acc2[t - t0, l])
                        if iq1s:
                            s = 0
                            for c in range(8):
                                s += xs[t, 16 * b + c] * dl[4 * c] * sc[2 * c]
                            s1[t - t0] = fma32(d, np.float32(s), s1[t - t0])
                for t in range(t0, t1):
                    v = _hsum8(acc[t - t0])
                    if iq1s:
                        v = v + np.float32(0.125) * s1[t - t0]
                    elif iq1m:
                        v = v + np.float32(0.125) * _hsum8(acc2[t - t0])
                    else:
                        v = np.float32(c_final) * v
                    out[t, r] = v

    return rows


ROWS_INT8 = Variants(_rows_of, "ROWS_INT8", **_NOPY)


def matmul_int8(type_id, raw, xq, xd, xs, tab, out, n_threads):
    """The int8 mat-mul of a grid type's rows times q8_K activations: rows over the threads (iq3_s
    and iq2_xxs: `iquants.matmul_int8`, the whole-row intrinsics of `_x86_iq` and a gemm)."""
    from . import iquants
    from .int8 import _over_threads

    if int(type_id) in iquants.ROW_BYTES:
        iquants.matmul_int8(type_id, raw, xq, xd, xs, tab, out, n_threads)
    else:
        _over_threads(ROWS_INT8[int(type_id)], raw.shape[0], raw, xq, xd, xs, tab, out, n_threads)
