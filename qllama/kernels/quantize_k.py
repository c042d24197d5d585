"""k-quant block quantizers (q4_K, q5_K, q6_K): ggml's reference algorithms, float32 step by step.

q4_K and q5_K use `make_qkx2_quants` (a weighted least-squares search over 21 / 16 trial scales
per 32 values, with a min); q6_K uses `make_qx_quants` (19 trial scales per 16 values,
symmetric), both from ggml-quants.c without an importance matrix. They are sequential per
sub-block, so they are kernels that follow the C code's float32 arithmetic operation by operation
(same rounding, same order of accumulation): the bytes equal llama.cpp's.

Typing rule: every float is float32 and every int that meets a float is cast with _F32() first
(numba would otherwise promote float32*int64 to float64 and the rounding, hence the bytes, would
differ from C).
"""

from __future__ import annotations

import math

import numpy as np

from ..gguf.types import Q5_K
from .jit import kernel

_F32 = np.float32
_GROUP_MAX_EPS = np.float32(1e-15)  # ggml's GROUP_MAX_EPS: a group below this is "all zero"


@kernel(inline="always")
def nearest_int(fval):
    # ggml's nearest_int: adding 1.5*2^23 leaves the float32 rounded to an integer (half to even)
    val = fval + np.float32(12582912.0)
    return np.int64(val) - 12582912


@kernel
def fp16_round(f):
    """The float32 value of GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f)): round to nearest even."""
    a = abs(np.float64(f))
    if not (a > 0.0) or a == np.inf:
        return f  # 0, nan, inf
    _, e = math.frexp(a)  # a = m * 2**e with 0.5 <= m < 1
    q = max(e - 1, -14) - 10  # exponent of one fp16 ulp at this magnitude (subnormals: 2**-24)
    r = math.ldexp(a, -q)  # exact: now the ulp is 1
    r = (r + 4503599627370496.0) - 4503599627370496.0  # rint, half to even (2**52 trick)
    r = math.ldexp(r, q)
    if r > 65504.0:
        r = np.inf
    return np.float32(math.copysign(r, np.float64(f)))


@kernel
def _make_qkx2_quants(x, off, n, nmax, weights, L, Laux, rmin, rdelta, nstep):
    """ggml's make_qkx2_quants on x[off:off+n] (use_mad = false). Writes L[off:off+n].

    Fits x ~ scale * L - the_min with L in 0..nmax by trying nstep+1 trial scales and keeping
    the one of least weighted squared error. Returns (scale, the_min).
    """
    fnmax = _F32(nmax)
    mn = x[off]
    mx = x[off]
    sum_w = weights[0]
    sum_x = sum_w * x[off]
    for i in range(1, n):
        v = x[off + i]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
        w = weights[i]
        sum_w += w
        sum_x += w * v
    if mn > _F32(0):
        mn = _F32(0)
    if mx == mn:
        for i in range(n):
            L[off + i] = 0
        return _F32(0), -mn
    iscale = fnmax / (mx - mn)
    scale = _F32(1) / iscale
    best_error = _F32(0)
    for i in range(n):
        v = x[off + i]
        l = nearest_int(iscale * (v - mn))
        l = max(0, min(nmax, l))
        L[off + i] = l
        diff = scale * _F32(l) + mn - v
        best_error += weights[i] * (diff * diff)
    if nstep < 1:
        return scale, -mn
    for step in range(nstep + 1):
        # (mn may have moved to a better fit found at an earlier step: the C code does the same)
        iscale = (rmin + rdelta * _F32(step) + fnmax) / (mx - mn)
        sum_l = _F32(0)
        sum_l2 = _F32(0)
        sum_xl = _F32(0)
        for i in range(n):
            v = x[off + i]
            l = nearest_int(iscale * (v - mn))
            l = max(0, min(nmax, l))
            Laux[i] = l
            w = weights[i]
            fl = _F32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * v
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > _F32(0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > _F32(0):
                this_min = _F32(0)
                this_scale = sum_xl / sum_l2
            cur_error = _F32(0)
            for i in range(n):
                diff = this_scale * _F32(Laux[i]) + this_min - x[off + i]
                cur_error += weights[i] * (diff * diff)
            if cur_error < best_error:
                for i in range(n):
                    L[off + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@kernel(inline="always")
def _qx_sums(x, off, n, nmax, iscale):
    """(sum w*x*l, sum w*l*l) with w = x^2 and l = nearest_int(iscale*x) clamped to [-nmax, nmax-1]."""
    sumlx = _F32(0)
    suml2 = _F32(0)
    for i in range(n):
        v = x[off + i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
        w = v * v
        fl = _F32(l)
        sumlx += w * v * fl
        suml2 += w * fl * fl
    return sumlx, suml2


@kernel(inline="always")
def _qx_store(x, off, n, nmax, iscale, L):
    """L[off:off+n] = nmax + l, the l of `_qx_sums`."""
    for i in range(n):
        L[off + i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[off + i])))


@kernel
def _make_qx_quants_rmse1(x, off, n, nmax, L):
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) on x[off:off+n].

    Symmetric fit x ~ scale * (L - nmax), L in 0..2*nmax-1, weights x^2, 19 trial scales.
    """
    fnmax = _F32(nmax)
    mx = _F32(0)
    amax = _F32(0)
    for i in range(n):
        ax = abs(x[off + i])
        if ax > amax:
            amax = ax
            mx = x[off + i]
    if amax < _GROUP_MAX_EPS:
        for i in range(n):
            L[off + i] = 0
        return _F32(0)
    iscale = -fnmax / mx
    _qx_store(x, off, n, nmax, iscale, L)
    sumlx, suml2 = _qx_sums(x, off, n, nmax, iscale)
    scale = sumlx / suml2 if suml2 != _F32(0) else _F32(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + _F32(0.1) * _F32(step)) / mx
        sumlx, suml2 = _qx_sums(x, off, n, nmax, iscale)
        if suml2 > _F32(0) and sumlx * sumlx > best * suml2:
            _qx_store(x, off, n, nmax, iscale, L)
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@kernel
def _kx_block_scales(xb, nmax, rmin, rdelta, nstep, L, Laux, weights, ls, lm, dd, ib):
    """The shared first half of q4_K / q5_K for one super-block xb (256,).

    Fits each 32-value sub-block with make_qkx2_quants, quantizes the 8 scales and 8 mins to
    6 bits (ls, lm), stores the fp16-rounded super-block d / dmin in dd[ib], and requantizes L
    against the rounded scales (as ggml does). L keeps the fit's values where a scale rounds to 0.
    """
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    max_scale = _F32(0)
    max_min = _F32(0)
    for j in range(8):
        sum_x2 = _F32(0)
        for l in range(32):
            v = xb[32 * j + l]
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / _F32(32))
        for l in range(32):
            weights[l] = av_x + abs(xb[32 * j + l])
        sc, mi = _make_qkx2_quants(xb, 32 * j, 32, nmax, weights, L, Laux, rmin, rdelta, nstep)
        scales[j] = sc
        mins[j] = mi
        if sc > max_scale:
            max_scale = sc
        if mi > max_min:
            max_min = mi
    inv_scale = _F32(63) / max_scale if max_scale > _F32(0) else _F32(0)
    inv_min = _F32(63) / max_min if max_min > _F32(0) else _F32(0)
    for j in range(8):
        # C stores nearest_int() into a uint8_t before MIN(63, .): keep the wrap-around
        ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
    d = fp16_round(max_scale / _F32(63))
    dmin = fp16_round(max_min / _F32(63))
    dd[ib, 0] = d
    dd[ib, 1] = dmin
    for j in range(8):
        dj = d * _F32(ls[j])
        if dj == _F32(0):
            continue
        dm = dmin * _F32(lm[j])
        for ii in range(32):
            l = nearest_int((xb[32 * j + ii] + dm) / dj)
            L[32 * j + ii] = max(0, min(nmax, l))


@kernel(inline="always")
def _pack_k4_scales(ls, lm, sc):
    """8 six-bit scales and mins -> the 12-byte k4 scale field (see get_scale_min_k4)."""
    for j in range(12):
        sc[j] = 0
    for j in range(8):
        if j < 4:
            sc[j] = ls[j]
            sc[j + 4] = lm[j]
        else:
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            sc[j - 4] |= (ls[j] >> 4) << 6
            sc[j] |= (lm[j] >> 4) << 6


@kernel
def _q4_K_block(xb, o, dd, ib, L, Laux, weights, ls, lm):
    """One q4_K super-block: xb (256,) float32 -> o (144,) uint8 (d, dmin left in dd[ib])."""
    _kx_block_scales(xb, 15, _F32(-1.0), _F32(0.1), 20, L, Laux, weights, ls, lm, dd, ib)
    _pack_k4_scales(ls, lm, o[4:16])
    # qs (128) at 16: byte 32g + l = L[64g + l] | L[64g + 32 + l] << 4
    for g in range(4):
        for l in range(32):
            o[16 + 32 * g + l] = L[64 * g + l] | (L[64 * g + 32 + l] << 4)


@kernel
def _q5_K_block(xb, o, dd, ib, L, Laux, weights, ls, lm):
    """One q5_K super-block: xb (256,) float32 -> o (176,) uint8 (d, dmin left in dd[ib])."""
    _kx_block_scales(xb, 31, _F32(-0.5), _F32(0.1), 15, L, Laux, weights, ls, lm, dd, ib)
    _pack_k4_scales(ls, lm, o[4:16])
    # qh (32) at 16, qs (128) at 48: value 64g + 32h + l -> low nibble in qs[32g + l]
    # (h selects the nibble), bit 4 in qh[l] bit 2g + h
    for l in range(32):
        o[16 + l] = 0
    for g in range(4):
        for l in range(32):
            l1 = L[64 * g + l]
            l2 = L[64 * g + 32 + l]
            o[16 + l] |= ((l1 >> 4) << (2 * g)) | ((l2 >> 4) << (2 * g + 1))
            o[48 + 32 * g + l] = (l1 & 0xF) | ((l2 & 0xF) << 4)


@kernel
def _q6_K_block(xb, o, dd, ib, L, scales, qsc):
    """One q6_K super-block: xb (256,) float32 -> o (210,) uint8 (the trailing d left in dd[ib])."""
    max_scale = _F32(0)
    max_abs_scale = _F32(0)
    for j in range(16):
        s = _make_qx_quants_rmse1(xb, 16 * j, 16, 32, L)
        scales[j] = s
        if abs(s) > max_abs_scale:
            max_abs_scale = abs(s)
            max_scale = s
    if max_abs_scale < _GROUP_MAX_EPS:
        for k in range(o.shape[0]):
            o[k] = 0
        dd[ib, 0] = _F32(0)
        return
    iscale = _F32(-128) / max_scale
    d = fp16_round(_F32(1) / iscale)
    dd[ib, 0] = d
    for j in range(16):
        q = min(127, nearest_int(iscale * scales[j]))
        q = ((q + 128) & 0xFF) - 128  # stored as int8_t
        qsc[j] = q
        o[192 + j] = q & 0xFF
    for j in range(16):
        dj = d * _F32(qsc[j])
        if dj == _F32(0):
            continue
        for ii in range(16):
            l = nearest_int(xb[16 * j + ii] / dj)
            L[16 * j + ii] = max(-32, min(31, l)) + 32
    # ql (128) at 0, qh (64) at 128; per half h of 128 values, value 128h + 32k + l:
    # low nibble -> ql[64h + l + 32*(k&1)] (high nibble if k >= 2), 2 high bits -> qh[32h + l] bits 2k
    for h in range(2):
        for l in range(32):
            q1 = L[128 * h + l]
            q2 = L[128 * h + l + 32]
            q3 = L[128 * h + l + 64]
            q4 = L[128 * h + l + 96]
            o[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            o[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            o[128 + 32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


# The kernels: x (nb, 256) float32 -> out (nb, type_size) uint8, with the fp16 super-block
# scales left as (fp16-exact) float32 in dd (nb, 2 or 1) for NumPy to pack. nogil: the caller
# (`qllama.quantize.blocks`) runs them on slices of blocks in threads (cheaper to compile than
# numba's parallel=True).
# Blocks are independent, so the split cannot change the bytes.

@kernel(nogil=True)
def quantize_q4_k_q5_k(type_id, x, out, dd):
    """q4_K or q5_K super-blocks (by type_id): x (nb, 256) float32 -> out (nb, 144 or 176), dd (nb, 2)."""
    L = np.empty(256, np.int64)
    Laux = np.empty(32, np.int64)
    weights = np.empty(32, np.float32)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    for ib in range(x.shape[0]):
        if type_id == Q5_K:
            _q5_K_block(x[ib], out[ib], dd, ib, L, Laux, weights, ls, lm)
        else:
            _q4_K_block(x[ib], out[ib], dd, ib, L, Laux, weights, ls, lm)


@kernel(nogil=True)
def quantize_q6_k(x, out, dd):
    """q6_K super-blocks: x (nb, 256) float32 -> out (nb, 210) uint8, dd (nb, 1)."""
    L = np.empty(256, np.int64)
    scales = np.empty(16, np.float32)
    qsc = np.empty(16, np.int64)
    for ib in range(x.shape[0]):
        _q6_K_block(x[ib], out[ib], dd, ib, L, scales, qsc)
