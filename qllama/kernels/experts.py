"""A layer's routed experts in one Numba call (llama.cpp's mul_mat_id + build_moe_ffn), for a
decoded token and for a prompt batch alike.

Why: an expert FFN is three small matrices (Qwen3-30B-A3B: 768 x 2048), a decoded token runs 8
of them and a 64-token prompt about 126 experts over ~4 tokens each. Run from Python, each
expert cost a dozen calls (the activation gathered and quantized, gate, up, GLU, quantize, down,
weights, sums) whose dispatch was a fifth of the prompt's time and most of gpt-oss's GLU and bias
time. Here one call loops over the chosen experts and, for each, its tokens:

    xa   = the rows of h's int8 activation for those tokens       (gathered, quantized once)
    g, u = gate_e xa (+ bias), up_e xa (+ bias)                    the type's row kernel, or its
                                                                   gemm from `gemm_from` tokens on
    g    = act(g, u)                                               layer_ops.glu / swiglu_oai
    y    = down_e quantize(g) (+ bias)
    ys[t, slot] = y * w[t, slot]
then out[t] = ys[t, 0] + ys[t, 1] + ... in slot order.

Every step is the kernel (row kernels, gemms, act_quant row functions, glu) the unfused path
calls, by its address (`jit.call_address`: compiled once, not again in here), and the float
steps are the same operations in the same order, so the bits are those of the unfused path and
a prompt's rows equal a decoded token's. Matrices run over the threads as int8.py's do (one
chunk of rows per thread; none at one thread), gate and up in one parallel region.

Shapes: hq/hd/hs (T, n_embd) the activation in gate/up's form; raw_g/raw_u (n_expert, n_ff,
row bytes), raw_d (n_expert, n_embd, row bytes) uint8; biases (n_expert, width) float32 or
(0, 0) for none; w (T, k) float32; out (T, n_embd) float32.
"""

from __future__ import annotations

import numpy as np

from numba import prange

from .jit import call_address, kernel

_NOPY = dict(boundscheck=False)
SWIGLU_OAI_ALPHA = np.float32(1.702)
SWIGLU_OAI_LIMIT = np.float32(7.0)


@kernel(**_NOPY)
def swiglu_oai(gate, up, out, act):
    """out = ggml_swiglu_oai(gate, up), all (T, n_ff) float32 (out may be gate): x = min(g, 7);
    x / (1 + e^(-1.702 x)) * (clamp(u, -7, 7) + 1). act: unused (glu's signature)."""
    one = np.float32(1.0)
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            x = min(gate[t, i], SWIGLU_OAI_LIMIT)
            y = max(min(up[t, i], SWIGLU_OAI_LIMIT), -SWIGLU_OAI_LIMIT)
            out[t, i] = x / (one + np.exp(SWIGLU_OAI_ALPHA * -x)) * (y + one)


@kernel(parallel=True, **_NOPY)
def _units(address, raw_a, out_a, raw_b, out_b, both, xq, xd, xs, tab, n_units, n_threads):
    """Units (rows or row groups) 0..n_units-1 of matrix a, then (both) of matrix b, taken end to
    end in one chunk per thread, each chunk by the serial kernel at address."""
    total = 2 * n_units if both else n_units
    n_chunks = max(1, min(total, n_threads))
    per = (total + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        lo, hi = c * per, min(total, (c + 1) * per)
        if lo < n_units:
            call_address(address, raw_a, xq, xd, xs, tab, out_a, np.int64(lo), np.int64(min(hi, n_units)))
        if hi > n_units:
            call_address(address, raw_b, xq, xd, xs, tab, out_b, np.int64(max(lo, n_units) - n_units),
                         np.int64(hi - n_units))


@kernel(**_NOPY)
def _matmul(rows_address, gemm_address, tile_rows, gemm_from, raw_a, out_a, raw_b, out_b, both, xq, xd, xs, tab,
            n_threads):
    """out_a (n, rows) = xa raw_a^T and (both) the same for b, in one parallel
    region (none at one thread): the gemm (groups of tile_rows rows) when there is one and n >=
    gemm_from, else the row kernel."""
    address, units = rows_address, raw_a.shape[0]
    if gemm_address != 0 and xq.shape[0] >= gemm_from:
        address, units = gemm_address, units // tile_rows
    if n_threads > 1:
        _units(address, raw_a, out_a, raw_b, out_b, both, xq, xd, xs, tab, units, n_threads)
        return
    call_address(address, raw_a, xq, xd, xs, tab, out_a, np.int64(0), np.int64(units))
    if both:
        call_address(address, raw_b, xq, xd, xs, tab, out_b, np.int64(0), np.int64(units))


@kernel(**_NOPY)
def _add_bias(y, b, e):
    """y (n, width) += b[e] (a bias row of (n_expert, width); none when b is empty)."""
    if b.shape[0] == 0:
        return
    for i in range(y.shape[0]):
        for c in range(y.shape[1]):
            y[i, c] = y[i, c] + b[e, c]


@kernel(**_NOPY)
def experts_ffn(hq, hd, hs, ids, bounds, pos, w, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, tab,
                rows_gu, gemm_gu, rows_d, gemm_d, tile_rows, gemm_from, act_address, act, quant_address,
                dd_like, ds_like, out, n_threads):
    """out = the weighted sum of each token's experts (module docstring). ids (G,) the chosen
    experts, bounds (G + 1,): expert ids[j]'s entries are pos[bounds[j]:bounds[j + 1]], flat
    positions t * k + slot. rows_* / gemm_*: addresses of the gate|up and down matrices' row
    kernel and gemm (0: none); act_address: glu or swiglu_oai; quant_address: act_quant's row
    function of down's form; dd_like, ds_like: (1, n_ff / per_d), (1, n_ff / per_sum) arrays of
    that form (their shapes and dtypes make the scratch's)."""
    n_tok, k = w.shape
    n_embd, n_ff = raw_d.shape[1], raw_g.shape[1]
    ys = np.empty((n_tok, k, n_embd), np.float32)  # (T, k, n_embd) each slot's weighted output
    for j in range(ids.shape[0]):
        e = ids[j]
        p0, p1 = bounds[j], bounds[j + 1]
        n = p1 - p0
        xq = np.empty((n, hq.shape[1]), hq.dtype)  # (n, n_embd) the rows of its tokens
        xd = np.empty((n, hd.shape[1]), hd.dtype)
        xs = np.empty((n, hs.shape[1]), hs.dtype)
        for i in range(n):
            t = pos[p0 + i] // k
            xq[i] = hq[t]
            xd[i] = hd[t]
            xs[i] = hs[t]
        g = np.empty((n, n_ff), np.float32)
        u = np.empty((n, n_ff), np.float32)
        _matmul(rows_gu, gemm_gu, tile_rows, gemm_from, raw_g[e], g, raw_u[e], u, True, xq, xd, xs, tab, n_threads)
        _add_bias(g, bias_g, e)
        _add_bias(u, bias_u, e)
        call_address(act_address, g, u, g, act)
        gq = np.empty((n, n_ff), np.int8)  # g in down's activation form
        gd = np.empty((n, dd_like.shape[1]), dd_like.dtype)
        gs = np.empty((n, ds_like.shape[1]), ds_like.dtype)
        for i in range(n):
            call_address(quant_address, g, np.int64(i), gq, gd, gs)
        y = np.empty((n, n_embd), np.float32)
        _matmul(rows_d, gemm_d, tile_rows, gemm_from, raw_d[e], y, raw_d[e], y, False, gq, gd, gs, tab, n_threads)
        _add_bias(y, bias_d, e)
        for i in range(n):
            t, s = pos[p0 + i] // k, pos[p0 + i] % k
            ws = w[t, s]
            for c in range(n_embd):
                ys[t, s, c] = y[i, c] * ws
    for t in range(n_tok):  # slot order, as llama.cpp's adds
        for c in range(n_embd):
            out[t, c] = ys[t, 0, c]
        for s in range(1, k):
            for c in range(n_embd):
                out[t, c] = out[t, c] + ys[t, s, c]


def row_kernels(type_id: int):
    """(serial row kernel, gemm or None) of a type, both (raw, xq, xd, xs, tab, out, u0, u1) as
    int8.py's; None when the type has none (f32, q2_K/q3_K, i-quants: the per-expert calls)."""
    from ..gguf.types import MXFP4
    from . import int8, mxfp4

    if type_id == MXFP4:
        return mxfp4.rows_int8, None
    if type_id not in int8._BLOCK_BYTES:
        return None
    return int8.ROWS_INT8[type_id], (int8.GEMM_ROWS[type_id] if type_id in int8.GEMM_TYPES else None)
