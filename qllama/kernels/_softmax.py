"""Attention's softmax numerators: the intrinsic `exp_sum16`.

x[:n] = exp(x[:n] - shift) in place, and the sum of the results, in one pass of 16-lane vectors.
`layer_ops._exp_shifted` computes the same function in two passes through an int32 scratch (Numba
cannot reinterpret a float's bits in a loop it vectorises), and the sum took a third: at depth
4096 those passes were a quarter of a prompt's attention time.

The function: v = clamp(x - shift, -87.3, 88.37); k = floor(v log2(e) + 1/2); r = v - k ln2 (ln 2
in two parts, each step one fused multiply-add); exp(r) ~ 1 + r + r^2 P(r) (Cephes' degree-5 P,
Horner with fused multiply-adds); times 2^k made from its IEEE bits. The sum: lane l adds the
elements l, l + 16, ... in order, then the 16 lanes add as a fixed tree. Explicit LLVM vector
operations without fast-math freedom: the same bits on every ISA, and for a row whatever batch it
is in.

Arguments: x (R, N) float32, C-contiguous; r int64: the row; n int64: its first n elements (the
row must have room for n rounded up to 16: the last vector is computed whole, its lanes past n
are written with garbage and left out of the sum); shift float32. Returns the float32 sum.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._scores import _row_ptr
from ._x86 import _loop, _vec
from ._x86_gemm import _c64, _exact, _fma, _splat_scalar

LANES = 16
_F = ir.FloatType()
_I32 = ir.IntType(32)
_VF = _vec(_F, LANES)
_VI = _vec(_I32, LANES)

# the constants of layer_ops' expf (Cephes)
_EXP_MIN, _EXP_MAX = -87.3, 88.37
_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _vc(v):
    return ir.Constant(_VF, [float(np.float32(v))] * LANES)


def _vexp(builder, v):
    """exp(v) lane-wise, v already clamped."""
    floor = builder.module.declare_intrinsic("llvm.floor.v16f32", fnty=ir.FunctionType(_VF, [_VF]))
    k = builder.call(floor, [_fma(builder, v, _vc(_LOG2E), _vc(0.5))])
    nk = builder.fneg(k)
    r = _fma(builder, nk, _vc(_LN2_HI), v)
    r = _fma(builder, nk, _vc(_LN2_LO), r)
    p = _vc(_P[0])
    for c in _P[1:]:
        p = _fma(builder, p, r, _vc(c))
    e = _exact("fadd", builder, _fma(builder, p, _exact("fmul", builder, r, r), r), _vc(1.0))
    bits = builder.shl(builder.add(builder.fptosi(k, _VI), ir.Constant(_VI, [127] * LANES)), ir.Constant(_VI, [23] * LANES))
    return _exact("fmul", builder, e, builder.bitcast(bits, _VF))


def lane_tree(builder, x, combine):
    """The 16 lanes of x folded as a fixed tree: combine(low half, high half), then again on the
    result's halves, down to one lane, returned as a scalar."""
    n = LANES
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(x, x, ir.Constant(_vec(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(x, x, ir.Constant(_vec(_I32, n), list(range(n, 2 * n))))
        x = combine(lo, hi)
    return builder.extract_element(x, ir.Constant(_I32, 0))


def _hsum(builder, x):
    """The 16 lanes of x added as a fixed tree (halves, then quarters, ...), in this order."""
    return lane_tree(builder, x, lambda lo, hi: _exact("fadd", builder, lo, hi))


@intrinsic
def exp_sum16(typingctx, x, r, n, shift):
    if not (isinstance(x, types.Array) and x.ndim == 2 and x.dtype == types.float32 and x.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        x, r, n, shift = args
        row = builder.bitcast(_row_ptr(context, builder, sig.args[0], x, r), ir.PointerType(_VF))
        sh = _splat_scalar(builder, shift, LANES)
        lo, hi = _vc(_EXP_MIN), _vc(_EXP_MAX)

        def exp_at(i):
            p = builder.gep(row, [i])
            v = _exact("fsub", builder, builder.load(p, align=4), sh)
            v = builder.select(builder.fcmp_ordered("<", v, lo), lo, v)
            v = builder.select(builder.fcmp_ordered(">", v, hi), hi, v)
            e = _vexp(builder, v)
            builder.store(e, p, align=4)
            return e

        n_full = builder.sdiv(n, _c64(LANES))
        (acc,) = _loop(builder, _c64(0), n_full, lambda i, accs: [_exact("fadd", builder, accs[0], exp_at(i))],
                       [ir.Constant(_VF, [0.0] * LANES)])
        left = builder.trunc(builder.sub(n, builder.mul(n_full, _c64(LANES))), _I32)  # 0..15 elements
        before = builder.block
        with builder.if_then(builder.icmp_signed(">", left, ir.Constant(_I32, 0))):  # the last, partial vector
            e = exp_at(n_full)
            keep = builder.icmp_signed("<", ir.Constant(_VI, list(range(LANES))), _splat_scalar(builder, left, LANES))
            acc_tail = _exact("fadd", builder, acc, builder.select(keep, e, ir.Constant(_VF, [0.0] * LANES)))
            tail_block = builder.block
        total = builder.phi(_VF)
        total.add_incoming(acc, before)
        total.add_incoming(acc_tail, tail_block)
        return _hsum(builder, total)

    return types.float32(x, r, n, shift), codegen


@intrinsic
def row_max16(typingctx, x, r, n):
    """float32: the largest of x[r, :n] (-inf when n = 0), a running maximum per lane held in a
    register (a max has the same value in any order). The row must have room for n rounded up to
    16, as for `exp_sum16`; lanes past n are left out."""
    if not (isinstance(x, types.Array) and x.ndim == 2 and x.dtype == types.float32 and x.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        x, r, n = args
        row = builder.bitcast(_row_ptr(context, builder, sig.args[0], x, r), ir.PointerType(_VF))
        lane_ids = ir.Constant(_VI, list(range(LANES)))
        n_vec = builder.sdiv(builder.add(n, _c64(LANES - 1)), _c64(LANES))
        ninf = ir.Constant(_VF, [float("-inf")] * LANES)

        def step(i, accs):
            v = builder.load(builder.gep(row, [i]), align=4)
            left = builder.trunc(builder.sub(n, builder.mul(i, _c64(LANES))), _I32)
            v = builder.select(builder.icmp_signed("<", lane_ids, _splat_scalar(builder, left, LANES)), v, ninf)
            return [builder.select(builder.fcmp_ordered(">", v, accs[0]), v, accs[0])]

        (m,) = _loop(builder, _c64(0), n_vec, step, [ninf])
        return lane_tree(builder, m, lambda lo, hi: builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo))

    return types.float32(x, r, n), codegen
