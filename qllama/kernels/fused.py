"""Fused decode kernels: one Numba call quantizes a token's activation and runs the rows of up to
three matrices that share it (Q|K|V, gate|up) in one parallel region; `ffn` also applies the
gated activation, quantizes its output and runs ffn_down, all in the same call.

Why: on a small model (SmolLM2-135M: 30 layers of 576) one decode token is ~250 small kernels,
and each Python -> Numba call costs microseconds and each parallel region a thread wake-up;
that per-call cost, not arithmetic, set the speed. These kernels cut a layer's Numba calls on
the int8 path from 15 to 7 and its parallel regions from 9 to 4 (none at one thread).

Results are bit-identical to the unfused int8 path (`kernels/int8.py` through QTensor): each
row is the same whole-row intrinsic of `_x86.py` (as int8.py's kernels call for one token),
the activation is rounded by act_quant.py's own per-token code (`q8_k_row`, `q8_0_row`,
`q8_1_row`, called by address), and the GLU is `layer_ops.glu` itself.

The same calls serve a step of n tokens (2 .. decode.MAX_ROWS: a server step of n streams,
prompt lookup's verify batch): every token is quantized on the calling thread, and each matrix
slot holds, instead of a type id, the address of that type's n-token row kernel (the one the
unfused path runs, `int8.ROWS_INT8` / `iquants.ROWS_INT8`: every token of a row while it is in
L1, the same bits as one token; `n_token_slots`). So an n-token step is one call and one region
for Q|K|V, one and one for attn_output, one and two for the FFN, and nothing new to compile
beyond the row kernels a k-row step ran before.

Types: those with whole-row intrinsics (q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K, iq4_nl, iq4_xs,
iq3_s, iq2_xxs); a group's matrices must share one activation form. Others take the unfused path.
Shapes: x (T, n) float32 (T = 1, or n tokens); xq int8 (T, n), xd float32 (T, n/32 or n/256), xs
int32 or float32 (T, n/32 or n/16) as `qtensor.Activation.quantized` makes them; raw uint8 (rows,
row_bytes); outputs float32 (T, rows). An unused slot is an empty raw (0, 1) with an empty output (T, 0).
"""

from __future__ import annotations

import numpy as np
from numba import prange, types
from numba.extending import overload, register_jitable

from ..gguf.types import IQ2_XXS, IQ3_S, IQ4_NL, IQ4_XS, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0
from . import (
    _x86,  # the whole-row intrinsics, as _x86.row_dot_<type>
    int8,
    iquants,
)
from ._x86_iq import row_dot_iq2_xxs, row_dot_iq3_s, row_dot_iq4_nl, row_dot_iq4_xs, tail_iq4_nl
from .act_quant import q8_0_row, q8_1_row, q8_k_row
from .int8 import FASTMATH
from .jit import address_of, call_address, kernel
from .layer_ops import glu

_NOPY = dict(boundscheck=False)
_OVERLOAD = dict(boundscheck=False, error_model="numpy")  # as every kernel (kernels/jit.py)

# (which types these kernels run: qtensor.FUSED_TYPES, from the type records)


# -- rows of one matrix, by type (picked at run time, once per chunk of rows: the loop around
# each whole-row intrinsic is then as tight as int8.py's; the sum dtype picks the compiled set) --


def _paired(one, two):
    """Rows [lo, hi) by the two-row intrinsic `two` on rows half the range apart (two fma chains
    at once; rows side by side defeat the prefetcher), the odd one by `one`: the same bits."""

    @register_jitable
    def rows(raw, nb, out, lo, hi, xq, xd, xs):
        h = (hi - lo) // 2
        for i in range(lo, lo + h):
            out[0, i], out[0, i + h] = two(raw[i], raw[i + h], nb, xq, xd, xs)
        if (hi - lo) % 2:
            out[0, hi - 1] = one(raw[hi - 1], nb, xq, xd, xs)

    return rows


_rows_q4_legacy = _paired(_x86.row_dot_q4_legacy, _x86.row2_dot_q4_legacy)
_rows_q5_legacy = _paired(_x86.row_dot_q5_legacy, _x86.row2_dot_q5_legacy)
_rows_q8_0 = _paired(_x86.row_dot_q8_0, _x86.row2_dot_q8_0)


def _rows(type_id, raw, out, lo, hi, xq, xd, xs):
    """out[0, r] = row r of raw . x for r in [lo, hi); x one token's int8 activation (1-D arrays)."""


@overload(_rows, jit_options=dict(fastmath=FASTMATH, **_OVERLOAD))
def _rows_impl(type_id, raw, out, lo, hi, xq, xd, xs):
    if xs.dtype == types.float32:  # q8_1 activations: q4_1, q5_1

        def legacy_1(type_id, raw, out, lo, hi, xq, xd, xs):
            if type_id == Q4_1:
                _rows_q4_legacy(raw, raw.shape[1] // 20, out, lo, hi, xq, xd, xs)
            else:
                _rows_q5_legacy(raw, raw.shape[1] // 24, out, lo, hi, xq, xd, xs)

        return legacy_1

    def int_sums(type_id, raw, out, lo, hi, xq, xd, xs):  # q8_K (k-quants) or q8_0 (q8_0, q4_0, q5_0)
        if type_id == Q4_K:
            nb = raw.shape[1] // 144
            for r in range(lo, hi):  # (the intrinsic prefetches ahead, per block)
                out[0, r] = _x86.row_dot_q4_k(raw[r], nb, xq, xd, xs)
        elif type_id == Q5_K:
            nb = raw.shape[1] // 176
            for r in range(lo, hi):  # (the intrinsic prefetches ahead, per block)
                out[0, r] = _x86.row_dot_q5_k(raw[r], nb, xq, xd, xs)
        elif type_id == Q6_K:
            nb = raw.shape[1] // 210
            for r in range(lo, hi):  # (the intrinsic prefetches ahead, per block)
                out[0, r] = _x86.row_dot_q6_k(raw[r], nb, xq, xd, xs)
        elif type_id == Q8_0:
            _rows_q8_0(raw, raw.shape[1] // 34, out, lo, hi, xq, xd, xs)
        elif type_id == Q4_0:
            _rows_q4_legacy(raw, raw.shape[1] // 18, out, lo, hi, xq, xd, xs)
        elif type_id == IQ4_XS:  # (iq4: the intrinsics of _x86_iq.py, as kernels/iquants.py calls them)
            nb = raw.shape[1] // 136
            for r in range(lo, hi):
                out[0, r] = row_dot_iq4_xs(raw[r], nb, xq, xd, xs)
        elif type_id == IQ4_NL:
            nb = raw.shape[1] // 18
            nbe = nb - nb % 2  # (pairs of blocks; ggml's tail block after them)
            for r in range(lo, hi):
                y = row_dot_iq4_nl(raw[r], nbe, xq, xd, xs)
                out[0, r] = tail_iq4_nl(raw[r], nb, xq, xd, y) if nb % 2 else y
        elif type_id == IQ3_S:
            nb = raw.shape[1] // 110
            for r in range(lo, hi):
                out[0, r] = row_dot_iq3_s(raw[r], nb, xq, xd, xs)
        elif type_id == IQ2_XXS:
            nb = raw.shape[1] // 66
            for r in range(lo, hi):
                out[0, r] = row_dot_iq2_xxs(raw[r], nb, xq, xd, xs)
        else:
            _rows_q5_legacy(raw, raw.shape[1] // 22, out, lo, hi, xq, xd, xs)

    return int_sums


# -- the activation, quantized on the calling thread by act_quant's row function, called by its
# address (found once by `quant_address`): a form's code is not compiled into these kernels again,
# and a model's unused forms not at all --

_ROW_OF_FORM = {"q8_K": q8_k_row, "q8_0": q8_0_row, "q8_1": q8_1_row}


def glu_address(gate, up, act: int) -> int:
    """The address of layer_ops.glu compiled for (gate, up, gate, act) as `ffn` calls it (gate is
    overwritten meanwhile); 0 while compile_pool records."""
    args = (gate, up, gate, act)
    return address_of(glu, args, lambda: glu(*args))


def quant_address(form: str, x, xq, xd, xs) -> int:
    """The address of the act_quant row function of `form` ("q8_K", "q8_0", "q8_1") compiled for
    these arguments' types (token 0 of x is quantized meanwhile); 0 while compile_pool records."""
    row = _ROW_OF_FORM[form]
    args = (x, 0, xq, xd, xs)
    return address_of(row, args, lambda: row(*args))


# -- n tokens: each matrix by its type's row kernel, called by address --

_NO_TAB = np.zeros(1, np.float32)  # the row kernels' fp16 table argument (they do not read it), typed as
_NO_TAB.flags.writeable = False  # _fp16.FP16_TO_F32 is (read-only): a constant of _chunk3's code
_ADDRESS_MIN = 1 << 16  # a slot's number below this is a type id (one token), else a row kernel's address


def n_token_slots(slots, xq, xd, xs) -> list | None:
    """[t0, r0, o0, t1, r1, o1, t2, r2, o2] of a call of n >= 2 tokens (xq (n, .)) with each type id
    replaced by the address of its row kernel for these arguments (0 for an empty slot); None while
    compile_pool records (then the caller asks again)."""
    out = list(slots)
    for i in (0, 3, 6):
        raw, out[i] = slots[i + 1], 0
        if raw.shape[0]:
            rows = (iquants.ROWS_INT8 if slots[i] in iquants.ROW_BYTES else int8.ROWS_INT8)[slots[i]]
            args = (raw, xq, xd, xs, _NO_TAB, slots[i + 2], np.int64(0), np.int64(0))
            out[i] = address_of(rows, args, lambda rows=rows, args=args: rows(*args))  # (an empty range)
            if not out[i]:
                return None
    return out


@register_jitable
def _matrix(t, raw, out, lo, hi, xq, xd, xs):
    """Rows [lo, hi) of one matrix: t a type id (one token, `_rows`) or its n-token row kernel's address."""
    if t < _ADDRESS_MIN:
        _rows(t, raw, out, lo, hi, xq[0], xd[0], xs[0])
    else:
        call_address(t, raw, xq, xd, xs, _NO_TAB, out, lo, hi)


# -- rows of up to three matrices in one region --


@kernel(**_NOPY)
def _chunk3(t0, r0, o0, t1, r1, o1, t2, r2, o2, xq, xd, xs, lo, hi):
    """Rows [lo, hi) of the three matrices' rows taken end to end."""
    n0, n1 = r0.shape[0], r1.shape[0]
    if lo < n0:
        _matrix(t0, r0, o0, lo, min(hi, n0), xq, xd, xs)
    if hi > n0 and lo < n0 + n1:
        _matrix(t1, r1, o1, max(lo, n0) - n0, min(hi, n0 + n1) - n0, xq, xd, xs)
    if hi > n0 + n1:
        _matrix(t2, r2, o2, max(lo, n0 + n1) - n0 - n1, hi - n0 - n1, xq, xd, xs)


# -- the parallel region, shared by the entry points. It calls _chunk3 by its address
# (jit.call_address): linked in by name, _chunk3's code (every type's row intrinsic) would be
# optimised again in _rows3's serial branch, twice in its parallel loop and in both entry points,
# ~3 s more on a first run. The caller gets the address once from `rows_address`. --


def rows_address(t0, r0, o0, t1, r1, o1, t2, r2, o2, xq, xd, xs) -> int:
    """The address of `_chunk3` compiled for these arguments' types (as `_rows3` passes them on);
    0 while compile_pool records a warm-up (then nothing is computed: the caller asks again)."""
    args = (t0, r0, o0, t1, r1, o1, t2, r2, o2, xq, xd, xs, 0, 0)
    return address_of(_chunk3, args, lambda: _chunk3(*args))  # (an empty range: only compiles, or loads, it)


@kernel(parallel=True, **_NOPY)
def _rows3(t0, r0, o0, t1, r1, o1, t2, r2, o2, xq, xd, xs, chunk_address, n_threads):
    """o_i = W_i x for up to three matrices (type ids t_i, or n-token row kernels' addresses;
    packed rows r_i) and the quantized tokens x, their rows taken end to end and split into one
    chunk per thread in one parallel region (none with one thread). chunk_address:
    `rows_address` of the same arguments."""
    if chunk_address == 0:
        return
    total = r0.shape[0] + r1.shape[0] + r2.shape[0]
    if n_threads <= 1:
        call_address(chunk_address, t0, r0, o0, t1, r1, o1, t2, r2, o2, xq, xd, xs, np.int64(0), np.int64(total))
        return
    n_chunks = min(total, n_threads)
    per = (total + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        call_address(chunk_address, t0, r0, o0, t1, r1, o1, t2, r2, o2, xq, xd, xs, np.int64(c * per),
                     np.int64(min(total, (c + 1) * per)))


# -- entry points --


@kernel(**_NOPY)
def matvec3(x, quant_address, xq, xd, xs, t0, r0, o0, t1, r1, o1, t2, r2, o2, chunk_address, n_threads):
    """Quantize x (T, n) into (xq, xd, xs) on this thread (quant_address: `quant_address` of x and
    them), then o_i = W_i x for up to three matrices (type ids t_i, or for T >= 2 their row
    kernels' addresses; packed rows r_i) in one parallel region (`_rows3`). An address 0 (a
    recording warm-up): nothing is computed."""
    if quant_address == 0:
        return
    for t in range(x.shape[0]):
        call_address(quant_address, x, np.int64(t), xq, xd, xs)
    _rows3(t0, r0, o0, t1, r1, o1, t2, r2, o2, xq, xd, xs, chunk_address, n_threads)


@kernel(**_NOPY)
def ffn(x, quant_address, xq, xd, xs, tg, rg, gate, tu, ru, up, act, quant_d_address, gq, gd, gs, td, rd, out,
        empty_raw, empty_out, gate_up_address, down_address, glu_address, n_threads):
    """A gated FFN for T tokens: gate|up rows in one region, gate = act(gate) * up
    (layer_ops.glu) on this thread, then ffn_down of it into out (T, n_embd) in a second
    region (slots as `matvec3`'s). (gq, gd, gs): the quantized GLU output in ffn_down's form.
    The addresses: `quant_address` of x and of gate, `rows_address` of the two `_rows3` calls'
    arguments, `glu_address`."""
    if quant_address == 0 or quant_d_address == 0 or glu_address == 0:
        return
    for t in range(x.shape[0]):
        call_address(quant_address, x, np.int64(t), xq, xd, xs)
    _rows3(tg, rg, gate, tu, ru, up, tg, empty_raw, empty_out, xq, xd, xs, gate_up_address, n_threads)
    call_address(glu_address, gate, up, gate, act)
    for t in range(x.shape[0]):
        call_address(quant_d_address, gate, np.int64(t), gq, gd, gs)
    _rows3(td, rd, out, td, empty_raw, empty_out, td, empty_raw, empty_out, gq, gd, gs, down_address, n_threads)
