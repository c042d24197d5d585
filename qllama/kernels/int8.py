"""The int8-activation path (as llama.cpp runs quantized mat-vecs), for every quantized type.

Activations are quantized once per call (or once for several matrices, see
`qllama.qtensor.quantize_activation`) in ggml's formats q8_K, q8_0 and q8_1 (`act_quant.py`).

Weight blocks are then dotted with integer arithmetic (`_x86.py`): exact integer sums times
float scales, so the only error versus float is the rounding of x to 8 bits, like llama.cpp
(measured: max|y - y64| / max|y64| from 2e-3 to 1.3e-2 on random data; see the tests).

Each mat-mul takes x as (n_tok, ne0) and serves both decode (n_tok = 1) and prefill: rows are
split over threads (`_row_chunks`: one contiguous chunk of rows per thread, each by a serial row
kernel called by address); for each tile of TOKEN_TILE tokens a row is read from memory once
(then from L1) and applied to every token of the tile. All but q2_K/q3_K use whole-row
intrinsics (vector accumulators, one horizontal sum per row) and a 4-token variant that unpacks
the weights once for 4 tokens and computes, per token, exactly what the one-token intrinsic
computes (so prefill rows equal decode bit for bit); q2_K/q3_K call a per-block intrinsic.
q4_K, q6_K, q4_0, q5_0 and q8_0 batches take `gemm` (TILE_ROWS = 8 or, on a 512-bit ISA, 16 rows per
pass; the same values: `_x86_gemm.py`), and so do the i-quants' (`iquants.py`, `_x86_gemm_iq.py`),
whose prompts of 8+ tokens also have a gemm in llama.cpp's prompt arithmetic (`gemm(SUMS | type)`,
`_x86_gemm_iq.py`), which is not vec_dot's.

Numba's cache key covers every qllama/kernels/*.py (`jit.py`), so a change to an intrinsic in
`_x86.py` recompiles the kernels that inline it.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..gguf.types import (
    GGML_TYPES,
    IQ4_NL,
    Q2_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
)
from ._fp16 import f16_at
from ._x86 import (
    dot_q2_k,
    dot_q3_k,
    row_dot4_q4_k,
    row_dot4_q4_legacy,
    row_dot4_q5_k,
    row_dot4_q5_legacy,
    row_dot4_q6_k,
    row_dot4_q8_0,
    row_dot_q4_k,
    row_dot_q4_legacy,
    row_dot_q5_k,
    row_dot_q5_legacy,
    row_dot_q6_k,
    row_dot_q8_0,
    row_dotn,
)
from ._x86_gemm import L1_BLOCK_BYTES, PACKED_BYTES, SUMS, TILE_ROWS
from ._x86_gemm_iq import FLIPPED_X
from ._x86_gemms import ALL_PACKED_BYTES, pack_rows, tile_rows
from ._x86_iq import tail_iq4_nl
from .act_quant import Q8K_SUMS, bsum16
from .jit import Variants, address_of, call_address, kernel
from .kquants import scale_q3_k

_NOPY = dict(boundscheck=False)
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
QK_K = 256
QK8_0 = 32
TOKEN_TILE = 64  # 64 tokens x ne0 int8 activations stay in L2
@kernel(**_NOPY)
def _chunks(n_rows, n_threads):
    """Split rows into one contiguous chunk per thread: (n_chunks, rows per chunk).

    (n_threads comes from the caller: `numba.get_num_threads()` inside a kernel defeats caching.)
    """
    n = max(1, min(n_rows, n_threads))
    return n, (n_rows + n - 1) // n


# The parallel loop of the mat-muls: one contiguous chunk of rows per thread, each chunk by a
# serial row kernel called by its address (jit.call_address). Inside a parallel loop a kernel's
# code would be linked in and optimised again, twice over, for every type; this way each type's
# rows compile once, serially, and the loop once for all types (~0.5-1 s less per type on a
# first run).


@kernel(parallel=True, **_NOPY)
def _row_chunks(address, raw, xq, xd, xs, tab, out, n_units, n_threads):
    """rows(raw, xq, xd, xs, tab, out, u0, u1) over units 0..n_units-1 (rows or row groups), one
    contiguous chunk per thread (address: `compiled_address` of rows for these types; 0: nothing,
    as in a recording warm-up)."""
    if address == 0:
        return
    n_chunks, per = _chunks(n_units, n_threads)
    for c in prange(n_chunks):
        call_address(address, raw, xq, xd, xs, tab, out, np.int64(c * per), np.int64(min(n_units, (c + 1) * per)))


def _over_threads(rows, n_units, raw, xq, xd, xs, tab, out, n_threads) -> None:
    """Run the serial row kernel `rows` over n_units split across n_threads (`_row_chunks`)."""
    args = (raw, xq, xd, xs, tab, out, np.int64(0), np.int64(0))
    address = address_of(rows, args, lambda: rows(*args))  # (an empty range: only compiles or loads it)
    _row_chunks(address, raw, xq, xd, xs, tab, out, np.int64(n_units), np.int64(n_threads))


# Row kernels (q4_K, q5_K, q6_K, q8_0, q4_0, q4_1, q5_0, q5_1): the whole row dot product is one intrinsic (`_x86.py`)
# that loops over the blocks in IR with a vector accumulator. Per row chunk and tile of tokens,
# a row is read from memory once and stays in L1 for the other tokens of the tile.


# Batch kernels (q4_K, q6_K, q4_0, q5_0, q8_0; `_x86_gemm.py`): TILE_ROWS rows per pass, rows in the vector
# lanes; the same values as the row kernels, bit for bit.
GEMM_TYPES = tuple(PACKED_BYTES)  # q4_K, q6_K, q4_0, q5_0, q8_0
# the types whose prompts have kernels in llama.cpp's prompt arithmetic (`gemm(SUMS | type)`, `_x86_gemm.SUMS`):
# q2_K, q4_K, q5_K, q6_K and the i-quants iq4_xs, iq3_s, iq2_xxs, iq3_xxs
PROMPT_TYPES = frozenset(k & ~SUMS for k in ALL_PACKED_BYTES if k & SUMS)


@kernel(**_NOPY)
def _aligned_bytes(n):
    """An uninitialised uint8 array of n bytes starting on a 64-byte boundary. (Numba's allocations
    are 32-byte aligned or better: a 64-byte vector load from a scratch that is not splits across two
    cache lines, and one process in two ran the 512-bit gemms ~40% slower.)"""
    buf = np.empty(n + 64, np.uint8)
    skip = (64 - buf.ctypes.data % 64) % 64
    return buf[skip:skip + n]


def _gemm_rows_of(type_id: int):
    """The batch kernel of one type (a closure constant, as `_rows_of`): groups g0..g1-1 of
    TILE_ROWS rows, each packed once into a scratch (`pack_*`), then multiplied with every token
    (`tile_*`). Also the i-quants' (`iquants.matmul_int8` calls it): iq4_nl's unit is a pair of
    blocks, with 16 accumulators and ggml's scalar tail block after an odd count."""
    nl = type_id == IQ4_NL
    sums = bool(type_id & SUMS)  # (the key of an i-quant's super-block sums kernels: one accumulator)
    bb = GGML_TYPES[type_id & ~SUMS].type_size * (2 if nl else 1)  # bytes per unit (a block, or iq4_nl's pair)
    packed = ALL_PACKED_BYTES[type_id]
    n_acc = 1 if sums else 16 if nl else 8

    def gemm_rows(raw, xq, xd, xs, tab, out, g0, g1):
        nb, n_tok = raw.shape[1] // bb, xq.shape[0]
        pack = _aligned_bytes(nb * packed)  # TILE_ROWS rows, packed: in L2
        n_ranges = (nb * packed + L1_BLOCK_BYTES - 1) // L1_BLOCK_BYTES
        per = (nb + n_ranges - 1) // n_ranges  # blocks per range: their packed bytes stay in L1
        # (n_tok, n_acc vectors of TILE_ROWS) accumulators between ranges
        acc = _aligned_bytes(n_tok * 4 * n_acc * TILE_ROWS).view(np.float32).reshape(n_tok, n_acc * TILE_ROWS)
        for g in range(g0, g1):
            r = g * TILE_ROWS
            pack_rows(type_id, raw, r, nb, pack)
            for b0 in range(0, nb, per):
                tile_rows(type_id, pack, nb, b0, min(nb, b0 + per), xq, xd, xs, 0, n_tok, out, r, acc)
            if nl and (raw.shape[1] // 18) % 2 == 1:  # ggml's scalar tail block
                for t in range(n_tok):
                    for i in range(r, r + TILE_ROWS):
                        out[t, i] = tail_iq4_nl(raw[i], 2 * nb + 1, xq[t], xd[t], out[t, i])

    return gemm_rows


def gemm(type_id, raw, xq, xd, xs, tab, out, n_threads):
    """matmul_rows(type_id, ...) (the same values, bit for bit) for batches of 2+ tokens, when
    n_rows is a multiple of TILE_ROWS (type_id in GEMM_TYPES, or an i-quant's): groups of
    TILE_ROWS rows over the threads. type_id = SUMS | an i-quant: its prompt gemm (llama.cpp's
    prompt arithmetic, `_x86_gemm_iq.py`)."""
    if raw.shape[0] % TILE_ROWS:
        raise ValueError(f"gemm needs a multiple of {TILE_ROWS} rows, not {raw.shape[0]}")
    if type_id in FLIPPED_X:  # (the prompt kernels multiply x + 128, read from memory, on a VNNI ISA)
        xq = (xq.view(np.uint8) ^ np.uint8(0x80)).view(np.int8)
    if type_id in (SUMS | Q4_K, SUMS | Q5_K):  # q4_K's prompt kernel reads the sums of 32 (slots 0-7) in int16 pairs, slots 0-3
        sums = xs.reshape(xs.shape[0], -1, Q8K_SUMS)[:, :, :8]
        xs = xs.copy()
        xs.reshape(xs.shape[0], -1, Q8K_SUMS)[:, :, :4] = (sums[:, :, 0::2] & 0xFFFF) | (sums[:, :, 1::2] << 16)
    _over_threads(GEMM_ROWS[type_id], raw.shape[0] // TILE_ROWS, raw, xq, xd, xs, tab, out, n_threads)


_BLOCK_BYTES = {t: GGML_TYPES[t].type_size for t in (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)}  # (gguf.types)


def _rows_of(type_id: int):
    """The row kernel of one type (type_id, a constant of the closure: Numba keeps only its
    branch, so a member compiles only its own intrinsics): out[t, r] = row r . x[t] for rows
    r0..r1-1 of raw (uint8 (n_rows, nb * block bytes)), out float32 (n_tok, n_rows).

    x in the type's activation form (`act_quant.py`): q8_K (xq (n_tok, ne0), xd (n_tok, ne0/256),
    xs (n_tok, ne0/16) int32) for the k-quants; q8_0 (xd (n_tok, ne0/32), xs int32 sums of xq)
    for q8_0, q4_0, q5_0; q8_1 (xs float32 s = fp16(dx * sum xq)) for q4_1 and q5_1. As ggml's
    vec_dot: q4_0: d*(q-8), q5_0: d*(q-16) -> d*dx*(sum q xq - off*xs); q4_1 / q5_1: d*q + m ->
    d*dx*sum q xq + m*s; the k-quants per super-block (`_x86.py`).
    """
    bb = _BLOCK_BYTES[type_id]
    q4k, q5k, q6k, q80 = type_id == Q4_K, type_id == Q5_K, type_id == Q6_K, type_id == Q8_0
    five = type_id == Q5_0 or type_id == Q5_1  # else q4_0 / q4_1 (the legacy intrinsics)

    def rows(raw, xq, xd, xs, tab, out, r0, r1):
        n_tok, nb = xq.shape[0], raw.shape[1] // bb
        for t0 in range(0, n_tok, TOKEN_TILE):
            for r in range(r0, r1):  # (the row intrinsics prefetch ahead, per block)
                row = raw[r]
                t1 = min(n_tok, t0 + TOKEN_TILE)
                t = t0
                while t + 4 <= t1:  # 4 tokens per call: the weights are unpacked once for them
                    if q4k:
                        y = row_dot4_q4_k(row, nb, xq, xd, xs, t)
                    elif q5k:
                        y = row_dot4_q5_k(row, nb, xq, xd, xs, t)
                    elif q6k:
                        y = row_dot4_q6_k(row, nb, xq, xd, xs, t)
                    elif q80:
                        y = row_dot4_q8_0(row, nb, xq, xd, xs, t)
                    elif five:
                        y = row_dot4_q5_legacy(row, nb, xq, xd, xs, t)
                    else:
                        y = row_dot4_q4_legacy(row, nb, xq, xd, xs, t)
                    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = y
                    t += 4
                if t1 - t == 3:  # a tail of 3 or 2 tokens: the weights unpacked once for them too
                    out[t, r], out[t + 1, r], out[t + 2, r] = row_dotn(type_id, row, nb, xq, xd, xs, t, 3)
                    t += 3
                elif t1 - t == 2:
                    out[t, r], out[t + 1, r] = row_dotn(type_id, row, nb, xq, xd, xs, t, 2)
                    t += 2
                while t < t1:
                    if q4k:
                        out[t, r] = row_dot_q4_k(row, nb, xq[t], xd[t], xs[t])
                    elif q5k:
                        out[t, r] = row_dot_q5_k(row, nb, xq[t], xd[t], xs[t])
                    elif q6k:
                        out[t, r] = row_dot_q6_k(row, nb, xq[t], xd[t], xs[t])
                    elif q80:
                        out[t, r] = row_dot_q8_0(row, nb, xq[t], xd[t], xs[t])
                    elif five:
                        out[t, r] = row_dot_q5_legacy(row, nb, xq[t], xd[t], xs[t])
                    else:
                        out[t, r] = row_dot_q4_legacy(row, nb, xq[t], xd[t], xs[t])
                    t += 1

    return rows


# one row kernel per type, made on first use (a model compiles only the types it has)
ROWS_INT8 = Variants(_rows_of, "ROWS_INT8", fastmath=FASTMATH, **_NOPY)
GEMM_ROWS = Variants(_gemm_rows_of, "GEMM_ROWS", fastmath=FASTMATH, **_NOPY)


def matmul_rows(type_id, raw, xq, xd, xs, tab, out, n_threads):
    """The int8 mat-mul of q4_K, q5_K, q6_K, q8_0, q4_0, q4_1, q5_0 or q5_1 rows: the rows over
    the threads, each chunk by ROWS_INT8[type_id]."""
    _over_threads(ROWS_INT8[type_id], raw.shape[0], raw, xq, xd, xs, tab, out, n_threads)


@kernel(parallel=True, fastmath=FASTMATH, **_NOPY)
def matmul_q2_q3_k(type_id, raw, xq, xd, xs, tab, out, n_threads):
    """q2_K (84-byte blocks) or q3_K (110-byte blocks) rows times q8_K activations.

    q2_K: x = d*sc_k*q - dmin*m_k -> d*dx*dot - dmin*dx*sum_k m_k*bsum_k;
    q3_K: x = d*sc_k*(q+4 - 4) -> d*dx*(dot - 4*sum_k sc_k*bsum_k).
    Per row and tile, scales are decoded once into a scratch (nb, 3) int64 (scales lo/hi, mins term unused for q3).
    """
    n_rows = raw.shape[0]
    n_tok = xq.shape[0]
    is_q2 = type_id == Q2_K
    bb = 84 if is_q2 else 110
    nb = raw.shape[1] // bb
    n_chunks, per = _chunks(n_rows, n_threads)
    for c in prange(n_chunks):
        sc = np.empty((nb, 2), np.int64)  # (nb, [scales 0-7, scales 8-15]) one per byte
        ms = np.empty((nb, 16), np.int64)  # (nb, 16) mins (q2_K) or scales (q3_K), for the bsum terms
        dd = np.empty((nb, 2), np.float32)  # (nb, [d, dmin])
        for t0 in range(0, n_tok, TOKEN_TILE):
            for r in range(c * per, min(n_rows, (c + 1) * per)):
                row = raw[r]
                for b in range(nb):
                    o = b * bb
                    lo = 0
                    hi = 0
                    for k in range(16):
                        if is_q2:
                            v = np.int64(row[o + k])
                            s = v & 15
                            ms[b, k] = v >> 4
                        else:
                            s = np.int64(scale_q3_k(row, o + 96, k))
                            ms[b, k] = s
                        if k < 8:
                            lo |= (s & 255) << (8 * k)
                        else:
                            hi |= (s & 255) << (8 * (k - 8))
                    sc[b, 0] = lo
                    sc[b, 1] = hi
                    if is_q2:
                        dd[b, 0] = f16_at(row, o + 80, tab)
                        dd[b, 1] = f16_at(row, o + 82, tab)
                    else:
                        dd[b, 0] = f16_at(row, o + 108, tab)
                        dd[b, 1] = np.float32(0.0)
                for t in range(t0, min(n_tok, t0 + TOKEN_TILE)):
                    xqt, xdt, xst = xq[t], xd[t], xs[t]
                    acc = np.float32(0.0)
                    for b in range(nb):
                        corr = 0
                        for k in range(16):
                            corr += ms[b, k] * bsum16(xst, b, k)
                        if is_q2:
                            isum = dot_q2_k(row, b * bb, xqt, b * QK_K, sc[b, 0], sc[b, 1])
                            acc += (xdt[b] * dd[b, 0]) * np.float32(isum) - (xdt[b] * dd[b, 1]) * np.float32(corr)
                        else:
                            isum = dot_q3_k(row, b * bb, xqt, b * QK_K, sc[b, 0], sc[b, 1])
                            acc += (xdt[b] * dd[b, 0]) * np.float32(isum - 4 * corr)
                    out[t, r] = acc

