"""Row dequantization of the i-quants and ternary types in NumPy (the embedding lookup, and the
float path's decoded tiles of the grid types).

The same float32 operations in the same order as ggml's `dequantize_row_*` and gguf-py (and the
Numba decoders of `kernels/iquants.py`): the block scale d times the sub-block scale first, then
times the value. Tables: `qllama.dequant.iq_grids`.
"""

from __future__ import annotations

import numpy as np

from ..gguf.types import GGML_TYPES
from .iq_grids import KSIGNS_IQ2XS, KVALUES_IQ4NL, grid

F32 = np.float32
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0 = 16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """The fp16 at byte off of each block of b (..., block bytes) -> float32 (...)."""
    return np.ascontiguousarray(b[..., off : off + 2]).view(np.float16)[..., 0].astype(F32)


def _nibble_values(qs: np.ndarray) -> np.ndarray:
    """(..., 16) packed bytes -> (..., 32) float32 kvalues: the low nibbles, then the high ones."""
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return KVALUES_IQ4NL[q].astype(F32)


def _iq4_nl(b):  # b (..., 18): d, qs[16]
    return _f16(b, 0)[..., None] * _nibble_values(b[..., 2:18])


def _iq4_xs(b):  # b (..., 136): d, scales_h (u16), scales_l[4], qs[128]
    sh = b[..., 2].astype(np.int32) | (b[..., 3].astype(np.int32) << 8)  # (...)
    j = np.arange(8)
    lo = (b[..., 4 + j // 2].astype(np.int32) >> (4 * (j & 1))) & 15  # (..., 8)
    ls = lo | (((sh[..., None] >> (2 * j)) & 3) << 4)
    dl = _f16(b, 0)[..., None] * (ls - 32).astype(F32)  # (..., 8)
    q = _nibble_values(b[..., 8:136].reshape(*b.shape[:-1], 8, 16))  # (..., 8, 32)
    return dl[..., None] * q


def _u16(b: np.ndarray, off: int, n: int) -> np.ndarray:
    """n little-endian uint16 from byte off of each block -> int64 (..., n)."""
    return np.ascontiguousarray(b[..., off : off + 2 * n]).view("<u2").astype(np.int64)


def _u32(b: np.ndarray, off: int, n: int) -> np.ndarray:
    """n little-endian uint32 from byte off of each block -> int64 (..., n)."""
    return np.ascontiguousarray(b[..., off : off + 4 * n]).view("<u4").astype(np.int64)


_BIT8 = np.arange(8)


def _sign_bits(s: np.ndarray) -> np.ndarray:
    """(...) bytes of 8 sign bits -> (..., 8) float32: -1 where bit k is set, else 1."""
    return np.where((s[..., None] >> _BIT8) & 1, F32(-1), F32(1))


def _ksigns(idx: np.ndarray) -> np.ndarray:
    """(...) 7-bit sign indices -> (..., 8) float32 signs of ksigns_iq2xs[idx]."""
    return _sign_bits(KSIGNS_IQ2XS[idx].astype(np.int64))


def _grid(type_id: int) -> np.ndarray:
    return grid(type_id).astype(F32)  # (n_entries, 8 or 4) float32 (exact small integers)


def _iq2_xxs(b):  # b (..., 66): d, then per 32 elements two uint32: 4 grid bytes; 4 x 7 sign bits + 4-bit scale
    lead = b.shape[:-1]
    q = _u32(b, 2, 16).reshape(*lead, 8, 2)  # (..., 8 sub-blocks, [grid bytes, signs|scale])
    db = (_f16(b, 0)[..., None] * (F32(0.5) + (q[..., 1] >> 28).astype(F32))) * F32(0.25)  # (..., 8)
    idx = np.ascontiguousarray(b[..., 2:66]).reshape(*lead, 8, 8)[..., :4].astype(np.int64)  # (..., 8, 4)
    signs = _ksigns((q[..., 1:2] >> (7 * np.arange(4))) & 127)  # (..., 8, 4, 8)
    return db[..., None, None] * _grid(IQ2_XXS)[idx] * signs


def _iq2_xs(b):  # b (..., 74): d, qs[32] uint16 (9-bit grid index, 7-bit sign index), scales[8] (4 bits per 16)
    lead = b.shape[:-1]
    qs = _u16(b, 2, 32)  # (..., 32)
    sc = b[..., 66:74].astype(np.int64)
    ls = np.stack([sc & 15, sc >> 4], axis=-1).reshape(*lead, 16)  # (..., 16): per 16 elements
    db = (_f16(b, 0)[..., None] * (F32(0.5) + ls.astype(F32))) * F32(0.25)
    v = _grid(IQ2_XS)[qs & 511] * _ksigns(qs >> 9)  # (..., 32, 8)
    return db.reshape(*lead, 16, 1, 1) * v.reshape(*lead, 16, 2, 8)


def _iq2_s(b):  # b (..., 82): d, qs[32] grid low bytes, signs[32], qh[8] (2 high bits per index), scales[8]
    lead = b.shape[:-1]
    qh = b[..., 66:74].astype(np.int64)
    idx = b[..., 2:34].astype(np.int64) | (((qh[..., None] >> (2 * np.arange(4))) & 3) << 8).reshape(*lead, 32)
    sc = b[..., 74:82].astype(np.int64)
    ls = np.stack([sc & 15, sc >> 4], axis=-1).reshape(*lead, 16)
    db = (_f16(b, 0)[..., None] * (F32(0.5) + ls.astype(F32))) * F32(0.25)
    v = _grid(IQ2_S)[idx] * _sign_bits(b[..., 34:66].astype(np.int64))  # (..., 32, 8)
    return db.reshape(*lead, 16, 1, 1) * v.reshape(*lead, 16, 2, 8)


def _iq3_xxs(b):  # b (..., 98): d, qs[64] grid bytes (4 values each), then 8 uint32: 4 x 7 sign bits + 4-bit scale
    lead = b.shape[:-1]
    aux = _u32(b, 66, 8)  # (..., 8)
    db = (_f16(b, 0)[..., None] * (F32(0.5) + (aux >> 28).astype(F32))) * F32(0.5)  # (..., 8)
    g = _grid(IQ3_XXS)[b[..., 2:66].astype(np.int64)].reshape(*lead, 8, 4, 8)  # 8 grid entries of 4 per 32
    signs = _ksigns((aux[..., None] >> (7 * np.arange(4))) & 127)  # (..., 8, 4, 8)
    return db[..., None, None] * g * signs


def _iq3_s(b):  # b (..., 110): d, qs[64], qh[8] (9th index bits), signs[32], scales[4] (4 bits per 32)
    lead = b.shape[:-1]
    qh = b[..., 66:74].astype(np.int64)
    idx = b[..., 2:66].astype(np.int64) | (((qh[..., None] >> _BIT8) & 1) << 8).reshape(*lead, 64)
    sc = b[..., 106:110].astype(np.int64)
    ls = np.stack([sc & 15, sc >> 4], axis=-1).reshape(*lead, 8)
    db = _f16(b, 0)[..., None] * (1 + 2 * ls).astype(F32)  # (..., 8)
    v = _grid(IQ3_S)[idx].reshape(*lead, 32, 8) * _sign_bits(b[..., 74:106].astype(np.int64))
    return db.reshape(*lead, 8, 1, 1) * v.reshape(*lead, 8, 4, 8)


def _iq1_s(b):  # b (..., 50): d, qs[32] grid low bytes, qh[8] uint16: 4 x 3 high bits, 3-bit scale, delta sign
    lead = b.shape[:-1]
    qh = _u16(b, 34, 8)  # (..., 8)
    dl = _f16(b, 0)[..., None] * (2 * ((qh >> 12) & 7) + 1).astype(F32)  # (..., 8)
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA)  # (..., 8)
    idx = b[..., 2:34].astype(np.int64) | (((qh[..., None] >> (3 * np.arange(4))) & 7) << 8).reshape(*lead, 32)
    g = _grid(IQ1_S)[idx].reshape(*lead, 8, 4, 8)
    return dl[..., None, None] * (g + delta[..., None, None])


def _iq1_m(b):  # b (..., 56): qs[32], qh[16] (per 8 values: 3 high bits + delta sign), scales[8]: 4 uint16
    lead = b.shape[:-1]
    sc = _u16(b, 48, 4)  # (..., 4): 4 x 3-bit scales each; their top nibbles make the fp16 d
    dbits = (sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0xF0) | ((sc[..., 2] >> 4) & 0xF00) | (sc[..., 3] & 0xF000)
    d = dbits.astype(np.uint16).view(np.float16).astype(F32)  # (...)
    ls = ((sc[..., None] >> (3 * np.arange(4))) & 7).reshape(*lead, 16)  # per 16 elements
    dl = d[..., None] * (2 * ls + 1).astype(F32)  # (..., 16)
    qh = b[..., 32:48].astype(np.int64)
    h = np.stack([qh & 15, qh >> 4], axis=-1).reshape(*lead, 32)  # per 8 values
    idx = b[..., :32].astype(np.int64) | ((h & 7) << 8)
    delta = np.where(h & 8, -IQ1_DELTA, IQ1_DELTA)  # (..., 32)
    g = _grid(IQ1_M)[idx] + delta[..., None]  # (..., 32, 8)
    return dl.reshape(*lead, 16, 1, 1) * g.reshape(*lead, 16, 2, 8)


_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _tq1_0(b):  # b (..., 54): qs[48] (5 base-3 digits per byte), qh[4] (4 per byte), d
    lead = b.shape[:-1]
    q0 = (b[..., None, 0:32] * _POW3[:, None]).reshape(*lead, 160)  # uint8 products wrap, as ggml's
    q1 = (b[..., None, 32:48] * _POW3[:, None]).reshape(*lead, 80)
    q2 = (b[..., None, 48:52] * _POW3[:4, None]).reshape(*lead, 16)
    q = np.concatenate([q0, q1, q2], axis=-1).astype(np.int64)
    return _f16(b, 52)[..., None] * (((q * 3) >> 8) - 1).astype(F32)


def _tq2_0(b):  # b (..., 66): qs[64] (4 two-bit values per byte), d
    lead = b.shape[:-1]
    q = b[..., 0:64].reshape(*lead, 2, 1, 32).astype(np.int64) >> (2 * np.arange(4)).reshape(4, 1)
    return _f16(b, 64)[..., None] * ((q & 3) - 1).reshape(*lead, 256).astype(F32)


IQ1_DELTA = F32(0.125)

DECODERS = {IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs, IQ2_XXS: _iq2_xxs, IQ2_XS: _iq2_xs, IQ2_S: _iq2_s, IQ3_XXS: _iq3_xxs,
            IQ3_S: _iq3_s, IQ1_S: _iq1_s, IQ1_M: _iq1_m, TQ1_0: _tq1_0, TQ2_0: _tq2_0}


def dequantize_rows(type_id: int, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (int64 (n,)) of raw (uint8 (n_rows, nb * block bytes)) as float32 (n, nb * block size)."""
    t = GGML_TYPES[type_id]
    nb = raw.shape[1] // t.type_size
    b = raw[rows].reshape(len(rows), nb, t.type_size)  # (n, nb, block bytes)
    with np.errstate(all="ignore"):  # (a NaN or Inf scale gives NaN / Inf rows, silently)
        return DECODERS[type_id](b).reshape(len(rows), nb * t.block_size)
