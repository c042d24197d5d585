"""Row dequantization of every block type: one source, the type as a compile-time constant.

`dequantize_rows(type_id, raw, rows, tab, out)` decodes whole rows with the block decoders of
`legacy.py` and `kquants.py` (bit-exact, equal to gguf-py). It serves the embedding lookup (a
few rows) and the float mat-mat of quantized types (a tile of rows at a time).

Each type runs its own kernel, `ROWS[type_id]` (a `jit.Variants` family; `ROWS_SERIAL` on the
calling thread, for the embedding lookup): it compiles only its own decoder. (One kernel branching on the type at run time compiled all ten decoders, ~8 s of
CPU on the first run, for the one or two types a model has.)
"""

from __future__ import annotations

from numba import prange, types
from numba.extending import overload

from ..gguf.types import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QK_K
from . import kquants as kq
from . import legacy as lg
from .jit import Variants

DECODERS = {Q4_K: kq.decode_q4_k, Q6_K: kq.decode_q6_k, Q5_K: kq.decode_q5_k, Q3_K: kq.decode_q3_k,
            Q2_K: kq.decode_q2_k, Q4_0: lg.decode_q4_0, Q4_1: lg.decode_q4_1, Q5_0: lg.decode_q5_0,
            Q5_1: lg.decode_q5_1, Q8_0: lg.decode_q8_0}


def _decode_row(type_id, row, tab, out):
    """Every block of `row` (uint8, one row of type `type_id`, a literal) -> out (float32, its elements)."""


@overload(_decode_row, prefer_literal=True, inline="always")
def _decode_row_impl(type_id, row, tab, out):
    if not isinstance(type_id, types.IntegerLiteral) or type_id.literal_value not in DECODERS:
        return None
    decode = DECODERS[type_id.literal_value]
    block = QK_K if Q2_K <= type_id.literal_value <= Q6_K else lg.QK  # elements per block (k-quants: ids 10..14)

    def decode_row(type_id, row, tab, out):
        nb = out.shape[0] // block
        bb = row.shape[0] // max(nb, 1)  # bytes per block
        for b in range(nb):
            decode(row, b * bb, tab, out, b * block)

    return decode_row


def _rows_of(type_id: int):
    """The parallel kernel of one type: type_id is a constant of the closure (a literal to Numba)."""

    def rows_of(raw, rows, tab, out):
        for i in prange(rows.shape[0]):
            _decode_row(type_id, raw[rows[i]], tab, out[i])

    return rows_of


def _rows_serial_of(type_id: int):
    """`_rows_of` on the calling thread (a few rows: an embedding lookup).

    Its own function rather than `_rows_of` compiled without parallel=True: Numba keys a cached
    kernel on the function's name, code and closure values, not on its options, so the two would
    share (and overwrite) one cache entry."""

    def rows_serial(raw, rows, tab, out):
        for i in range(rows.shape[0]):
            _decode_row(type_id, raw[rows[i]], tab, out[i])

    return rows_serial


ROWS = Variants(_rows_of, "ROWS", parallel=True, boundscheck=False)
ROWS_SERIAL = Variants(_rows_serial_of, "ROWS_SERIAL", boundscheck=False)  # (a parallel kernel compiles ~2x longer)


def dequantize_rows(type_id: int, raw, rows, tab, out, parallel: bool = True) -> None:
    """out[i] = row rows[i] as float32, for any block type (validated by the caller); the rows
    spread over the threads, or on this thread with parallel=False.

    raw: uint8 (n_rows, nb * block bytes); rows: int64 (n,); tab: `_fp16.FP16_TO_F32`;
    out: float32 (n, nb * block size).
    """
    (ROWS if parallel else ROWS_SERIAL)[int(type_id)](raw, rows, tab, out)
