"""Row dequantization of the i-quants and ternary types in NumPy (the embedding lookup, and the
float path's decoded tiles of the grid types).

The same float32 operations in the same order as ggml's `dequantize_row_*` and gguf-py (and the
Numba decoders of `kernels/iquants.py`): the block scale d times the sub-block scale first, then
times the value. Tables: `qllama.iq_tables`.
"""

from __future__ import annotations

import numpy as np

from .gguf.types import GGML_TYPES
from .iq_tables import KVALUES_IQ4NL

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


DECODERS = {IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs}


def dequantize_rows(type_id: int, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (int64 (n,)) of raw (uint8 (n_rows, nb * block bytes)) as float32 (n, nb * block size)."""
    t = GGML_TYPES[type_id]
    nb = raw.shape[1] // t.type_size
    b = raw[rows].reshape(len(rows), nb, t.type_size)  # (n, nb, block bytes)
    with np.errstate(all="ignore"):  # (a NaN or Inf scale gives NaN / Inf rows, silently)
        return DECODERS[type_id](b).reshape(len(rows), nb * t.block_size)
