"""Packed weight matrices and the operations on them: the only place that dispatches on type.

A `QTensor` is a 2-D weight matrix kept in its packed ggml form (a zero-copy view into the
GGUF mmap). Its operations never materialise a dequantized copy of the matrix:

- `matvec(x)`  (decode)  y[r] = W[r] . x
- `matmul(X)`  (prefill) Y[t, r] = W[r] . X[t]; each weight block is decoded once per tile
  of tokens
- `dequantize(rows)` / `row(i)`  rows as float32 (embedding lookup)

Two arithmetic paths:

- float (every type, portable): blocks decoded bit-exactly (== gguf-py) and dotted in float32;
  max|y - y64| / max|y64| <= 1e-5 against a float64 reference.
- int8 activations (every quantized type, on AVX2 hosts; on by default): x is rounded to 8 bits
  per block as llama.cpp does (q8_K for k-quants, q8_0 for the 32-element types) and blocks are
  dotted with integer SIMD (pmaddubsw). It is 1.2-5x faster than the float path (q8_0 .. q6_K)
  and follows llama.cpp's own numerics; its error against float64 comes only from rounding x:
  max|y - y64| / max|y64| measured 2e-3 .. 1.3e-2 on random data (tests allow 3e-2).
  `set_int8_activations(False)` selects the float path everywhere.

When several matrices multiply the same x (Q, K, V; gate, up), `quantize_activation(x)` returns
an `Activation` that can be passed instead of x, so x is quantized once.

Threads: `set_threads(n)` sets Numba's thread count, used by every kernel (each splits rows
over threads with one `prange`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from .errors import QllamaError, UnsupportedError
from .ggml_types import BF16, F16, F32, GGML_TYPES, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, type_name

if TYPE_CHECKING:
    from .gguf import GGUFFile

__all__ = [
    "SUPPORTED_TYPES",
    "INT8_TYPES",
    "QTensor",
    "Activation",
    "quantize_activation",
    "set_threads",
    "get_threads",
    "physical_cores",
    "set_int8_activations",
    "int8_activations",
]

SUPPORTED_TYPES: frozenset[int] = frozenset({F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})
# types with an int8-activation kernel (used when the host has AVX2 and int8 is enabled)
INT8_TYPES: frozenset[int] = frozenset({Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1})
_Q8K_TYPES = frozenset({Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})  # activations in q8_K form; the 32-blocks use q8_0 form

_state = {"int8": True, "int8_types": None}  # int8_types: the answer of int8_activations(), cached
FLOAT_MATMUL_TILE_BYTES = 1 << 20  # decoded rows per step of the float mat-mat of quantized types


# -- threads --------------------------------------------------------------------------------


def physical_cores() -> int:
    """Physical cores available to this process (logical CPUs / SMT siblings), at least 1."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 2) // 2)
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(c))
    return max(1, len(cores))


def set_threads(n: int | None) -> None:
    """Use `n` threads in every kernel (None: the number of physical cores)."""
    import numba

    if n is None:
        n = physical_cores()
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"thread count must be a positive integer, got {n!r}")
    numba.set_num_threads(int(min(n, numba.config.NUMBA_NUM_THREADS)))


def get_threads() -> int:
    """The number of threads kernels use."""
    import numba

    return numba.get_num_threads()


def set_int8_activations(enabled: bool) -> None:
    """Enable (default) or disable the int8-activation kernels (disabled: float path everywhere)."""
    _state["int8"] = bool(enabled)
    _state["int8_types"] = None


def int8_activations() -> frozenset[int]:
    """The types that currently run with int8 activations (empty if disabled or no AVX2)."""
    types = _state["int8_types"]
    if types is None:  # cached: this is asked on every mat-vec
        from .kernels._x86 import HAVE_AVX2

        types = _state["int8_types"] = INT8_TYPES if (_state["int8"] and HAVE_AVX2) else frozenset()
    return types


# -- activations ----------------------------------------------------------------------------


class Activation:
    """Activations x (n_tok, n) float32, quantized lazily (once) into the forms the int8 kernels use.

    Pass an `Activation` instead of the array to `QTensor.matvec` / `matmul` of several matrices
    that share x; the float path reads `.x`.
    """

    def __init__(self, x: np.ndarray):
        x = np.asarray(x)
        if x.dtype != np.float32:
            raise ValueError(f"activations must be float32, got {x.dtype}")
        if x.ndim == 1:
            x = x.reshape(1, -1)
        if x.ndim != 2:
            raise ValueError(f"activations must be 1-D or 2-D, got shape {x.shape}")
        self.x = np.ascontiguousarray(x)  # (n_tok, n)
        if not self.x.flags.writeable:  # one kernel signature: writable arrays only
            self.x = self.x.copy()
        self._q8_k: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._q8_0: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def n_tok(self) -> int:
        return self.x.shape[0]

    @property
    def n(self) -> int:
        return self.x.shape[1]

    def q8_k(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(xq int8 (n_tok, n), d float32 (n_tok, n/256), bsums int32 (n_tok, n/16)); n % 256 == 0."""
        if self._q8_k is None:
            from .kernels.int8 import quantize_q8_k

            t, n = self.x.shape
            xq = np.empty((t, n), np.int8)
            xd = np.empty((t, n // 256), np.float32)
            xs = np.empty((t, n // 16), np.int32)
            quantize_q8_k(self.x, xq, xd, xs)
            self._q8_k = (xq, xd, xs)
        return self._q8_k

    def q8_0(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(xq int8 (n_tok, n), d float32 (n_tok, n/32), sums of xq int32 (n_tok, n/32)); n % 32 == 0."""
        if self._q8_0 is None:
            from .kernels.int8 import quantize_q8_0

            t, n = self.x.shape
            xq = np.empty((t, n), np.int8)
            xd = np.empty((t, n // 32), np.float32)
            xs = np.empty((t, n // 32), np.int32)
            quantize_q8_0(self.x, xq, xd, xs)
            self._q8_0 = (xq, xd, xs)
        return self._q8_0


def quantize_activation(x: np.ndarray) -> Activation:
    """Wrap x (float32 (n,) or (n_tok, n)) for reuse across matrices; see `Activation`."""
    return Activation(x)


# -- the packed matrix -----------------------------------------------------------------------


class QTensor:
    """A 2-D weight matrix in its packed ggml form. shape is GGUF order (ne0 = row length, ne1 = rows)."""

    __slots__ = ("type_id", "shape", "n_cols", "n_rows", "raw", "_typed")

    def __init__(self, type_id: int, raw: np.ndarray, shape: tuple[int, int]):
        """Use `from_gguf` or `from_bytes`, which validate; raw: uint8 (n_rows, row_bytes)."""
        self.type_id = int(type_id)
        self.shape = (int(shape[0]), int(shape[1]))
        self.n_cols, self.n_rows = self.shape
        self.raw = raw  # uint8 (n_rows, row_bytes), read-only
        # a typed (n_rows, n_cols) view for the float types' direct kernels
        if self.type_id == F32:
            self._typed = raw.view(np.float32)
        elif self.type_id in (F16, BF16):
            self._typed = raw.view(np.uint16)
        else:
            self._typed = None

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gf: "GGUFFile", name: str) -> "QTensor":
        """The tensor `name` of an open GGUF file, as a zero-copy QTensor."""
        info = gf.tensors.get(name)
        if info is None:
            raise QllamaError(f"no tensor named {name!r}")
        if info.type_id not in SUPPORTED_TYPES:
            raise UnsupportedError(f"tensor {name} has type {type_name(info.type_id)}, which qllama cannot run yet")
        shape = tuple(info.shape)
        if len(shape) == 1:
            shape = (shape[0], 1)
        if len(shape) < 2 or any(d != 1 for d in shape[2:]):
            raise UnsupportedError(f"tensor {name} has shape {list(info.shape)}; only 2-D matrices are supported")
        return cls.from_bytes(info.type_id, gf.tensor_bytes(name), (shape[0], shape[1]), name=name)

    @classmethod
    def from_bytes(cls, type_id: int, raw: np.ndarray, shape: tuple[int, int], *, name: str = "tensor") -> "QTensor":
        """Wrap packed bytes (any C-contiguous buffer) of a `shape` = (ne0, ne1) matrix of `type_id`."""
        if type_id not in SUPPORTED_TYPES:
            raise UnsupportedError(f"{name} has type {type_name(type_id)}, which qllama cannot run yet")
        t = GGML_TYPES[type_id]
        if len(shape) != 2 or any(int(d) < 1 for d in shape):
            raise QllamaError(f"{name}: shape must be two positive sizes (ne0, ne1), got {tuple(shape)}")
        ne0, ne1 = int(shape[0]), int(shape[1])
        if ne0 % t.block_size:
            raise QllamaError(f"{name}: row length {ne0} is not a multiple of the {t.name} block size {t.block_size}")
        raw = np.frombuffer(raw, np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else np.asarray(raw)
        if not raw.flags.c_contiguous:
            raise QllamaError(f"{name}: packed data must be C-contiguous")
        raw = raw.reshape(-1).view(np.uint8)
        row_bytes = t.row_bytes(ne0)
        if raw.size != ne1 * row_bytes:
            raise QllamaError(f"{name}: {raw.size} bytes of {t.name} data, but shape ({ne0}, {ne1}) needs {ne1 * row_bytes}")
        raw = raw.reshape(ne1, row_bytes)
        if raw.flags.writeable:  # always read-only: one kernel signature, and weights are constant
            raw = raw.view()
            raw.flags.writeable = False
        return cls(type_id, raw, (ne0, ne1))

    @property
    def nbytes(self) -> int:
        """Packed bytes."""
        return self.raw.nbytes

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    def __repr__(self) -> str:
        return f"QTensor({self.type_name}, ne0={self.n_cols}, ne1={self.n_rows})"

    # -- operations ----------------------------------------------------------------------

    def matvec(self, x: "np.ndarray | Activation", out: np.ndarray | None = None) -> np.ndarray:
        """y = W x. x: float32 (ne0,) (or an `Activation` of one token) -> float32 (ne1,)."""
        act = x if isinstance(x, Activation) else None
        if act is None:
            x = _check_x(x, 1, self.n_cols)
        elif act.n_tok != 1 or act.n != self.n_cols:
            raise ValueError(f"activation of shape {act.x.shape} does not fit matvec with ne0={self.n_cols}")
        out = _check_out(out, (self.n_rows,))
        if self.type_id in int8_activations():
            self._int8(act if act is not None else Activation(x), out.reshape(1, -1))
            return out
        xv = act.x[0] if act is not None else x
        from .kernels import floats

        if self.type_id == F32:
            floats.matvec_f32(self._typed, xv, out)
        elif self.type_id == F16:
            floats.matvec_f16(self._typed, xv, out)
        elif self.type_id == BF16:
            floats.matvec_bf16(self._typed, xv, out)
        else:
            xs = xv.reshape(-1, 16).sum(axis=1, dtype=np.float32)  # (ne0/16,) for the min terms
            _float_matvec_kernel(self.type_id)(self.raw, xv, xs, _fp16_table(), out)
        return out

    def matmul(self, x: "np.ndarray | Activation", out: np.ndarray | None = None) -> np.ndarray:
        """Y = X W^T. x: float32 (n_tok, ne0) (or an `Activation`) -> float32 (n_tok, ne1)."""
        act = x if isinstance(x, Activation) else None
        if act is None:
            x = _check_x(x, 2, self.n_cols)
            n_tok = x.shape[0]
        else:
            if act.n != self.n_cols:
                raise ValueError(f"activation of shape {act.x.shape} does not fit ne0={self.n_cols}")
            n_tok = act.n_tok
        out = _check_out(out, (n_tok, self.n_rows))
        if n_tok == 0:
            return out
        if self.type_id in int8_activations():
            self._int8(act if act is not None else Activation(x), out)
            return out
        xv = act.x if act is not None else x
        from .kernels import floats

        nt = get_threads()
        if self.type_id == F32:
            floats.matmul_f32(self._typed, xv, out, nt)
        elif self.type_id in (F16, BF16):
            floats.matmul_half(self._typed, self.type_id == BF16, xv, out, nt)
        else:
            # decode a tile of rows (bit-exact, into a small scratch), multiply it with every token
            dequant, tab = _dequantize_kernel(self.type_id), _fp16_table()
            tile = max(1, min(self.n_rows, FLOAT_MATMUL_TILE_BYTES // (4 * self.n_cols)))
            w = np.empty((tile, self.n_cols), np.float32)  # (tile, ne0) decoded rows
            y = np.empty((n_tok, tile), np.float32)  # (n_tok, tile)
            for r0 in range(0, self.n_rows, tile):
                n = min(tile, self.n_rows - r0)
                if n < tile:
                    w, y = w[:n], np.empty((n_tok, n), np.float32)
                dequant(self.raw, np.arange(r0, r0 + n, dtype=np.int64), tab, w)
                wv = w.view()
                wv.flags.writeable = False  # the same kernel signature as f32 weights
                floats.matmul_f32(wv, xv, y, nt)
                out[:, r0 : r0 + n] = y
        return out

    def _int8(self, act: Activation, out: np.ndarray) -> None:
        from .kernels import int8

        tab = _fp16_table()
        nt = get_threads()
        if self.type_id in _Q8K_TYPES:
            xq, xd, xs = act.q8_k()
            if self.type_id in (Q2_K, Q3_K):
                int8.matmul_q2_q3_k(self.type_id, self.raw, xq, xd, xs, tab, out, nt)
            else:
                kernel = {Q4_K: int8.matmul_q4_k, Q5_K: int8.matmul_q5_k, Q6_K: int8.matmul_q6_k}[self.type_id]
                kernel(self.raw, xq, xd, xs, tab, out, nt)
        elif self.type_id == Q8_0:
            xq, xd, xs = act.q8_0()
            int8.matmul_q8_0(self.raw, xq, xd, xs, tab, out, nt)
        else:
            xq, xd, xs = act.q8_0()
            int8.matmul_legacy(self.type_id, self.raw, xq, xd, xs, tab, out, nt)

    def dequantize(self, rows: "None | slice | np.ndarray | list[int]" = None) -> np.ndarray:
        """Rows as float32 (len(rows), ne0): all (None), a slice, or an array of row ids."""
        if rows is None:
            ids = np.arange(self.n_rows, dtype=np.int64)
        elif isinstance(rows, slice):
            ids = np.arange(*rows.indices(self.n_rows), dtype=np.int64)
        else:
            ids = np.asarray(rows)
            if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(f"row ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
            ids = ids.astype(np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.n_rows):
                bad = int(ids[(ids < 0) | (ids >= self.n_rows)][0])
                raise IndexError(f"row {bad} out of range for a tensor of {self.n_rows} rows")
        if self.type_id == F32:
            return self._typed[ids]  # fancy indexing copies
        if self.type_id == F16:
            return _fp16_table()[self._typed[ids]]
        if self.type_id == BF16:
            return (self._typed[ids].astype(np.uint32) << 16).view(np.float32)
        out = np.empty((ids.size, self.n_cols), np.float32)
        if ids.size:
            _dequantize_kernel(self.type_id)(self.raw, ids, _fp16_table(), out)
        return out

    def row(self, i: int) -> np.ndarray:
        """Row i as float32 (ne0,)."""
        if not -self.n_rows <= i < self.n_rows:
            raise IndexError(f"row {i} out of range for a tensor of {self.n_rows} rows")
        return self.dequantize(np.array([i % self.n_rows]))[0]


def _float_matvec_kernel(type_id: int):
    """The fused float mat-vec kernel of a quantized type: kernel(raw, x, xs16, tab, out)."""
    from .kernels import kquants as kq
    from .kernels import legacy as lg

    return {
        Q4_0: lg.matvec_q4_0, Q4_1: lg.matvec_q4_1, Q5_0: lg.matvec_q5_0, Q5_1: lg.matvec_q5_1,
        Q8_0: lg.matvec_q8_0, Q2_K: kq.matvec_q2_k, Q3_K: kq.matvec_q3_k, Q4_K: kq.matvec_q4_k,
        Q5_K: kq.matvec_q5_k, Q6_K: kq.matvec_q6_k,
    }[type_id]


def _dequantize_kernel(type_id: int):
    """The row dequantization kernel of a quantized type: kernel(raw, rows, tab, out)."""
    from .kernels import kquants as kq
    from .kernels import legacy as lg

    return {
        Q4_0: lg.dequantize_q4_0, Q4_1: lg.dequantize_q4_1, Q5_0: lg.dequantize_q5_0, Q5_1: lg.dequantize_q5_1,
        Q8_0: lg.dequantize_q8_0, Q2_K: kq.dequantize_q2_k, Q3_K: kq.dequantize_q3_k, Q4_K: kq.dequantize_q4_k,
        Q5_K: kq.dequantize_q5_k, Q6_K: kq.dequantize_q6_k,
    }[type_id]


def _fp16_table() -> np.ndarray:
    from .kernels._fp16 import FP16_TO_F32

    return FP16_TO_F32


def _check_x(x: np.ndarray, ndim: int, n_cols: int) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.ndim != ndim or x.shape[-1] != n_cols:
        want = f"({n_cols},)" if ndim == 1 else f"(n_tok, {n_cols})"
        raise ValueError(f"x has shape {x.shape}, expected {want}")
    if not x.flags.c_contiguous or not x.flags.writeable:
        x = np.array(x, dtype=np.float32, order="C")  # one kernel signature: C, writable
    return x


def _check_out(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"out must be a float32 array of shape {shape}, got {got}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writable")
    return out
