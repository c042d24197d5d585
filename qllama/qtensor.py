"""Packed weight matrices, the operations on them, and the one table of what each type runs.

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

Each supported type has one `TensorType` entry in `TYPES` (registered once, below): its ggml
block layout, and how to bind its kernels; `QTensor` looks its bound `TypeOps` up once and
calls through it (no per-type branching anywhere else). Kernels are imported on first use, so
importing this module does not import numba.

Threads: every operation takes its thread count explicitly (`n_threads`, the forward round's);
`set_threads(n)` is the one place Numba's own count is set (by each forward round, for its
calling thread), and `resolve_threads` turns a request (None: the physical cores) into a count.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from .errors import QllamaError, UnsupportedError
from .gguf.types import (BF16, F16, F32, GGML_TYPES, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS,
                          MXFP4, TQ1_0, TQ2_0, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, GGMLType, type_name)

if TYPE_CHECKING:
    from .gguf.reader import GGUFFile

__all__ = [
    "SUPPORTED_TYPES",
    "INT8_TYPES",
    "TYPES",
    "TensorType",
    "TypeOps",
    "QTensor",
    "Activation",
    "quantize_activation",
    "set_threads",
    "resolve_threads",
    "get_threads",
    "physical_cores",
    "set_int8_activations",
    "int8_activations",
    "int8_enabled",
]

FLOAT_MATMUL_TILE_BYTES = 1 << 20  # decoded rows per step of the float mat-mat of quantized types
# batches of at least this many tokens take a type's int8 gemm kernel when it has one (the same
# values as its row kernel: kernels/_x86_gemm.py); the warm-up's prompt (warmup.PREFILL_TOKENS) is
# longer, so it compiles or loads that kernel. Up to 4 tokens (a server step of 2-4 streams) the
# row kernel is cheaper: its 4-token intrinsic unpacks each row once for them, with no packing pass
# (1B Q4_K_M, 1 thread, CPU time per step: 4 streams 224 ms against the gemm's 289, 2: 199 vs 230)
GEMM_MIN_TOKENS = 5
# prompts of this many tokens or more take llama.cpp's prompt arithmetic where it has its own
# (`QTensor.matmul(prompt=...)`: its ggml-cpu/tiled kernels take batches of 8 tokens and more). The
# caller decides once per prompt, so that every chunk of it rounds alike
PROMPT_MIN_TOKENS = 8


# -- the per-type table ------------------------------------------------------------------------


class TypeOps(NamedTuple):
    """The operations of one type with its kernels bound (built once per type, on first use).

    q is the QTensor; every array is float32 unless said otherwise.
    """

    matvec: Callable  # float path: (q, x (ne0,), out (ne1,)) -> None
    matmul: Callable  # float path: (q, x (n_tok, ne0), out (n_tok, ne1), n_threads) -> None
    dequantize: Callable  # (q, row ids int64 (n,)) -> (n, ne0)
    int8: Callable | None  # int8 path: (q, Activation, out (n_tok, ne1), n_threads) -> None; None: float only
    # a prompt's rows as llama.cpp's prompt kernels round them (int8.PROMPT_TYPES, `_prompt_op`), same arguments; None: int8's
    int8_prompt: Callable | None = None


class TensorType(NamedTuple):
    """The record of one supported type: every fact the runtime keeps about it. Holds no kernel:
    `bind()` imports them (and numba). Block size and bytes come from `ggml`; the sets below
    (`SUPPORTED_TYPES`, `INT8_TYPES`, `FUSED_TYPES`, `GEMM_TYPES`) are derived from these records."""

    ggml: GGMLType  # id, name, elements and bytes per block (`qllama.gguf.types`)
    view: type | None  # dtype the float types' kernels read rows as (float32, or uint16 bits); None: blocks
    int8_form: str | None  # how x is rounded for the int8 path: "q8_K", "q8_0" or "q8_1" (`Activation`); None: none
    bind: Callable[[], TypeOps]
    fused: bool = False  # steps of 1 to models/decode.MAX_ROWS tokens run it in the fused kernels (kernels/fused.py)
    gemm: bool = False  # batches take its int8 gemm (kernels/_x86_gemm.py) instead of the row kernel


TYPES: dict[int, TensorType] = {}


def _register(type_id: int, view: type | None, int8_form: str | None, bind: Callable[[], TypeOps], *,
              fused: bool = False, gemm: bool = False) -> None:
    assert type_id not in TYPES, type_name(type_id)
    TYPES[type_id] = TensorType(GGML_TYPES[type_id], view, int8_form, bind, fused, gemm)


def _fp16_table() -> np.ndarray:
    from .kernels._fp16 import FP16_TO_F32

    return FP16_TO_F32  # (65536,) float32


def _f32_ops() -> TypeOps:
    from .kernels import floats

    return TypeOps(
        matvec=lambda q, x, out: floats.matvec_f32(q._typed, x, out),
        matmul=lambda q, x, out, nt: floats.matmul_f32(q._typed, x, out, nt),
        dequantize=lambda q, ids: q._typed[ids],  # fancy indexing copies
        int8=None,
    )


def _half_ops(is_bf16: bool) -> TypeOps:
    """f16 or bf16: rows read as uint16 bits."""
    from .kernels import floats

    tab = _fp16_table()
    matvec = floats.matvec_bf16 if is_bf16 else floats.matvec_f16
    if is_bf16:
        def dequantize(q, ids):
            return (q._typed[ids].astype(np.uint32) << 16).view(np.float32)
    else:
        def dequantize(q, ids):
            return tab[q._typed[ids]]
    return TypeOps(
        matvec=lambda q, x, out: matvec(q._typed, x, out),
        matmul=lambda q, x, out, nt: floats.matmul_half(q._typed, is_bf16, x, out, nt),
        dequantize=dequantize,
        int8=None,
    )


def _block_ops(type_id: int, int8_kernel: str, takes_type: bool, gemm: str | None) -> TypeOps:
    """A quantized type (float mat-vec: `kernels/block_matvec.MATVEC`). int8_kernel: its mat-mat in
    kernels/int8.py, called with the type id first when `takes_type` is True; gemm: its mat-mat
    for batches of at least GEMM_MIN_TOKENS tokens, if it has one."""
    from .dequant import rows as numpy_rows
    from .kernels import floats, int8
    from .kernels._x86 import HAVE_AVX2
    from .kernels.block_matvec import MATVEC
    from .kernels.dequantize import dequantize_rows

    tab = _fp16_table()
    fused = MATVEC[type_id]
    decode = partial(dequantize_rows, type_id)

    def matvec(q, x, out):
        xs = x.reshape(-1, 16).sum(axis=1, dtype=np.float32)  # (ne0/16,) for the min terms
        fused(q.raw, x, xs, tab, out)

    def matmul(q, x, out, nt):
        # decode a tile of rows (bit-exact, into a small scratch), multiply it with every token
        n_tok, n_rows, n_cols = x.shape[0], q.n_rows, q.n_cols
        tile = max(1, min(n_rows, FLOAT_MATMUL_TILE_BYTES // (4 * n_cols)))
        w = np.empty((tile, n_cols), np.float32)  # (tile, ne0) decoded rows
        y = np.empty((n_tok, tile), np.float32)  # (n_tok, tile)
        for r0 in range(0, n_rows, tile):
            n = min(tile, n_rows - r0)
            if n < tile:
                w, y = w[:n], np.empty((n_tok, n), np.float32)
            decode(q.raw, np.arange(r0, r0 + n, dtype=np.int64), tab, w)
            wv = w.view()
            wv.flags.writeable = False  # the same kernel signature as f32 weights
            floats.matmul_f32(wv, x, y, nt)
            out[:, r0 : r0 + n] = y

    def dequantize(q, ids):  # (a few rows: an embedding lookup)
        if type_id in numpy_rows.DECODERS:  # no kernel to compile for it
            return numpy_rows.dequantize_rows(type_id, q.raw, ids)
        out = np.empty((ids.size, q.n_cols), np.float32)
        if ids.size:
            decode(q.raw, ids, tab, out, parallel=False)
        return out

    ops = TypeOps(matvec, matmul, dequantize, None)
    if HAVE_AVX2:
        kernel = getattr(int8, int8_kernel)
        if takes_type:
            kernel = partial(kernel, type_id)
        form = TYPES[type_id].int8_form
        big = partial(int8.gemm, type_id) if gemm else kernel

        def int8_matmul(q, act, out, nt):
            xq, xd, xs = act.quantized(form)
            k = big if xq.shape[0] >= GEMM_MIN_TOKENS and q.n_rows % int8.TILE_ROWS == 0 else kernel  # (gemm: TILE_ROWS per pass)
            k(q.raw, xq, xd, xs, tab, out, nt)

        ops = ops._replace(int8=int8_matmul, int8_prompt=_prompt_op(type_id, int8_matmul, tab))
    return ops


def _prompt_op(type_id: int, int8_matmul, tab):
    """TypeOps.int8_prompt of a type with prompt kernels (`int8.PROMPT_TYPES`: q2_K, q4_K, q6_K,
    q5_K, iq4_xs, iq3_s, iq2_xxs, iq3_xxs; else None): `int8.gemm(SUMS | type)` on whole groups of TILE_ROWS rows,
    else the type's int8 mat-mul (decode's rounding)."""
    from .kernels import int8

    if type_id not in int8.PROMPT_TYPES:
        return None
    form = TYPES[type_id].int8_form

    def int8_prompt(q, act, out, nt):
        if q.n_rows % int8.TILE_ROWS:
            return int8_matmul(q, act, out, nt)
        xq, xd, xs = act.quantized(form)
        int8.gemm(int8.SUMS | type_id, q.raw, xq, xd, xs, tab, out, nt)

    return int8_prompt


def _iquant_ops(type_id: int) -> TypeOps:
    """An i-quant or ternary type. Rows decode in NumPy for the embedding lookup
    (`dequant/iq_rows.py`); iq4_nl / iq4_xs have Numba decoders for the float path's tiles and an
    int8 kernel (`kernels/iquants.py`, ggml's vec_dot bit for bit); the grid and ternary types an
    int8 kernel (`kernels/iquants_grid.py`, also ggml's bits) and a float path on NumPy-decoded
    tiles. iq4_xs, iq3_s, iq2_xxs and iq3_xxs prompts take llama.cpp's prompt arithmetic (`int8_prompt`,
    `_prompt_op`)."""
    from .dequant import iq_rows as numpy_rows
    from .kernels import floats
    from .kernels._x86 import HAVE_AVX2

    tab = _fp16_table()
    kernels = int8_kernel = None  # Numba row decoders (iq4, mxfp4); the int8 mat-mul
    if type_id == MXFP4:  # its own decoders and int8 kernel (dequant/mxfp4_rows.py, kernels/mxfp4.py)
        from .dequant import mxfp4_rows as numpy_rows
        from .kernels import mxfp4 as kernels

        int8_kernel = kernels.matmul_int8
    elif type_id in (IQ4_NL, IQ4_XS):
        from .kernels import iquants as kernels

        int8_kernel = kernels.matmul_int8
    elif TYPES[type_id].int8_form is not None:
        from .kernels import iquants_grid

        int8_kernel = iquants_grid.matmul_int8

    def matmul(q, x, out, nt):  # decode a tile of rows (bit-exact), multiply it with every token
        n_tok, n_rows, n_cols = x.shape[0], q.n_rows, q.n_cols
        tile = max(1, min(n_rows, FLOAT_MATMUL_TILE_BYTES // (4 * n_cols)))
        for r0 in range(0, n_rows, tile):
            ids = np.arange(r0, min(n_rows, r0 + tile), dtype=np.int64)
            if kernels is not None:
                w = np.empty((ids.size, n_cols), np.float32)  # (tile, ne0) decoded rows
                kernels.dequantize_rows(type_id, q.raw, ids, tab, w)
            else:
                w = numpy_rows.dequantize_rows(type_id, q.raw, ids)
            w.flags.writeable = False  # the same kernel signature as f32 weights
            y = np.empty((n_tok, ids.size), np.float32)  # (n_tok, tile)
            floats.matmul_f32(w, x, y, nt)
            out[:, r0 : r0 + ids.size] = y

    ops = TypeOps(
        matvec=lambda q, x, out: matmul(q, x.reshape(1, -1), out.reshape(1, -1), get_threads()),
        matmul=matmul,
        dequantize=lambda q, ids: numpy_rows.dequantize_rows(type_id, q.raw, ids),
        int8=None,
    )
    if int8_kernel is not None and HAVE_AVX2:
        form = TYPES[type_id].int8_form

        def int8_with(kernel):
            def int8_matmul(q, act, out, nt):
                xq, xd, xs = act.quantized(form)
                kernel(type_id, q.raw, xq, xd, xs, tab, out, nt)
            return int8_matmul

        int8_matmul = int8_with(int8_kernel)
        ops = ops._replace(int8=int8_matmul, int8_prompt=_prompt_op(type_id, int8_matmul, tab))
    return ops


_register(F32, np.float32, None, _f32_ops)
_register(F16, np.uint16, None, partial(_half_ops, False))
_register(BF16, np.uint16, None, partial(_half_ops, True))
# quantized types: int8 activation form, int8 mat-mat kernel
# (kernels/int8.py), whether that kernel serves several types (then it takes the type id first),
# its gemm for batches (or None), and whether the fused decode kernels run it
for _tid, _form, _kernel, _shared, _gemm, _fused in (
    (Q4_0, "q8_0", "matmul_rows", True, "gemm", True),
    (Q4_1, "q8_1", "matmul_rows", True, None, True),
    (Q5_0, "q8_0", "matmul_rows", True, "gemm", True),
    (Q5_1, "q8_1", "matmul_rows", True, None, True),
    (Q8_0, "q8_0", "matmul_rows", True, "gemm", True),
    (Q2_K, "q8_K", "matmul_q2_q3_k", True, None, False),
    (Q3_K, "q8_K", "matmul_q2_q3_k", True, None, False),
    (Q4_K, "q8_K", "matmul_rows", True, "gemm", True),
    (Q5_K, "q8_K", "matmul_rows", True, None, True),
    (Q6_K, "q8_K", "matmul_rows", True, "gemm", True),
):
    _register(_tid, None, _form, partial(_block_ops, _tid, _kernel, _shared, _gemm),
              fused=_fused, gemm=_gemm is not None)
del _tid, _form, _kernel, _shared, _gemm, _fused
# i-quants (kernels/iquants.py, dequant/iq_rows.py): int8 activation form, or None (float path only)
for _tid, _form in ((IQ4_NL, "q8_0"), (IQ4_XS, "q8_K"), (IQ3_S, "q8_K"), (IQ3_XXS, "q8_K"), (IQ2_XXS, "q8_K"),
                    (IQ2_XS, "q8_K"), (IQ2_S, "q8_K"), (IQ1_S, "q8_K"), (IQ1_M, "q8_K"), (TQ1_0, "q8_K"), (TQ2_0, "q8_K")):
    _register(_tid, None, _form, partial(_iquant_ops, _tid), fused=_tid in (IQ4_NL, IQ4_XS, IQ3_S, IQ2_XXS))
del _tid, _form
_register(MXFP4, None, "q8_0", partial(_iquant_ops, MXFP4))  # gpt-oss's experts: e8m0 scale, e2m1 values

SUPPORTED_TYPES: frozenset[int] = frozenset(TYPES)
# types with an int8-activation kernel (used when the host has AVX2 and int8 is enabled)
INT8_TYPES: frozenset[int] = frozenset(t for t, e in TYPES.items() if e.int8_form)
# types the fused decode kernels run (models/decode.py plans a step of 1-9 tokens with them)
FUSED_TYPES: frozenset[int] = frozenset(t for t, e in TYPES.items() if e.fused)
# types whose batches take an int8 gemm (kernels/int8.GEMM_ROWS; tests check the two agree)
GEMM_TYPES: frozenset[int] = frozenset(t for t, e in TYPES.items() if e.gemm)

_OPS: dict[int, TypeOps] = {}  # type id -> its bound operations (filled on first use)
_state = {"int8": True}  # the int8 path's switch (`set_int8_activations`)


def type_ops(type_id: int) -> TypeOps:
    """The bound operations of a supported type (imports its kernels the first time)."""
    ops = _OPS.get(type_id)
    if ops is None:
        ops = _OPS[type_id] = TYPES[type_id].bind()
    return ops


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


def resolve_threads(n: int | None) -> int:
    """The thread count kernels will use for a request of `n` (None: the physical cores), capped
    by the size of Numba's pool."""
    import numba

    if n is None:
        n = physical_cores()
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"thread count must be a positive integer, got {n!r}")
    return int(min(n, numba.config.NUMBA_NUM_THREADS))


def set_threads(n: int | None) -> None:
    """Numba's thread count for this calling thread (None: the physical cores). The one place that
    sets it: a forward round (`Transformer._forward_round`) calls it with the round's count; every
    kernel then receives that count explicitly."""
    import numba

    numba.set_num_threads(resolve_threads(n))


def get_threads() -> int:
    """The number of threads kernels use."""
    import numba

    return numba.get_num_threads()


def set_int8_activations(enabled: bool) -> None:
    """Enable (default) or disable the int8-activation kernels (disabled: float path everywhere)."""
    _state["int8"] = bool(enabled)


def int8_enabled() -> bool:
    """Whether the int8 path runs (enabled and the host has AVX2): one cheap test per forward pass."""
    have = _state.get("avx2")
    if have is None:
        from .kernels._x86 import HAVE_AVX2

        have = _state["avx2"] = bool(HAVE_AVX2)
    return have and _state["int8"]


def int8_activations() -> frozenset[int]:
    """The types that currently run with int8 activations (empty if disabled or no AVX2)."""
    from .kernels._x86 import HAVE_AVX2

    return INT8_TYPES if (_state["int8"] and HAVE_AVX2) else frozenset()


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
        self._forms: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @property
    def n_tok(self) -> int:
        return self.x.shape[0]

    @property
    def n(self) -> int:
        return self.x.shape[1]

    def rows(self, ids: np.ndarray) -> "Activation":
        """The activations of rows ids (int64), with the int8 forms already made (the same bytes)."""
        sub = Activation(self.x[ids])
        sub._forms = {f: tuple(np.ascontiguousarray(a[ids]) for a in q) for f, q in self._forms.items()}
        return sub

    def quantized(self, form: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x in an int8 form (computed once): (xq int8 (n_tok, n), d float32, int32 sums).

        "q8_K": one d per 256 elements, sums of every 16 quants (n % 256 == 0);
        "q8_0": one d per 32 elements, sums of every 32 quants (n % 32 == 0);
        "q8_1": as q8_0, with float32 sums s = fp16(d * sum) (q4_1 / q5_1, as ggml).
        """
        q = self._forms.get(form)
        if q is None:
            from .kernels import act_quant

            per_d, per_sum, quantize, sum_dtype = ACTIVATION_FORMS[form]
            t, n = self.x.shape
            q = (np.empty((t, n), np.int8), np.empty((t, n // per_d), np.float32), np.empty((t, n // per_sum), sum_dtype))
            getattr(act_quant, quantize)(self.x, *q)
            self._forms[form] = q
        return q

    def q8_k(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`quantized("q8_K")`."""
        return self.quantized("q8_K")

    def q8_0(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`quantized("q8_0")`."""
        return self.quantized("q8_0")


class ActivationForm(NamedTuple):
    """How x is rounded to int8 for a type's int8 kernels (as ggml's vec_dot_type)."""

    per_d: int  # elements per scale d
    per_sum: int  # elements per sum of quants
    quantizer: str  # its function in kernels/act_quant.py
    sum_dtype: type  # dtype of the sums (q8_1: float32 s = fp16(d * sum))


ACTIVATION_FORMS: dict[str, ActivationForm] = {
    "q8_K": ActivationForm(256, 16, "quantize_q8_k", np.int32),
    "q8_0": ActivationForm(32, 32, "quantize_q8_0", np.int32),
    "q8_1": ActivationForm(32, 32, "quantize_q8_1", np.float32),
}


def quantize_activation(x: np.ndarray) -> Activation:
    """Wrap x (float32 (n,) or (n_tok, n)) for reuse across matrices; see `Activation`."""
    return Activation(x)


# -- the packed matrix -----------------------------------------------------------------------


class QTensor:
    """A 2-D weight matrix in its packed ggml form. shape is GGUF order (ne0 = row length, ne1 = rows)."""

    __slots__ = ("type_id", "shape", "n_cols", "n_rows", "raw", "_typed", "_ops")

    def __init__(self, type_id: int, raw: np.ndarray, shape: tuple[int, int]):
        """Use `from_gguf` or `from_bytes`, which validate; raw: uint8 (n_rows, row_bytes)."""
        self.type_id = int(type_id)
        self.shape = (int(shape[0]), int(shape[1]))
        self.n_cols, self.n_rows = self.shape
        self.raw = raw  # uint8 (n_rows, row_bytes), read-only
        view = TYPES[self.type_id].view
        self._typed = raw.view(view) if view is not None else None  # (n_rows, n_cols) for the float types
        self._ops: TypeOps | None = None  # bound on first use (that imports the kernels)

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
        entry = TYPES.get(type_id)
        if entry is None:
            raise UnsupportedError(f"{name} has type {type_name(type_id)}, which qllama cannot run yet")
        t = entry.ggml
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

    def matvec(self, x: "np.ndarray | Activation", out: np.ndarray | None = None, n_threads: int | None = None) -> np.ndarray:
        """y = W x. x: float32 (ne0,) (or an `Activation` of one token) -> float32 (ne1,)."""
        act = x if isinstance(x, Activation) else None
        if act is None:
            x = _check_x(x, 1, self.n_cols)
        elif act.n_tok != 1 or act.n != self.n_cols:
            raise ValueError(f"activation of shape {act.x.shape} does not fit matvec with ne0={self.n_cols}")
        out = _check_out(out, (self.n_rows,))
        ops = self._ops or self._bind()
        if ops.int8 is not None and _state["int8"]:
            ops.int8(self, act if act is not None else Activation(x), out.reshape(1, -1), n_threads or get_threads())
        else:
            ops.matvec(self, act.x[0] if act is not None else x, out)
        return out

    def matmul(self, x: "np.ndarray | Activation", out: np.ndarray | None = None, n_threads: int | None = None,
               prompt: "bool | np.ndarray" = False) -> np.ndarray:
        """Y = X W^T. x: float32 (n_tok, ne0) (or an `Activation`) -> float32 (n_tok, ne1).

        prompt: whether the rows are a prompt's (all, or a bool mask (n_tok,)); the types whose
        prompts llama.cpp rounds differently from its decode (`TypeOps.int8_prompt`) round those
        rows as it does, the others as one-token decode."""
        act = x if isinstance(x, Activation) else None
        if act is None:
            x = _check_x(x, 2, self.n_cols)
            n_tok = x.shape[0]
        else:
            if act.n != self.n_cols:
                raise ValueError(f"activation of shape {act.x.shape} does not fit ne0={self.n_cols}")
            n_tok = act.n_tok
        out = _check_out(out, (n_tok, self.n_rows))
        if isinstance(prompt, np.ndarray) and prompt.shape != (n_tok,):
            raise ValueError(f"a prompt mask of shape {prompt.shape} for {n_tok} rows")
        if n_tok == 0:
            return out
        ops = self._ops or self._bind()
        if ops.int8 is not None and _state["int8"]:
            act = act if act is not None else Activation(x)
            nt = n_threads or get_threads()
            if ops.int8_prompt is None or not np.any(prompt):
                ops.int8(self, act, out, nt)
            elif np.all(prompt):
                ops.int8_prompt(self, act, out, nt)
            else:  # a step of prompt rows and decode rows (the server's): each kind by its own kernel
                for rows, op in ((np.flatnonzero(prompt), ops.int8_prompt), (np.flatnonzero(~np.asarray(prompt)), ops.int8)):
                    part = np.empty((rows.size, self.n_rows), np.float32)  # (rows, ne1)
                    op(self, act.rows(rows), part, nt)
                    out[rows] = part
        else:
            ops.matmul(self, act.x if act is not None else x, out, n_threads or get_threads())
        return out

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
        return (self._ops or self._bind()).dequantize(self, ids)

    def _bind(self) -> TypeOps:
        self._ops = type_ops(self.type_id)
        return self._ops

    def row(self, i: int) -> np.ndarray:
        """Row i as float32 (ne0,)."""
        if not -self.n_rows <= i < self.n_rows:
            raise IndexError(f"row {i} out of range for a tensor of {self.n_rows} rows")
        return self.dequantize(np.array([i % self.n_rows]))[0]


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
