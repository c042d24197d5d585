"""Float weight types: f32, f16, bf16.

Row decoders (same convention as `legacy.py`: `decode_<type>(row, bo, tab, out, oo, n)` converts
`n` elements starting at byte `bo`) and direct mat-vec kernels that read the packed row and
convert on the fly (no scratch). f16 mat-vec converts with bit arithmetic (vectorisable),
not the table; the decoders use the table, which is bit-exact with NumPy.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._fp16 import f16_at, f32_as_u32 as _f32_as_u32, u32_as_f32 as _u32_as_f32

_NOPY = dict(cache=True, boundscheck=False)
# float reductions may be reassociated (vectorised), but NaN/Inf must still propagate
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(**_NOPY)
def decode_f32(row, bo, tab, out, oo, n):
    for i in range(n):
        o = bo + 4 * i
        bits = np.uint32(row[o]) | (np.uint32(row[o + 1]) << 8) | (np.uint32(row[o + 2]) << 16) | (np.uint32(row[o + 3]) << 24)
        out[oo + i] = _u32_as_f32(bits)


@njit(**_NOPY)
def decode_f16(row, bo, tab, out, oo, n):
    for i in range(n):
        out[oo + i] = f16_at(row, bo + 2 * i, tab)


@njit(**_NOPY)
def decode_bf16(row, bo, tab, out, oo, n):
    for i in range(n):
        o = bo + 2 * i
        out[oo + i] = _u32_as_f32((np.uint32(row[o]) << 16) | (np.uint32(row[o + 1]) << 24))


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matvec_f32(w, x, out):
    """out[r] = w[r] . x. w: float32 (n_rows, ne0); x: float32 (ne0,); out: float32 (n_rows,)."""
    for r in prange(w.shape[0]):
        acc = np.float32(0.0)
        wr = w[r]
        for i in range(x.shape[0]):
            acc += wr[i] * x[i]
        out[r] = acc


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matvec_bf16(w, x, out):
    """w: uint16 bf16 bits (n_rows, ne0)."""
    for r in prange(w.shape[0]):
        acc = np.float32(0.0)
        wr = w[r]
        for i in range(x.shape[0]):
            acc += _u32_as_f32(np.uint32(wr[i]) << 16) * x[i]
        out[r] = acc


@njit(parallel=True, fastmath=FASTMATH, **_NOPY)
def matvec_f16(w, x, out):
    """w: uint16 fp16 bits (n_rows, ne0). Converts with integer ops + one multiply by 2^112."""
    magic = np.float32(2.0**112)
    for r in prange(w.shape[0]):
        acc = np.float32(0.0)
        wr = w[r]
        for i in range(x.shape[0]):
            h = np.int32(wr[i])
            sign = np.uint32((h & 0x8000) << 16)
            mag = np.uint32((h & 0x7FFF) << 13)
            v = _u32_as_f32(mag) * magic  # exact for normals and subnormals
            bits = _f32_as_u32(v)
            if (h & 0x7C00) == 0x7C00:  # Inf / NaN: exponent all ones, keep the mantissa
                bits = mag | np.uint32(0x7F800000)
            acc += _u32_as_f32(bits | sign) * x[i]
        out[r] = acc

