"""MXFP4's kernels (ggml type 39): the block decoder (bit-exact, equal to gguf-py's and ggml's
dequantize_row_mxfp4) and the int8 mat-mul (the row intrinsics of `_x86_mxfp4.py`, equal to
ggml's `ggml_vec_dot_mxfp4_q8_0` bit for bit; activations in q8_0 form).

- `dequantize_rows`: rows -> float32 (the float path's tiles; the embedding lookup uses NumPy,
  `qllama.dequant.mxfp4_rows`).
- `matmul_int8`: rows over the threads, tokens in tiles of TOKEN_TILE, 4 tokens per intrinsic
  call (weights unpacked once), each token exactly the one-token value (a prompt's rows equal
  decode's bit for bit).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..dequant.mxfp4_rows import BLOCK, BLOCK_BYTES, E8M0_HALF, KVALUES_MXFP4
from . import iquants
from .iquants import MXFP4
from .jit import kernel

_NOPY = dict(boundscheck=False)
_KV = KVALUES_MXFP4  # (16,) int8, constants of the compiled code
_E = E8M0_HALF  # (256,) float32


@kernel(**_NOPY)
def decode_mxfp4(row, bo, out, oo):
    """The mxfp4 block at row[bo:] (e, qs[16]) -> out[oo:oo + 32]: E8M0_HALF[e] * kvalue."""
    d = _E[row[bo]]
    for l in range(16):
        b = row[bo + 1 + l]
        out[oo + l] = d * np.float32(_KV[b & 15])
        out[oo + 16 + l] = d * np.float32(_KV[b >> 4])


@kernel(**_NOPY)
def _decode_row(row, out):
    for b in range(out.shape[0] // BLOCK):
        decode_mxfp4(row, b * BLOCK_BYTES, out, b * BLOCK)


@kernel(parallel=True, **_NOPY)
def _rows(raw, rows, out):
    for i in prange(rows.shape[0]):
        _decode_row(raw[rows[i]], out[i])


def dequantize_rows(type_id: int, raw, rows, tab, out, parallel: bool = True) -> None:
    """out[i] = row rows[i] as float32. raw: uint8 (n_rows, row bytes); rows: int64 (n,);
    tab, parallel: unused (the signature of the other decoders: always over the threads, the
    embedding lookup decodes in NumPy, `dequant/mxfp4_rows.py`); out: float32 (n, ne0)."""
    _rows(raw, rows, out)


# out[t, r] = row r . x[t] for rows r0..r1-1, every token; x in q8_0 form (xq (n_tok, ne0) int8,
# xd (n_tok, ne0/32) float32, xs unused): iq4_nl's row kernel with mxfp4's intrinsics
rows_int8 = iquants.ROWS_INT8[MXFP4]


def matmul_int8(type_id, raw, xq, xd, xs, tab, out, n_threads):
    """The int8 mat-mul of mxfp4 rows (decode and prompts): rows over the threads, each chunk by
    `rows_int8` (`int8._over_threads`)."""
    from .int8 import _over_threads

    _over_threads(rows_int8, raw.shape[0], raw, xq, xd, xs, tab, out, n_threads)
