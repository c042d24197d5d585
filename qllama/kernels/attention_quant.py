"""Attention over a quantized KV cache (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl keys and/or values),
and the store of new keys and values into it.

A cache with a quantized K or V keeps both row-major, as ggml blocks of 32: one layer's keys
are uint8 (Hkv, ring, D/32 * block bytes), position p in slot p % ring, and the values the same
(an f16 or f32 partner of a quantized type is kept in that layout too, as 32-element "blocks"
of 64 or 128 bytes). Type codes are ggml's type ids (F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6,
Q5_1 7, Q8_0 8, IQ4_NL 20).

Storing (`rope_store_quant`): RoPE as `layer_ops.rope_store`, then each key and value row is
quantized as ggml's reference quantizers do (`quantize_row_q8_0_ref` etc.; bytes equal
`qllama.quantize.blocks`), f16 rounded to nearest even.

Attention follows llama.cpp's CPU flash attention (`ggml_compute_forward_flash_attn_ext_f16`),
which is how llama.cpp runs a quantized cache:
- each query head is converted to K's vec_dot type: q8_0 for q8_0/q4_0/q5_0/iq4_nl keys, q8_1
  for q4_1/q5_1 (`act_quant.q8_0_row` / `q8_1_row`, as ggml's x86 quantize_row_q8_0/q8_1), f16
  for f16 keys; a score is the type's vec_dot, d_k d_q sum(q_k q_q) (+ m_k s_q for q4_1/q5_1)
  per block, computed as a float32 dot of the dequantized key row with the dequantized query
  (both exact in float32 but for q4_1/q5_1's q * d + m; the products and sums round: ~1e-7
  relative to ggml's int32 sums), four query heads per pass over a key row, as
  `layer_ops._attend_jobs`;
- scores times the scale (with `q_scaled`, Q was multiplied by it before the conversion, as the
  graphs that scale Q themselves have it), softcap, window mask;
- softmax in float32 and the values dequantized row by row to float32 (ggml's to_float) and
  accumulated in float32 with weights exp(s - max), then multiplied by 1 / sum.
ggml does the softmax online (rescaling its accumulator when a new maximum appears); here the
maximum is found first (the scores of a job are all in a buffer), so each weight is exp(s - max)
directly, which is the same sum up to float32 rounding, and lets exp run vectorised.

The jobs are (token, KV head) pairs, as `layer_ops._attend_jobs`: the n_rep query heads of a KV
head read each key and value block once, while it is in L1.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .act_quant import q8_0_row, q8_1_row
from .jit import address_of, call_address, kernel
from ._fp16 import HAVE_F16C, f16_bits, f16_value, f16c_store, f32_as_u32, u32_as_f32
from .layer_ops import _dots4, _exp_shifted, _key_range, _softcap, rope_heads, rope_row, row_max

# ggml type ids of the cache types (the `type_k` / `type_v` arguments)
T_F32, T_F16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_IQ4_NL = 0, 1, 2, 3, 6, 7, 8, 20
QK = 32  # elements per block
BLOCK_BYTES = {T_F32: 128, T_F16: 64, T_Q4_0: 18, T_Q4_1: 20, T_Q5_0: 22, T_Q5_1: 24, T_Q8_0: 34, T_IQ4_NL: 18}

# the 16 values of an iq4_nl quant (ggml-common.h kvalues_iq4nl)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32)
KVALUES_IQ4NL_F = KVALUES_IQ4NL.astype(np.float32)

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_NEG_INF = np.float32(-np.inf)
_FLT_MAX = np.float32(3.4028234663852886e38)
_GROUP_MAX_EPS = np.float32(1e-15)


# -- fp16 fields -------------------------------------------------------------------------------

@kernel(inline="always", boundscheck=False)
def _f16_load(row, o):
    """The fp16 at row[o:o+2] (little endian) as float32."""
    return f16_value(np.int32(row[o]) | (np.int32(row[o + 1]) << 8))


@kernel(inline="always", boundscheck=False)
def _f16_round_bits(x):
    """float32 -> f16 bits (uint16), rounded to nearest even (as NumPy's astype(float16))."""
    if HAVE_F16C:
        return f16c_store(np.float32(x))
    return f16_bits(np.float32(x))


@kernel(inline="always", boundscheck=False)
def _f16_store(row, o, x):
    h = _f16_round_bits(x)
    row[o] = np.uint8(h & 0xFF)
    row[o + 1] = np.uint8((h >> 8) & 0xFF)


@kernel(inline="always", boundscheck=False)
def _f32_store(row, o, x):
    bits = f32_as_u32(np.float32(x))
    for i in range(4):
        row[o + i] = np.uint8((bits >> np.uint32(8 * i)) & np.uint32(0xFF))


# -- quantizing one 32-element block (ggml's *_ref, no fast-math: the bytes must be exact) -----

@kernel(inline="always", boundscheck=False)
def _roundf(v):
    """C roundf (half away from zero) of a float32, as an int."""
    t = int(v)  # truncation toward zero; v - t is exact in float32
    f = v - np.float32(t)
    if f >= _HALF:
        t += 1
    elif f <= -_HALF:
        t -= 1
    return t


@kernel(fastmath=False, boundscheck=False)
def _best_index(x, vals):
    """ggml's best_index_int8(16, kvalues_iq4nl, x): the index of the table value nearest to x."""
    if x <= np.float32(vals[0]):
        return 0
    if x >= np.float32(vals[15]):
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < np.float32(vals[mav]):
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - np.float32(vals[mu - 1]) < np.float32(vals[mu]) - x else mu


@kernel(fastmath=False, boundscheck=False)
def quantize_block(typ, x, xo, row, o, vals, lbuf):
    """x[xo:xo+32] (float32) -> one block of type `typ` at row[o:] (uint8), as ggml's reference
    quantizer of that type writes it. vals: KVALUES_IQ4NL; lbuf: int32 (32,) scratch."""
    if typ == T_F32:
        for j in range(QK):
            _f32_store(row, o + 4 * j, x[xo + j])
        return
    if typ == T_F16:
        for j in range(QK):
            _f16_store(row, o + 2 * j, x[xo + j])
        return
    if typ == T_Q8_0:
        amax = _F0
        for j in range(QK):
            amax = max(amax, abs(x[xo + j]))
        d = amax / np.float32(127.0)
        idv = _F1 / d if d != _F0 else _F0
        _f16_store(row, o, d)
        for j in range(QK):
            q = _roundf(x[xo + j] * idv)
            row[o + 2 + j] = np.uint8(q & 0xFF)
        return
    if typ == T_Q4_0 or typ == T_Q5_0 or typ == T_IQ4_NL:
        amax = _F0
        vmax = _F0
        for j in range(QK):
            a = abs(x[xo + j])
            if amax < a:
                amax = a
                vmax = x[xo + j]
        if typ == T_IQ4_NL:
            if amax < _GROUP_MAX_EPS:  # ggml leaves the quants as they were; zeros here (d is 0)
                _f16_store(row, o, _F0)
                for j in range(16):
                    row[o + 2 + j] = 0
                return
            d = vmax / np.float32(vals[0])
            idv = _F1 / d
            sumqx = _F0
            sumq2 = _F0
            for j in range(QK):
                xj = x[xo + j]
                ll = _best_index(idv * xj, vals)
                lbuf[j] = ll
                qv = np.float32(vals[ll])
                w = xj * xj
                sumqx += w * qv * xj
                sumq2 += w * qv * qv
            d = sumqx / sumq2
            _f16_store(row, o, d)
            for j in range(16):
                row[o + 2 + j] = np.uint8(lbuf[j] | (lbuf[j + 16] << 4))
            return
        if typ == T_Q4_0:
            d = vmax / np.float32(-8.0)
            idv = _F1 / d if d != _F0 else _F0
            _f16_store(row, o, d)
            for j in range(16):
                q0 = min(15, int(x[xo + j] * idv + np.float32(8.5)))
                q1 = min(15, int(x[xo + 16 + j] * idv + np.float32(8.5)))
                row[o + 2 + j] = np.uint8(q0 | (q1 << 4))
            return
        d = vmax / np.float32(-16.0)  # q5_0
        idv = _F1 / d if d != _F0 else _F0
        _f16_store(row, o, d)
        qh = np.uint32(0)
        for j in range(16):
            q0 = min(31, int(x[xo + j] * idv + np.float32(16.5)))
            q1 = min(31, int(x[xo + 16 + j] * idv + np.float32(16.5)))
            row[o + 6 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
            qh |= np.uint32((q0 & 0x10) >> 4) << np.uint32(j)
            qh |= np.uint32((q1 & 0x10) >> 4) << np.uint32(j + 16)
        for i in range(4):
            row[o + 2 + i] = np.uint8((qh >> np.uint32(8 * i)) & np.uint32(0xFF))
        return
    # q4_1, q5_1: scale and minimum
    lo = _FLT_MAX
    hi = -_FLT_MAX
    for j in range(QK):
        v = x[xo + j]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    nmax = np.float32(15.0) if typ == T_Q4_1 else np.float32(31.0)
    d = (hi - lo) / nmax
    idv = _F1 / d if d != _F0 else _F0
    _f16_store(row, o, d)
    _f16_store(row, o + 2, lo)
    if typ == T_Q4_1:
        for j in range(16):
            q0 = min(15, int((x[xo + j] - lo) * idv + _HALF))
            q1 = min(15, int((x[xo + 16 + j] - lo) * idv + _HALF))
            row[o + 4 + j] = np.uint8(q0 | (q1 << 4))
        return
    qh = np.uint32(0)
    for j in range(16):
        q0 = min(31, int((x[xo + j] - lo) * idv + _HALF))
        q1 = min(31, int((x[xo + 16 + j] - lo) * idv + _HALF))
        row[o + 8 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
        qh |= np.uint32((q0 & 0x10) >> 4) << np.uint32(j)
        qh |= np.uint32((q1 & 0x10) >> 4) << np.uint32(j + 16)
    for i in range(4):
        row[o + 4 + i] = np.uint8((qh >> np.uint32(8 * i)) & np.uint32(0xFF))


@kernel(fastmath=False, boundscheck=False)
def quantize_rows(typ, x, out):
    """x float32 (n, D) -> out uint8 (n, D/32 * block bytes): every row by `quantize_block` (for tests)."""
    vals = KVALUES_IQ4NL
    lbuf = np.empty(QK, np.int32)
    nb = x.shape[1] // QK
    bb = out.shape[1] // nb
    for i in range(x.shape[0]):
        for b in range(nb):
            quantize_block(typ, x[i], b * QK, out[i], b * bb, vals, lbuf)


# -- reading blocks -----------------------------------------------------------------------------

@kernel(inline="always", boundscheck=False)
def _to_float(typ, row, out, vals):
    """One cache row (D/32 blocks at row) -> out float32 (D,), as ggml's to_float of the type:
    q8_0, q4_0, q5_0, iq4_nl q * d; q4_1, q5_1 q * d + m; f16 converted; f32 as is. (One loop
    nest per type, the type tested once per row; the 32-element loops have constant bounds.)
    vals: KVALUES_IQ4NL_F (an argument: indexing a global array here was 3x slower)."""
    nb = out.shape[0] // QK
    if typ == T_F32:
        for i in range(out.shape[0]):
            o = 4 * i
            bits = (np.uint32(row[o]) | (np.uint32(row[o + 1]) << np.uint32(8)) | (np.uint32(row[o + 2]) << np.uint32(16))
                    | (np.uint32(row[o + 3]) << np.uint32(24)))
            out[i] = u32_as_f32(bits)
    elif typ == T_F16:
        for i in range(out.shape[0]):
            out[i] = _f16_load(row, 2 * i)
    elif typ == T_Q8_0:
        for b in range(nb):
            o = b * 34
            d = _f16_load(row, o)
            for j in range(QK):
                out[b * QK + j] = np.float32(np.int8(row[o + 2 + j])) * d
    elif typ == T_Q4_0:
        for b in range(nb):
            o = b * 18
            d = _f16_load(row, o)
            for j in range(16):
                x = np.int32(row[o + 2 + j])
                out[b * QK + j] = np.float32((x & 0xF) - 8) * d
                out[b * QK + 16 + j] = np.float32((x >> 4) - 8) * d
    elif typ == T_IQ4_NL:
        for b in range(nb):
            o = b * 18
            d = _f16_load(row, o)
            for j in range(16):
                x = np.int32(row[o + 2 + j])
                out[b * QK + j] = vals[x & 0xF] * d
                out[b * QK + 16 + j] = vals[x >> 4] * d
    elif typ == T_Q4_1:
        for b in range(nb):
            o = b * 20
            d = _f16_load(row, o)
            m = _f16_load(row, o + 2)
            for j in range(16):
                x = np.int32(row[o + 4 + j])
                out[b * QK + j] = np.float32(x & 0xF) * d + m
                out[b * QK + 16 + j] = np.float32(x >> 4) * d + m
    else:  # q5_0 (d, qh at 2, qs at 6), q5_1 (d, m at 2, qh at 4, qs at 8)
        five_one = typ == T_Q5_1
        bb = 24 if five_one else 22
        qo = 8 if five_one else 6
        off = 0 if five_one else 16
        for b in range(nb):
            o = b * bb
            d = _f16_load(row, o)
            m = _f16_load(row, o + 2) if five_one else _F0
            qh = (np.int32(row[o + qo - 4]) | (np.int32(row[o + qo - 3]) << 8)
                  | (np.int32(row[o + qo - 2]) << 16) | (np.int32(row[o + qo - 1]) << 24))
            for j in range(16):
                x = np.int32(row[o + qo + j])
                h0 = ((qh >> j) & 1) << 4
                h1 = ((qh >> (j + 16)) & 1) << 4
                out[b * QK + j] = np.float32(((x & 0xF) | h0) - off) * d + m
                out[b * QK + 16 + j] = np.float32(((x >> 4) | h1) - off) * d + m


@kernel(boundscheck=False)
def dequantize_rows(typ, rows, out):
    """rows uint8 (n, row bytes) -> out float32 (n, D): each row by the type's to_float (for tests)."""
    vals = KVALUES_IQ4NL_F
    for i in range(rows.shape[0]):
        _to_float(typ, rows[i], out[i], vals)


@kernel(fastmath=False, boundscheck=False)
def _query_q8(qf, r, qq, qd, qsi, qsf, q8_1):
    """Row r of qf in q8_0 (q8_1 when q8_1) form, by act_quant's row quantizers.

    fastmath=False explicitly: Numba compiles a callee that sets no fastmath option with its
    caller's flags, and caches it so. Called from the fast-math attention body directly,
    act_quant's fp16 rounding of d (an add-and-subtract of 2^52) was folded away, and that
    cached copy then served every q8_0 activation of the process. This function sets the flag,
    so the quantizers it calls compile exactly."""
    if q8_1:
        q8_1_row(qf, r, qq, qd, qsf)
    else:
        q8_0_row(qf, r, qq, qd, qsi)


# -- storing new keys and values ------------------------------------------------------------------

@kernel(fastmath=True, boundscheck=False)
def rope_store_quant(q, k, v, start, cos_table, sin_table, k_cache, v_cache, neox, type_k, type_v):
    """RoPE on q and k (q in place) for positions start.., then k and v into the cache quantized.

    As `layer_ops.rope_store` (the same rotation, with its fast-math flags: the same bits), but
    k_cache and v_cache are uint8 (Hkv, ring, D/32 * block bytes) of types type_k and type_v
    (ggml ids), both row-major. (`quantize_block` sets fastmath=False itself, so it compiles
    without the fast-math flags of this caller and its bytes stay ggml's.)
    """
    n_tok, head_dim = q.shape[0], q.shape[2]
    n_kv = k.shape[1]
    ring = k_cache.shape[1]
    nb = head_dim // QK
    bk = k_cache.shape[2] // nb
    bv = v_cache.shape[2] // nb
    kr = np.empty(head_dim, np.float32)  # one roped key row
    vals = KVALUES_IQ4NL
    lbuf = np.empty(QK, np.int32)
    for t in range(n_tok):
        p = start + t
        slot = p % ring
        rope_heads(q, t, p, cos_table, sin_table, neox)
        for h in range(n_kv):
            rope_row(k[t, h], kr, p, cos_table, sin_table, neox)
            for d in range(2 * cos_table.shape[1], head_dim):  # dims past n_rot are not rotated
                kr[d] = k[t, h, d]
            krow = k_cache[h, slot]
            vrow = v_cache[h, slot]
            vsrc = v[t, h]
            for b in range(nb):
                quantize_block(type_k, kr, b * QK, krow, b * bk, vals, lbuf)
                quantize_block(type_v, vsrc, b * QK, vrow, b * bv, vals, lbuf)


# -- attention -----------------------------------------------------------------------------------

@kernel(fastmath=True, boundscheck=False)
def _attend_jobs_quant(q, k_cache, v_cache, type_k, type_v, start_pos, n_rep, scale, window, softcap, q_scaled,
                       out, first, step):
    """Attention over a block cache for the jobs first, first + step, ... of (token t, KV head)
    job t * Hkv + kvh (see the module docstring for the arithmetic; shapes as `attention_quant_serial`).

    A score is computed as the dot of the dequantized key row (d * q, as ggml's to_float) with
    the dequantized q8 query (fp16 d times the int8 quants, exact in float32), plus, for
    q4_1/q5_1 keys, m * (s - d * sum q) per block: that is ggml's vec_dot, d_k d_q sum(q_k q_q) +
    m_k s_q, up to float32 rounding of the products (~1e-7 relative), in long vector loops.
    """
    n_tok = q.shape[0]
    head_dim = q.shape[2]
    n_kv = k_cache.shape[0]
    ring = k_cache.shape[1]
    nb = head_dim // QK
    bk = k_cache.shape[2] // nb
    n_max = min(start_pos + n_tok, ring)
    qf = np.empty((n_rep, head_dim), np.float32)  # the queries (scaled when q_scaled), as K's vec_dot type holds them
    qq = np.empty((n_rep, head_dim), np.int8)  # q8_0 / q8_1 quants (quantized keys)
    qd = np.empty((n_rep, nb), np.float32)
    qsi = np.empty((n_rep, nb), np.int32)  # q8_0 sums
    qsf = np.empty((n_rep, nb), np.float32)  # q8_1 s = fp16(d * sum)
    corr = np.empty((n_rep, nb), np.float32)  # q4_1/q5_1 keys: s - d * sum, the min term's correction
    vals = KVALUES_IQ4NL_F
    kf = np.empty(head_dim, np.float32)  # a key row as float32
    vrow = np.empty(head_dim, np.float32)  # a value row as float32
    acc = np.empty((n_rep, head_dim), np.float32)
    scores = np.empty((n_rep, n_max), np.float32)
    totals = np.empty(n_rep, np.float32)
    lanes = np.empty(16, np.float32)  # row_max's running maxima
    bits = np.empty(n_max, np.int32)
    fbits = bits.view(np.float32)
    k_quant = type_k != T_F32 and type_k != T_F16
    k_min = type_k == T_Q4_1 or type_k == T_Q5_1
    q_mul = scale if q_scaled else _F1
    dot_scale = _F1 if q_scaled else scale
    for job in range(first, n_tok * n_kv, step):
        t = job % n_tok  # (kv-head-major, as layer_ops._attend_jobs)
        kvh = job // n_tok
        lo, n_keys = _key_range(start_pos + t, window)
        s0 = lo % ring
        n1 = min(n_keys, ring - s0)
        h0 = kvh * n_rep
        for r in range(n_rep):
            for d in range(head_dim):
                x = q[t, h0 + r, d] * q_mul
                if type_k == T_F16:  # Q as f16, as ggml's from_float for an f16 K
                    x = f16_value(np.int32(_f16_round_bits(x)))
                qf[r, d] = x
        if k_quant:  # Q as q8_0 (q8_1), then its values: fp16 d times the quants, exact in float32
            for r in range(n_rep):
                _query_q8(qf, r, qq, qd, qsi, qsf, k_min)
                for b in range(nb):
                    isum = 0
                    for i in range(QK):
                        qf[r, b * QK + i] = np.float32(qq[r, b * QK + i]) * qd[r, b]
                        isum += np.int32(qq[r, b * QK + i])
                    corr[r, b] = qsf[r, b] - qd[r, b] * np.float32(isum) if k_min else _F0
        # scores: each key row converted once, dotted with four query heads at a time (as layer_ops)
        for j in range(n_keys):
            slot = s0 + j if j < n1 else j - n1
            krow = k_cache[kvh, slot]
            _to_float(type_k, krow, kf, vals)
            r = 0
            while r + 4 <= n_rep:
                a0, a1, a2, a3 = _dots4(_F0, _F0, _F0, _F0, qf[r], qf[r + 1], qf[r + 2], qf[r + 3], 0, kf, head_dim)
                scores[r, j] = a0
                scores[r + 1, j] = a1
                scores[r + 2, j] = a2
                scores[r + 3, j] = a3
                r += 4
            while r < n_rep:
                qr = qf[r]
                a = _F0
                for d in range(head_dim):
                    a += qr[d] * kf[d]
                scores[r, j] = a
                r += 1
            if k_min:
                for b in range(nb):
                    mk = _f16_load(krow, b * bk + 2)
                    for r in range(n_rep):
                        scores[r, j] += mk * corr[r, b]
        for r in range(n_rep):
            sr = scores[r]
            for j in range(n_keys):
                sr[j] *= dot_scale
            if softcap > _F0:
                _softcap(sr, n_keys, softcap, bits, fbits)
            best = row_max(sr, n_keys, lanes)
            _exp_shifted(sr, n_keys, best, bits, fbits)
            total = _F0
            for j in range(n_keys):
                total += sr[j]
            totals[r] = total
            for d in range(head_dim):
                acc[r, d] = _F0
        # values: each row converted to float32 once, accumulated for the n_rep heads
        for j in range(n_keys):
            slot = s0 + j if j < n1 else j - n1
            _to_float(type_v, v_cache[kvh, slot], vrow, vals)
            for r in range(n_rep):
                w = scores[r, j]
                for d in range(head_dim):
                    acc[r, d] += w * vrow[d]
        for r in range(n_rep):
            inv = _F1 / totals[r] if totals[r] != _F0 else _F0
            for d in range(head_dim):
                out[t, h0 + r, d] = acc[r, d] * inv


def _typed(type_k, type_v, start_pos, n_rep, scale, window, softcap, q_scaled) -> tuple:
    return (np.int64(type_k), np.int64(type_v), np.int64(start_pos), np.int64(n_rep), np.float32(scale),
            np.int64(window), np.float32(softcap), bool(q_scaled))


def attention_quant_serial(q, k_cache, v_cache, type_k, type_v, start_pos, n_rep, scale, window, softcap, q_scaled, out):
    """Causal grouped-query attention over a block cache, on the calling thread.

    q: (T, H, D) float32, roped; k_cache, v_cache: uint8 (Hkv, ring, D/32 * block bytes) of ggml
    types type_k, type_v, holding positions [start_pos + T - ring, start_pos + T); out: (T, H, D)
    float32. window, softcap, q_scaled: as `layer_ops.attention_serial`.
    """
    _attend_jobs_quant(q, k_cache, v_cache, *_typed(type_k, type_v, start_pos, n_rep, scale, window, softcap, q_scaled),
                       out, np.int64(0), np.int64(1))


ATTENTION_CHUNKS = 16


def attention_quant(q, k_cache, v_cache, type_k, type_v, start_pos, n_rep, scale, window, softcap, q_scaled, out):
    """`attention_quant_serial` with the jobs spread over the threads (one parallel region), computing the same."""
    args = (q, k_cache, v_cache, *_typed(type_k, type_v, start_pos, n_rep, scale, window, softcap, q_scaled), out)
    if not all(a.flags.c_contiguous and a.flags.aligned for a in (q, k_cache, v_cache, out)):
        _attend_jobs_quant(*args, np.int64(0), np.int64(1))
        return
    no_jobs = (*args, np.int64(q.shape[0] * k_cache.shape[0]), np.int64(1))
    _attention_quant_chunks(address_of(_attend_jobs_quant, no_jobs, lambda: _attend_jobs_quant(*no_jobs)), *args)


@kernel(parallel=True)
def _attention_quant_chunks(jobs_address, q, k_cache, v_cache, type_k, type_v, start_pos, n_rep, scale, window,
                            softcap, q_scaled, out):
    """The parallel region of `attention_quant`: chunk c runs every ATTENTION_CHUNKS-th job from c."""
    if jobs_address == 0:
        return
    n_jobs = q.shape[0] * k_cache.shape[0]
    n_chunks = min(n_jobs, ATTENTION_CHUNKS)
    for c in prange(n_chunks):
        call_address(jobs_address, q, k_cache, v_cache, type_k, type_v, start_pos, n_rep, scale, window, softcap,
                     q_scaled, out, np.int64(c), np.int64(n_chunks))
