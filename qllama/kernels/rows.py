"""The float mat-mat of the quantized types (used when int8 activations are off or unavailable).

One kernel dispatching on the type id *inside* (once per row), so it compiles once with one
signature (but then compiles every decoder: ~10 s cold; it is only compiled when used).
`matmul`: per row, decode the row once (bit-exact decoders of `legacy.py` / `kquants.py`) into
a per-task scratch (ne0 floats) and apply it to every token of the batch. Scratch is O(ne0) per
task; the matrix is never materialised.

All three take `raw` as the (n_rows, row_bytes) uint8 view of the packed tensor.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..ggml_types import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from . import kquants as kq
from . import legacy as lg
from .floats import FASTMATH

_NOPY = dict(cache=True, boundscheck=False)
ROWS_PER_TASK = 8  # rows per prange iteration (amortises scratch allocation)


@njit(**_NOPY)
def decode_row(type_id, row, n_cols, tab, out):
    """Decode a whole row (n_cols elements) into out[:n_cols] (one type dispatch per row)."""
    if type_id == Q4_K:
        for b in range(n_cols // 256):
            kq.decode_q4_k(row, 144 * b, tab, out, 256 * b)
    elif type_id == Q6_K:
        for b in range(n_cols // 256):
            kq.decode_q6_k(row, 210 * b, tab, out, 256 * b)
    elif type_id == Q8_0:
        for b in range(n_cols // 32):
            lg.decode_q8_0(row, 34 * b, tab, out, 32 * b)
    elif type_id == Q5_K:
        for b in range(n_cols // 256):
            kq.decode_q5_k(row, 176 * b, tab, out, 256 * b)
    elif type_id == Q3_K:
        for b in range(n_cols // 256):
            kq.decode_q3_k(row, 110 * b, tab, out, 256 * b)
    elif type_id == Q2_K:
        for b in range(n_cols // 256):
            kq.decode_q2_k(row, 84 * b, tab, out, 256 * b)
    elif type_id == Q4_0:
        for b in range(n_cols // 32):
            lg.decode_q4_0(row, 18 * b, tab, out, 32 * b)
    elif type_id == Q4_1:
        for b in range(n_cols // 32):
            lg.decode_q4_1(row, 20 * b, tab, out, 32 * b)
    elif type_id == Q5_0:
        for b in range(n_cols // 32):
            lg.decode_q5_0(row, 22 * b, tab, out, 32 * b)
    elif type_id == Q5_1:
        for b in range(n_cols // 32):
            lg.decode_q5_1(row, 24 * b, tab, out, 32 * b)
    return out


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
