"""A layer's routed experts in one Numba call (llama.cpp's mul_mat_id + build_moe_ffn), for a
decoded token and for a prompt batch alike.

Why: an expert FFN is three small matrices (Qwen3-30B-A3B: 768 x 2048), a decoded token runs 8
of them and a 64-token prompt about 126 experts over ~4 tokens each. Run from Python, each
expert cost a dozen calls (the activation gathered and quantized, gate, up, GLU, quantize, down,
weights, sums) whose dispatch was a fifth of the prompt's time and most of gpt-oss's GLU and bias
time. Here one call loops over the chosen experts and, for each, its tokens:

    xa   = the rows of h's int8 activation for those tokens       (gathered, quantized once)
    g, u = gate_e xa (+ bias), up_e xa (+ bias)                    the type's row kernel, or its
                                                                   gemm from `gemm_from_*` tokens on
    g    = act(g, u)                                               layer_ops.glu / swiglu_oai
    y    = down_e quantize(g) (+ bias)
    ys[t, slot] = y * w[t, slot]
then out[t] = ys[t, 0] + ys[t, 1] + ... in slot order.

Every step is the kernel (row kernels, gemms, act_quant row functions, glu) the unfused path
calls, by its address (`jit.call_address`: compiled once, not again in here), and the float
steps are the same operations in the same order, so the bits are those of the unfused path and
a prompt's rows equal a decoded token's.

Threads: the call gathers every (token, slot) row by expert into one scratch (row p of xq, g, u,
y ...), then runs three phases, each one parallel region over all the chosen experts: gate|up
(each expert's units split evenly over the threads, as int8.py splits a matrix), biases + act +
quantize (rows over the threads; on the calling thread below ACT_PARALLEL_ROWS rows), and down,
where each thread owns a range of output columns for every expert and so also applies the
weights and the slot sums of its columns. A decoded token pays 2 fork/joins per layer instead of
2 k, a 64-token prompt 3 instead of ~250. (At one thread the regions have one chunk, run by the
calling thread.)

Shapes: hq/hd/hs (T, n_embd) the activation in gate/up's form; raw_g/raw_u (n_expert, n_ff,
row bytes), raw_d (n_expert, n_embd, row bytes) uint8; biases (n_expert, width) float32 or
(0, 0) for none; w (T, k) float32; out (T, n_embd) float32.
"""

from __future__ import annotations

import numpy as np

from numba import prange

from .jit import call_address, compiled_address, kernel
from .router import group_by_expert, softmax_top_k, top_k_softmax

_NOPY = dict(boundscheck=False)
SWIGLU_OAI_ALPHA = np.float32(1.702)
SWIGLU_OAI_LIMIT = np.float32(7.0)
ACT_PARALLEL_ROWS = 32  # rows (tokens x k) from which biases, act and quantize take a parallel region too


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


@kernel(**_NOPY)
def _pick(rows_address, gemm_address, tile_rows, gemm_from, n_tok):
    """(address, rows per unit) of an expert's matrix for n_tok tokens: its gemm (units of
    tile_rows rows) when there is one and n_tok >= gemm_from, else its row kernel (rows)."""
    if gemm_address != 0 and n_tok >= gemm_from:
        return gemm_address, tile_rows
    return rows_address, np.int64(1)


@kernel(**_NOPY)
def _gate_up_chunk(c, n_chunks, ids, bounds, raw_g, raw_u, xq, xd, xs, tab, g, u, rows_address, gemm_address,
                   tile_rows, gemm_from):
    """Chunk c of n_chunks of every chosen expert's gate|up units, taken end to end per expert:
    g[p0:p1] = xq[p0:p1] raw_g[e]^T and the same for u, for expert e = ids[j]'s rows p0:p1."""
    for j in range(ids.shape[0]):
        e, p0, p1 = ids[j], bounds[j], bounds[j + 1]
        address, unit = _pick(rows_address, gemm_address, tile_rows, gemm_from, p1 - p0)
        units = raw_g.shape[1] // unit
        per = (2 * units + n_chunks - 1) // n_chunks
        lo, hi = c * per, min(2 * units, (c + 1) * per)
        if lo < min(hi, units):
            call_address(address, raw_g[e], xq[p0:p1], xd[p0:p1], xs[p0:p1], tab, g[p0:p1], np.int64(lo),
                         np.int64(min(hi, units)))
        if hi > max(lo, units):
            call_address(address, raw_u[e], xq[p0:p1], xd[p0:p1], xs[p0:p1], tab, u[p0:p1],
                         np.int64(max(lo, units) - units), np.int64(hi - units))


@kernel(**_NOPY)
def _add_bias_rows(bias, row_e, y, p0, p1):
    """y[p] += bias[row_e[p]] for rows p0..p1-1 of y (P, width); bias (n_expert, width), or (0, 0): none."""
    if bias.shape[0] == 0:
        return
    for p in range(p0, p1):
        yr, br = y[p], bias[row_e[p]]
        for i in range(yr.shape[0]):
            yr[i] = yr[i] + br[i]


@kernel(**_NOPY)
def _act_chunk(c, n_chunks, row_e, bias_g, bias_u, g, u, act_address, act, quant_address, gq, gd, gs):
    """Rows of chunk c of g, u (P, n_ff): the biases of their experts (row_e (P,)) added, g =
    act(g, u), g quantized into (gq, gd, gs), row by row as the kernels do for any batch."""
    n = g.shape[0]
    per = (n + n_chunks - 1) // n_chunks
    p0, p1 = c * per, min(n, (c + 1) * per)
    if p0 >= p1:
        return
    _add_bias_rows(bias_g, row_e, g, p0, p1)  # (row by row: loops LLVM vectorizes; a loop over a
    _add_bias_rows(bias_u, row_e, u, p0, p1)  # tuple of (bias, rows) pairs ran ~4 ns per add)
    call_address(act_address, g[p0:p1], u[p0:p1], g[p0:p1], act)
    for p in range(p0, p1):
        call_address(quant_address, g, np.int64(p), gq, gd, gs)


@kernel(**_NOPY)
def _down_chunk(c, n_chunks, ids, bounds, at, w, raw_d, bias_d, gq, gd, gs, tab, y, out, rows_address, gemm_address,
                tile_rows, gemm_from):
    """Columns [r0, r1) of chunk c (whole tiles) for every chosen expert: y[p0:p1] = down_e gq
    (+ bias) times each row's weight; then out[t, r0:r1] = the token's k weighted rows summed in
    slot order (at (T, k): the row of y holding token t's slot s)."""
    n_embd = raw_d.shape[1]
    per = ((n_embd + tile_rows - 1) // tile_rows + n_chunks - 1) // n_chunks * tile_rows
    r0, r1 = c * per, min(n_embd, (c + 1) * per)
    if r0 >= r1:
        return
    n_tok, k = w.shape
    for j in range(ids.shape[0]):
        e, p0, p1 = ids[j], bounds[j], bounds[j + 1]
        address, unit = _pick(rows_address, gemm_address, tile_rows, gemm_from, p1 - p0)
        call_address(address, raw_d[e], gq[p0:p1], gd[p0:p1], gs[p0:p1], tab, y[p0:p1], np.int64(r0 // unit),
                     np.int64(r1 // unit))
        if bias_d.shape[0] != 0:
            for p in range(p0, p1):
                for i in range(r0, r1):
                    y[p, i] = y[p, i] + bias_d[e, i]
    for t in range(n_tok):
        for s in range(k):
            p = at[t, s]
            ws = w[t, s]
            for i in range(r0, r1):
                y[p, i] = y[p, i] * ws
        for i in range(r0, r1):
            out[t, i] = y[at[t, 0], i]
        for s in range(1, k):  # slot order, as llama.cpp's adds
            p = at[t, s]
            for i in range(r0, r1):
                out[t, i] = out[t, i] + y[p, i]


@kernel(**_NOPY)
def _phase(phase, c, n_chunks, a):
    """Chunk c of n_chunks of phase 0 (gate|up), 1 (biases, act, quantize) or 2 (down, weights,
    sums); a: experts_ffn's arrays and addresses (one tuple: the three phases share them)."""
    (ids, bounds, at, w, row_e, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, xq, xd, xs, tab, g, u, gq, gd, gs, y,
     out, rows_gu, gemm_gu, rows_d, gemm_d, tile_rows, gemm_from_gu, gemm_from_d, act_address, act, quant_address) = a
    if phase == 0:
        _gate_up_chunk(c, n_chunks, ids, bounds, raw_g, raw_u, xq, xd, xs, tab, g, u, rows_gu, gemm_gu, tile_rows,
                       gemm_from_gu)
    elif phase == 1:
        _act_chunk(c, n_chunks, row_e, bias_g, bias_u, g, u, act_address, act, quant_address, gq, gd, gs)
    else:
        _down_chunk(c, n_chunks, ids, bounds, at, w, raw_d, bias_d, gq, gd, gs, tab, y, out, rows_d, gemm_d,
                    tile_rows, gemm_from_d)


@kernel(parallel=True, **_NOPY)
def _over_threads(phase_address, phase, n_chunks, a):
    """One parallel region: the n_chunks chunks of a phase, one per thread, each a call of
    _phase by its address (`phase_address`): _phase compiles once, in its own dispatcher, not
    twice more into this parfor (experts' first compile: 11 -> 8 s CPU)."""
    for c in prange(n_chunks):
        call_address(phase_address, phase, c, n_chunks, a)


@kernel(**_NOPY)
def _copy_row(src, i, dst, j):
    """dst[j] = src[i] (2-D arrays of one width)."""
    for c in range(src.shape[1]):
        dst[j, c] = src[i, c]


@kernel(**_NOPY)
def phase_arrays(hq, hd, hs, ids, bounds, pos, w, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, tab,
                 rows_gu, gemm_gu, rows_d, gemm_d, tile_rows, gemm_from_gu, gemm_from_d, act_address, act,
                 quant_address, dd_like, ds_like, out):
    """The phases' one tuple: the arguments (as experts_ffn's) and the scratch, with the tokens'
    activation rows gathered by expert. (Called from Python on 0 rows too: its result's types
    are those _phase is compiled for, `phase_address`.)"""
    n_tok, k = w.shape
    n_pos, n_ff, n_embd = pos.shape[0], raw_g.shape[1], raw_d.shape[1]
    # row p of every scratch below is flat position pos[p]: each expert's tokens are rows bounds[j]:bounds[j + 1]
    xq = np.empty((n_pos, hq.shape[1]), hq.dtype)  # (P, n_embd) the activation rows gathered
    xd = np.empty((n_pos, hd.shape[1]), hd.dtype)
    xs = np.empty((n_pos, hs.shape[1]), hs.dtype)
    row_e = np.empty(n_pos, np.int64)  # (P,) the row's expert
    at = np.empty((n_tok, k), np.int64)  # (T, k) the row of token t's slot s
    for j in range(ids.shape[0]):
        for p in range(bounds[j], bounds[j + 1]):
            t = pos[p] // k
            _copy_row(hq, t, xq, p)  # (element loops: a row assignment compiles a shape-checked raise, ~3 s CPU)
            _copy_row(hd, t, xd, p)
            _copy_row(hs, t, xs, p)
            row_e[p] = ids[j]
            at[t, pos[p] % k] = p
    g = np.empty((n_pos, n_ff), np.float32)  # (P, n_ff) gate, then act(gate, up)
    u = np.empty((n_pos, n_ff), np.float32)
    gq = np.empty((n_pos, n_ff), np.int8)  # g in down's activation form
    gd = np.empty((n_pos, dd_like.shape[1]), dd_like.dtype)
    gs = np.empty((n_pos, ds_like.shape[1]), ds_like.dtype)
    y = np.empty((n_pos, n_embd), np.float32)  # (P, n_embd) each row's down, then times its weight
    return (ids, bounds, at, w, row_e, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, xq, xd, xs, tab, g, u, gq, gd, gs,
            y, out, rows_gu, gemm_gu, rows_d, gemm_d, tile_rows, gemm_from_gu, gemm_from_d, act_address, act,
            quant_address)


def phase_address(a) -> int:
    """The address of _phase compiled (or loaded) for phase_arrays' tuple a; 0 while compile_pool
    records a warm-up."""
    args = (np.int64(0), np.int64(0), np.int64(1), a)
    _phase(*args)  # (a made from 0 rows: nothing runs)
    return compiled_address(_phase, args)


@kernel(**_NOPY)
def experts_ffn(hq, hd, hs, ids, bounds, pos, w, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, tab,
                rows_gu, gemm_gu, rows_d, gemm_d, tile_rows, gemm_from_gu, gemm_from_d, act_address, act, quant_address,
                dd_like, ds_like, out, phase_address, n_threads):
    """out = the weighted sum of each token's experts (module docstring). ids (G,) the chosen
    experts, bounds (G + 1,): expert ids[j]'s entries are pos[bounds[j]:bounds[j + 1]], flat
    positions t * k + slot. rows_* / gemm_*: addresses of the gate|up and down matrices' row
    kernel and gemm (0: none; the gemm from gemm_from_gu / gemm_from_d tokens of an expert on);
    act_address: glu or swiglu_oai; quant_address: act_quant's row function of down's form; dd_like,
    ds_like: (1, n_ff / per_d), (1, n_ff / per_sum) arrays of that form (their shapes and dtypes
    make the scratch's); phase_address: `phase_address` of these types; w C-contiguous, writable."""
    a = phase_arrays(hq, hd, hs, ids, bounds, pos, w, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, tab, rows_gu,
                     gemm_gu, rows_d, gemm_d, tile_rows, gemm_from_gu, gemm_from_d, act_address, act, quant_address,
                     dd_like, ds_like, out)
    _over_threads(phase_address, np.int64(0), np.int64(n_threads), a)
    if n_threads > 1 and pos.shape[0] >= ACT_PARALLEL_ROWS:
        _over_threads(phase_address, np.int64(1), np.int64(n_threads), a)
    else:  # (a decoded token's k rows: no region)
        call_address(phase_address, np.int64(1), np.int64(0), np.int64(1), a)
    _over_threads(phase_address, np.int64(2), np.int64(n_threads), a)


@kernel(**_NOPY)
def moe_decode(h, router_w, router_b, router_address, top_k_first, k, forced, norm, scale, sum_min, hq_like,
               hd_like, hs_like, quant_x_address, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, tab, rows_gu, gemm_gu, rows_d, gemm_d,
               tile_rows, gemm_from_gu, gemm_from_d, act_address, act, quant_address, dd_like, ds_like, out,
               phase_address, n_threads):
    """A decoded token's whole MoE FFN in one call: out (1, n_embd) = experts_ffn of the experts
    the router picks for h (1, n_embd). The steps and kernels of MoeFFN's unfused route, in its
    order, so the same bits: logits = router_w h (floats.matmul_f32 by its address; router_w
    (n_expert, n_embd) float32) + router_b ((n_expert,), or (0,) for none); the gate
    (router.top_k_softmax when top_k_first, gpt-oss's order, else router.softmax_top_k); the
    groups; h quantized by act_quant's row function of the experts' form (quant_x_address) into
    arrays like hq_like, hd_like, hs_like (1, .) (made here: concurrent steps share nothing); then
    experts_ffn (its arguments as there).

    Why: run from Python, the router, the gate, the grouping and the quantization were ~10 calls
    and array wrappers per layer, ~0.2 ms of a ~3.5 ms layer at two threads (Qwen3-30B-A3B shape)."""
    n_expert = router_w.shape[0]
    logits = np.empty((1, n_expert), np.float32)  # (1, n_expert)
    call_address(router_address, router_w, h, logits, n_threads)
    for i in range(router_b.shape[0]):
        logits[0, i] = logits[0, i] + router_b[i]
    if top_k_first:
        experts, w = top_k_softmax(logits, k, forced)
    else:
        experts, w = softmax_top_k(logits, k, forced, norm, scale, sum_min)
    ids, bounds, order = group_by_expert(experts, n_expert)
    hq, hd, hs = np.empty_like(hq_like), np.empty_like(hd_like), np.empty_like(hs_like)
    call_address(quant_x_address, h, np.int64(0), hq, hd, hs)
    experts_ffn(hq, hd, hs, ids, bounds, order, w, raw_g, raw_u, raw_d, bias_g, bias_u, bias_d, tab, rows_gu, gemm_gu,
                rows_d, gemm_d, tile_rows, gemm_from_gu, gemm_from_d, act_address, act, quant_address, dd_like, ds_like,
                out, phase_address, n_threads)


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
