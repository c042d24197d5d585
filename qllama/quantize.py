"""A ggml-compatible quantizer: float rows -> ggml block bytes, and whole GGUF files -> a preset.

Three layers, each usable alone:

* `quantize_array(x, type_id)`: float32 rows `(n_rows, ne0)` -> uint8 `(n_rows, row_bytes)` in ggml's
  block layout. The algorithms are ggml's reference ones *without* an importance matrix
  (`quantize_row_*_ref` in ggml-quants.c), rewritten here:
    - q8_0, q4_0, q4_1, q5_0, q5_1: vectorised NumPy, byte-identical to ggml (and to gguf-py);
    - q4_K, q5_K: `make_qkx2_quants` (a weighted least-squares search over 21 / 16 trial scales
      per 32 values, with a min), q6_K: `make_qx_quants` (19 trial scales per 16 values, symmetric).
      These are sequential per sub-block, so they are Numba kernels that follow the C code's float32
      arithmetic operation by operation (same rounding, same order of accumulation), which makes
      their bytes identical to llama.cpp's (checked on the shared model's Q4_K_M file). They
      release the GIL and split large tensors across a thread pool.
    - f32, f16, bf16 (ggml's round-to-nearest-even bf16, NaN kept quiet).
* `choose_tensor_type(...)`: llama.cpp's per-tensor type mix (`llama_tensor_get_type` in
  src/llama-quant.cpp) for the presets in `PRESETS`.
* `quantize_gguf(src, dst, preset)`: reads with `qllama.gguf.GGUFFile`, writes with gguf-py's
  `GGUFWriter` (streaming, one tensor in memory at a time), copies every metadata key with its type,
  sets `general.file_type` and `general.quantization_version`.
"""

from __future__ import annotations

import logging
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
from .kernels.jit import kernel

from .errors import GGUFError, QllamaError, UnsupportedError
from .ggml_types import (
    BF16, F16, F32, GGML_TYPES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QK_K, type_name,
)

log = logging.getLogger(__name__)

GGML_QNT_VERSION = 2  # general.quantization_version written by current ggml
QK = 32  # block size of the legacy quants (q4_0 ... q8_0)

_F32 = np.float32
_GROUP_MAX_EPS = np.float32(1e-15)  # ggml's GROUP_MAX_EPS: a group below this is "all zero"


# =============================================================================================
# Float types
# =============================================================================================

def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits as ggml does: round to nearest even, NaN forced quiet."""
    u = x.view(np.uint32).astype(np.uint64)  # widened so that the rounding add cannot overflow
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet = ((u >> 16) | 64) & 0xFFFF  # keep sign/exponent/top mantissa, set the quiet bit
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# =============================================================================================
# Legacy quants (blocks of 32): vectorised NumPy, byte-identical to ggml's *_ref
# =============================================================================================
# Every function takes blocks (n_blocks, 32) float32 and returns uint8 (n_blocks, type_size).
# Arithmetic stays in float32 (NumPy 2 keeps float32 op python-scalar in float32).

def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8: IEEE half, round to nearest even (like F16C / ggml)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).view(np.uint8)


def _inverse(d: np.ndarray) -> np.ndarray:
    """ggml's `id = d ? 1.0f/d : 0.0f`, elementwise in float32."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, _F32(1) / d, _F32(0)).astype(np.float32)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 1): the value of largest magnitude, keeping its sign (first one on ties)."""
    idx = np.abs(b).argmax(axis=1)
    return b[np.arange(b.shape[0]), idx][:, None]


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero), exact in float32: the fraction v - trunc(v) is exact."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= _F32(0.5), np.sign(v), _F32(0)).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16): byte j = q[j] | q[j+16] << 4 (ggml's legacy order)."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit values -> (n, 4): bit k of a little-endian uint32 = bit 4 of q[k]."""
    bits = (q.astype(np.uint32) >> 4) & 1
    qh = (bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return qh.astype("<u4").view(np.uint8).reshape(-1, 4)


def _quantize_q8_0(b: np.ndarray) -> np.ndarray:
    amax = np.abs(b).max(axis=1, keepdims=True)  # (n, 1)
    d = amax / _F32(127)
    q = _roundf(b * _inverse(d)).astype(np.int8)  # (n, 32), |q| <= 127
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1)


def _quantize_q4_0(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / _F32(-8)  # the extreme value maps to -8
    q = np.minimum(15, np.trunc(b * _inverse(d) + _F32(8.5)))  # C: MIN(15, (int8_t)(x + 8.5f))
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=1)


def _quantize_q5_0(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / _F32(-16)
    q = np.minimum(31, np.trunc(b * _inverse(d) + _F32(16.5)))
    return np.concatenate([_fp16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


def _quantize_q4_1(b: np.ndarray) -> np.ndarray:
    lo = b.min(axis=1, keepdims=True)
    d = (b.max(axis=1, keepdims=True) - lo) / _F32(15)
    q = np.minimum(15, np.trunc((b - lo) * _inverse(d) + _F32(0.5)))
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], axis=1)


def _quantize_q5_1(b: np.ndarray) -> np.ndarray:
    lo = b.min(axis=1, keepdims=True)
    d = (b.max(axis=1, keepdims=True) - lo) / _F32(31)
    q = np.minimum(31, np.trunc((b - lo) * _inverse(d) + _F32(0.5)))
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


# =============================================================================================
# k-quants (super-blocks of 256): Numba kernels that follow ggml's float32 arithmetic exactly
# =============================================================================================
# Typing rule in these kernels: every float is float32 and every int that meets a float is cast
# with _F32() first (numba would otherwise promote float32*int64 to float64 and the rounding,
# hence the bytes, would differ from C).

@kernel(inline="always")
def _nearest_int(fval):
    # ggml's nearest_int: adding 1.5*2^23 leaves the float32 rounded to an integer (half to even)
    val = fval + np.float32(12582912.0)
    return np.int64(val) - 12582912


@kernel
def _fp16_round(f):
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
        l = _nearest_int(iscale * (v - mn))
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
            l = _nearest_int(iscale * (v - mn))
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
    sumlx = _F32(0)
    suml2 = _F32(0)
    for i in range(n):
        v = x[off + i]
        l = _nearest_int(iscale * v)
        l = max(-nmax, min(nmax - 1, l))
        L[off + i] = l + nmax
        w = v * v
        fl = _F32(l)
        sumlx += w * v * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != _F32(0) else _F32(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + _F32(0.1) * _F32(step)) / mx
        sumlx = _F32(0)
        suml2 = _F32(0)
        for i in range(n):
            v = x[off + i]
            l = _nearest_int(iscale * v)
            l = max(-nmax, min(nmax - 1, l))
            w = v * v
            fl = _F32(l)
            sumlx += w * v * fl
            suml2 += w * fl * fl
        if suml2 > _F32(0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                l = _nearest_int(iscale * x[off + i])
                L[off + i] = nmax + max(-nmax, min(nmax - 1, l))
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
        ls[j] = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)
        lm[j] = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
    d = _fp16_round(max_scale / _F32(63))
    dmin = _fp16_round(max_min / _F32(63))
    dd[ib, 0] = d
    dd[ib, 1] = dmin
    for j in range(8):
        dj = d * _F32(ls[j])
        if dj == _F32(0):
            continue
        dm = dmin * _F32(lm[j])
        for ii in range(32):
            l = _nearest_int((xb[32 * j + ii] + dm) / dj)
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
    d = _fp16_round(_F32(1) / iscale)
    dd[ib, 0] = d
    for j in range(16):
        q = min(127, _nearest_int(iscale * scales[j]))
        q = ((q + 128) & 0xFF) - 128  # stored as int8_t
        qsc[j] = q
        o[192 + j] = q & 0xFF
    for j in range(16):
        dj = d * _F32(qsc[j])
        if dj == _F32(0):
            continue
        for ii in range(16):
            l = _nearest_int(xb[16 * j + ii] / dj)
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
# scales left as (fp16-exact) float32 in dd (nb, 2 or 1) for NumPy to pack. nogil: _run_blocks
# runs them on slices of blocks in threads (cheaper to compile than numba's parallel=True).
# Blocks are independent, so the split cannot change the bytes.

@kernel(nogil=True)
def _quantize_q4_K_kernel(x, out, dd):
    L = np.empty(256, np.int64)
    Laux = np.empty(32, np.int64)
    weights = np.empty(32, np.float32)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    for ib in range(x.shape[0]):
        _q4_K_block(x[ib], out[ib], dd, ib, L, Laux, weights, ls, lm)


@kernel(nogil=True)
def _quantize_q5_K_kernel(x, out, dd):
    L = np.empty(256, np.int64)
    Laux = np.empty(32, np.int64)
    weights = np.empty(32, np.float32)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    for ib in range(x.shape[0]):
        _q5_K_block(x[ib], out[ib], dd, ib, L, Laux, weights, ls, lm)


@kernel(nogil=True)
def _quantize_q6_K_kernel(x, out, dd):
    L = np.empty(256, np.int64)
    scales = np.empty(16, np.float32)
    qsc = np.empty(16, np.int64)
    for ib in range(x.shape[0]):
        _q6_K_block(x[ib], out[ib], dd, ib, L, scales, qsc)


_MIN_BLOCKS_PER_THREAD = 256
_pool: ThreadPoolExecutor | None = None


def _run_blocks(kernel, b: np.ndarray, type_id: int, n_scales: int) -> tuple[np.ndarray, np.ndarray]:
    """Run a k-quant kernel over blocks b (nb, 256), split across threads when there is enough work."""
    global _pool
    nb = b.shape[0]
    out = np.empty((nb, GGML_TYPES[type_id].type_size), np.uint8)
    dd = np.empty((nb, n_scales), np.float32)
    n_threads = min(os.cpu_count() or 1, nb // _MIN_BLOCKS_PER_THREAD)
    if n_threads <= 1:
        kernel(b, out, dd)
        return out, dd
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="qllama-quantize")
    bounds = np.linspace(0, nb, n_threads + 1).astype(int)
    futures = [_pool.submit(kernel, b[s:e], out[s:e], dd[s:e]) for s, e in zip(bounds[:-1], bounds[1:])]
    for f in futures:
        f.result()
    return out, dd


def _quantize_q4_K(b: np.ndarray) -> np.ndarray:
    out, dd = _run_blocks(_quantize_q4_K_kernel, b, Q4_K, 2)  # dd: (d, dmin), already fp16-exact
    out[:, 0:4] = dd.astype(np.float16).view(np.uint8)
    return out


def _quantize_q5_K(b: np.ndarray) -> np.ndarray:
    out, dd = _run_blocks(_quantize_q5_K_kernel, b, Q5_K, 2)
    out[:, 0:4] = dd.astype(np.float16).view(np.uint8)
    return out


def _quantize_q6_K(b: np.ndarray) -> np.ndarray:
    out, dd = _run_blocks(_quantize_q6_K_kernel, b, Q6_K, 1)
    out[:, 208:210] = dd.astype(np.float16).view(np.uint8)
    return out


# type id -> function (n_blocks, block_size) float32 -> (n_blocks, type_size) uint8
_BLOCK_QUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q8_0: _quantize_q8_0, Q4_0: _quantize_q4_0, Q4_1: _quantize_q4_1,
    Q5_0: _quantize_q5_0, Q5_1: _quantize_q5_1,
    Q4_K: _quantize_q4_K, Q5_K: _quantize_q5_K, Q6_K: _quantize_q6_K,
}
FLOAT_TYPES = (F32, F16, BF16)
QUANTIZABLE_TYPES = FLOAT_TYPES + tuple(_BLOCK_QUANTIZERS)
_CHUNK_ELEMENTS = 1 << 22  # rows are processed in chunks of about this many values (bounds temporaries)


def quantize_array(x: np.ndarray, type_id: int) -> np.ndarray:
    """Quantize float rows to ggml's block layout.

    x: (n_rows, ne0) float array (a 1-D array is one row); ne0 must be a multiple of the type's
    block size. Returns uint8 (n_rows, row_bytes), row_bytes = ne0 / block_size * type_size,
    the exact bytes llama.cpp's reference quantizer (no importance matrix) would write.
    Supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K.
    """
    gtype = GGML_TYPES.get(type_id)
    if gtype is None or type_id not in QUANTIZABLE_TYPES:
        raise UnsupportedError(f"cannot quantize to type {type_name(type_id)}")
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise QllamaError(f"quantize_array wants a 2-D array (n_rows, ne0), got shape {x.shape}")
    if x.dtype.kind != "f":
        raise QllamaError(f"quantize_array wants floats, got {x.dtype}")
    n_rows, ne0 = x.shape
    if ne0 % gtype.block_size:
        raise QllamaError(f"row length {ne0} is not a multiple of the {gtype.name} block size {gtype.block_size}")
    out = np.empty((n_rows, gtype.row_bytes(ne0)), np.uint8)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(ne0, 1))
    for r0 in range(0, n_rows, rows_per_chunk):
        chunk = np.ascontiguousarray(x[r0 : r0 + rows_per_chunk], dtype=np.float32)  # (rows, ne0)
        out[r0 : r0 + rows_per_chunk] = _quantize_rows(chunk, type_id).reshape(chunk.shape[0], -1)
    return out


def _quantize_rows(x: np.ndarray, type_id: int) -> np.ndarray:
    """Contiguous float32 (rows, ne0) -> uint8 bytes of those rows (any shape, row-major)."""
    if type_id == F32:
        return x.view(np.uint8)
    if type_id == F16:
        with np.errstate(over="ignore"):  # beyond +-65504 -> inf, as ggml
            return x.astype(np.float16).view(np.uint8)
    if type_id == BF16:
        return _to_bf16_bits(x).view(np.uint8)
    if not np.isfinite(x).all():
        # ggml's reference code has no defined result for NaN/Inf (nearest_int asserts)
        raise QllamaError(f"cannot quantize to {type_name(type_id)}: the data contains NaN or Inf")
    gtype = GGML_TYPES[type_id]
    blocks = x.reshape(-1, gtype.block_size)  # (n_blocks, block_size), a view
    return _BLOCK_QUANTIZERS[type_id](blocks)


# =============================================================================================
# Presets and llama.cpp's per-tensor type mix
# =============================================================================================

class Preset(NamedTuple):
    """A `llama-quantize` file type: its llama_ftype value and its default tensor type."""

    name: str
    ftype: int  # enum llama_ftype, written to general.file_type
    default_type: int


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("Q4_K_M", 15, Q4_K),
        Preset("Q5_K_M", 17, Q5_K),
        Preset("Q6_K", 18, Q6_K),
        Preset("Q8_0", 7, Q8_0),
        Preset("Q4_0", 2, Q4_0),
        Preset("Q4_K_S", 14, Q4_K),
        Preset("Q5_K_S", 16, Q5_K),
        Preset("Q4_1", 3, Q4_1),
        Preset("Q5_0", 8, Q5_0),
        Preset("Q5_1", 9, Q5_1),
        Preset("F16", 1, F16),
        Preset("BF16", 32, BF16),
        Preset("F32", 0, F32),
    )
}


def get_preset(name: str) -> Preset:
    """Look up a preset by name, case-insensitively (`q4_k_m` works)."""
    for key, preset in PRESETS.items():
        if key.lower() == str(name).lower():
            return preset
    raise QllamaError(f"unknown quantization type {name!r}; choose one of: {', '.join(PRESETS)}")


# When ne0 is not a multiple of a k-quant's 256, llama.cpp falls back to a 32-block type.
_FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}

# Substrings of weight names llama.cpp never quantizes (besides 1-D tensors and *_norm.weight).
_NEVER_QUANTIZED = (
    "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d",
    "shortconv.conv.weight", "attn_rel_b.weight", "time_mix_", "position_embd", "token_types",
    ".rel_pos", ".patch_embd", ".patch_merger",
)
_LAYER_RE = re.compile(r"blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_is_quantized(name: str, shape: Iterable[int]) -> bool:
    """Whether llama.cpp quantizes this tensor at all (weights of >= 2 dims, not norms/gates...)."""
    dims = [d for d in shape]
    if len(dims) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return False
    return not any(s in name for s in _NEVER_QUANTIZED)


def _layer_index(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def choose_tensor_type(
    name: str,
    shape,
    preset: str,
    n_layers: int,
    *,
    current_type: int = F32,
    n_attn_v: int | None = None,
    tied_embeddings: bool = False,
    n_expert: int = 0,
    is_70b: bool = False,
) -> int:
    """The ggml type llama.cpp's `llama_tensor_get_type` picks for one tensor (no imatrix).

    shape is in GGUF order (ne0 first). n_layers is `{arch}.block_count`; n_attn_v the number
    of attn_v tensors (default n_layers); tied_embeddings when the file has no output.weight
    (token_embd then gets the output's type). Tensors llama.cpp does not quantize (1-D, norms...)
    keep `current_type`. The mix, for the `_M` presets: output (and tied token_embd) -> q6_K;
    attn_v and ffn_down of the use_more_bits() layers -> q6_K; a k-quant whose 256 does not divide
    ne0 falls back to q5_0 (q4_K), q5_1 (q5_K) or q8_0 (q6_K).
    """
    p = get_preset(preset)
    shape = tuple(int(d) for d in shape)
    if not tensor_is_quantized(name, shape):
        return current_type
    new = p.default_type
    ft = p.name
    if p.default_type in FLOAT_TYPES:
        return new  # F16/BF16/F32 presets: no mix, no fallback
    ne0 = shape[0]
    i_layer = _layer_index(name)
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        if ne0 % GGML_TYPES[new].block_size:
            new = Q8_0
        elif new != Q8_0:
            new = Q6_K
    elif name == "token_embd.weight":
        pass  # the preset's default type
    elif any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")):
        i = i_layer if i_layer is not None else 0
        n = n_attn_v if n_attn_v is not None else n_layers
        if ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            new = Q6_K
        elif ft == "Q4_K_S" and i < 4:
            new = Q5_K
        if is_70b and new == Q4_K:  # 8 heads share attn_v: more bits are nearly free
            new = Q5_K
        if n_expert == 8:
            new = Q8_0
    elif "attn_k.weight" in name:
        if n_expert == 8:
            new = Q8_0
    elif "ffn_down" in name:
        i = i_layer if i_layer is not None else 0
        if ft == "Q4_K_M" and use_more_bits(i, n_layers):
            new = Q6_K
        elif ft == "Q5_K_M" and use_more_bits(i, n_layers):
            new = Q6_K
        elif ft == "Q4_K_S" and i < n_layers // 8:
            new = Q5_K
    elif "attn_output.weight" in name:
        if n_expert == 8 and ft in ("Q4_K_S", "Q4_K_M"):
            new = Q5_K
    # shapes a k-quant cannot hold
    if ne0 % GGML_TYPES[new].block_size:
        new = _FALLBACK.get(new, F16)
        if ne0 % GGML_TYPES[new].block_size:
            new = F16
    return new


# =============================================================================================
# GGUF -> GGUF
# =============================================================================================

@dataclass(frozen=True)
class TensorPlan:
    """What quantize_gguf does with one tensor."""

    name: str
    shape: tuple[int, ...]  # GGUF order, ne0 first
    src_type: int
    dst_type: int
    n_elements: int
    dst_bytes: int


class RequantizeError(UnsupportedError):
    """A tensor that must be converted is already quantized, and requantizing was not allowed."""


def plan_quantization(src, preset: str, allow_requantize: bool = False) -> list[TensorPlan]:
    """The per-tensor types quantize_gguf would write for `src` (a path or an open GGUFFile).

    Raises RequantizeError when a tensor that must be converted is already quantized, unless
    allow_requantize (then it is dequantized and quantized again: the errors add up).
    """
    from .gguf import GGUFFile

    own = not isinstance(src, GGUFFile)
    g = GGUFFile(src) if own else src
    try:
        p = get_preset(preset)
        md = g.metadata
        arch = md.get("general.architecture", "")
        n_layers = int(md.get(f"{arch}.block_count", 0) or 0)
        names = list(g.tensors)
        n_attn_v = sum(1 for n in names if any(s in n for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")))
        tied = "output.weight" not in g.tensors
        n_head = md.get(f"{arch}.attention.head_count", 0)
        n_head_kv = md.get(f"{arch}.attention.head_count_kv", n_head)
        is_70b = arch == "llama" and n_layers == 80 and _scalar(n_head) != _scalar(n_head_kv)
        n_expert = int(_scalar(md.get(f"{arch}.expert_count", 0)) or 0)
        plans = []
        for t in g.tensors.values():
            dst = choose_tensor_type(
                t.name, t.shape, p.name, n_layers, current_type=t.type_id, n_attn_v=n_attn_v,
                tied_embeddings=tied, n_expert=n_expert, is_70b=is_70b,
            )
            if dst != t.type_id and t.type_id not in FLOAT_TYPES and not allow_requantize:
                raise RequantizeError(
                    f"tensor {t.name!r} is already quantized ({t.type_name}); requantizing to "
                    f"{type_name(dst)} would compound the error: quantize from the f32/f16/bf16 model"
                )
            n_bytes = t.n_bytes if dst == t.type_id else t.n_elements // GGML_TYPES[dst].block_size * GGML_TYPES[dst].type_size
            if n_bytes is None:
                raise UnsupportedError(f"tensor {t.name!r} has an unknown type id {t.type_id}")
            plans.append(TensorPlan(t.name, t.shape, t.type_id, dst, t.n_elements, n_bytes))
        return plans
    finally:
        if own:
            g.close()


def _scalar(v: Any) -> Any:
    """Per-layer arrays (some archs store head counts per layer): take the first value."""
    if isinstance(v, np.ndarray):
        return v.flat[0].item() if v.size else 0
    return v


def _copy_metadata(writer, g) -> None:
    """Copy every metadata key of GGUFFile g to a GGUFWriter, keeping each value's GGUF type."""
    from gguf import GGUFValueType

    from .gguf import ValueType

    skip = {"general.architecture", "general.alignment", "general.file_type", "general.quantization_version",
            "split.no", "split.count", "split.tensors.count"}  # set by the writer / ours / not a split
    for key, value in g.metadata.items():
        if key in skip:
            continue
        mtype = g.metadata_types[key]
        vt = GGUFValueType(int(mtype.type))
        if mtype.type == ValueType.STRING:
            writer.add_key_value(key, _encode(value), vt)
        elif mtype.type == ValueType.ARRAY:
            items = _array_items(value)
            if len(items) == 0:
                # GGUFWriter cannot write an empty array; nothing reads an empty array anyway
                log.warning("quantize: metadata key %s is an empty array and is not copied", key)
                continue
            sub = GGUFValueType(int(mtype.item.type)) if mtype.item is not None else None
            writer.add_key_value(key, items, vt, sub_type=sub)
        else:
            writer.add_key_value(key, value, vt)


def _encode(s: str) -> bytes:
    # surrogateescape: the reader keeps invalid UTF-8 this way; write back the original bytes
    return s.encode("utf-8", "surrogateescape")


def _array_items(value: Any) -> list:
    """A metadata array as the list GGUFWriter packs (numpy views -> python lists, str -> bytes)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return [_encode(v) if isinstance(v, str) else _array_items(v) if isinstance(v, (list, np.ndarray)) else v for v in value]


def _tensor_as_f32_rows(g, t, r0: int, r1: int) -> np.ndarray:
    """Rows r0:r1 of a tensor as float32 (r1-r0, ne0): f16/bf16 are widened exactly, a quantized
    tensor (requantizing) is dequantized by QTensor."""
    ne0 = t.shape[0] if t.shape else 1
    if t.type_id not in FLOAT_TYPES:
        from .qtensor import QTensor

        return QTensor.from_gguf(g, t.name).dequantize(slice(r0, r1))
    arr = g.tensor_array(t.name).reshape(-1, ne0)[r0:r1]  # zero-copy view of the mmap
    if t.type_id == BF16:
        return bf16_to_f32(arr)
    return np.ascontiguousarray(arr, dtype=np.float32)


def quantize_gguf(
    src_path,
    dst_path,
    preset: str,
    progress: Callable[[int, int, str], None] | None = None,
    *,
    force: bool = False,
    allow_requantize: bool = False,
) -> None:
    """Quantize a f32/f16/bf16 GGUF model to a llama.cpp preset (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0...).

    Writes dst_path with gguf's GGUFWriter: all metadata copied with its types, general.file_type
    set to the preset's llama_ftype and general.quantization_version to 2; the tensors in input
    order, each converted as `plan_quantization` says. progress(done, total, tensor_name) is
    called after each tensor (done/total count elements). The output appears atomically (a
    temporary file is renamed); it refuses to overwrite the input, and an existing output unless
    force=True. A quantized input is refused unless allow_requantize (see plan_quantization).
    """
    import gguf as gguf_py

    from .gguf import GGUFFile

    p = get_preset(preset)
    src_path = os.fspath(src_path)
    dst_path = os.fspath(dst_path)
    if not os.path.exists(src_path):
        raise QllamaError(f"{src_path}: no such file")
    if os.path.exists(dst_path):
        if os.path.samefile(src_path, dst_path):
            raise QllamaError(f"{dst_path}: the output would overwrite the input")
        if not force:
            raise QllamaError(f"{dst_path} exists (use --force to overwrite it)")
        if os.path.isdir(dst_path):
            raise QllamaError(f"{dst_path}: is a directory")

    with GGUFFile(src_path) as g:
        arch = g.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(f"{src_path}: no general.architecture: not a model file")
        plans = plan_quantization(g, p.name, allow_requantize=allow_requantize)
        total = sum(pl.n_elements for pl in plans)

        tmp_path = f"{dst_path}.tmp{os.getpid()}"
        writer = gguf_py.GGUFWriter(tmp_path, arch)
        try:
            if "general.alignment" in g.metadata:
                writer.add_custom_alignment(int(g.alignment))
            _copy_metadata(writer, g)
            writer.add_quantization_version(GGML_QNT_VERSION)
            writer.add_file_type(p.ftype)
            for pl in plans:
                # GGUFWriter wants the numpy (reversed) shape; with uint8 + raw_dtype, the byte shape
                np_shape = tuple(reversed(pl.shape)) or (1,)
                gt = GGML_TYPES[pl.dst_type]
                byte_shape = (*np_shape[:-1], np_shape[-1] // gt.block_size * gt.type_size)
                writer.add_tensor_info(pl.name, byte_shape, np.dtype(np.uint8), pl.dst_bytes,
                                       raw_dtype=gguf_py.GGMLQuantizationType(pl.dst_type))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            done = 0
            for pl in plans:
                t = g.tensors[pl.name]
                if pl.dst_type == pl.src_type:
                    data = g.tensor_bytes(pl.name)
                else:
                    ne0 = pl.shape[0] if pl.shape else 1
                    n_rows = pl.n_elements // ne0
                    row_bytes = GGML_TYPES[pl.dst_type].row_bytes(ne0)
                    data = np.empty((n_rows, row_bytes), np.uint8)
                    step = max(1, _CHUNK_ELEMENTS // max(ne0, 1))
                    for r0 in range(0, n_rows, step):
                        rows = _tensor_as_f32_rows(g, t, r0, r0 + step)
                        data[r0 : r0 + step] = quantize_array(rows, pl.dst_type)
                writer.write_tensor_data(data.reshape(-1))
                done += pl.n_elements
                if progress is not None:
                    progress(done, total, pl.name)
            writer.close()
            os.replace(tmp_path, dst_path)
        except BaseException:
            writer.close()
            try:
                os.unlink(tmp_path)
            except OSError:
                pass
            raise
