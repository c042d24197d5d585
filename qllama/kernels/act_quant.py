"""Activations rounded to 8 bits in ggml's formats, for the int8 mat-muls (`int8.py`).

- q8_K (for the k-quants): per 256 elements a float32 scale d = max/-127 of the signed value
  of largest magnitude, int8 quants round(x/d) (ties to even), and the sums of every 16 quants
  ("bsums" b_0..b_15, used for the min / offset terms), kept in 16 int32 slots per block in the
  two arrangements the kernels read (`Q8K_SUMS`): slots 0-7 the sums of 32, b_2l + b_2l+1
  (q4_K / q5_K mins, the iq1 types), slots 8-15 the int16 pairs (b_l, b_l+8) (q6_K's offset
  term: one `pmaddwd` against its scales paired alike; q2_K / q3_K read them one by one,
  `bsum16`). Every |b| <= 16 * 127 fits in int16.
- q8_0 (for q8_0, q4_0, q5_0): per 32 elements d = amax/127 rounded to fp16 as ggml stores it,
  quants round-half-even(x * 127/amax), and their int32 sum;
- q8_1 (for q4_1, q5_1): as q8_0, with s = fp16(d * sum of quants) instead of the sum (ggml's
  q8_1 `s`, for the min term m * s).

Each takes x float32 (n_tok, n) and fills preallocated outputs (`qtensor.Activation` owns them).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ._act_q8k import q8_0_block, q8k_block
from .jit import address_of, call_address, kernel
from .quantize_k import fp16_round

_NOPY = dict(boundscheck=False)
QK_K = 256
QK8_0 = 32
# q8_K's 16 int32 sum slots per block: [0, 8) sums of 32 quants, [8, 16) int16 pairs (b_l, b_l+8)
Q8K_SUMS = 16

@kernel(**_NOPY)
def q8_k_row(x, t, xq, xd, xs):
    """Token t (int64) of x in q8_K form (shapes as `quantize_q8_k`), on the calling thread, one
    256-element block at a time in vector code (`_act_q8k.q8k_block`).

    fused.py's one-token step calls it too. A block holding NaN/Inf gets d = NaN (so results
    are NaN, not garbage).
    """
    for b in range(x.shape[1] // QK_K):
        q8k_block(x, t, b, xq, xd, xs)


@kernel(inline="always", **_NOPY)
def bsum16(xs_row, b, k):
    """b_k, the sum of quants 16k..16k+15 of block b, from a token's q8_K sums (`Q8K_SUMS`)."""
    w = np.int64(xs_row[b * Q8K_SUMS + 8 + (k & 7)])
    h = (w >> 16) if k >= 8 else ((w & 0xFFFF) ^ 0x8000) - 0x8000  # (high half: arithmetic shift; low: sign-extended)
    return np.int32(h)


@kernel(**_NOPY)
def _as_fp16(v):
    """v rounded to fp16 as ggml stores a q8_0/q8_1 scale; beyond fp16's range (|v| > 65504, where
    ggml's scale would be inf) v itself, so that extreme activations stay finite."""
    r = fp16_round(v)
    return r if abs(r) != np.inf else v


@kernel(**_NOPY)
def _q8_block(x, t, o, xq):
    """One 32-element block as llama.cpp's AVX2 quantize_row_q8_0/q8_1: d = amax/127,
    q = round-half-even(x * 127/amax). Returns (d unrounded, sum of q); d NaN if x is not finite.
    In vector code (`_act_q8k.q8_0_block`)."""
    return q8_0_block(x, t, o, xq)


@kernel(**_NOPY)
def q8_0_row(x, t, xq, xd, xs):
    """Token t of x in q8_0 form: xd (n_tok, n/32) = fp16(d) as ggml stores it, xs int32 (n_tok, n/32) sums of xq."""
    for b in range(x.shape[1] // QK8_0):
        d, s = _q8_block(x, t, b * QK8_0, xq)
        xd[t, b] = _as_fp16(d)
        xs[t, b] = s


@kernel(**_NOPY)
def q8_1_row(x, t, xq, xd, xs):
    """As q8_0_row, but xs float32 (n_tok, n/32) = fp16(d * sum of xq), ggml's q8_1 `s` (the
    activation form of q4_1 and q5_1: their min term is m * s)."""
    for b in range(x.shape[1] // QK8_0):
        d, s = _q8_block(x, t, b * QK8_0, xq)
        xd[t, b] = _as_fp16(d)
        xs[t, b] = _as_fp16(d * np.float32(s))


# -- whole activations: each token by one of the row functions above, tokens over the threads.
# The parallel loop calls the row function by its address (jit.call_address), so the row code
# compiles once, not again inside the loop (~1 s less per form on a first run). --


@kernel(parallel=True, **_NOPY)
def _each_token(row_address, x, xq, xd, xs):
    """row(x, t, xq, xd, xs) for every token t of x, tokens spread over the threads
    (row_address: `compiled_address` of row for these types; 0: nothing, as in a recording warm-up)."""
    if row_address == 0:
        return
    for t in prange(x.shape[0]):
        call_address(row_address, x, np.int64(t), xq, xd, xs)


# Up to this many tokens are quantized on the calling thread, one call per token: a parallel
# region's launch costs more than their rows (SmolLM2's 576 values: ~3 us a row; the region ~10-25
# us even at one thread, measured per verify batch of prompt lookup and per server step)
SERIAL_TOKENS = 4


def _quantize(row, x, xq, xd, xs) -> None:
    """x float32 (n_tok, n) -> (xq, xd, xs) by `row` for each token: on this thread for up to
    SERIAL_TOKENS tokens, else in one parallel region."""
    if x.shape[0] <= SERIAL_TOKENS:  # (no thread wake-up)
        for t in range(x.shape[0]):
            row(x, t, xq, xd, xs)
        return
    args = (x, 0, xq, xd, xs)
    address = address_of(row, args, lambda: row(*args))  # (token 0 is quantized here meanwhile)
    _each_token(address, x, xq, xd, xs)  # (address 0, a recording warm-up: only noted)


def quantize_q8_k(x, xq, xd, xs) -> None:
    """x: float32 (n_tok, n) -> xq int8 (n_tok, n), xd float32 (n_tok, n/256), xs int32 (n_tok, n/16).
    All C-contiguous and writable (qtensor.Activation makes them so)."""
    _quantize(q8_k_row, x, xq, xd, xs)


def quantize_q8_0(x, xq, xd, xs) -> None:
    """x: float32 (n_tok, n) -> xq int8 (n_tok, n), xd float32 (n_tok, n/32) = fp16(d) as ggml
    stores it, xs int32 (n_tok, n/32) sums of xq."""
    _quantize(q8_0_row, x, xq, xd, xs)


def quantize_q8_1(x, xq, xd, xs) -> None:
    """As quantize_q8_0, but xs float32 (n_tok, n/32) = fp16(d * sum of xq) (see q8_1_row)."""
    _quantize(q8_1_row, x, xq, xd, xs)
