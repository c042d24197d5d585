"""The float paths, for every supported type: dequantize rows, fused mat-vec, tiled mat-mat.

One kernel per operation, dispatching on the type id *inside* (a predictable branch per block),
so each operation compiles once with one signature. Blocks are decoded by the bit-exact
decoders of `floats.py`, `legacy.py` and `kquants.py`:

- `dequantize_rows`: decode whole rows straight into the output (embedding lookup).
- `matvec`: per row, decode one block into a small per-thread scratch (<= 256 floats, in L1)
  and dot it with x. Scratch is O(block) per row chunk; the matrix is never materialised.
- `matmul`: per row, decode the row once into a per-chunk scratch (ne0 floats) and apply it to
  every token of the batch. Scratch is O(ne0) per chunk.

All three take `raw` as the (n_rows, row_bytes) uint8 view of the packed tensor.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..ggml_types import BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from . import kquants as kq
from . import legacy as lg
from .floats import FASTMATH, decode_bf16, decode_f16, decode_f32

_NOPY = dict(cache=True, boundscheck=False)
ROWS_PER_TASK = 8  # rows per prange iteration (amortises scratch allocation)
FLOAT_CHUNK = 256  # elements a float type decodes at a time


@njit(**_NOPY)
def block_geometry(type_id):
    """(elements, bytes) of one block; float types are handled in chunks of FLOAT_CHUNK."""
    if type_id == F32:
        return FLOAT_CHUNK, 4 * FLOAT_CHUNK
    if type_id == F16 or type_id == BF16:
        return FLOAT_CHUNK, 2 * FLOAT_CHUNK
    if type_id == Q4_0:
        return 32, 18
    if type_id == Q4_1:
        return 32, 20
    if type_id == Q5_0:
        return 32, 22
    if type_id == Q5_1:
        return 32, 24
    if type_id == Q8_0:
        return 32, 34
    if type_id == Q2_K:
        return 256, 84
    if type_id == Q3_K:
        return 256, 110
    if type_id == Q4_K:
        return 256, 144
    if type_id == Q5_K:
        return 256, 176
    if type_id == Q6_K:
        return 256, 210
    return 0, 0


@njit(**_NOPY)
def decode_block(type_id, row, bo, tab, out, oo, n):
    """Decode the block at byte bo of row into out[oo:oo+n] (n = block elements; floats: any n)."""
    if type_id == Q4_K:
        kq.decode_q4_k(row, bo, tab, out, oo)
    elif type_id == Q6_K:
        kq.decode_q6_k(row, bo, tab, out, oo)
    elif type_id == Q8_0:
        lg.decode_q8_0(row, bo, tab, out, oo)
    elif type_id == Q5_K:
        kq.decode_q5_k(row, bo, tab, out, oo)
    elif type_id == Q3_K:
        kq.decode_q3_k(row, bo, tab, out, oo)
    elif type_id == Q2_K:
        kq.decode_q2_k(row, bo, tab, out, oo)
    elif type_id == Q4_0:
        lg.decode_q4_0(row, bo, tab, out, oo)
    elif type_id == Q4_1:
        lg.decode_q4_1(row, bo, tab, out, oo)
    elif type_id == Q5_0:
        lg.decode_q5_0(row, bo, tab, out, oo)
    elif type_id == Q5_1:
        lg.decode_q5_1(row, bo, tab, out, oo)
    elif type_id == F32:
        decode_f32(row, bo, tab, out, oo, n)
    elif type_id == F16:
        decode_f16(row, bo, tab, out, oo, n)
    elif type_id == BF16:
        decode_bf16(row, bo, tab, out, oo, n)


@njit(**_NOPY)
def decode_row(type_id, row, n_cols, tab, out):
    """Decode a whole row (n_cols elements) into out[:n_cols]."""
    be, bb = block_geometry(type_id)
    e = 0
    o = 0
    while e < n_cols:
        n = min(be, n_cols - e)  # float types may end with a partial chunk
        decode_block(type_id, row, o, tab, out, e, n)
        e += n
        o += bb * n // be
    return out


@njit(parallel=True, **_NOPY)
def dequantize_rows(type_id, raw, n_cols, rows, tab, out):
    """out[i] = row rows[i] of the tensor, as float32. rows: int64 (n,), out: float32 (n, n_cols)."""
    for i in prange(rows.shape[0]):
        decode_row(type_id, raw[rows[i]], n_cols, tab, out[i])


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matvec(type_id, raw, x, tab, out):
    """out[r] = dequant(row r) . x, in float32. x: float32 (ne0,), out: float32 (n_rows,)."""
    n_rows = raw.shape[0]
    n_cols = x.shape[0]
    be, bb = block_geometry(type_id)
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for t in prange(n_tasks):
        buf = np.empty(be, np.float32)  # (block,) decoded block
        for r in range(t * ROWS_PER_TASK, min(n_rows, (t + 1) * ROWS_PER_TASK)):
            row = raw[r]
            acc = np.float32(0.0)
            e = 0
            o = 0
            while e < n_cols:
                n = min(be, n_cols - e)
                decode_block(type_id, row, o, tab, buf, 0, n)
                s = np.float32(0.0)
                for i in range(n):
                    s += buf[i] * x[e + i]
                acc += s
                e += n
                o += bb * n // be
            out[r] = acc


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matmul(type_id, raw, x, tab, out):
    """out[t, r] = dequant(row r) . x[t]. x: float32 (n_tok, ne0), out: float32 (n_tok, n_rows).

    Each row is decoded once (into a per-task scratch) and applied to every token.
    """
    n_rows = raw.shape[0]
    n_tok, n_cols = x.shape
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for t in prange(n_tasks):
        buf = np.empty(n_cols, np.float32)  # (ne0,) decoded row
        for r in range(t * ROWS_PER_TASK, min(n_rows, (t + 1) * ROWS_PER_TASK)):
            decode_row(type_id, raw[r], n_cols, tab, buf)
            for k in range(n_tok):
                xk = x[k]
                s = np.float32(0.0)
                for i in range(n_cols):
                    s += buf[i] * xk[i]
                out[k, r] = s
