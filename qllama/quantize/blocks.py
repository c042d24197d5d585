"""Block quantizers: float32 rows -> ggml block bytes (`quantize_array`).

The algorithms are ggml's (ggml-quants.c), rewritten here; `quantize_array` follows the row
references (`quantize_row_*_ref`), `quantize_chunk` what `ggml_quantize_chunk` writes into files
(the same but for iq4_nl's scale search):

- q8_0, q4_0, q4_1, q5_0, q5_1: vectorised NumPy, byte-identical to ggml (and to gguf-py);
- iq4_nl: ggml's quantize_row_iq4_nl_ref (the KV cache's iq4_nl rows), vectorised NumPy; in
  files, quantize_row_iq4_nl_impl's search (as iq4_xs);
- q2_K, q3_K, q4_K, q5_K, q6_K, iq4_xs (and iq4_nl in files): the kernels of
  `qllama.kernels.quantize_k` (bytes identical to llama.cpp's), run on slices of blocks in a
  thread pool (they release the GIL);
- f32, f16, bf16 (ggml's round-to-nearest-even bf16, NaN kept quiet).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable

import numpy as np

from ..errors import QllamaError, UnsupportedError
from ..gguf.types import (BF16, F16, F32, GGML_TYPES, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS,
                          MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TQ1_0, TQ2_0, type_name)

_F32 = np.float32


# =============================================================================================
# Float types
# =============================================================================================

def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits as ggml does: round to nearest even, NaN forced quiet."""
    u = x.view(np.uint32).astype(np.uint64)  # widened so that the rounding add cannot overflow
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet = ((u >> 16) | 64) & 0xFFFF  # keep sign/exponent/top mantissa, set the quiet bit
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# =============================================================================================
# Legacy quants (blocks of 32): vectorised NumPy, byte-identical to ggml's *_ref
# =============================================================================================
# Every function takes blocks (n_blocks, 32) float32 and returns uint8 (n_blocks, type_size).
# Arithmetic stays in float32 (NumPy 2 keeps float32 op python-scalar in float32).

def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8: IEEE half, round to nearest even (like F16C / ggml)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).view(np.uint8)


def _inverse(d: np.ndarray) -> np.ndarray:
    """ggml's `id = d ? 1.0f/d : 0.0f`, elementwise in float32."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, _F32(1) / d, _F32(0)).astype(np.float32)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 1): the value of largest magnitude, keeping its sign (first one on ties)."""
    idx = np.abs(b).argmax(axis=1)
    return b[np.arange(b.shape[0]), idx][:, None]


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero), exact in float32: the fraction v - trunc(v) is exact."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= _F32(0.5), np.sign(v), _F32(0)).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16): byte j = q[j] | q[j+16] << 4 (ggml's legacy order)."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit values -> (n, 4): bit k of a little-endian uint32 = bit 4 of q[k]."""
    bits = (q.astype(np.uint32) >> 4) & 1
    qh = (bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return qh.astype("<u4").view(np.uint8).reshape(-1, 4)


def _quantize_q8_0(b: np.ndarray) -> np.ndarray:
    amax = np.abs(b).max(axis=1, keepdims=True)  # (n, 1)
    d = amax / _F32(127)
    q = _roundf(b * _inverse(d)).astype(np.int8)  # (n, 32), |q| <= 127
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1)


def _quantize_q4_0(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / _F32(-8)  # the extreme value maps to -8
    q = np.minimum(15, np.trunc(b * _inverse(d) + _F32(8.5)))  # C: MIN(15, (int8_t)(x + 8.5f))
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=1)


def _quantize_q5_0(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / _F32(-16)
    q = np.minimum(31, np.trunc(b * _inverse(d) + _F32(16.5)))
    return np.concatenate([_fp16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


def _quantize_q4_1(b: np.ndarray) -> np.ndarray:
    lo = b.min(axis=1, keepdims=True)
    d = (b.max(axis=1, keepdims=True) - lo) / _F32(15)
    q = np.minimum(15, np.trunc((b - lo) * _inverse(d) + _F32(0.5)))
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], axis=1)


def _quantize_q5_1(b: np.ndarray) -> np.ndarray:
    lo = b.min(axis=1, keepdims=True)
    d = (b.max(axis=1, keepdims=True) - lo) / _F32(31)
    q = np.minimum(31, np.trunc((b - lo) * _inverse(d) + _F32(0.5)))
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


_KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _quantize_iq4_nl(b: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_iq4_nl_ref (no importance matrix, no scale search): d = max / -127 from
    the value of largest magnitude, each x to the nearest table value at 1/d (best_index_int8),
    then d refit as sum(w q x) / sum(w q^2) with w = x^2, summed in order in float32. A block
    below 1e-15 gets d = 0 and zero quants (ggml leaves them unwritten)."""
    n = b.shape[0]
    vmax = _signed_absmax(b)  # (n, 1)
    small = (np.abs(vmax) < _F32(1e-15))[:, 0]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = vmax / _KVALUES_IQ4NL[0]
        inv = (_F32(1) / d).astype(np.float32)
        al = (inv * b).astype(np.float32)  # (n, 32)
    vals = _KVALUES_IQ4NL
    mu = np.clip(np.searchsorted(vals, al, side="right"), 1, 15)  # vals[mu - 1] <= al < vals[mu]
    with np.errstate(invalid="ignore"):
        nearer_lower = (al - vals[mu - 1]) < (vals[mu] - al)
    idx = np.where(nearer_lower, mu - 1, mu)
    idx = np.where(al <= vals[0], 0, np.where(al >= vals[15], 15, idx))
    q = vals[idx]  # (n, 32) float32
    w = b * b
    sumqx = np.zeros(n, np.float32)
    sumq2 = np.zeros(n, np.float32)
    for j in range(32):  # in order, as the C loop
        wq = w[:, j] * q[:, j]
        sumqx = sumqx + wq * b[:, j]
        sumq2 = sumq2 + wq * q[:, j]
    with np.errstate(divide="ignore", invalid="ignore"):
        dd = (sumqx / sumq2).astype(np.float32)[:, None]
    dd[small] = 0
    idx[small] = 0
    return np.concatenate([_fp16_bytes(dd), _pack_nibbles(idx)], axis=1)


def _quantize_mxfp4(b: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_mxfp4_ref: the exponent byte e = floor(log2(amax)) - 2 + 127 (0 for an
    all-zero block), d = E8M0_HALF[e], each x to the doubled e2m1 value nearest x / d (the first of
    equals: best_index_mxfp4 keeps the lower index), |k d - x| in float32."""
    from ..dequant.mxfp4_rows import E8M0_HALF, KVALUES_MXFP4

    amax = np.abs(b).max(axis=1)  # (n,)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)  # (n,)
    d = E8M0_HALF[e][:, None]  # (n, 1)
    idx = np.zeros(b.shape, np.uint8)  # (n, 32)
    best = np.abs(d * _F32(KVALUES_MXFP4[0]) - b)
    for i in range(1, 16):  # a strictly smaller error replaces: the first minimum wins, as the C loop
        err = np.abs(d * _F32(KVALUES_MXFP4[i]) - b)
        better = err < best
        idx[better], best = i, np.where(better, err, best)
    return np.concatenate([e[:, None], idx[:, :16] | (idx[:, 16:] << 4)], axis=1)


# =============================================================================================
# k-quants and iq4 (super-blocks of 256; iq4_nl 32): the kernels of qllama.kernels.quantize_k, in threads
# =============================================================================================

_MIN_BLOCKS_PER_THREAD = 256
_pool: ThreadPoolExecutor | None = None
# where each kernel's fp16 block scales (d, and dmin) go in the block, and how many there are
_SCALE_FIELDS = {IQ3_S: (0, 1), IQ3_XXS: (0, 1), IQ2_XXS: (0, 1), IQ2_XS: (0, 1), IQ2_S: (0, 1), TQ1_0: (52, 1), TQ2_0: (64, 1), IQ1_S: (0, 1), IQ1_M: (0, 0), Q2_K: (80, 2), Q3_K: (108, 1), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208, 1), IQ4_NL: (0, 1), IQ4_XS: (0, 1)}


def _run_blocks(kernel, type_id: int, b: np.ndarray, *per_block: np.ndarray) -> np.ndarray:
    """Run a kernel(b, *per_block, out, dd) over blocks b (nb, block_size), split across threads
    when there is enough work; then pack the fp16 scales the kernel left in dd into the blocks."""
    global _pool
    nb = b.shape[0]
    at, n_scales = _SCALE_FIELDS[type_id]
    out = np.empty((nb, GGML_TYPES[type_id].type_size), np.uint8)
    dd = np.empty((nb, n_scales), np.float32)
    arrays = (b, *per_block, out, dd)
    n_threads = min(os.cpu_count() or 1, nb // _MIN_BLOCKS_PER_THREAD)
    if n_threads <= 1:
        kernel(*arrays)
    else:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="qllama-quantize")
        bounds = np.linspace(0, nb, n_threads + 1).astype(int)
        futures = [_pool.submit(kernel, *(a[s:e] for a in arrays)) for s, e in zip(bounds[:-1], bounds[1:])]
        for f in futures:
            f.result()
    with np.errstate(over="ignore"):
        out[:, at : at + 2 * n_scales] = dd.astype(np.float16).view(np.uint8)
    return out


def _kquant(type_id: int, b: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """ggml's k-quant quantizer of a type on blocks b (nb, 256): the row reference, or with qw (the
    importance weight of each value, (nb, 256)) quantize_row_*_impl."""
    from ..kernels import quantize_k as k

    return _run_blocks(partial(k.quantize_kquant, type_id, qw is not None), type_id, b, _weights_or_none(b, qw))


def _weights_or_none(b: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """The kernels' qw argument: the weights (nb, block), or (nb, 0) when there are none."""
    return qw if qw is not None else np.empty((b.shape[0], 0), np.float32)


def _iq4(type_id: int, b: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """ggml's quantize_iq4_nl / quantize_iq4_xs (the scale search, ntry 7) on blocks b (nb, 32 or
    256); qw: the importance weight of each value (nb, 32 or 256), or None."""
    from ..kernels.quantize_k import quantize_iq4

    kernel = partial(quantize_iq4, b.shape[1] // 32, _KVALUES_IQ4NL, qw is not None)
    return _run_blocks(kernel, type_id, b, _weights_or_none(b, qw))


def _legacy_weighted(x: np.ndarray, type_id: int, imatrix: np.ndarray) -> np.ndarray:
    """q4_0, q5_0, q4_1, q5_1 rows x (rows, ne0) with importance weights (ggml's quantize_row_*_impl)."""
    from ..kernels.quantize_k import quantize_legacy_weighted

    nmax, with_min = _LEGACY_WEIGHTED[type_id]
    nb = x.size // 32
    L = np.empty((nb, 32), np.int64)  # codes
    dm = np.empty((nb, 2), np.float32)  # d, m
    quantize_legacy_weighted(nmax, with_min, x, imatrix, L, dm)
    parts = [_fp16_bytes(dm[:, :1])] + ([_fp16_bytes(dm[:, 1:])] if with_min else [])
    parts += ([_pack_high_bits(L)] if type_id in (Q5_0, Q5_1) else []) + [_pack_nibbles(L)]
    return np.concatenate(parts, axis=1)


def grid_tables(levels: np.ndarray, bits: int, nwant: int, n_levels: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's iq2xs_init_impl / iq3xs_init_impl map and neighbour lists for a grid of points given by
    their levels (n_points, k) (0 .. n_levels - 1 each; ggml's values are 2 level + 1): kmap
    (2 ** (bits k),) maps the code sum(level_i << bits i) of a point to its index, and a code off
    the grid (levels < n_levels) to -(offset + 1) of its list in neigh: the count, then the grid
    points within its nwant nearest squared distances, by distance then index (ggml's qsort)."""
    n_points, k = levels.shape
    shifts = bits * np.arange(k)  # (k,)
    kmap = np.full(1 << (bits * k), -1, np.int64)
    kmap[(levels.astype(np.int64) << shifts).sum(axis=1)] = np.arange(n_points)
    # every code of levels < n_levels in increasing order (ggml also lists unreachable codes: never read)
    digits = np.indices((n_levels,) * k).reshape(k, -1)[::-1].T  # (n_levels ** k, k), digit 0 fastest
    codes = (digits << shifts).sum(axis=1)
    order = np.argsort(codes)
    codes, digits = codes[order], digits[order]
    off = kmap[codes] < 0
    codes, digits = codes[off], digits[off]
    neigh: list[np.ndarray] = []
    at = 0
    for c0 in range(0, len(codes), 256):  # in slices: (256, n_points) distances at a time
        d2 = ((digits[c0:c0 + 256, None, :] - levels[None, :, :].astype(np.int64)) ** 2).sum(axis=2)
        by = np.argsort(d2, axis=1, kind="stable")  # by distance, then index
        s = np.take_along_axis(d2, by, axis=1)
        rank = np.cumsum(np.diff(s, axis=1, prepend=s[:, :1]) > 0, axis=1)  # distinct distances before
        counts = (rank < nwant).sum(axis=1)
        for r in range(len(by)):
            kmap[codes[c0 + r]] = -(at + 1)
            neigh.append(np.concatenate([[counts[r]], by[r, :counts[r]]]))
            at += counts[r] + 1
    return kmap, np.concatenate(neigh).astype(np.int64)


def _iq3s_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's iq3xs_init_impl(512): the grid (512, 4) of odd values 1..15, the map of each 12-bit
    code of 4 levels (0..7) to its grid index or neighbour list (`grid_tables`, 3 distances)."""
    global _IQ3S
    if _IQ3S is None:
        from ..dequant.iq_grids import grid

        g = grid(IQ3_S).astype(np.int64)  # (512, 4)
        _IQ3S = (g, *grid_tables((g - 1) // 2, 3, 3, 8))
    return _IQ3S


_IQ3S: tuple | None = None


def _iq3s(b: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """ggml's quantize_iq3_s on super-blocks b (nb, 256), with importance weights qw (nb, 256) or None."""
    from ..kernels.quantize_k import quantize_iq3s

    return _run_blocks(partial(quantize_iq3s, qw is not None, *_iq3s_tables()), IQ3_S, b, _weights_or_none(b, qw))


def _tq(type_id: int, b: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_tq1_0_ref / tq2_0_ref on super-blocks b (nb, 256) (no importance weights)."""
    from ..kernels import quantize_iq1 as k

    return _run_blocks(k.quantize_tq1_0 if type_id == TQ1_0 else k.quantize_tq2_0, type_id, b)


def _iq1_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's iq2xs_init_impl for iq1_s / iq1_m: the 2048-point grid as levels 0..2 (2048, 8), the map
    of 16-bit codes and the neighbour lists (3 distances) of the off-grid codes of levels 0..2."""
    global _IQ1
    if _IQ1 is None:
        from ..dequant.iq_grids import grid

        levels = grid(IQ1_S).astype(np.int64) + 1  # (2048, 8): the grid's -1, 0, 1 as levels
        _IQ1 = (levels, *grid_tables(levels, 2, 3, 3))
    return _IQ1


_IQ1: tuple | None = None


def _iq1(type_id: int, b: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """ggml's quantize_iq1_s / quantize_iq1_m on super-blocks b (nb, 256) with importance weights qw
    (nb, 256); iq1_s cannot do without them (ggml asserts), iq1_m weighs by x^2 then."""
    from ..kernels import quantize_iq1 as k

    if qw is None and type_id == IQ1_S:
        raise UnsupportedError("iq1_s needs importance weights (an importance matrix)")
    if type_id == IQ1_S:
        return _run_blocks(partial(k.quantize_iq1_s, *_iq1_tables()), IQ1_S, b, qw)
    return _run_blocks(partial(k.quantize_iq1_m, qw is not None, *_iq1_tables()), IQ1_M, b, _weights_or_none(b, qw))


# iq3_xxs, iq2_xxs, iq2_xs, iq2_s: (bits per level, neighbour distances, levels) of ggml's init_impl
_GRID_SEARCH = {IQ3_XXS: (3, 2, 8), IQ2_XXS: (2, 2, 3), IQ2_XS: (2, 2, 3), IQ2_S: (2, 1, 3)}
_GRID_TABLES: dict[int, tuple] = {}


def _grid_search(type_id: int, b: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """ggml's quantize_iq3_xxs / iq2_xxs / iq2_xs / iq2_s on super-blocks b (nb, 256) with importance
    weights qw (nb, 256) or None (iq2_xxs / iq2_xs cannot do without: ggml asserts)."""
    from ..dequant.iq_grids import grid
    from ..kernels.quantize_iq2 import quantize_grid

    if qw is None and type_id in (IQ2_XXS, IQ2_XS):
        raise UnsupportedError(f"{type_name(type_id)} needs importance weights (an importance matrix)")
    if type_id not in _GRID_TABLES:
        values = grid(type_id)  # (n, 4 or 8) the dequantization values; their rank is the level
        levels = np.searchsorted(np.unique(values), values).astype(np.int64)
        bits, nwant, n_levels = _GRID_SEARCH[type_id]
        _GRID_TABLES[type_id] = (2 * levels + 1, *grid_tables(levels, bits, nwant, n_levels))
    kernel = partial(quantize_grid, type_id, qw is not None, *_GRID_TABLES[type_id])
    return _run_blocks(kernel, type_id, b, _weights_or_none(b, qw))


# type id -> function (n_blocks, block_size) float32 -> (n_blocks, type_size) uint8: the row
# references (ggml's quantize_row_*_ref: the KV cache and activations use these)
_BLOCK_QUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q8_0: _quantize_q8_0, Q4_0: _quantize_q4_0, Q4_1: _quantize_q4_1,
    Q5_0: _quantize_q5_0, Q5_1: _quantize_q5_1, IQ4_NL: _quantize_iq4_nl, MXFP4: _quantize_mxfp4,
    **{t: partial(_kquant, t) for t in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)}, IQ4_XS: partial(_iq4, IQ4_XS),
    IQ3_S: _iq3s,
    TQ1_0: partial(_tq, TQ1_0), TQ2_0: partial(_tq, TQ2_0), IQ1_S: partial(_iq1, IQ1_S), IQ1_M: partial(_iq1, IQ1_M),
    **{t: partial(_grid_search, t) for t in _GRID_SEARCH},
}
# where ggml_quantize_chunk (what llama-quantize writes into files) differs from the row reference:
# iq4_nl searches its scales there
_CHUNK_QUANTIZERS = {**_BLOCK_QUANTIZERS, IQ4_NL: partial(_iq4, IQ4_NL)}
# the types whose chunk quantizer takes importance weights (qw=, (nb, block) float32)
WEIGHTED_TYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ3_S, IQ1_S, IQ1_M, *_GRID_SEARCH)
# and the 32-blocks whose weights depend on the whole row: (nmax, with a min)
_LEGACY_WEIGHTED = {Q4_0: (8, False), Q5_0: (16, False), Q4_1: (15, True), Q5_1: (31, True)}
# and those that ignore a matrix, as ggml does
_IGNORE_WEIGHTS = (F32, F16, BF16, Q8_0, MXFP4, TQ1_0, TQ2_0)
FLOAT_TYPES = (F32, F16, BF16)
QUANTIZABLE_TYPES = FLOAT_TYPES + tuple(_BLOCK_QUANTIZERS)
CHUNK_ELEMENTS = 1 << 22  # rows are processed in chunks of about this many values (bounds temporaries)


def quantize_array(x: np.ndarray, type_id: int) -> np.ndarray:
    """Quantize float rows to ggml's block layout with ggml's row reference (`quantize_row_*_ref`).

    x: (n_rows, ne0) float array (a 1-D array is one row); ne0 must be a multiple of the type's
    block size. Returns uint8 (n_rows, row_bytes), row_bytes = ne0 / block_size * type_size,
    the exact bytes ggml's reference quantizer would write. Supported: f32, f16, bf16, q4_0,
    q4_1, q5_0, q5_1, q8_0, iq4_nl, iq4_xs, mxfp4, q2_K, q3_K, q4_K, q5_K, q6_K. Files are
    quantized with `quantize_chunk` (the same bytes but for iq4_nl).
    """
    return _quantize_2d(x, type_id, _BLOCK_QUANTIZERS)


def quantize_chunk(x: np.ndarray, type_id: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize float rows as ggml_quantize_chunk does (what llama-quantize writes into a file):
    as `quantize_array`, but iq4_nl searches its block scales; imatrix: the importance of each
    column (ne0,) float32 (llama.cpp's matrix, sums / counts), shared by every row, or None."""
    if imatrix is None or type_id in _IGNORE_WEIGHTS:
        return _quantize_2d(x, type_id, _CHUNK_QUANTIZERS)
    if type_id not in WEIGHTED_TYPES and type_id not in _LEGACY_WEIGHTED:
        raise UnsupportedError(f"cannot quantize to {type_name(type_id)} with an importance matrix yet")
    imatrix = np.ascontiguousarray(imatrix, np.float32).reshape(-1)  # (ne0,)
    return _quantize_2d(x, type_id, _CHUNK_QUANTIZERS, imatrix)


def _quantize_2d(x: np.ndarray, type_id: int, quantizers: dict, imatrix: np.ndarray | None = None) -> np.ndarray:
    gtype = GGML_TYPES.get(type_id)
    if gtype is None or type_id not in QUANTIZABLE_TYPES:
        raise UnsupportedError(f"cannot quantize to type {type_name(type_id)}")
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise QllamaError(f"quantize_array wants a 2-D array (n_rows, ne0), got shape {x.shape}")
    if x.dtype.kind != "f":
        raise QllamaError(f"quantize_array wants floats, got {x.dtype}")
    n_rows, ne0 = x.shape
    if ne0 % gtype.block_size:
        raise QllamaError(f"row length {ne0} is not a multiple of the {gtype.name} block size {gtype.block_size}")
    if imatrix is not None and imatrix.shape != (ne0,):
        raise QllamaError(f"an importance matrix of {imatrix.size} values does not fit rows of {ne0}")
    out = np.empty((n_rows, gtype.row_bytes(ne0)), np.uint8)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(ne0, 1))
    for r0 in range(0, n_rows, rows_per_chunk):
        chunk = np.ascontiguousarray(x[r0 : r0 + rows_per_chunk], dtype=np.float32)  # (rows, ne0)
        out[r0 : r0 + rows_per_chunk] = _quantize_rows(chunk, type_id, quantizers, imatrix).reshape(chunk.shape[0], -1)
    return out


def _quantize_rows(x: np.ndarray, type_id: int, quantizers: dict, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Contiguous float32 (rows, ne0) -> uint8 bytes of those rows (any shape, row-major)."""
    if type_id == F32:
        return x.view(np.uint8)
    if type_id == F16:
        with np.errstate(over="ignore"):  # beyond +-65504 -> inf, as ggml
            return x.astype(np.float16).view(np.uint8)
    if type_id == BF16:
        return to_bf16_bits(x).view(np.uint8)
    if not np.isfinite(x).all():
        # ggml's reference code has no defined result for NaN/Inf (nearest_int asserts)
        raise QllamaError(f"cannot quantize to {type_name(type_id)}: the data contains NaN or Inf")
    gtype = GGML_TYPES[type_id]
    blocks = x.reshape(-1, gtype.block_size)  # (n_blocks, block_size), a view
    if imatrix is None:
        return quantizers[type_id](blocks)
    if type_id in _LEGACY_WEIGHTED:
        return _legacy_weighted(x, type_id, imatrix)
    qw = np.broadcast_to(imatrix, x.shape).reshape(blocks.shape)  # (n_blocks, block_size): a copy
    return quantizers[type_id](blocks, qw)
