"""Quantizers of the ternary and 1-bit types: tq1_0, tq2_0, iq1_s, iq1_m (ggml's ggml-quants.c).

- tq1_0 / tq2_0: quantize_row_tq1_0_ref / tq2_0_ref: d = max |x|, each x to round(x / d) in
  {-1, 0, 1}, packed 5 per byte in base 3 (tq1_0) or 4 per byte in 2 bits (tq2_0);
- iq1_s (blocks of 32) / iq1_m (blocks of 16): quantize_row_iq1_s_impl / iq1_m_impl: the values
  of a block sorted, every split of them into three groups (-1, 0, 1, shifted by +-1/8: one
  shift per block for iq1_s, one per half block for iq1_m) tried through prefix sums, the best
  fit's groups of 8 put on the 2048-point grid or its nearest listed neighbour
  (`qllama.quantize.blocks.grid_tables`).

Float32 step by step as the C code (the typing rule of `quantize_k`), so the bytes equal ggml's.
Kernels run over super-blocks x (nb, 256) -> out (nb, type_size), nogil, on slices of blocks in
threads (`blocks._run_blocks`); the fp16 d goes into dd (nb, 1) for NumPy to pack, but iq1_m's d
is spread over its scales, so its kernel writes it itself.
"""

from __future__ import annotations

import numpy as np

from ._fp16 import f16_bits
from .jit import kernel
from .quantize_k import _importance, _sum_squares, nearest_int

_F32 = np.float32
_FLT_MAX = np.float32(3.4028234663852886e38)
_DELTA = np.float32(0.125)  # IQ1S_DELTA == IQ1M_DELTA
# the values of levels 0, 1, 2 shifted by +delta (x_p) and -delta (x_m), (2, 3)
_SHIFTED = np.array([[-1 + _DELTA, _DELTA, 1 + _DELTA], [-1 - _DELTA, -_DELTA, 1 - _DELTA]], np.float32)


@kernel(inline="always")
def _tq_trit(v, inv):
    """lroundf(v * inv) + 1: the trit 0, 1, 2 of -1, 0, 1 (C's lroundf: halves away from zero)."""
    p = v * inv
    t = np.float32(np.trunc(p))
    if abs(p - t) >= _F32(0.5):
        t += _F32(1) if p > _F32(0) else _F32(-1)
    return np.int64(t) + 1


@kernel(inline="always")
def _tq_scale(xb, dd, ib):
    """d = max |x| of a super-block into dd[ib, 0]; returns 1/d (0 for an all-zero block)."""
    amax = _F32(0)
    for j in range(256):
        a = abs(xb[j])
        amax = a if a > amax else amax
    dd[ib, 0] = amax
    return _F32(1) / amax if amax != _F32(0) else _F32(0)


@kernel(inline="always")
def _base3_byte(xb, at, stride, n, inv, tail):
    """n trits xb[at], xb[at + stride]... as base-3 digits (first most significant), times 3^tail, to a
    byte by ceiling division: q * 256 / 243 rounded up."""
    q = 0
    for k in range(n):
        q = q * 3 + _tq_trit(xb[at + k * stride], inv)
    for _ in range(tail):
        q *= 3
    return (q * 256 + 242) // 243


@kernel(nogil=True)
def quantize_tq1_0(x, out, dd):
    """tq1_0: x (nb, 256) -> out (nb, 54): qs (48: 32 bytes of 5 trits 32 apart, then 16 of 5 trits 16
    apart), qh (4: 4 trits 4 apart, times 3), d (left in dd (nb, 1))."""
    for ib in range(x.shape[0]):
        xb = x[ib]
        o = out[ib]
        inv = _tq_scale(xb, dd, ib)
        for m in range(32):
            o[m] = _base3_byte(xb, m, 32, 5, inv, 0)
        for m in range(16):
            o[32 + m] = _base3_byte(xb, 160 + m, 16, 5, inv, 0)
        for j in range(4):
            o[48 + j] = _base3_byte(xb, 240 + j, 4, 4, inv, 1)


@kernel(nogil=True)
def quantize_tq2_0(x, out, dd):
    """tq2_0: x (nb, 256) -> out (nb, 66): qs (64: 4 trits 32 apart per byte, 2 bits each, first in
    the low bits), d (left in dd (nb, 1))."""
    for ib in range(x.shape[0]):
        xb = x[ib]
        o = out[ib]
        inv = _tq_scale(xb, dd, ib)
        for j in range(2):
            for m in range(32):
                q = 0
                for n in range(4):
                    q |= (_tq_trit(xb[128 * j + m + 32 * n], inv) & 3) << (2 * n)
                o[32 * j + m] = q


# ---------------------------------------------------------------------------------------------
# iq1_s / iq1_m
# ---------------------------------------------------------------------------------------------

@kernel(inline="always")
def _sort_indices(xb, off, n, idx):
    """idx[:n] = the indices 0..n-1 of xb[off:off+n] by value, equal values in index order (glibc's
    qsort of ggml's (value, index) pairs is a merge sort: stable)."""
    for j in range(n):
        v = xb[off + j]
        k = j
        while k > 0 and xb[off + idx[k - 1]] > v:
            idx[k] = idx[k - 1]
            k -= 1
        idx[k] = j


@kernel(inline="always")
def _block_weights(xbl, off, n, qw, has_w, sigma2, weight):
    """ggml's weights of a block: qw * sqrt(sigma2 + x^2) with a matrix, else x^2."""
    if has_w:
        _importance(xbl, off, n, qw, sigma2, weight)
    else:
        for i in range(n):
            weight[i] = xbl[off + i] * xbl[off + i]


@kernel(inline="always")
def _abs_max(xbl, off, n):
    mx = abs(xbl[off])
    for i in range(1, n):
        a = abs(xbl[off + i])
        mx = mx if mx > a else a  # C's MAX(a, b): a > b ? a : b
    return mx


@kernel(inline="always")
def _code(L, at):
    """The 16-bit code of 8 levels L[at:at+8] (2 bits each, first lowest)."""
    u = 0
    for j in range(8):
        u |= L[at + j] << (2 * j)
    return u


@kernel(inline="always")
def _best_neighbour(neigh, at, levels, xbl, off, weight, woff, scale, xx, L, loff):
    """ggml's iq1_find_best_neighbour2: of the grid points listed at neigh[at] (count, indices), the one
    whose values xx[level] times scale are nearest xbl[off:off+8] (weights weight[woff:]); its levels
    to L[loff:loff+8]. Returns its index."""
    best = _FLT_MAX
    gi = -1
    for j in range(1, neigh[at] + 1):
        g = neigh[at + j]
        d2 = _F32(0)
        for i in range(8):
            diff = scale * xx[levels[g, i]] - xbl[off + i]
            d2 += weight[woff + i] * diff * diff
        if d2 < best:
            best = d2
            gi = g
    for i in range(8):
        L[loff + i] = levels[gi, i]
    return gi


@kernel(inline="always")
def _assign_groups(idx, n, i1, i2, L):
    """Levels of a split of the sorted values: the first i1 -> 0, up to i2 -> 1, the rest -> 2."""
    for j in range(n):
        L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)


@kernel(inline="always")
def _plus(m_type, shift, k):
    """Whether group k of 8 of a block uses the + shift (x_p): iq1_s (m_type False) has one per
    block (shift 1 or -1); iq1_m one per half block, as its code 0 (+, +), 1 (+, -), 2 (-, +), 3 (-, -)."""
    if not m_type:
        return shift == 1
    return shift < 2 if k == 0 else shift % 2 == 0


@kernel(inline="always")
def _grid_fit(levels, index, n_groups, xbl, off, weight, m_type, shift, x_p, x_m, mul, sumqx, sumq2):
    """sumqx + sum w q x, sumq2 + sum w q^2 (in order) over a block's groups of 8 on their grid points
    index[k], q = xx[level] * mul with xx = x_p or x_m as `_plus` says."""
    for k in range(n_groups):
        xx = x_p if _plus(m_type, shift, k) else x_m
        for j in range(8):
            w = weight[8 * k + j]
            q = xx[levels[index[k], j]] * mul
            sumqx += w * q * xbl[off + 8 * k + j]
            sumq2 += w * q * q
    return sumqx, sumq2


@kernel(inline="always")
def _keep_better(sumqx, sumq2, cur, i1, i2, shift):
    """cur = (best, scale, i1, i2, shift), or this split's when its fit is better (ggml's test: the
    first of equal fits stays)."""
    if sumq2 > _F32(0) and sumqx * sumqx > cur[0] * sumq2:
        scale = sumqx / sumq2
        return scale * sumqx, scale, i1, i2, shift
    return cur


@kernel(inline="always")
def _odd_level(v):
    """A block scale's 3-bit level l (its value is 2 l + 1 units of d): nearest (v - 1) / 2, clamped."""
    return max(0, min(7, nearest_int(_F32(0.5) * (v - _F32(1)))))


@kernel(inline="always")
def _keep_block(scales, shifts, b, scale, shift, max_scale):
    """Block b's scale and shift kept; returns the larger of max_scale and scale (C's MAX)."""
    scales[b] = scale
    shifts[b] = shift
    return max_scale if max_scale > scale else scale


@kernel(inline="always")
def _on_grid(m_type, idx, n, i1, i2, scale, shift, levels, kmap, neigh, xbl, off, weight, x_p, x_m, L, index):
    """The best split (i1, i2 of the sorted values idx, at scale, with its shift) as grid points: levels
    to L (flipped, with the shift, for a negative scale), each group of 8 to its grid index in index
    or, off the grid, its best listed neighbour, then the scale refit on those points. Returns
    (scale, shift)."""
    _assign_groups(idx, n, i1, i2, L)
    if scale < _F32(0):
        for j in range(n):
            L[j] = 2 - L[j]
        scale = -scale
        shift = 3 - shift if m_type else -shift
    on_grid = True
    for k in range(n // 8):
        xx = x_p if _plus(m_type, shift, k) else x_m
        gi = kmap[_code(L, 8 * k)]
        if gi < 0:
            on_grid = False
            gi = _best_neighbour(neigh, -gi - 1, levels, xbl, off + 8 * k, weight, 8 * k, scale, xx, L, 8 * k)
        index[k] = gi
    if not on_grid:
        sumqx, sumq2 = _grid_fit(levels, index, n // 8, xbl, off, weight, m_type, shift, x_p, x_m, _F32(1), _F32(0),
                                 _F32(0))
        if sumqx > _F32(0) and sumq2 > _F32(0):
            scale = sumqx / sumq2
    return scale, shift


@kernel
def _iq1s_block(xbl, qw, o, dd, ib, levels, kmap, neigh, x_p, x_m, weight, sumx, sumw, idx, L, index, scales,
                shifts):
    """quantize_row_iq1_s_impl on one super-block xbl (256,) -> o (50,): d (left in dd[ib]), qs (32),
    qh (8 uint16: 3 high index bits per group, the block's 3-bit scale and its shift sign)."""
    for k in range(50):
        o[k] = 0
    dd[ib, 0] = _F32(0)
    max_scale = _F32(0)
    sigma2 = _F32(2) * _sum_squares(xbl, 256) / _F32(256)
    for b in range(8):
        off = 32 * b
        _importance(xbl, off, 32, qw, sigma2, weight)
        scales[b] = _F32(0)
        shifts[b] = 1
        if _abs_max(xbl, off, 32) < _F32(1e-12):  # GROUP_MAX_EPS_IQ1_S
            continue
        _sort_indices(xbl, off, 32, idx)
        sumx[0] = _F32(0)
        sumw[0] = _F32(0)
        for j in range(32):
            i = idx[j]
            sumx[j + 1] = sumx[j] + weight[i] * xbl[off + i]
            sumw[j + 1] = sumw[j] + weight[i]
        best = -_FLT_MAX
        scale = _F32(0)
        besti1 = -1
        besti2 = -1
        best_shift = 0
        for i1 in range(33):
            for i2 in range(i1, 33):
                for sh in (1, -1):
                    xx = x_p if sh == 1 else x_m
                    sumqx = (sumx[i1] - sumx[0]) * xx[0] + (sumx[i2] - sumx[i1]) * xx[1] + (sumx[32] - sumx[i2]) * xx[2]
                    sumq2 = ((sumw[i1] - sumw[0]) * xx[0] * xx[0] + (sumw[i2] - sumw[i1]) * xx[1] * xx[1]
                             + (sumw[32] - sumw[i2]) * xx[2] * xx[2])
                    best, scale, besti1, besti2, best_shift = _keep_better(
                        sumqx, sumq2, (best, scale, besti1, besti2, best_shift), i1, i2, sh)
        if besti1 < 0:
            continue
        scale, best_shift = _on_grid(False, idx, 32, besti1, besti2, scale, best_shift, levels, kmap, neigh, xbl, off,
                                     weight, x_p, x_m, L, index)
        h = 0
        for k in range(4):
            o[2 + 4 * b + k] = index[k] & 255
            h |= (index[k] >> 8) << (3 * k)
        o[34 + 2 * b] = h & 255
        o[35 + 2 * b] = h >> 8
        max_scale = _keep_block(scales, shifts, b, scale, best_shift, max_scale)
    if max_scale == _F32(0):
        return
    d = max_scale / _F32(15)
    dd[ib, 0] = d * _F32(1.125)
    inv = _F32(1) / d
    for b in range(8):
        l = _odd_level(inv * scales[b])
        if shifts[b] == -1:
            l |= 8
        o[35 + 2 * b] |= l << 4


@kernel(nogil=True)
def quantize_iq1_s(levels, kmap, neigh, x, qw, out, dd):
    """iq1_s super-blocks: x (nb, 256) float32, qw (nb, 256) the importance weights (ggml requires
    them) -> out (nb, 50) uint8 but the fp16 d, dd (nb, 1); levels (2048, 8) the grid's levels
    0..2, kmap (65536,) / neigh: `grid_tables`."""
    f = np.empty((3, 33), np.float32)  # weight (32), sumx, sumw
    n = np.empty((3, 32), np.int64)  # idx, L, index (4)
    s = np.empty(8, np.float32)  # block scales
    shifts = np.empty(8, np.int64)
    x_p, x_m = _SHIFTED[0], _SHIFTED[1]
    for ib in range(x.shape[0]):
        _iq1s_block(x[ib], qw[ib], out[ib], dd, ib, levels, kmap, neigh, x_p, x_m, f[0], f[1], f[2], n[0], n[1],
                    n[2, :4], s, shifts)


@kernel
def _iq1m_block(xbl, qw, has_w, o, levels, kmap, neigh, x_p, x_m, weight, px, pw, idx, L, index, scales, shifts):
    """quantize_row_iq1_m_impl on one super-block xbl (256,) -> o (56,): qs (32), qh (16: per block of
    16, 3 high index bits and the shift bit of each half), scales (8: 3-bit block scales, the fp16 d
    in the top 4 bits of each uint16)."""
    for k in range(56):
        o[k] = 0
    max_scale = _F32(0)
    sigma2 = _F32(2) * _sum_squares(xbl, 256) / _F32(256)
    p2 = x_p[2]
    m2 = x_m[2]
    cp1 = x_p[0] * x_p[0] - x_p[1] * x_p[1]
    cp2 = x_p[1] * x_p[1] - x_p[2] * x_p[2]
    cm1 = x_m[0] * x_m[0] - x_m[1] * x_m[1]
    cm2 = x_m[1] * x_m[1] - x_m[2] * x_m[2]
    for b in range(16):
        off = 16 * b
        _block_weights(xbl, off, 16, qw, has_w, sigma2, weight)
        scales[b] = _F32(0)
        shifts[b] = 0
        if _abs_max(xbl, off, 16) < _F32(1e-7):  # GROUP_MAX_EPS_IQ1_M
            continue
        _sort_indices(xbl, off, 16, idx)
        # prefix sums of w x and w over the sorted values, per half block (each half has its own shift)
        for h in range(2):
            px[h, 0] = _F32(0)
            pw[h, 0] = _F32(0)
        for j in range(16):
            i = idx[j]
            h = 0 if i < 8 else 1
            px[h, j + 1] = px[h, j] + weight[i] * xbl[off + i]
            px[1 - h, j + 1] = px[1 - h, j]
            pw[h, j + 1] = pw[h, j] + weight[i]
            pw[1 - h, j + 1] = pw[1 - h, j]
        best = -_FLT_MAX
        scale = _F32(0)
        besti1 = -1
        besti2 = -1
        best_k = -1
        for i1 in range(17):
            for i2 in range(i1, 17):
                # a split's sum over the three groups is T v2 - S(i1) - S(i2) (levels 1 apart)
                sx = px[0, i1] + px[0, i2]
                qxp0 = px[0, 16] * p2 - sx
                qxm0 = px[0, 16] * m2 - sx
                q2p0 = pw[0, 16] * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
                q2m0 = pw[0, 16] * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
                sx = px[1, i1] + px[1, i2]
                qxp1 = px[1, 16] * p2 - sx
                qxm1 = px[1, 16] * m2 - sx
                q2p1 = pw[1, 16] * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
                q2m1 = pw[1, 16] * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
                for k in range(4):
                    sumqx = (qxp0 if k < 2 else qxm0) + (qxp1 if k % 2 == 0 else qxm1)
                    sumq2 = (q2p0 if k < 2 else q2m0) + (q2p1 if k % 2 == 0 else q2m1)
                    best, scale, besti1, besti2, best_k = _keep_better(
                        sumqx, sumq2, (best, scale, besti1, besti2, best_k), i1, i2, k)
        if besti1 < 0:
            continue
        scale, best_k = _on_grid(True, idx, 16, besti1, besti2, scale, best_k, levels, kmap, neigh, xbl, off, weight,
                                 x_p, x_m, L, index)
        o[2 * b] = index[0] & 255
        o[2 * b + 1] = index[1] & 255
        o[32 + b] = (index[0] >> 8) | ((index[1] >> 8) << 4)
        max_scale = _keep_block(scales, shifts, b, scale, best_k, max_scale)
    if max_scale == _F32(0):
        return
    d = max_scale / _F32(15)
    inv = _F32(1) / d
    sumqx = _F32(0)
    sumq2 = _F32(0)
    sc = 0  # the 4 uint16 of scales, 3 bits per block: as one 64-bit word
    for b in range(16):
        l = _odd_level(inv * scales[b])
        sc |= l << (16 * (b // 4) + 3 * (b % 4))
        o[32 + b] |= (0x80 if shifts[b] == 1 or shifts[b] == 3 else 0) | (0x08 if shifts[b] >= 2 else 0)
        off = 16 * b
        _block_weights(xbl, off, 16, qw, has_w, sigma2, weight)
        for k in range(2):
            index[k] = o[2 * b + k] + ((o[32 + b] << (8 - 4 * k)) & 0x700)
        sumqx, sumq2 = _grid_fit(levels, index, 2, xbl, off, weight, True, shifts[b], x_p, x_m, _F32(2 * l + 1),
                                 sumqx, sumq2)  # one running sum over the super-block, as ggml
    if sumq2 > _F32(0):
        d = sumqx / sumq2
    s = np.int64(f16_bits(d * _F32(1.1125)))
    sc |= ((s & 0xF) << 12) | ((s & 0xF0) << 24) | ((s & 0xF00) << 36) | ((s & 0xF000) << 48)
    for k in range(8):
        o[48 + k] = (sc >> (8 * k)) & 255


@kernel(nogil=True)
def quantize_iq1_m(has_w, levels, kmap, neigh, x, qw, out, dd):
    """iq1_m super-blocks: x (nb, 256) float32, qw (nb, 256) importance weights read when has_w ->
    out (nb, 56) uint8 (d included: dd (nb, 0) is unused); levels, kmap, neigh as quantize_iq1_s."""
    weight = np.empty(16, np.float32)
    px = np.empty((2, 17), np.float32)
    pw = np.empty((2, 17), np.float32)
    n = np.empty((3, 16), np.int64)  # idx, L, index (2)
    s = np.empty(16, np.float32)  # block scales
    shifts = np.empty(16, np.int64)
    x_p, x_m = _SHIFTED[0], _SHIFTED[1]
    for ib in range(x.shape[0]):
        _iq1m_block(x[ib], qw[ib], has_w, out[ib], levels, kmap, neigh, x_p, x_m, weight, px, pw, n[0], n[1],
                    n[2, :2], s, shifts)
