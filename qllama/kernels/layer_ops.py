"""Numba kernels for the non-matmul parts of a transformer layer, shared by every family:
RMSNorm, RoPE (+ KV-cache store), attention over the cache, gated FFN activations.

Family differences are parameters, not copies:
- RoPE layout: `neox` False rotates interleaved pairs (x[2i], x[2i+1]) (llama); True rotates
  halves (x[i], x[i + n_rot/2]) (qwen, gemma, phi).
- KV cache: a layer's cache holds `ring` slots; position p lives in slot p % ring. A full
  layer has ring = n_ctx (slot = position); a sliding-window layer keeps only the last
  window + batch positions, as llama.cpp's SWA cache does.
- KV cache element type: float32 arrays, or uint16 arrays of f16 bits (llama.cpp's default
  cache). The same source compiles for either (Numba specialises on the array types; `_load`,
  `_encode`, `_as_stored` pick the conversion). With f16 keys, the queries are rounded to f16
  before the q.k dots, and with f16 values the normalised probabilities are rounded to f16
  before the weighted sum: that is what ggml's mul_mat does with an f16 matrix (it converts
  the other operand to f16, then sums the products in float32), so the logits follow
  llama.cpp's default cache. Rounding is to nearest even, as ggml's fp32 -> fp16 (F16C
  vcvtps2ph); loads convert with vcvtph2ps where the host has F16C.
- attention: `window` (0 = none) masks keys at distance >= window, as llama.cpp's
  is_masked_swa; `softcap` (0 = none) maps scores s -> cap * tanh(s / cap) before softmax.
- gated FFN: `act` ACT_SILU (SwiGLU) or ACT_GELU (GELU, tanh approximation, GeGLU).

Shapes use T for tokens in the batch, H for query heads, Hkv for KV heads, D for head_dim.

Speed notes:
- Numba has no vectorised `exp` without Intel SVML, and a scalar libm call costs ~20 ns: at depth
  1024 the softmax alone would take ~10 ms per token. `_exp_shifted` is a Cephes-style expf
  (range reduction to r in [-ln2/2, ln2/2], degree-6 polynomial, 2^k built from its IEEE bits)
  written as plain counted loops over float32/int32 so that LLVM vectorises it (16 lanes on
  AVX-512). Its relative error is below 3e-7 (a few ulp); ggml's SIMD silu/softmax use the same
  kind of approximation. tanh (softcap) and GELU are written through it too:
  tanh(y) = 1 - 2 / (exp(2y) + 1) and gelu(x) = x / (1 + exp(-2u)), u = sqrt(2/pi)(x + 0.044715x^3).
- Attention has a parallel form and a serial one: decode-sized work is done without waking the
  thread pool (each wake-up costs microseconds on a quiet machine and milliseconds on a loaded
  one). The Python side picks one with `attention_parallel_pays`. Both run `_attend_jobs`, so
  its long body compiles once. The other kernels here are serial: their work is small next to
  the mat-muls, and each parallel region costs a second or more to compile on the first run.
- Attention works per KV head: the n_rep query heads that share it read each cached key and
  value row once, one after another, while the row is in L1.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from ._fp16 import HAVE_F16C, f16_bits, f16_value, f16c_load, f16c_store
from ._glu import glu16
from ._scores import LANES as SCORE_LANES
from ._scores import scores16x1, scores16x4, scores16x8, scores32x4
from ._softmax import exp_sum16, row_max16
from ._value_sums import BLOCK as VALUE_BLOCK
from ._value_sums import LANES as VALUE_LANES
from ._value_sums import lane_sum16, value_block1, value_block2, value_block4
from .jit import address_of, call_address, kernel

# float32 constants (module globals are frozen into the kernels with their float32 type)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # ln 2 split in two (Cody-Waite): k*HI is exact for |k| < 2^9
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.3)  # exp of less is below the smallest normal float32: clamped (~1e-38)
_EXP_MAX = np.float32(88.37)  # keeps k <= 127 (2^128 is not a float32): larger inputs clamp (~2.4e38)
_HALF = np.float32(0.5)
_NEG_INF = np.float32(-np.inf)
_BIAS = np.float32(127.0)  # IEEE float32 exponent bias
_MANT = np.float32(8388608.0)  # 2^23: one unit of the exponent field
# Cephes expf polynomial: exp(r) ~ 1 + r + r^2 * P(r), |r| <= ln2/2
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_F2 = np.float32(2.0)

ACT_SILU = 0  # gated FFN activations (the `act` parameter)
ACT_GELU = 1

# -- KV cache element types: float32, or f16 bits in uint16 ---------------------------------

def _load(x):
    """A cache element as float32 (f16 bits are converted)."""


def _encode(cache, x):
    """float32 x as an element of `cache` (f16 bits: rounded to nearest even)."""


def _as_stored(cache, x):
    """float32 x rounded as `cache` would store it (identity for a float32 cache)."""


@overload(_load, inline="always")
def _load_impl(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if x == types.uint16:
        if HAVE_F16C:
            return lambda x: f16c_load(x)
        return lambda x: f16_value(np.int32(x))
    return None


def _is_half_array(cache) -> bool:
    return isinstance(cache, types.Array) and cache.dtype == types.uint16


@overload(_encode, inline="always")
def _encode_impl(cache, x):
    if not _is_half_array(cache):
        return lambda cache, x: x
    if HAVE_F16C:
        return lambda cache, x: f16c_store(np.float32(x))
    return lambda cache, x: f16_bits(x)


def _is_half(cache):
    """Whether `cache` holds f16 bits (a compile-time constant)."""


@overload(_is_half, inline="always")
def _is_half_impl(cache):
    flag = _is_half_array(cache)
    return lambda cache: flag


@overload(_as_stored, inline="always")
def _as_stored_impl(cache, x):
    if not _is_half_array(cache):
        return lambda cache, x: x
    return lambda cache, x: _load(_encode(cache, x))


@kernel(fastmath=True)
def round_f16(x, out, portable):
    """out[i] = the f16 bits of float32 x[i] (1-D arrays; out uint16), through the kernels'
    conversion (F16C where present) or, with portable, the integer fallback; for tests."""
    for i in range(x.shape[0]):
        out[i] = f16_bits(x[i]) if portable else _encode(out, x[i])


# Numba's fastmath without reassociation: keeps the Cody-Waite reduction exact; the loops have
# no reductions, so they vectorise without it.
_EXP_FLAGS = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}

EXP_BLOCK = 256  # elements per scratch block of the vectorised exp


@kernel(fastmath=_EXP_FLAGS)
def _exp_shifted(x, n, shift, bits, fbits):
    """x[:n] = exp(x[:n] - shift) in place. bits: int32 scratch (>= n); fbits: its float32 view."""
    for i in range(n):
        v = min(max(x[i] - shift, _EXP_MIN), _EXP_MAX)
        k = np.floor(v * _LOG2E + _HALF)  # exp(v) = 2^k * exp(r)
        r = (v - k * _LN2_HI) - k * _LN2_LO
        p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
        x[i] = p * r * r + r + _F1
        # the float32 bits of 2^k, computed in float (exact: an integer times 2^23 < 2^31) so
        # that the lanes stay 32-bit (Numba widens int32 arithmetic to int64)
        bits[i] = np.int32((k + _BIAS) * _MANT)
    for i in range(n):
        x[i] *= fbits[i]


@kernel(fastmath=True)
def exp_f32(x, out):
    """out = exp(x) for 1-D float32 arrays, with the vectorised approximation (for tests and reuse)."""
    n = x.shape[0]
    bits = np.empty(EXP_BLOCK, np.int32)
    fbits = bits.view(np.float32)
    for b0 in range(0, n, EXP_BLOCK):
        m = min(EXP_BLOCK, n - b0)
        blk = out[b0 : b0 + m]
        for i in range(m):
            blk[i] = x[b0 + i]
        _exp_shifted(blk, m, _F0, bits, fbits)


@kernel(fastmath=True)
def rmsnorm(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight.   x, out: (T, d) float32; weight: (d,)."""
    n_tok, dim = x.shape
    for t in range(n_tok):
        acc = 0.0  # float64 sum, as ggml does
        for i in range(dim):
            v = np.float64(x[t, i])
            acc += v * v
        scale = np.float32(1.0 / math.sqrt(acc / dim + eps))
        for i in range(dim):
            out[t, i] = (x[t, i] * scale) * weight[i]


@kernel(inline="always")
def rope_row(x, y, p, cos_table, sin_table, neox):
    """y = x (one head's row, (D,)) rotated for position p: pairs (i * step, i * step + off) of
    the first n_rot dims (neox: halves, off = n_rot/2; else interleaved, off = 1); y may be x.
    Inlined, so it has its caller's fast-math flags (`rope_store` and `rope_store_quant`: the
    same bits)."""
    half = cos_table.shape[1]
    step = 1 if neox else 2
    off = half if neox else 1
    for i in range(half):
        c = cos_table[p, i]
        s = sin_table[p, i]
        i0 = i * step
        x0 = x[i0]
        x1 = x[i0 + off]
        y[i0] = x0 * c - x1 * s
        y[i0 + off] = x0 * s + x1 * c


@kernel(inline="always")
def rope_heads(q, t, p, cos_table, sin_table, neox):
    """`rope_row` in place on every head of token t of q (T, H, D), for position p."""
    for h in range(q.shape[1]):
        rope_row(q[t, h], q[t, h], p, cos_table, sin_table, neox)


@kernel(fastmath=True)
def rope_store(q, k, v, start, cos_table, sin_table, kt_cache, vt_cache, neox):
    """RoPE on q and k (in place) for positions start.., then k and v into the cache, in one call.

    q: (T, H, D); k, v: (T, Hkv, D); cos/sin_table: (n_ctx, n_rot/2); kt_cache, vt_cache:
    (Hkv, D, ring) keys and values stored d-major (see `_attend_jobs`); float32, the caches float32
    or f16 bits (rounded to nearest even on store), one layer.
    Position p goes to slot p % ring. neox: rotate halves (i, i + n_rot/2) instead of
    interleaved pairs (2i, 2i+1). Dims past n_rot are not rotated.
    """
    n_tok, head_dim = q.shape[0], q.shape[2]
    n_kv = k.shape[1]
    half = cos_table.shape[1]
    ring = kt_cache.shape[2]
    step = 1 if neox else 2  # element index of pair i: (i * step, i * step + off)
    off = half if neox else 1
    for t in range(n_tok):
        p = start + t
        slot = p % ring
        rope_heads(q, t, p, cos_table, sin_table, neox)
        for h in range(n_kv):
            for d in range(2 * half, head_dim):  # dims past n_rot are not rotated
                kt_cache[h, d, slot] = _encode(kt_cache, k[t, h, d])
            for i in range(half):
                c = cos_table[p, i]
                s = sin_table[p, i]
                i0 = i * step
                x0 = k[t, h, i0]
                x1 = k[t, h, i0 + off]
                kt_cache[h, i0, slot] = _encode(kt_cache, x0 * c - x1 * s)
                kt_cache[h, i0 + off, slot] = _encode(kt_cache, x0 * s + x1 * c)
            for d in range(head_dim):
                vt_cache[h, d, slot] = _encode(vt_cache, v[t, h, d])


@kernel(inline="always")
def _dots4(a0, a1, a2, a3, u0, u1, u2, u3, uo, v, n):
    """(a_r + sum_j u_r[uo + j] * v[j] for r = 0..3): four heads' dots with one row v (cache
    elements, `_load`ed once for the four; float32 rows as they are). Inlined: the caller's
    fast-math flags."""
    for j in range(n):
        x = _load(v[j])
        a0 += u0[uo + j] * x
        a1 += u1[uo + j] * x
        a2 += u2[uo + j] * x
        a3 += u3[uo + j] * x
    return a0, a1, a2, a3


@kernel(fastmath=True)
def _softcap(x, n, cap, bits, fbits):
    """x[:n] = cap * tanh(x[:n] / cap) in place, as cap - 2 cap / (exp(2 x / cap) + 1)."""
    two_over = _F2 / cap
    for i in range(n):
        x[i] *= two_over
    _exp_shifted(x, n, _F0, bits, fbits)  # clamped: saturates to +-cap
    for i in range(n):
        x[i] = cap - _F2 * cap / (x[i] + _F1)


@kernel(inline="always")
def row_max(x, n, lanes):
    """The largest of x[:n] (float32; -inf when n = 0), through 16 running maxima in `lanes` (a (16,)
    float32 scratch): a max has the same value in any order, and the one running maximum of a
    plain loop is a chain of compare-and-select that LLVM does not vectorise (1.2 ns per element
    against 0.3-0.4). Inlined: its caller's fast-math flags. (The f16 cache's attention uses
    `_softmax.row_max16`, which keeps the maxima in a register: 0.09 ns.)"""
    for i in range(SCORE_LANES):
        lanes[i] = _NEG_INF
    full = n - n % SCORE_LANES
    for j in range(0, full, SCORE_LANES):
        for i in range(SCORE_LANES):
            v = x[j + i]
            lanes[i] = v if v > lanes[i] else lanes[i]
    best = _NEG_INF
    for j in range(full, n):
        best = x[j] if x[j] > best else best
    for i in range(SCORE_LANES):
        best = lanes[i] if lanes[i] > best else best
    return best


@kernel
def _key_range(p, window):
    """(first visible position, number of keys) for a query at position p: keys p - window + 1 .. p."""
    lo = p - window + 1 if window > 0 and p - window + 1 > 0 else 0
    return lo, p + 1 - lo


@kernel
def padded_rows(n_rep):
    """The query rows the score and value calls take for a group of n_rep heads: 1, 4, or a
    multiple of 8 (rows past n_rep are zero queries with zero probabilities, computed and
    ignored). One call for the whole group converts each key and value once for it, and keeps
    4-8 chains of multiply-adds in flight (`_scores`); two calls of 4 for a group of 7 took 1.4x
    as long as one of 8."""
    if n_rep == 1:
        return 1
    if n_rep <= 4:
        return 4
    return (n_rep + 7) // 8 * 8


@kernel(inline="always")
def _score_block(kt, kvh, slot, qbuf, n_rows, scale, out, j):
    """out[r, j:j+16] = scale * (qbuf[r] . key) for the 16 keys in slots slot.. of kv head kvh,
    every query row r < n_rows (`padded_rows`). A row's bits do not depend on the call."""
    if n_rows == 1:
        scores16x1(kt, kvh, slot, qbuf, 0, scale, out, j)
    elif n_rows == 4:
        scores16x4(kt, kvh, slot, qbuf, 0, scale, out, j)
    else:
        for r in range(0, n_rows, 8):
            scores16x8(kt, kvh, slot, qbuf, r, scale, out, j)


@kernel
def _score_run(kt, kvh, slot, n, qbuf, n_rows, scale, scores, j, tail, tail_scores):
    """scores[r, j:j+n] = scale * (qbuf[r] . key) for the keys in slots slot..slot+n-1 of kv head
    kvh, every query row r < n_rows, 16 slots at a time (32 for a group of 4 rows: 8 chains); the
    last n % 16 keys are copied into `tail` (1, D, 16), zero-padded, and go through the same call."""
    full = n - n % SCORE_LANES
    i = 0
    if n_rows == 4:
        while i + 2 * SCORE_LANES <= full:
            scores32x4(kt, kvh, slot + i, qbuf, 0, scale, scores, j + i)
            i += 2 * SCORE_LANES
    while i < full:
        _score_block(kt, kvh, slot + i, qbuf, n_rows, scale, scores, j + i)
        i += SCORE_LANES
    m = n - full
    if m > 0:
        for d in range(kt.shape[1]):
            for i in range(m):
                tail[0, d, i] = kt[kvh, d, slot + full + i]
            for i in range(m, SCORE_LANES):
                tail[0, d, i] = 0
        _score_block(tail, 0, 0, qbuf, n_rows, scale, tail_scores, 0)
        for r in range(n_rows):
            for i in range(m):
                scores[r, j + full + i] = tail_scores[r, i]


@kernel
def _value_rows(vrows, col, probs, n_rep, n_rows, pj, acc):
    """acc[:, r] += the products of probability rows r (columns pj..pj+63) with the values in
    columns col..col+63 of vrows (D, N) (`_value_sums`): rows 0..1 for n_rep <= 2, else every one
    of the n_rows (`padded_rows`), four per call."""
    if n_rep == 1:
        value_block1(vrows, col, probs, 0, pj, acc)
    elif n_rep == 2:
        value_block2(vrows, col, probs, 0, pj, acc)
    else:
        for r in range(0, n_rows, 4):
            value_block4(vrows, col, probs, r, pj, acc)


@kernel(fastmath=True)
def _attend_jobs(q, kt_cache, vt_cache, start_pos, n_rep, scale, window, softcap, q_scaled, sinks, out, first, step):
    """Attention for the jobs first, first + step, ... of the (token t, KV head kvh) jobs, job
    kvh * T + t: for each, the n_rep query heads of kvh attend over the keys token t sees. (Head
    by head, not token by token: one head's keys and values, 1 MB at depth 4096 in f16, stay in L2
    for all its tokens; token-major order read every head's from L3 for each token. Depth 8000,
    128 tokens, one thread: 1.23x faster. A job's arithmetic does not depend on the order.)

    The one function body of both `attention_serial` (all jobs) and `attention` (one job stride
    per parallel chunk): it is compiled once, and each job's arithmetic is the same however
    the jobs are spread. Shapes and arguments: see `attention_serial`.

    kt_cache: (Hkv, D, ring), keys d-major: the scores of 16 consecutive slots are one vector of
    fused multiply-adds over d (`_scores`: no horizontal sum per key, and bits that do
    not depend on the ISA or on how many tokens are computed together); position p is in slot
    p % ring (the range may wrap around the ring once).
    vt_cache: (Hkv, D, ring), values d-major: out[h, d] = sum_j p[h, j] v[d, j] in blocks of 64 keys
    (`_value_sums`: a block's probabilities stay in registers for every d, and each converted value
    serves four heads), summed in lanes in key order. A range that wraps around the ring is first
    copied into key order (`vkey`), so that these sums see the same blocks however the ring lies: a
    window layer's rows are then equal for every batch size (its ring's size, and so where it
    wraps, depends on the batch).
    softcap > 0: cap the scores (Gemma 2). Either cache may hold f16 bits (see the module
    docstring for the rounding); q_scaled: with f16 keys, the queries are multiplied by `scale`
    before they are rounded, as the llama.cpp graphs that scale Q themselves (Gemma, Phi-3)
    have them (f32 keys: unused). sinks: (H,) float32 attention sinks (gpt-oss: one more logit per
    query head in the softmax's max and denominator, with no value), or an empty array: none (the
    branches below are not taken, every other family's arithmetic is unchanged).
    """
    n_tok = q.shape[0]
    has_sinks = sinks.shape[0] > 0
    n_kv = kt_cache.shape[0]
    n_max = min(start_pos + n_tok, kt_cache.shape[2])
    n_rows = padded_rows(n_rep)
    qbuf = np.zeros((n_rows, q.shape[2]), np.float32)  # scratch: the queries as the keys are stored
    scores = np.empty((n_rows, n_max + VALUE_BLOCK), np.float32)  # (+ room for a zero-padded last value block)
    totals = np.empty(n_rep, np.float32)
    bits = np.empty(n_max, np.int32)  # int32 scratch for _exp_shifted, and its float32 view
    fbits = bits.view(np.float32)
    tail = np.zeros((1, q.shape[2], SCORE_LANES), kt_cache.dtype)  # a run's last < 16 keys, zero-padded
    tail_scores = np.empty((n_rows, SCORE_LANES), np.float32)
    acc = np.empty((q.shape[2], n_rows, VALUE_LANES), np.float32)  # the value sums' lanes (see _value_sums)
    vtail = np.zeros((q.shape[2], VALUE_BLOCK), vt_cache.dtype)  # the last < 64 keys' values, zero-padded
    wraps = start_pos + n_tok > vt_cache.shape[2]  # (a window layer's ring: a range may wrap around it)
    vkey = np.empty((q.shape[2], n_max if wraps else 0), vt_cache.dtype)  # a wrapped range's values in key order
    for job in range(first, n_tok * n_kv, step):
        t = job % n_tok  # (kv-head-major: one head's keys and values stay in L2 across its tokens)
        kvh = job // n_tok
        lo, n_keys = _key_range(start_pos + t, window)
        head_dim = q.shape[2]
        ring = kt_cache.shape[2]
        s0 = lo % ring  # slot of the first key
        n1 = min(n_keys, ring - s0)  # keys in slots s0.. before the wrap
        h0 = kvh * n_rep
        pre = q_scaled and _is_half(kt_cache)
        q_mul = scale if pre else _F1  # scale applied to q before rounding, or to the dot products
        dot_scale = _F1 if pre else scale
        for r in range(n_rep):  # the queries as the key type holds them (f16 keys: rounded, as ggml)
            for d in range(head_dim):
                qbuf[r, d] = _as_stored(kt_cache, q[t, h0 + r, d] * q_mul)
        _score_run(kt_cache, kvh, s0, n1, qbuf, n_rows, dot_scale, scores, 0, tail, tail_scores)
        _score_run(kt_cache, kvh, 0, n_keys - n1, qbuf, n_rows, dot_scale, scores, n1, tail, tail_scores)
        for r in range(n_rep):
            sr = scores[r]
            if softcap > _F0:
                _softcap(sr, n_keys, softcap, bits, fbits)
            best = row_max16(scores, r, n_keys)
            if has_sinks:
                best = sinks[h0 + r] if sinks[h0 + r] > best else best
            total = exp_sum16(scores, r, n_keys, best)  # stable softmax: the largest term is exp(0)
            if has_sinks:  # the sink's term joins the denominator only
                total += np.float32(math.exp(sinks[h0 + r] - best))
            if _is_half(vt_cache):  # ggml: probabilities normalised, then rounded to f16 for the V product
                inv = _F1 / total
                for j in range(n_keys):
                    sr[j] = _as_stored(vt_cache, sr[j] * inv)
                total = _F1
            totals[r] = total
        vsrc = vt_cache[kvh]  # (D, ring): the values, read in key order from column vcol
        vcol = s0
        if n_keys > n1:  # positions lo.. up to the wrap, then the rest from slot 0, copied into key
            for d in range(head_dim):  # order: the sums see the same blocks however the ring lies
                for j in range(n1):
                    vkey[d, j] = vt_cache[kvh, d, s0 + j]
                for j in range(n_keys - n1):
                    vkey[d, n1 + j] = vt_cache[kvh, d, j]
            vsrc = vkey
            vcol = 0
        acc[:] = _F0
        full = n_keys - n_keys % VALUE_BLOCK
        for r in range(n_rep, n_rows):  # the padding rows: zero probabilities (their scores are not used)
            for j in range(full + VALUE_BLOCK):
                scores[r, j] = _F0
        for b in range(0, full, VALUE_BLOCK):
            _value_rows(vsrc, vcol + b, scores, n_rep, n_rows, b, acc)
        m = n_keys - full
        if m > 0:  # the last < 64 keys: zero-padded values and probabilities (zero products)
            for d in range(head_dim):
                for i in range(m):
                    vtail[d, i] = vsrc[d, vcol + full + i]
                for i in range(m, VALUE_BLOCK):
                    vtail[d, i] = 0
            for r in range(n_rep):
                for i in range(m, VALUE_BLOCK):
                    scores[r, full + i] = _F0
            _value_rows(vtail, 0, scores, n_rep, n_rows, full, acc)
        for r in range(n_rep):
            for d in range(head_dim):
                out[t, h0 + r, d] = lane_sum16(acc, d, r) / totals[r]


def _typed(start_pos, n_rep, scale, window, softcap, q_scaled) -> tuple:
    """The scalar arguments of `_attend_jobs` in the one set of types it is compiled for."""
    return np.int64(start_pos), np.int64(n_rep), np.float32(scale), np.int64(window), np.float32(softcap), bool(q_scaled)


NO_SINKS = np.zeros(0, np.float32)  # `_attend_jobs`'s sinks when a model has none
NO_SINKS.flags.writeable = False


def _sinks(sinks) -> np.ndarray:
    if sinks is None:
        return NO_SINKS
    s = np.ascontiguousarray(sinks, dtype=np.float32)
    s.flags.writeable = False  # (one array type for the compiled code, as NO_SINKS)
    return s


def attention_serial(q, kt_cache, vt_cache, start_pos, n_rep, scale, window, softcap, q_scaled, out, sinks=None):
    """Causal grouped-query attention over the cache, on the calling thread (decode-sized work).

    q: (T, H, D) float32 (already roped); kt_cache, vt_cache: (Hkv, D, ring) (keys and values d-major)
    float32 or f16 bits (uint16) for one layer, holding positions [start_pos + T - ring, start_pos + T) (all of
    [0, start_pos + T) when ring = n_ctx); out: (T, H, D) float32. Token t sees the keys at
    positions start_pos + t - window + 1 .. start_pos + t (window 0: from 0). q_scaled: see `_attend_jobs`.
    sinks: (H,) float32 attention sinks, or None (see `_attend_jobs`).
    (A Python function: a compiled wrapper would compile the whole body once more.)
    """
    _attend_jobs(q, kt_cache, vt_cache, *_typed(start_pos, n_rep, scale, window, softcap, q_scaled), _sinks(sinks), out,
                 0, 1)


ATTENTION_CHUNKS = 16  # job strides of the parallel form: contiguous runs of them per thread stay balanced


def attention(q, kt_cache, vt_cache, start_pos, n_rep, scale, window, softcap, q_scaled, out, sinks=None):
    """`attention_serial` with the jobs spread over the threads (one parallel region), computing
    exactly the same: `_attention_chunks` calls the same compiled `_attend_jobs` by its address."""
    args = (q, kt_cache, vt_cache, *_typed(start_pos, n_rep, scale, window, softcap, q_scaled), _sinks(sinks), out)
    arrays = (q, kt_cache, vt_cache, out)
    if not all(a.flags.c_contiguous and a.flags.aligned for a in arrays):  # (the address is for C-contiguous arrays)
        _attend_jobs(*args, 0, 1)
        return
    no_jobs = (*args, q.shape[0] * kt_cache.shape[0], 1)  # (first = every job: only compiles, or loads, it)
    _attention_chunks(address_of(_attend_jobs, no_jobs, lambda: _attend_jobs(*no_jobs)), *args)


@kernel(parallel=True)
def _attention_chunks(jobs_address, q, kt_cache, vt_cache, start_pos, n_rep, scale, window, softcap, q_scaled, sinks,
                      out):
    """The parallel region of `attention`: chunk c runs _attend_jobs (at jobs_address) for every
    ATTENTION_CHUNKS-th job from c, so that each thread gets early (short) and late (long)
    tokens of a causal batch alike. jobs_address 0: nothing (a recording warm-up's call)."""
    if jobs_address == 0:
        return
    n_jobs = q.shape[0] * kt_cache.shape[0]
    n_chunks = min(n_jobs, ATTENTION_CHUNKS)
    for c in prange(n_chunks):
        call_address(jobs_address, q, kt_cache, vt_cache, start_pos, n_rep, scale, window, softcap, q_scaled, sinks,
                     out, np.int64(c), np.int64(n_chunks))


# below this many (query head x key) dot products, waking the thread pool costs more than it saves
ATTENTION_PARALLEL_MIN = 16384


def attention_parallel_pays(n_tok: int, start_pos: int, n_head: int, n_threads: int) -> bool:
    """Whether `attention` (parallel) beats `attention_serial` for this much work."""
    n_dots = n_head * n_tok * (start_pos + (n_tok + 1) / 2)
    return n_threads > 1 and n_dots >= ATTENTION_PARALLEL_MIN


@kernel(fastmath=False)  # explicit: a callee without the option compiles with its caller's flags
def glu(gate, up, out, act):
    """out = act(gate) * up, all (T, n_ff) float32 (out may be gate); act ACT_SILU or ACT_GELU.

    Row by row in 16-lane vectors (`_glu.glu16`); a row's last n_ff % 16 elements go through the
    same vector code on a zero-padded copy, so every element has the same bits wherever it is.
    On the calling thread even for a prompt: 512 x 8192 takes ~4 ms next to the ~600 ms of
    mat-muls around it, and a parallel form would cost more to compile than it could save.
    """
    n_tok, n_ff = gate.shape
    n_vec = n_ff // 16
    m = n_ff - 16 * n_vec
    gelu = act == ACT_GELU
    g1 = np.zeros((1, 16), np.float32)  # the padded tail of a row
    u1 = np.zeros((1, 16), np.float32)
    for t in range(n_tok):
        glu16(gate, up, out, t, n_vec, gelu)
        if m:
            for i in range(m):
                g1[0, i] = gate[t, 16 * n_vec + i]
                u1[0, i] = up[t, 16 * n_vec + i]
            glu16(g1, u1, g1, 0, 1, gelu)
            for i in range(m):
                out[t, 16 * n_vec + i] = g1[0, i]
