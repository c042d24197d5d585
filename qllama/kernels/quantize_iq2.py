"""Grid-search quantizers of iq3_xxs, iq2_xxs, iq2_xs and iq2_s: ggml's quantize_row_*_impl.

Each block of 16 or 32 values is split into signs (8 per byte; iq3_xxs / iq2_xxs / iq2_xs keep an
even number of minus signs by flipping the least important value) and magnitudes, which are fitted
as scale * (2 L + 1) with every group of 4 (iq3) or 8 (iq2) levels L a point of the type's grid:
a sweep of trial scales, each group rounded to its code and, off the grid, moved to the nearest of
the code's listed neighbours (`quantize.blocks.grid_tables`, ggml's iq2xs_init_impl /
iq3xs_init_impl), then a final requantization at the best scale. The sub-block scales become 4-bit
multiples of the super-block's fp16 d. Float32 step by step as the C code, so the bytes equal
ggml's (`quantize_k`'s typing rule).
"""

from __future__ import annotations

import numpy as np

from ..gguf.types import IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS
from .jit import kernel
from .quantize_k import (
    _code,
    _fit_grid,
    _importance,
    _make_qp_quants,
    _signs,
    _sum_squares,
    nearest_int,
)

_F32 = np.float32

# =============================================================================================
# Per sub-block: weights, signs, the trial scales and requantization (quantize_k._fit_grid, shared
# with iq3_s), the packing; then the super-block's d and the 4-bit sub-block scales.
# =============================================================================================

@kernel(inline="always")
def _sub_scales(scales, nsub, d):
    """Each sub-block scale (nsub,) in place as its 4-bit l, scale ~ d (2 l + 1): nearest_int(0.5 (scale / d - 1))."""
    inv = _F32(1) / d
    for b in range(nsub):
        scales[b] = max(0, min(15, nearest_int(_F32(0.5) * (inv * scales[b] - _F32(1)))))


@kernel(inline="always")
def _put(o, at, v, nbytes):
    """v as nbytes little-endian bytes at o[at:]."""
    for i in range(nbytes):
        o[at + i] = (v >> (8 * i)) & 255


@kernel
def _grid_block(type_id, xbl, qw, has_w, o, dd, ib, grid, kmap, neigh, f, n, flags):
    """One super-block xbl (256,) of type_id -> o (type_size,) but d, left as float32 in dd[ib]."""
    o[:] = 0
    dd[ib, 0] = _F32(0)
    iq3 = type_id == IQ3_XXS
    bs = 16 if type_id == IQ2_XS or type_id == IQ2_S else 32  # values per sub-block (one scale)
    nsub = 256 // bs
    m = grid.shape[1]
    bits, kmax = (3, 7) if iq3 else (2, 2)
    weight, waux, xval, scales = f[0, :bs], f[1, :bs], f[2, :bs], f[3, :nsub]
    L, Laux, signs, words = n[0, :bs], n[1, :bs], n[2, :bs // 8], n[3, :nsub]
    on_grid, on_aux = flags[0, :bs // m], flags[1, :bs // m]
    sumx2 = _sum_squares(xbl, 256)
    sigma2 = sumx2 / _F32(256) if type_id == IQ2_XXS or type_id == IQ2_XS else _F32(2) * sumx2 / _F32(256)
    eps = _F32(1e-15) if type_id == IQ2_XXS or type_id == IQ2_XS else _F32(1e-8)
    max_scale = _F32(0)
    for b in range(nsub):
        off = bs * b
        words[b] = 0
        scales[b] = _F32(0)
        L[:] = 0  # (kept when no trial scale fits: a block too small to square)
        if has_w:
            _importance(xbl, off, bs, qw, sigma2, weight)
        elif type_id == IQ2_S:
            for i in range(bs):
                weight[i] = _F32(0.25) * sigma2 + xbl[off + i] * xbl[off + i]
        else:
            for i in range(bs):
                weight[i] = xbl[off + i] * xbl[off + i]
        for i in range(bs):
            waux[i] = np.sqrt(weight[i])
        for k in range(bs // 8):
            signs[k] = _signs(xbl, off, weight, xval, k, type_id != IQ2_S)
        mx = xval[0]
        for i in range(1, bs):
            mx = xval[i] if xval[i] > mx else mx
        if mx < eps:
            continue
        if type_id == IQ2_XXS:  # a first fit of the magnitudes on 0..3, then trials around it
            scale = _make_qp_quants(bs, 4, xval, L, weight)
            eff_max = scale * _F32(3)
            if eff_max <= _F32(0):
                continue
            scale = _fit_grid(weight, waux, xval, grid, kmap, neigh, bits, kmax, eff_max, 5, _F32(0.1), 6, scale, -1,
                              True, L, Laux, on_grid, on_aux)
        elif iq3:
            scale = _fit_grid(weight, waux, xval, grid, kmap, neigh, bits, kmax, mx, 15, _F32(0.2), 15, mx / _F32(15),
                              1, False, L, Laux, on_grid, on_aux)
        else:
            scale = _fit_grid(weight, waux, xval, grid, kmap, neigh, bits, kmax, mx, 5, _F32(0.1), 9, mx / _F32(5),
                              1, False, L, Laux, on_grid, on_aux)
        if scale < _F32(0):  # (ggml: should never happen) a positive scale, the signs flipped
            scale = -scale
            for k in range(bs // 8):
                signs[k] = ~signs[k] & (0xFF if type_id == IQ2_S else 127)
        for k in range(bs // m):
            gi = kmap[_code(L, m * k, m, bits)]
            if type_id == IQ2_XXS or iq3:
                o[2 + 8 * b + k] = gi  # one byte per group (iq2_xxs: then a 4-byte word of signs and scale)
            elif type_id == IQ2_XS:
                _put(o, 2 + 4 * b + 2 * k, gi | (signs[k] << 9), 2)  # a uint16 per group
            else:  # iq2_s: low bytes, then signs, then the 2 high bits of each group's index
                i8 = 2 * b + k
                o[2 + i8] = gi & 255
                o[34 + i8] = signs[k]
                o[66 + i8 // 4] |= (gi >> 8) << (2 * (i8 % 4))
        if type_id == IQ2_XXS or iq3:
            words[b] = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
        scales[b] = scale
        max_scale = scale if scale > max_scale else max_scale
    if max_scale == _F32(0):
        o[:] = 0
        return
    d = max_scale / _F32(31)
    dd[ib, 0] = d * _F32(1.0125) if iq3 else d * _F32(0.9875) if type_id == IQ2_S else d
    _sub_scales(scales, nsub, d)
    for b in range(nsub):
        l = np.int64(scales[b])
        if type_id == IQ2_XXS:
            _put(o, 6 + 8 * b, words[b] | (l << 28), 4)
        elif iq3:
            _put(o, 66 + 4 * b, words[b] | (l << 28), 4)
        else:  # iq2_xs / iq2_s: 4 bits per sub-block after qs (and qh)
            o[(66 if type_id == IQ2_XS else 74) + b // 2] |= l << (4 * (b % 2))


@kernel(nogil=True)
def quantize_grid(type_id, has_w, grid, kmap, neigh, x, qw, out, dd):
    """iq3_xxs / iq2_xxs / iq2_xs / iq2_s super-blocks: x (nb, 256) float32 -> out (nb, type_size)
    uint8 but the fp16 d, dd (nb, 1); grid (n, 4 or 8) the points as odd values 2 l + 1, kmap and
    neigh the code map and neighbour lists (`quantize.blocks.grid_tables`); qw (nb, 256) the
    importance weights, read when has_w (iq2_xxs / iq2_xs need them)."""
    f = np.empty((4, 32), np.float32)  # scratch: weight, waux, xval, sub-block scales
    n = np.empty((4, 32), np.int64)  # L, Laux, signs, sign words
    flags = np.empty((2, 8), np.bool_)  # on_grid, on_aux
    for ib in range(x.shape[0]):
        _grid_block(type_id, x[ib], qw[ib], has_w, out[ib], dd, ib, grid, kmap, neigh, f, n, flags)
