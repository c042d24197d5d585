"""Float weight types: f32, f16, bf16 (on typed views: float32 or uint16 bits).

Mat-vec kernels convert on the fly (no scratch); mat-mat kernels convert each row once into a
per-thread scratch and apply it to every token. fp16 is converted with branch-free bit
arithmetic (vectorisable), not the table. (Dequantization of these types is plain NumPy, in
`qllama.qtensor`.)
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..gguf.types import BF16, F16, F32
from .jit import Variants, kernel

from ._fp16 import f16_value
from ._fp16 import u32_as_f32 as _u32_as_f32

_NOPY = dict(boundscheck=False)
# float reductions may be reassociated (vectorised), but NaN/Inf must still propagate
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
TOKEN_TILE = 64  # tokens per pass over a chunk of rows (their activations stay in L2)


@kernel(inline="always", boundscheck=False)
def _value(h, kind):
    """The float32 value of one weight element h of `kind` (F32: h itself; BF16, F16: uint16 bits);
    kind is a constant of the caller, so only its own branch remains."""
    if kind == BF16:
        return _u32_as_f32(np.uint32(h) << 16)
    if kind == F16:
        return f16_value(np.int32(h))
    return h


def _matvec_of(kind: int):
    """The mat-vec of weights of `kind` (a ggml type id, a constant of the closure):
    out[r] = w[r] . x. w: float32 or uint16 bits (n_rows, ne0); x: float32 (ne0,); out: float32 (n_rows,)."""

    def matvec(w, x, out):
        for r in prange(w.shape[0]):
            acc = np.float32(0.0)
            wr = w[r]
            for i in range(x.shape[0]):
                acc += _value(wr[i], kind) * x[i]
            out[r] = acc

    return matvec


MATVEC = Variants(_matvec_of, "MATVEC", parallel=True, fastmath=FASTMATH, **_NOPY)
matvec_f32, matvec_bf16, matvec_f16 = MATVEC[F32], MATVEC[BF16], MATVEC[F16]


@kernel(parallel=True, fastmath=FASTMATH, **_NOPY)
def matmul_f32(w, x, out, n_threads):
    """out[t, r] = w[r] . x[t]. w: float32 (n_rows, ne0); x: float32 (n_tok, ne0); out: (n_tok, n_rows)."""
    n_rows = w.shape[0]
    n_tok, n = x.shape
    nc = max(1, min(n_rows, n_threads))
    per = (n_rows + nc - 1) // nc
    for c in prange(nc):
        for t0 in range(0, n_tok, TOKEN_TILE):
            for r in range(c * per, min(n_rows, (c + 1) * per)):
                wr = w[r]
                for t in range(t0, min(n_tok, t0 + TOKEN_TILE)):
                    xt = x[t]
                    acc = np.float32(0.0)
                    for i in range(n):
                        acc += wr[i] * xt[i]
                    out[t, r] = acc


@kernel(parallel=True, fastmath=FASTMATH, **_NOPY)
def matmul_half(w, is_bf16, x, out, n_threads):
    """As matmul_f32 for w: uint16 (n_rows, ne0) fp16 or bf16 bits; each row is converted once
    into a per-thread scratch (ne0,) and applied to every token."""
    n_rows = w.shape[0]
    n_tok, n = x.shape
    nc = max(1, min(n_rows, n_threads))
    per = (n_rows + nc - 1) // nc
    for c in prange(nc):
        buf = np.empty(n, np.float32)  # (ne0,) one converted row
        for t0 in range(0, n_tok, TOKEN_TILE):
            for r in range(c * per, min(n_rows, (c + 1) * per)):
                wr = w[r]
                if is_bf16:
                    for i in range(n):
                        buf[i] = _u32_as_f32(np.uint32(wr[i]) << 16)
                else:
                    for i in range(n):
                        buf[i] = f16_value(np.int32(wr[i]))
                for t in range(t0, min(n_tok, t0 + TOKEN_TILE)):
                    xt = x[t]
                    acc = np.float32(0.0)
                    for i in range(n):
                        acc += buf[i] * xt[i]
                    out[t, r] = acc
