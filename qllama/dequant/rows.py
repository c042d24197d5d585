"""Row dequantization in NumPy, for the embedding lookup (`QTensor.dequantize`).

A prompt looks up a few hundred rows of the token embedding and a decode step one, so NumPy's
vector operations are fast enough (~0.1 ms per 8k elements), and the lookup needs no Numba
kernel: on the first run that kernel took ~1-1.5 s of compile for a few microseconds of work.

Every value is the one the Numba decoders of `kernels/legacy.py` and `kernels/kquants.py`
compute (and gguf-py, and ggml): the same float32 operations in the same order (d * q, then
+ m or - d_min * m; d * scale first where ggml forms a sub-block scale). q2_K and q3_K, rare
as embedding types, keep the Numba decoder (`DECODERS` lists the types handled here).
"""

from __future__ import annotations

import numpy as np

from ..gguf.types import GGML_TYPES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

F32 = np.float32


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """The fp16 at byte off of each block of b (..., block bytes) -> float32 (...)."""
    return np.ascontiguousarray(b[..., off : off + 2]).view(np.float16)[..., 0].astype(F32)


def _u32(b: np.ndarray, off: int) -> np.ndarray:
    """The little-endian uint32 at byte off of each block -> int64 (..., 1)."""
    return np.ascontiguousarray(b[..., off : off + 4]).view("<u4").astype(np.int64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) packed bytes -> (..., 2, k) int32: the low nibbles, then the high ones."""
    q = qs.astype(np.int32)
    return np.stack([q & 15, q >> 4], axis=-2)


_BITS = np.arange(32)  # bit l of qh: element l's fifth bit (l < 16: low nibbles, else high nibble l - 16)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(..., 1) uint32 of a q5_0 / q5_1 block -> (..., 2, 16) int32: 16 where the bit is set."""
    return (((qh >> _BITS) & 1) << 4).astype(np.int32).reshape(*qh.shape[:-1], 2, 16)


def _q4_0(b):
    d = _f16(b, 0)[..., None, None]
    return d * (_nibbles(b[..., 2:18]) - 8).astype(F32)


def _q4_1(b):
    d, m = _f16(b, 0)[..., None, None], _f16(b, 2)[..., None, None]
    return d * _nibbles(b[..., 4:20]).astype(F32) + m


def _q5_0(b):
    d = _f16(b, 0)[..., None, None]
    q = _nibbles(b[..., 6:22]) | _fifth_bits(_u32(b, 2))
    return d * (q - 16).astype(F32)


def _q5_1(b):
    d, m = _f16(b, 0)[..., None, None], _f16(b, 2)[..., None, None]
    q = _nibbles(b[..., 8:24]) | _fifth_bits(_u32(b, 4))
    return d * q.astype(F32) + m


def _q8_0(b):
    d = _f16(b, 0)[..., None]
    return b[..., 2:34].view(np.int8).astype(F32) * d


def _scales_mins_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of q4_K / q5_K blocks (..., 12) -> 8 six-bit scales and 8 mins, float32
    (ggml's get_scale_min_k4)."""
    q = s.astype(np.int32)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(F32), m.astype(F32)


def _k45(b, q):
    """q4_K / q5_K: q (..., 8, 32) int32 quants of the 8 sub-blocks (sub-block 2j + h: group j's
    low (h = 0) or high (h = 1) nibbles) -> d * sc * q - dmin * m."""
    sc, m = _scales_mins_k4(b[..., 4:16])
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    return (d * sc)[..., None] * q.astype(F32) - (dmin * m)[..., None]


def _q4_k(b):
    q = _nibbles(b[..., 16:144].reshape(*b.shape[:-1], 4, 32))  # (..., 4, 2, 32)
    return _k45(b, q.reshape(*b.shape[:-1], 8, 32))


_SUB = np.arange(8)[:, None]  # sub-block s: its fifth bits are bit s of qh[l]


def _q5_k(b):
    q = _nibbles(b[..., 48:176].reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
    qh = b[..., None, 16:48].astype(np.int32)  # (..., 1, 32)
    return _k45(b, q | (((qh >> _SUB) & 1) << 4))


# q6_K element e (0..255): its 4 low bits at ql[_QL[e]] >> _QS[e], its 2 high bits at qh[_QH[e]] >> _HS[e]
_E = np.arange(256)
_K, _L = _E // 16, _E % 16  # 16-element sub-block k and position l, as kernels/kquants.decode_q6_k
_N, _S = _K >> 3, (_K >> 1) & 3
_QL = 64 * _N + 32 * (_S & 1) + 16 * (_K & 1) + _L
_QS = 4 * (_S >> 1)
_QH = 128 + 32 * _N + 16 * (_K & 1) + _L
_HS = 2 * _S


def _q6_k(b):
    d = _f16(b, 208)[..., None]
    sc = b[..., 192:208].view(np.int8).astype(F32)  # (..., 16)
    q = ((b[..., _QL].astype(np.int32) >> _QS) & 15) | (((b[..., _QH].astype(np.int32) >> _HS) & 3) << 4)
    return (d * sc)[..., _K] * (q - 32).astype(F32)


DECODERS = {Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}


def dequantize_rows(type_id: int, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (int64 (n,)) of raw (uint8 (n_rows, nb * block bytes)) as float32 (n, nb * block size)."""
    t = GGML_TYPES[type_id]
    nb = raw.shape[1] // t.type_size
    b = raw[rows].reshape(len(rows), nb, t.type_size)  # (n, nb, block bytes)
    with np.errstate(all="ignore"):  # (a NaN or Inf scale gives NaN / Inf rows, as the kernels do, silently)
        return DECODERS[type_id](b).reshape(len(rows), nb * t.block_size)
