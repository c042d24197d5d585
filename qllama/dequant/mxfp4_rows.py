"""MXFP4 (ggml type 39, gpt-oss's expert weights): its value table, its scale and its NumPy row
decoder (the embedding lookup and the float path's decoded tiles).

A `block_mxfp4` holds 32 weights in 17 bytes: one E8M0 exponent byte e, then 16 bytes of 4-bit
e2m1 codes (element l in the low nibble of byte l, element 16 + l in the high one). ggml keeps
the e2m1 values doubled as integers (`KVALUES_MXFP4`) and halves the scale instead:
`E8M0_HALF[e]` = 2^(e - 128) as float32 (ggml's `GGML_E8M0_TO_FP32_HALF`; e < 2 gives the
subnormals 2^-128 and 2^-127). A weight is `E8M0_HALF[e] * kvalue` in float32, the operation
gguf-py's `MXFP4.dequantize_blocks` and ggml's `dequantize_row_mxfp4` do.

Import-light (NumPy only): the kernels (`kernels/mxfp4.py`) take their tables from here.
"""

from __future__ import annotations

import numpy as np

MXFP4 = 39
BLOCK, BLOCK_BYTES = 32, 17

KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # (16,) doubled e2m1


def _e8m0_half_table() -> np.ndarray:
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


E8M0_HALF = _e8m0_half_table()  # (256,) float32: exponent byte -> half the block scale


def dequantize_rows(type_id: int, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (int64 (n,)) of raw (uint8 (n_rows, nb * 17)) as float32 (n, nb * 32)."""
    assert type_id == MXFP4
    nb = raw.shape[1] // BLOCK_BYTES
    b = raw[rows].reshape(len(rows), nb, BLOCK_BYTES)  # (n, nb, 17)
    qs = b[..., 1:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # (n, nb, 32) codes: low nibbles, then high
    d = E8M0_HALF[b[..., 0]][..., None]  # (n, nb, 1)
    with np.errstate(over="ignore"):  # (e = 255 times 12 is Inf, as in gguf-py and ggml)
        return (d * KVALUES_MXFP4[q].astype(np.float32)).reshape(len(rows), nb * BLOCK)
