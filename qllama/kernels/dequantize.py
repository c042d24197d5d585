"""Row dequantization of every block type: one kernel, the type as a parameter.

`dequantize_rows(type_id, raw, rows, tab, out)` decodes whole rows with the block decoders of
`legacy.py` and `kquants.py` (bit-exact, equal to gguf-py). It serves the embedding lookup (a
few rows) and the float mat-mat of quantized types (a tile of rows at a time). The type is
tested once per block; the decoders themselves dominate the time.
"""

from __future__ import annotations

from numba import prange

from ..ggml_types import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, QK_K
from . import kquants as kq
from . import legacy as lg
from .jit import kernel

@kernel(inline="always", boundscheck=False)
def _decode(type_id, row, bo, tab, out, oo):
    """The block of `type_id` at byte bo of row -> out[oo:oo + block size] (float32)."""
    if type_id == Q4_K:
        kq.decode_q4_k(row, bo, tab, out, oo)
    elif type_id == Q6_K:
        kq.decode_q6_k(row, bo, tab, out, oo)
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
    else:
        lg.decode_q8_0(row, bo, tab, out, oo)


@kernel(parallel=True, boundscheck=False)
def dequantize_rows(type_id, raw, rows, tab, out):
    """out[i] = row rows[i] as float32, for any block type (validated by the caller).

    raw: uint8 (n_rows, nb * block bytes); rows: int64 (n,); tab: `_fp16.FP16_TO_F32`;
    out: float32 (n, nb * block size).
    """
    block = QK_K if Q2_K <= type_id <= Q6_K else lg.QK  # elements per block (k-quants: ids 10..14)
    nb = out.shape[1] // block
    bb = raw.shape[1] // max(nb, 1)  # bytes per block
    for i in prange(rows.shape[0]):
        row = raw[rows[i]]
        o = out[i]
        for b in range(nb):
            _decode(type_id, row, b * bb, tab, o, b * block)
