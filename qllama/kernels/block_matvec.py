"""The fused float mat-vec of the block types (the portable decode path): `MATVEC[type_id]`.

`MATVEC[t](raw, x, xs, tab, out)`: out[r] = row r . x, with raw uint8 (n_rows, nb * block bytes),
x float32 (ne0,), xs float32 (ne0/16,) the sums of x over 16 elements (for the min terms), tab
`_fp16.FP16_TO_F32`, out float32 (n_rows,). One loop for every type: tasks of ROWS_PER_TASK rows
over the threads; in a row, the blocks in order, each by the type's own block dot
(`legacy._dot_<type>`, `kquants._dot_<type>`) inlined, so each type compiles only its own (a
`jit.Variants` family, as `dequantize.ROWS`).
"""

from __future__ import annotations

import numpy as np
from numba import prange, types
from numba.extending import overload

from ..gguf.types import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from . import kquants as kq
from . import legacy as lg
from .jit import Variants

_FM = {"reassoc", "contract", "nsz", "arcp"}  # no nnan/ninf: NaN and Inf must propagate
ROWS_PER_TASK = 8

# type id -> (block dot, bytes per block, bytes before the quants in a legacy block: the rest
# is the run-time trip count `qk` of its loops, see legacy.py)
BLOCK_DOTS = {Q4_0: (lg._dot_q4_0, 18, 2), Q4_1: (lg._dot_q4_1, 20, 4), Q5_0: (lg._dot_q5_0, 22, 6),
              Q5_1: (lg._dot_q5_1, 24, 8), Q8_0: (lg._dot_q8_0, 34, 2),
              Q2_K: (kq._dot_q2_k, 84, 0), Q3_K: (kq._dot_q3_k, 110, 0), Q4_K: (kq._dot_q4_k, 144, 0),
              Q5_K: (kq._dot_q5_k, 176, 0), Q6_K: (kq._dot_q6_k, 210, 0)}


def _block_rows(type_id, raw, x, xs, tab, out):
    """out[r] = row r . x for rows of `type_id` (a literal); see the module docstring."""


@overload(_block_rows, prefer_literal=True, inline="always")
def _block_rows_impl(type_id, raw, x, xs, tab, out):
    if not isinstance(type_id, types.IntegerLiteral) or type_id.literal_value not in BLOCK_DOTS:
        return None
    block_dot, block_bytes, head_bytes = BLOCK_DOTS[type_id.literal_value]

    def block_rows(type_id, raw, x, xs, tab, out):
        n_rows, nb = raw.shape[0], raw.shape[1] // block_bytes
        qk = raw.shape[1] // max(nb, 1) - head_bytes  # (legacy blocks: unknown to the compiler)
        for t in prange((n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            for r in range(t * ROWS_PER_TASK, min(n_rows, (t + 1) * ROWS_PER_TASK)):
                row = raw[r]
                acc = np.float32(0.0)
                for b in range(nb):
                    acc += block_dot(row, b * block_bytes, b, qk, x, xs, tab)
                out[r] = acc

    return block_rows


def _matvec_of(type_id: int):
    """The mat-vec kernel of one type: type_id is a constant of the closure (a literal to Numba)."""

    def matvec(raw, x, xs, tab, out):
        _block_rows(type_id, raw, x, xs, tab, out)

    return matvec


MATVEC = Variants(_matvec_of, "MATVEC", parallel=True, fastmath=_FM, boundscheck=False)
