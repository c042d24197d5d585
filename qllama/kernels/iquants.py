"""The i-quants' kernels: iq4_nl and iq4_xs block decoders (bit-exact, equal to gguf-py and ggml's
dequantize_row_*) and their int8 mat-muls (the row intrinsics of `_x86_iq.py`, equal to ggml's
vec_dot bit for bit), and the int8 row kernels of iq3_s, iq2_xxs, iq3_xxs and iq2_s. The other grid types
(iq2/iq3/iq1, tq1_0/tq2_0) have `iquants_grid.py`'s.

Families of kernels, one per type (`jit.Variants`; type ids: iq4_nl 20, iq4_xs 23):

- `ROWS[t]`: rows -> float32 (the float mat-mat's tiles; the embedding lookup
  uses NumPy instead).
- `ROWS_INT8[t]`: rows r0..r1 times int8 activations (q8_0 for iq4_nl, q8_K for iq4_xs), over
  tokens in tiles of TOKEN_TILE, 4 tokens per intrinsic call (weights unpacked once), each token
  exactly the one-token value (so a batch's rows equal decode's bit for bit).
- a prompt's rows of iq4_xs, iq3_s, iq2_xxs and iq3_xxs take `int8.gemm(SUMS | type)` instead (llama.cpp's
  prompt arithmetic, ~2x the products per second of vec_dot's rounding: `_x86_gemm_iq.py`,
  chosen by `qtensor._prompt_op`).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..dequant.iq_grids import KVALUES_IQ4NL
from ._fp16 import f16_at
from ._x86_gemm import TILE_ROWS
from ._x86_gemm_iq import IQ_PACKED_BYTES
from ._x86_iq import (
    row_dot4_iq2_s,
    row_dot4_iq2_xxs,
    row_dot4_iq3_s,
    row_dot4_iq3_xxs,
    row_dot4_iq4_nl,
    row_dot4_iq4_xs,
    row_dot_iq2_s,
    row_dot_iq2_xxs,
    row_dot_iq3_s,
    row_dot_iq3_xxs,
    row_dot_iq4_nl,
    row_dot_iq4_xs,
    tail_iq4_nl,
)
from ._x86_mxfp4 import row_dot4_mxfp4, row_dot_mxfp4, tail_mxfp4
from .int8 import _over_threads, gemm
from .jit import Variants, kernel

IQ4_NL, IQ4_XS, IQ3_S, IQ2_XXS, IQ3_XXS, IQ2_S, MXFP4 = 20, 23, 21, 16, 18, 22, 39
BLOCK = {IQ4_NL: (32, 18), IQ4_XS: (256, 136)}  # type -> (elements, bytes) per block
ROW_BYTES = {IQ4_NL: 18, IQ4_XS: 136, IQ3_S: 110, IQ2_XXS: 66, IQ3_XXS: 98, IQ2_S: 82, MXFP4: 17}  # the types of ROWS_INT8: bytes per block
TOKEN_TILE = 64
_NOPY = dict(boundscheck=False)
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_KV = KVALUES_IQ4NL  # (16,) int8, a constant of the compiled code


@kernel(**_NOPY)
def decode_iq4_nl(row, bo, tab, out, oo):
    """The iq4_nl block at row[bo:] (d, qs[16]) -> out[oo:oo + 32]: d * kvalue."""
    d = f16_at(row, bo, tab)
    for l in range(16):
        b = row[bo + 2 + l]
        out[oo + l] = d * np.float32(_KV[b & 15])
        out[oo + 16 + l] = d * np.float32(_KV[b >> 4])


@kernel(**_NOPY)
def decode_iq4_xs(row, bo, tab, out, oo):
    """The iq4_xs block at row[bo:] (d, scales_h, scales_l[4], qs[128]) -> out[oo:oo + 256]:
    (d * (ls_j - 32)) * kvalue per 32-element sub-block j."""
    d = f16_at(row, bo, tab)
    sh = np.int32(row[bo + 2]) | (np.int32(row[bo + 3]) << 8)
    for j in range(8):
        ls = ((np.int32(row[bo + 4 + j // 2]) >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        q = bo + 8 + 16 * j
        o = oo + 32 * j
        for l in range(16):
            b = row[q + l]
            out[o + l] = dl * np.float32(_KV[b & 15])
            out[o + 16 + l] = dl * np.float32(_KV[b >> 4])


@kernel(**_NOPY)
def _decode_row(nl, row, tab, out):
    """An iq4_nl (nl) or iq4_xs row -> out float32 (ne0,)."""
    block, bb = (32, 18) if nl else (256, 136)
    for b in range(out.shape[0] // block):
        if nl:
            decode_iq4_nl(row, b * bb, tab, out, b * block)
        else:
            decode_iq4_xs(row, b * bb, tab, out, b * block)


def _rows_of(type_id: int):
    """Rows -> float32 of one type, over the threads (type_id a constant of the closure)."""
    nl = type_id == IQ4_NL

    def rows_of(raw, rows, tab, out):
        for i in prange(rows.shape[0]):
            _decode_row(nl, raw[rows[i]], tab, out[i])

    return rows_of


ROWS = Variants(_rows_of, "ROWS", parallel=True, **_NOPY)


def dequantize_rows(type_id: int, raw, rows, tab, out, parallel: bool = True) -> None:
    """out[i] = row rows[i] as float32 (the float path's tiles). raw: uint8 (n_rows, row bytes);
    rows: int64 (n,); tab: `_fp16.FP16_TO_F32`; out: float32 (n, ne0). parallel: the decoders'
    common signature; always over the threads (no serial kernel: the embedding lookup decodes
    in NumPy, `dequant/iq_rows.py`)."""
    ROWS[int(type_id)](raw, rows, tab, out)


@kernel(**_NOPY)
def _tail(mx, row, nb, xq, xd, y):
    """ggml's scalar tail block of an mxfp4 (mx) or iq4_nl row."""
    return tail_mxfp4(row, nb, xq, xd, y) if mx else tail_iq4_nl(row, nb, xq, xd, y)


def _int8_rows_of(type_id: int):
    """The int8 row kernel of one type: out[t, r] = row r . x[t] for rows r0..r1-1, every token.

    iq4_nl: x in q8_0 form (xq (n_tok, ne0) int8, xd (n_tok, ne0/32) float32, xs unused);
    iq4_xs, iq3_s, iq2_xxs, iq3_xxs, iq2_s: q8_K (xd (n_tok, ne0/256); xs unused); mxfp4 as iq4_nl."""
    nl, xs4, iq3s, mx = type_id == IQ4_NL, type_id == IQ4_XS, type_id == IQ3_S, type_id == MXFP4
    iq3xxs, iq2s = type_id == IQ3_XXS, type_id == IQ2_S  # (else iq2_xxs)
    pairs = nl or mx  # blocks in pairs, ggml's scalar tail after
    bb = ROW_BYTES[type_id]

    def rows(raw, xq, xd, xs, tab, out, r0, r1):
        n_tok, nb = xq.shape[0], raw.shape[1] // bb
        odd = pairs and nb % 2 == 1
        nbe = nb - 1 if odd else nb  # blocks the intrinsic takes (iq4_nl: pairs)
        for t0 in range(0, n_tok, TOKEN_TILE):
            t1 = min(n_tok, t0 + TOKEN_TILE)
            for r in range(r0, r1):  # (the row intrinsics prefetch ahead, per block)
                row = raw[r]
                t = t0
                while t + 4 <= t1:  # 4 tokens per call: the weights are unpacked once for them
                    if nl:
                        y = row_dot4_iq4_nl(row, nbe, xq, xd, xs, t)
                    elif mx:
                        y = row_dot4_mxfp4(row, nbe, xq, xd, xs, t)
                    elif xs4:
                        y = row_dot4_iq4_xs(row, nbe, xq, xd, xs, t)
                    elif iq3s:
                        y = row_dot4_iq3_s(row, nbe, xq, xd, xs, t)
                    elif iq3xxs:
                        y = row_dot4_iq3_xxs(row, nbe, xq, xd, xs, t)
                    elif iq2s:
                        y = row_dot4_iq2_s(row, nbe, xq, xd, xs, t)
                    else:
                        y = row_dot4_iq2_xxs(row, nbe, xq, xd, xs, t)
                    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = y
                    if odd:
                        for u in range(t, t + 4):
                            out[u, r] = _tail(mx, row, nb, xq[u], xd[u], out[u, r])
                    t += 4
                while t < t1:
                    if nl:
                        v = row_dot_iq4_nl(row, nbe, xq[t], xd[t], xs[t])
                    elif mx:
                        v = row_dot_mxfp4(row, nbe, xq[t], xd[t], xs[t])
                    elif xs4:
                        v = row_dot_iq4_xs(row, nbe, xq[t], xd[t], xs[t])
                    elif iq3s:
                        v = row_dot_iq3_s(row, nbe, xq[t], xd[t], xs[t])
                    elif iq3xxs:
                        v = row_dot_iq3_xxs(row, nbe, xq[t], xd[t], xs[t])
                    elif iq2s:
                        v = row_dot_iq2_s(row, nbe, xq[t], xd[t], xs[t])
                    else:
                        v = row_dot_iq2_xxs(row, nbe, xq[t], xd[t], xs[t])
                    if odd:
                        v = _tail(mx, row, nb, xq[t], xd[t], v)
                    out[t, r] = v
                    t += 1

    return rows


ROWS_INT8 = Variants(_int8_rows_of, "ROWS_INT8", fastmath=FASTMATH, **_NOPY)


def matmul_int8(type_id, raw, xq, xd, xs, tab, out, n_threads):
    """The int8 mat-mul of iq4_nl / iq4_xs / iq3_s / iq2_xxs / iq3_xxs / iq2_s / mxfp4 rows (decode and prompts): rows
    over the threads, each chunk by ROWS_INT8[type_id] (`int8._over_threads`); batches of 2+
    tokens take `int8.gemm` when the rows are whole groups of TILE_ROWS (the same values)."""
    unit = ROW_BYTES[int(type_id)] * (2 if int(type_id) == IQ4_NL else 1)  # (the gemm's: a pair of iq4_nl blocks)
    if int(type_id) in IQ_PACKED_BYTES and xq.shape[0] >= 2 and raw.shape[0] % TILE_ROWS == 0 and raw.shape[1] >= unit:
        gemm(type_id, raw, xq, xd, xs, tab, out, n_threads)
    else:
        _over_threads(ROWS_INT8[int(type_id)], raw.shape[0], raw, xq, xd, xs, tab, out, n_threads)
