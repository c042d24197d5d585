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

from ..gguf.types import Q2_K, Q3_K, Q4_K, Q5_K
from .jit import kernel

_F32 = np.float32
_GROUP_MAX_EPS = np.float32(1e-15)  # ggml's GROUP_MAX_EPS: a group below this is "all zero"


@kernel(inline="always")
def nearest_int(fval):
    # ggml's nearest_int: adding 1.5*2^23 leaves the float32 rounded to an integer (half to even)
    val = fval + np.float32(12582912.0)
    if abs(fval) <= np.float32(4194303.0):
        return np.int64(val) - 12582912
    return _mantissa_bits(val) - 0x400000  # beyond ggml's assert (off in release builds): its bit trick


@kernel
def _mantissa_bits(val):
    """The 23 mantissa bits of a float32 (what ggml's nearest_int reads once fval is out of range)."""
    a = abs(np.float64(val))
    if a == np.inf:
        return 0
    if a != a:
        return 0x400000  # a quiet NaN
    if a < 1.1754943508222875e-38:  # zero or subnormal: the bits are the value / 2^-149
        return np.int64(a * 7.1362384635297994e44)
    m, _ = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
    return np.int64((m * 2.0 - 1.0) * 8388608.0)


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


@kernel(inline="always")
def _fit_error(diff, use_mad):
    """ggml's per-value error of a fit: |diff| (use_mad) or diff^2."""
    return abs(diff) if use_mad else diff * diff


@kernel
def _make_qkx2_quants(x, off, n, nmax, weights, L, Laux, rmin, rdelta, nstep, use_mad, qkx3):
    """ggml's make_qkx2_quants on x[off:off+n], or make_qkx3_quants (qkx3: the same search, but a
    trial value is clamped before rounding, so a near-degenerate fit cannot overflow nearest_int).
    Writes L[off:off+n].

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
    if mx == mn or (qkx3 and not mx > mn):
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
        best_error += weights[i] * _fit_error(scale * _F32(l) + mn - v, use_mad)
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
            t = iscale * (v - mn)
            if qkx3:
                l = nearest_int(min(t, _F32(nmax))) if t > _F32(0) else 0
            else:
                l = max(0, min(nmax, nearest_int(t)))
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
                cur_error += weights[i] * _fit_error(this_scale * _F32(Laux[i]) + this_min - x[off + i], use_mad)
            if cur_error < best_error:
                for i in range(n):
                    L[off + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@kernel(inline="always")
def _qx_sums(x, off, n, nmax, iscale, qw, has_w):
    """(sum w*x*l, sum w*l*l) with w = qw[i] (has_w) or x^2 and l = nearest_int(iscale*x) clamped
    to [-nmax, nmax-1]."""
    sumlx = _F32(0)
    suml2 = _F32(0)
    for i in range(n):
        v = x[off + i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
        w = qw[i] if has_w else v * v
        fl = _F32(l)
        sumlx += w * v * fl
        suml2 += w * fl * fl
    return sumlx, suml2


@kernel(inline="always")
def _signed_absmax(x, off, n):
    """(max |x|, the value that has it, the first one) over x[off:off+n]."""
    amax = _F32(0)
    mx = _F32(0)
    for i in range(n):
        ax = abs(x[off + i])
        if ax > amax:
            amax = ax
            mx = x[off + i]
    return amax, mx


@kernel(inline="always")
def _qx_store(x, off, n, nmax, iscale, L):
    """L[off:off+n] = nmax + l, the l of `_qx_sums`."""
    for i in range(n):
        L[off + i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[off + i])))


@kernel
def _make_qx_quants(x, off, n, nmax, L, qw, has_w):
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, qw) on x[off:off+n], qw (n,) read when has_w.

    Symmetric fit x ~ scale * (L - nmax), L in 0..2*nmax-1, weights qw or x^2, 19 trial scales.
    """
    fnmax = _F32(nmax)
    amax, mx = _signed_absmax(x, off, n)
    if amax < _GROUP_MAX_EPS:
        L[off:off + n] = 0
        return _F32(0)
    iscale = -fnmax / mx
    _qx_store(x, off, n, nmax, iscale, L)
    sumlx, suml2 = _qx_sums(x, off, n, nmax, iscale, qw, has_w)
    scale = sumlx / suml2 if suml2 != _F32(0) else _F32(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + _F32(0.1) * _F32(step)) / mx
        sumlx, suml2 = _qx_sums(x, off, n, nmax, iscale, qw, has_w)
        if suml2 > _F32(0) and sumlx * sumlx > best * suml2:
            _qx_store(x, off, n, nmax, iscale, L)
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@kernel
def _make_qp_quants(n, nmax, x, L, qw):
    """ggml's make_qp_quants: non-negative x (n,) (sub-block scales or mins) ~ scale * L, L in
    0..nmax, weights qw; 9 trial scales, then up to 5 sweeps moving single values. Returns the scale."""
    mx = _F32(0)
    for i in range(n):
        mx = max(mx, x[i])
    if mx < _GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return _F32(0)
    iscale = _F32(nmax) / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF  # (a uint8_t in C)
    scale = _F32(1) / iscale
    best_mse = _F32(0)
    for i in range(n):
        diff = x[i] - scale * _F32(L[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (_F32(0.1) * _F32(step) + _F32(nmax)) / mx
        scale_is = _F32(1) / iscale_is
        mse = _F32(0)
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * _F32(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = _F32(0)
    suml2 = _F32(0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        w = qw[i]
        sumlx += w * x[i] * _F32(l)  # l, not L[i]: the C sums the int (iq2_xxs gives it a negative x)
        suml2 += w * _F32(l) * _F32(l)
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            li = _F32(L[i])
            slx = sumlx - w * x[i] * li
            sl2 = suml2 - w * li * li
            if slx > _F32(0) and sl2 > _F32(0):
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * _F32(new_l)
                    sl2 += w * _F32(new_l) * _F32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF  # (a uint8_t in C)
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > _F32(0) else _F32(0)


@kernel(inline="always")
def _importance(xb, off, n, qw, sigma2, weight):
    """ggml's weights from an importance matrix: weight[i] = qw[off+i] * sqrt(sigma2 + x^2); returns
    their sum (in order, as the k-quants' sw[j])."""
    sumw = _F32(0)
    for i in range(n):
        v = xb[off + i]
        weight[i] = qw[off + i] * np.sqrt(sigma2 + v * v)
    for i in range(n):
        sumw += weight[i]
    return sumw


@kernel(inline="always")
def _sum_squares(xb, n):
    s = _F32(0)
    for i in range(n):
        s += xb[i] * xb[i]
    return s


@kernel
def _kx_block_scales(xb, qw, has_w, nmax, rmin, rdelta, nstep, L, Laux, weights, ls, lm, dd, ib):
    """The shared first half of q4_K / q5_K for one super-block xb (256,).

    Fits each 32-value sub-block with make_qkx2_quants, quantizes the 8 scales and 8 mins to
    6 bits (ls, lm), stores the fp16-rounded super-block d / dmin in dd[ib], and requantizes L
    against the rounded scales (as ggml does). L keeps the fit's values where a scale rounds to 0.
    With an importance matrix (has_w, qw (256,)): quantize_row_q4_K_impl / q5_K_impl instead
    (weights qw * sqrt(sigma2 + x^2), make_qkx3_quants, the 6-bit scales fitted by make_qp_quants).
    """
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    if has_w:
        sigma2 = _F32(2) * _sum_squares(xb, 256) / _F32(256)
        sw = np.empty(8, np.float32)
        for j in range(8):
            sw[j] = _importance(xb, 32 * j, 32, qw, sigma2, weights)
            scales[j], mins[j] = _make_qkx2_quants(xb, 32 * j, 32, nmax, weights, L, Laux, _F32(-0.9), _F32(0.05),
                                                   36, False, True)
        d = fp16_round(_make_qp_quants(8, 63, scales, ls, sw))
        dmin = fp16_round(_make_qp_quants(8, 63, mins, lm, sw))
        _kx_requantize(xb, nmax, ls, lm, d, dmin, L)
        dd[ib, 0] = d
        dd[ib, 1] = dmin
        return
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
        sc, mi = _make_qkx2_quants(xb, 32 * j, 32, nmax, weights, L, Laux, rmin, rdelta, nstep, False, False)
        scales[j], mins[j] = sc, mi
        max_scale = sc if sc > max_scale else max_scale
        max_min = mi if mi > max_min else max_min
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
    _kx_requantize(xb, nmax, ls, lm, d, dmin, L)


@kernel(inline="always")
def _kx_requantize(xb, nmax, ls, lm, d, dmin, L):
    """q4_K / q5_K's last pass: each value against its sub-block's rounded scale and min."""
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
def _q4_K_block(xb, qw, has_w, o, dd, ib, L, Laux, weights, ls, lm):
    """One q4_K super-block: xb (256,) float32 -> o (144,) uint8 (d, dmin left in dd[ib])."""
    _kx_block_scales(xb, qw, has_w, 15, _F32(-1.0), _F32(0.1), 20, L, Laux, weights, ls, lm, dd, ib)
    _pack_k4_scales(ls, lm, o[4:16])
    # qs (128) at 16: byte 32g + l = L[64g + l] | L[64g + 32 + l] << 4
    for g in range(4):
        for l in range(32):
            o[16 + 32 * g + l] = L[64 * g + l] | (L[64 * g + 32 + l] << 4)


@kernel
def _q5_K_block(xb, qw, has_w, o, dd, ib, L, Laux, weights, ls, lm):
    """One q5_K super-block: xb (256,) float32 -> o (176,) uint8 (d, dmin left in dd[ib])."""
    _kx_block_scales(xb, qw, has_w, 31, _F32(-0.5), _F32(0.1), 15, L, Laux, weights, ls, lm, dd, ib)
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
def _q6_K_block(xb, qw, has_w, o, dd, ib, L, scales, qsc):
    """One q6_K super-block: xb (256,) float32 -> o (210,) uint8 (the trailing d left in dd[ib]).
    With an importance matrix (has_w) its weights qw (256,) go straight to make_qx_quants."""
    max_scale = _F32(0)
    max_abs_scale = _F32(0)
    for j in range(16):
        s = _make_qx_quants(xb, 16 * j, 16, 32, L, qw[16 * j:16 * j + 16], has_w)
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


@kernel(inline="always")
def _pack_2bit(L, o, at):
    """256 values 0..3 -> 64 bytes at o[at:]: byte 32h + l holds L[128h + l + 32k] in bits 2k (q2_K/q3_K)."""
    for h in range(2):
        for l in range(32):
            b = 128 * h + l
            o[at + 32 * h + l] = L[b] | (L[b + 32] << 2) | (L[b + 64] << 4) | (L[b + 96] << 6)


@kernel
def _q2_K_block(xb, qw, has_w, o, dd, ib, L, Laux, weights, scales, mins):
    """One q2_K super-block (quantize_row_q2_K_ref): xb (256,) -> o (84,): scales (16) at 0, qs (64)
    at 16; d and dmin (fp16-exact) left in dd[ib]. 16 sub-blocks of 16, make_qkx2_quants with
    weights |x| and mean absolute error, 4-bit scales and mins. With an importance matrix
    (has_w): quantize_row_q2_K_impl (make_qkx3_quants, the 4-bit scales fitted by make_qp_quants)."""
    if has_w:
        sigma2 = _sum_squares(xb, 256) / _F32(256)
        sw = np.empty(16, np.float32)
        ls = np.empty(16, np.int64)
        lm = np.empty(16, np.int64)
        for j in range(16):
            sw[j] = _importance(xb, 16 * j, 16, qw, sigma2, weights)
            scales[j], mins[j] = _make_qkx2_quants(xb, 16 * j, 16, 3, weights, L, Laux, _F32(-0.9), _F32(0.05), 36,
                                                   False, True)
        d = fp16_round(_make_qp_quants(16, 15, scales, ls, sw))
        dmin = fp16_round(_make_qp_quants(16, 15, mins, lm, sw))
        for j in range(16):
            o[j] = ls[j] | (lm[j] << 4)
        dd[ib, 0] = d
        dd[ib, 1] = dmin
        _requantize_2bit(xb, o, d, dmin, L)
        _pack_2bit(L, o, 16)
        return
    max_scale = _F32(0)
    max_min = _F32(0)
    for j in range(16):
        for l in range(16):
            weights[l] = abs(xb[16 * j + l])
        sc, mi = _make_qkx2_quants(xb, 16 * j, 16, 3, weights, L, Laux, _F32(-0.5), _F32(0.1), 15, True, False)
        scales[j], mins[j] = sc, mi
        max_scale = sc if sc > max_scale else max_scale
        max_min = mi if mi > max_min else max_min
    for j in range(16):
        o[j] = 0
    d = _F32(0)
    dmin = _F32(0)
    if max_scale > _F32(0):
        iscale = _F32(15) / max_scale
        for j in range(16):
            o[j] = nearest_int(iscale * scales[j]) & 0xFF
        d = fp16_round(max_scale / _F32(15))
    if max_min > _F32(0):
        iscale = _F32(15) / max_min
        for j in range(16):
            o[j] |= (nearest_int(iscale * mins[j]) << 4) & 0xFF
        dmin = fp16_round(max_min / _F32(15))
    dd[ib, 0] = d
    dd[ib, 1] = dmin
    _requantize_2bit(xb, o, d, dmin, L)
    _pack_2bit(L, o, 16)


@kernel(inline="always")
def _requantize_2bit(xb, sc, d, dmin, L):
    """q2_K's last pass: each value again against the rounded 4-bit scale and min of its sub-block."""
    for j in range(16):
        dj = d * _F32(sc[j] & 0xF)
        if dj == _F32(0):
            continue
        dm = dmin * _F32(sc[j] >> 4)
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int((xb[16 * j + ii] + dm) / dj)))


@kernel
def _make_q3_quants_rmse(x, off, n, nmax, L):
    """ggml's make_q3_quants(n, nmax, x, L, do_rmse=true) on x[off:off+n]: a symmetric start at
    -nmax/max, then up to 5 sweeps moving single values while the weighted (x^2) fit improves.
    Writes L[off:off+n] = nmax + l, returns the scale."""
    amax, mx = _signed_absmax(x, off, n)
    if amax < _GROUP_MAX_EPS:
        L[off:off + n] = 0
        return _F32(0)
    iscale = -_F32(nmax) / mx
    sumlx = _F32(0)
    suml2 = _F32(0)
    for i in range(n):
        v = x[off + i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
        L[off + i] = l
        w = v * v
        sumlx += w * v * _F32(l)
        suml2 += w * _F32(l) * _F32(l)
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            v = x[off + i]
            w = v * v
            li = _F32(L[off + i])
            slx = sumlx - w * v * li
            if slx > _F32(0):
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nearest_int(v * sl2 / slx)))
                if new_l != L[off + i]:
                    slx += w * v * _F32(new_l)
                    sl2 += w * _F32(new_l) * _F32(new_l)
                    if sl2 > _F32(0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[off + i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[off + i] += nmax
    return sumlx / suml2 if suml2 > _F32(0) else _F32(0)


@kernel
def _q3_K_block(xb, qw, has_w, o, dd, ib, L, scales, weight):
    """One q3_K super-block (quantize_row_q3_K_ref): xb (256,) -> o (110,): hmask (32) at 0, qs (64)
    at 32, 6-bit scales (12) at 96; d (fp16-exact) left in dd[ib]. With an importance matrix
    (has_w): quantize_row_q3_K_impl (make_qx_quants with weights, the scales fitted the same way)."""
    if has_w:
        sigma2 = _F32(2) * _sum_squares(xb, 256) / _F32(256)
        sw = np.empty(16, np.float32)
        ls = np.empty(16, np.int64)
        for j in range(16):
            sw[j] = _importance(xb, 16 * j, 16, qw, sigma2, weight)
            scales[j] = _make_qx_quants(xb, 16 * j, 16, 4, L, weight, True)
        for k in range(12):
            o[96 + k] = 0
        d_block = _make_qx_quants(scales, 0, 16, 32, ls, sw, True)
        for j in range(16):
            _put_q3_scale(o, j, ls[j])
        d = fp16_round(d_block)
        dd[ib, 0] = d
        _q3_K_finish(xb, o, d, L)
        return
    max_scale = _F32(0)
    amax = _F32(0)
    for j in range(16):
        s = _make_q3_quants_rmse(xb, 16 * j, 16, 4, L)
        scales[j] = s
        if abs(s) > amax:
            amax = abs(s)
            max_scale = s
    for k in range(12):
        o[96 + k] = 0
    d = _F32(0)
    if max_scale != _F32(0):
        iscale = _F32(-32) / max_scale
        for j in range(16):
            _put_q3_scale(o, j, max(-32, min(31, nearest_int(iscale * scales[j]))) + 32)
        d = fp16_round(_F32(1) / iscale)
    dd[ib, 0] = d
    _q3_K_finish(xb, o, d, L)


@kernel(inline="always")
def _put_q3_scale(o, j, l):
    """The 6-bit scale l (0..63) of sub-block j into q3_K's 12 scale bytes at o[96:]."""
    if j < 8:
        o[96 + j] |= l & 0xF
    else:
        o[96 + j - 8] |= (l & 0xF) << 4
    o[96 + 8 + j % 4] |= (l >> 4) << (2 * (j // 4))


@kernel
def _q3_K_finish(xb, o, d, L):
    """q3_K's last pass: every value against its rounded scale (L keeps the fit where that is 0),
    the high bit to hmask (bit j//32 of byte j%32), the low 2 bits packed into qs."""
    for j in range(16):
        lo = (np.int64(o[96 + j]) & 0xF) if j < 8 else (np.int64(o[96 + j - 8]) >> 4)  # (uint8 >> int: float in numba)
        sc = (lo | (((np.int64(o[104 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        dj = d * _F32(sc)
        if dj == _F32(0):
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(xb[16 * j + ii] / dj))) + 4
    for k in range(32):
        o[k] = 0
    for j in range(256):
        if L[j] > 3:
            o[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    _pack_2bit(L, o, 32)


@kernel(inline="always")
def _best_index_iq4(values, v):
    """ggml's best_index_int8 over the 16 sorted iq4 values: the nearest, the upper one on a tie."""
    if v <= values[0]:
        return 0
    if v >= values[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if v < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if v - values[mu - 1] < values[mu] - v else mu


@kernel
def _iq4_block(xb, qw, has_w, nsub, o, dd, ib, values, L, weight, scales):
    """ggml's quantize_row_iq4_nl_impl(super_block = 32 * nsub, block = 32, ntry = 7) on xb: iq4_nl
    (nsub 1: o = qs (16)) or iq4_xs (nsub 8: o = scales_h (2), scales_l (4), qs (128)). Per block
    of 32 a scale search over 15 trial scales with weights x^2, or qw * sqrt(sigma2 + x^2) with
    an importance matrix (has_w); iq4_xs then quantizes the 8 scales to 6 bits against
    -max_scale/32. Writes o[2:] (iq4_nl: qs (16); iq4_xs: scales_h (2), scales_l (4), qs (128));
    the fp16 d at o[0:2] is left (as float32) in dd[ib]."""
    n = 32 * nsub
    sigma2 = _F32(0)
    for j in range(n):
        sigma2 += xb[j] * xb[j]
    sigma2 *= _F32(2) / _F32(n)
    max_scale = _F32(0)
    amax_scale = _F32(0)
    for b in range(nsub):
        off = 32 * b
        for j in range(32):
            v = xb[off + j]
            weight[j] = qw[off + j] * np.sqrt(sigma2 + v * v) if has_w else v * v
        amax, mx = _signed_absmax(xb, off, 32)
        if amax < _GROUP_MAX_EPS:
            scales[b] = _F32(0)
            continue
        d = -mx / values[0]
        inv = _F32(1) / d
        sumqx = _F32(0)
        sumq2 = _F32(0)
        for j in range(32):
            l = _best_index_iq4(values, inv * xb[off + j])
            L[off + j] = l
            q = values[l]
            w = weight[j]
            sumqx += w * q * xb[off + j]
            sumq2 += w * q * q
        d = sumqx / sumq2
        best = d * sumqx
        for itry in range(-7, 8):
            inv = (_F32(itry) + values[0]) / mx
            sumqx = _F32(0)
            sumq2 = _F32(0)
            for j in range(32):
                q = values[_best_index_iq4(values, inv * xb[off + j])]
                w = weight[j]
                sumqx += w * q * xb[off + j]
                sumq2 += w * q * q
            if sumq2 > _F32(0) and sumqx * sumqx > best * sumq2:
                d = sumqx / sumq2
                best = d * sumqx
        scales[b] = d
        if abs(d) > amax_scale:
            amax_scale = abs(d)
            max_scale = d
    at = 2
    if nsub > 1:
        d = -max_scale / _F32(32)
        dd[ib, 0] = d
        inv = _F32(1) / d if d != _F32(0) else _F32(0)
        sh = 0
        for k in range(2, 8):
            o[k] = 0
        for b in range(nsub):
            l = max(-32, min(31, nearest_int(inv * scales[b])))
            dl = d * _F32(l)
            idl = _F32(1) / dl if dl != _F32(0) else _F32(0)
            for j in range(32):
                L[32 * b + j] = _best_index_iq4(values, idl * xb[32 * b + j])
            l += 32
            o[4 + b // 2] |= (l & 0xF) << (4 * (b % 2))
            sh |= (l >> 4) << (2 * (b % 8))
        o[2] = sh & 0xFF
        o[3] = sh >> 8
        at = 8
    else:
        dd[ib, 0] = scales[0]
        inv = _F32(1) / scales[0] if scales[0] != _F32(0) else _F32(0)
        for j in range(32):
            L[j] = _best_index_iq4(values, inv * xb[j])
    for i in range(nsub):
        for j in range(16):
            o[at + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)


# The kernels: x (nb, 256) float32 -> out (nb, type_size) uint8, with the fp16 super-block
# scales left as (fp16-exact) float32 in dd (nb, 2 or 1) for NumPy to pack. nogil: the caller
# (`qllama.quantize.blocks`) runs them on slices of blocks in threads (cheaper to compile than
# numba's parallel=True).
# Blocks are independent, so the split cannot change the bytes.

@kernel(nogil=True)
def quantize_kquant(type_id, has_w, x, qw, out, dd):
    """q2_K..q6_K super-blocks (by type_id): x (nb, 256) float32 -> out (nb, type_size) uint8, with
    the fp16 scales left in dd (nb, 2: d, dmin; q3_K / q6_K: d only); qw (nb, 256): importance
    weights, read when has_w."""
    L = np.empty(256, np.int64)
    Laux = np.empty(32, np.int64)
    weights = np.empty(32, np.float32)
    ls = np.empty(16, np.int64)
    lm = np.empty(16, np.int64)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    for ib in range(x.shape[0]):
        if type_id == Q2_K:
            _q2_K_block(x[ib], qw[ib], has_w, out[ib], dd, ib, L, Laux, weights, scales, mins)
        elif type_id == Q3_K:
            _q3_K_block(x[ib], qw[ib], has_w, out[ib], dd, ib, L, scales, weights)
        elif type_id == Q4_K:
            _q4_K_block(x[ib], qw[ib], has_w, out[ib], dd, ib, L, Laux, weights, ls, lm)
        elif type_id == Q5_K:
            _q5_K_block(x[ib], qw[ib], has_w, out[ib], dd, ib, L, Laux, weights, ls, lm)
        else:
            _q6_K_block(x[ib], qw[ib], has_w, out[ib], dd, ib, L, scales, ls)


@kernel(nogil=True)
def quantize_iq4(nsub, values, has_w, x, qw, out, dd):
    """iq4_nl (nsub 1) or iq4_xs (nsub 8) blocks: x (nb, 32 nsub) float32, qw the importance
    weights of each value (nb, 32 nsub; read only when has_w) -> out (nb, 18 or 136) uint8 but
    the fp16 d, dd (nb, 1)."""
    L = np.empty(32 * nsub, np.int64)
    weight = np.empty(32, np.float32)
    scales = np.empty(nsub, np.float32)
    for ib in range(x.shape[0]):
        _iq4_block(x[ib], qw[ib], has_w, nsub, out[ib], dd, ib, values, L, weight, scales)


@kernel(nogil=True)
def quantize_legacy_weighted(nmax, with_min, x, qw, L, dm):
    """q4_0 / q5_0 (nmax 8 / 16) or q4_1 / q5_1 (with_min, nmax 15 / 31) with an importance matrix
    (quantize_row_q4_0_impl ...): x (rows, ne0) float32, qw (ne0,) -> L (rows * ne0 / 32, 32) codes
    and dm (rows * ne0 / 32, 2) the block's d and m (unrounded) for NumPy to pack. The weights are
    qw * sqrt(sigma2 + x^2) with sigma2 the mean square of the whole row."""
    nb = x.shape[1] // 32
    weight = np.empty(32, np.float32)
    Laux = np.empty(32, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        sigma2 = _sum_squares(xr, x.shape[1]) / _F32(x.shape[1])
        for b in range(nb):
            k = r * nb + b
            _importance(xr, 32 * b, 32, qw, sigma2, weight)
            if with_min:
                d, the_min = _make_qkx2_quants(xr[32 * b:32 * b + 32], 0, 32, nmax, weight, L[k], Laux, _F32(-0.9),
                                               _F32(0.05), 36, False, True)
                dm[k, 0] = d
                dm[k, 1] = -the_min
            else:
                dm[k, 0] = _make_qx_quants(xr[32 * b:32 * b + 32], 0, 32, nmax, L[k], weight, True)
                dm[k, 1] = _F32(0)


@kernel(inline="always")
def _signs(xb, off, weight, xval, k, even):
    """Group k of 8 values xb[off + 8k:]: magnitudes to xval[8k:], the sign bits returned. even:
    an odd count of minus signs flips the value of least weight * x^2 (ggml keeps 7 bits)."""
    s = 0
    nflip = 0
    for i in range(8):
        v = xb[off + 8 * k + i]
        if v >= _F32(0):
            xval[8 * k + i] = v
        else:
            xval[8 * k + i] = -v
            s |= 1 << i
            nflip += 1
    if even and nflip % 2:
        imin = 0
        mn = weight[8 * k] * xb[off + 8 * k] * xb[off + 8 * k]
        for i in range(1, 8):
            ax = weight[8 * k + i] * xb[off + 8 * k + i] * xb[off + 8 * k + i]
            if ax < mn:
                mn = ax
                imin = i
        xval[8 * k + imin] = -xval[8 * k + imin]
        s ^= 1 << imin
    return s & 127 if even else s


@kernel(inline="always")
def _iq3_best_neighbour(neigh, at, grid, xval, waux, off, scale, L):
    """ggml's iq3_find_best_neighbour (iq2_find_best_neighbour for a grid of 8): of the grid points
    listed at neigh[at] (count, then indices), the one nearest scale * point to xval[off:off+m]
    (weights waux; m = grid.shape[1]); its levels to L[off:off+m]."""
    best_d2 = np.float32(3.4028234663852886e38)
    gi = -1
    for j in range(1, neigh[at] + 1):
        g = neigh[at + j]
        d2 = _F32(0)
        for i in range(grid.shape[1]):
            diff = scale * _F32(grid[g, i]) - xval[off + i]
            d2 += waux[off + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            gi = g
    for i in range(grid.shape[1]):
        L[off + i] = (grid[gi, i] - 1) // 2
    return gi


@kernel(inline="always")
def _iq3_fit(weight, xval, L):
    """(sum w x q, sum w q^2) over a block (L's length), q = 2 L + 1."""
    sumqx = _F32(0)
    sumq2 = _F32(0)
    for i in range(L.shape[0]):
        q = _F32(2 * L[i] + 1)
        sumqx += weight[i] * xval[i] * q
        sumq2 += weight[i] * q * q
    return sumqx, sumq2


@kernel(inline="always")
def _levels(xval, off, m, bits, kmax, inv, L):
    """The m levels nearest inv * xval[off:] (0..kmax) into L[off:], and their code."""
    u = 0
    for i in range(m):
        l = max(0, min(kmax, nearest_int(_F32(0.5) * (inv * xval[off + i] - _F32(1)))))
        L[off + i] = l
        u |= l << (bits * i)
    return u


@kernel(inline="always")
def _code(L, off, m, bits):
    u = 0
    for i in range(m):
        u |= L[off + i] << (bits * i)
    return u


@kernel
def _fit_grid(weight, waux, xval, grid, kmap, neigh, bits, kmax, mx, base, step, nstep, scale, on_grid0, all_groups,
              L, Laux, on_grid, on_aux):
    """Block magnitudes xval (16 or 32) as scale * (2 L + 1), groups of m = grid.shape[1] levels on
    the grid: the trial scales (base + is * step) / mx, is = -nstep..nstep, each group's code or its
    best listed neighbour, the weighted fit (kept when better); then, if a group of the kept trial
    was off the grid, those groups (every group when all_groups) again at the fitted scale, and the
    fit. on_grid0 -1 (iq2_xxs): requantize every group whenever the scale is positive. Returns the
    scale (scale: the one before the trials); the levels in L."""
    m = grid.shape[1]
    ng = xval.shape[0] // m
    best = _F32(0)
    for k in range(ng):
        on_grid[k] = on_grid0 > 0
    for s in range(-nstep, nstep + 1):
        inv = (_F32(base) + _F32(s) * step) / mx
        this_scale = _F32(1) / inv
        for k in range(ng):
            u = _levels(xval, m * k, m, bits, kmax, inv, Laux)
            on_aux[k] = kmap[u] >= 0
            if kmap[u] < 0:
                _iq3_best_neighbour(neigh, -kmap[u] - 1, grid, xval, waux, m * k, this_scale, Laux)
        sumqx, sumq2 = _iq3_fit(weight, xval, Laux)
        if sumq2 > _F32(0) and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:] = Laux
            on_grid[:] = on_aux
    if (on_grid0 >= 0 and on_grid.all()) or not scale > _F32(0):
        return scale
    inv = _F32(1) / scale
    for k in range(ng):
        if on_grid[k] and not all_groups:
            continue
        u = _levels(xval, m * k, m, bits, kmax, inv, L)
        if kmap[u] < 0:
            _iq3_best_neighbour(neigh, -kmap[u] - 1, grid, xval, waux, m * k, scale, L)
    sumqx, sumq2 = _iq3_fit(weight, xval, L)
    if sumq2 > _F32(0):
        scale = sumqx / sumq2
    return scale


@kernel
def _iq3s_block(xbl, qw, has_w, o, dd, ib, grid, kmap, neigh, weight, waux, xval, L, Laux, on_grid, on_aux,
                signs, scales):
    """ggml's quantize_row_iq3_s_impl (block 32) on one super-block xbl (256,) -> o (110,): d (2, left
    as float32 in dd[ib]), qs (64), qh (8), signs (32), scales (4). Per block of 32: signs apart,
    19 trial scales, each group of 4 levels on the 512-point grid or its nearest listed neighbour."""
    for k in range(110):
        o[k] = 0
    dd[ib, 0] = _F32(0)
    sigma2 = _F32(2) * _sum_squares(xbl, 256) / _F32(256)
    max_scale = _F32(0)
    nq = 0  # blocks written so far: ggml moves its qs/signs pointers past written blocks only (an
    # all-zero block is skipped, and the next block's qs and signs take its place)
    for b in range(8):
        off = 32 * b
        if has_w:
            _importance(xbl, off, 32, qw, sigma2, weight)
        else:
            for i in range(32):
                weight[i] = xbl[off + i] * xbl[off + i]
        for i in range(32):
            waux[i] = np.sqrt(weight[i])
        for k in range(4):
            signs[k] = _signs(xbl, off, weight, xval, k, False)
        mx = xval[0]
        for i in range(1, 32):
            mx = xval[i] if xval[i] > mx else mx
        L[:] = 0
        if mx == _F32(0):
            scales[b] = _F32(0)
            continue
        # 19 trial scales; every group again at the best when one was off the grid
        scale = _fit_grid(weight, waux, xval, grid, kmap, neigh, 3, 7, mx, 15, _F32(0.2), 9, mx / _F32(15), 0, True, L,
                          Laux, on_grid, on_aux)
        if scale < _F32(0):  # (ggml: should never happen) a positive scale, the signs flipped
            scale = -scale
            for k in range(4):
                signs[k] = ~signs[k] & 0xFF
        for k in range(8):
            gi = kmap[_code(L, 4 * k, 4, 3)]
            o[2 + 8 * nq + k] = gi & 255
            o[66 + b] |= (gi >> 8) << k
        for k in range(4):
            o[74 + 4 * nq + k] = signs[k]
        nq += 1
        scales[b] = scale
        max_scale = scale if scale > max_scale else max_scale
    if max_scale == _F32(0):
        return
    d = max_scale / _F32(31)
    dd[ib, 0] = d * _F32(1.033)
    inv = _F32(1) / d
    for b in range(0, 8, 2):
        l1 = max(0, min(15, nearest_int(_F32(0.5) * (inv * scales[b] - _F32(1)))))
        l2 = max(0, min(15, nearest_int(_F32(0.5) * (inv * scales[b + 1] - _F32(1)))))
        o[106 + b // 2] = l1 | (l2 << 4)


@kernel(nogil=True)
def quantize_iq3s(has_w, grid, kmap, neigh, x, qw, out, dd):
    """iq3_s super-blocks: x (nb, 256) float32 -> out (nb, 110) uint8 but the fp16 d, dd (nb, 1); grid
    (512, 4) the grid's odd values, kmap (4096,) a 12-bit code's grid index or -(its neighbour list
    offset + 1), neigh the lists (count, indices...); qw (nb, 256) read when has_w."""
    f = np.empty((4, 32), np.float32)  # scratch: weight, waux, xval, scales (8)
    n = np.empty((3, 32), np.int64)  # L, Laux, signs (4)
    flags = np.empty((2, 8), np.bool_)  # on_grid, on_aux
    weight, waux, xval, scales = f[0], f[1], f[2], f[3, :8]
    L, Laux, signs = n[0], n[1], n[2, :4]
    on_grid, on_aux = flags[0], flags[1]
    for ib in range(x.shape[0]):
        _iq3s_block(x[ib], qw[ib], has_w, out[ib], dd, ib, grid, kmap, neigh, weight, waux, xval, L, Laux, on_grid,
                    on_aux, signs, scales)
