"""Activations rounded to 8 bits, one block at a time: the intrinsics `q8k_block` (256 elements,
q8_K) and `q8_0_block` (32 elements, q8_0 / q8_1).

The same function as ggml's quantize_row_q8_K (and as `act_quant`'s docstring states): vmax = the
first element of largest magnitude, iscale = -127 / vmax, q = clamp(round-half-even(iscale x),
-127, 127) (NaN -> 0), d = 1 / iscale, and the 16 sums of 16 quants in the slot layout of
`act_quant.Q8K_SUMS`. A block holding NaN or Inf gets d = NaN and zero quants and sums; an all-zero
block d = 0.

Why: written as scalar Numba (a branch per element for the running maximum, another for NaN) the
quantizer ran ~2.8 ns per element, 6% of a prompt's time on the 1B shape. Here each step is a
16-lane vector operation: the largest magnitude as an integer maximum of the sign-cleared bits
(for floats those order as the magnitudes do, and NaN / Inf sort above every finite value), the
first element holding it from the 16 vectors' equality masks, the sums of 16 as a transposing
tree. Every float operation is the scalar one (a product, a rounding, a division), so the bits
are those of the scalar code on every ISA.

Arguments: x (T, N) float32, xq (T, N) int8, xd (T, N/256) float32, xs (T, N/16) int32, all
C-contiguous; t, b int64: token t's block b.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._scores import _row_ptr
from ._softmax import lane_tree
from ._x86 import _call, _vec
from ._x86_gemm import _exact, _splat_scalar

QK_K = 256
LANES = 16
_F = ir.FloatType()
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_VF, _VI = _vec(_F, LANES), _vec(_I32, LANES)


def _ci(v, t=_I32):
    return ir.Constant(t, v)


def _vi(v):
    return ir.Constant(_VI, [v] * LANES)


def _vf(v):
    return ir.Constant(_VF, [v] * LANES)


def _pair_sum(builder, a, b, lo, hi):
    """shuffle(a, b, lo) + shuffle(a, b, hi): one level of the transposing sum tree."""
    sa = builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, len(lo)), lo))
    sb = builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, len(hi)), hi))
    return builder.add(sa, sb)


def _sums_of_16(builder, vs):
    """The 16 lane sums of the 16 <16 x i32> vectors vs, as one vector in vs' order."""
    levels = [
        (list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))),
        ([j + 8 * g for g in range(4) for j in range(4)], [j + 4 + 8 * g for g in range(4) for j in range(4)]),
        ([j + 4 * g for g in range(8) for j in range(2)], [j + 2 + 4 * g for g in range(8) for j in range(2)]),
        (list(range(0, 32, 2)), list(range(1, 32, 2))),
    ]
    for lo, hi in levels:
        vs = [_pair_sum(builder, vs[i], vs[i + 1], lo, hi) for i in range(0, len(vs), 2)]
    return vs[0]


def _max_lanes(builder, m):
    """The largest of the 16 signed int32 lanes of m."""
    return lane_tree(builder, m, lambda lo, hi: builder.select(builder.icmp_signed(">", hi, lo), hi, lo))


def _quants(builder, vx, scale, pvq):
    """clamp(round-half-even(scale x), -127, 127), NaN -> 0, for each <16 x float> of vx: stored as
    int8 at pvq (<16 x i8>*, one vector after another) and returned as <16 x i32> vectors. NaN is
    found from the bits, so that no fast-math flag of a caller can fold the test away."""
    out = []
    for k, v in enumerate(vx):
        r = _call(builder, "llvm.rint.v16f32", _VF, [_exact("fmul", builder, scale, v)])
        nan = builder.icmp_signed(">", builder.and_(builder.bitcast(r, _VI), _vi(0x7FFFFFFF)), _vi(0x7F800000))
        r = builder.select(builder.fcmp_ordered("<", r, _vf(-127.0)), _vf(-127.0), r)
        r = builder.select(builder.fcmp_ordered(">", r, _vf(127.0)), _vf(127.0), r)
        q = builder.select(nan, _vi(0), builder.fptosi(r, _VI))
        builder.store(builder.trunc(q, _vec(_I8, LANES)), builder.gep(pvq, [_ci(k)]), align=1)
        out.append(q)
    return out


def _is(t, dtype, ndim=2):
    return isinstance(t, types.Array) and t.ndim == ndim and t.dtype == dtype and t.layout == "C"


@intrinsic
def q8k_block(typingctx, x, t, b, xq, xd, xs):
    if not (_is(x, types.float32) and _is(xq, types.int8) and _is(xd, types.float32) and _is(xs, types.int32)):
        return None

    def codegen(context, builder, sig, args):
        x, t, b, xq, xd, xs = args
        xty, _, _, qty, dty, sty = sig.args
        col = builder.mul(b, ir.Constant(_I64, QK_K))
        px = builder.bitcast(_row_ptr(context, builder, xty, x, t, col), ir.PointerType(_F))
        pq = _row_ptr(context, builder, qty, xq, t, col)  # i8*
        pd = builder.bitcast(_row_ptr(context, builder, dty, xd, t, b), ir.PointerType(_F))
        ps = builder.bitcast(_row_ptr(context, builder, sty, xs, t, builder.mul(b, ir.Constant(_I64, 16))),
                             ir.PointerType(_VI))
        pvx = builder.bitcast(px, ir.PointerType(_VF))
        vx = [builder.load(builder.gep(pvx, [_ci(k)]), align=4) for k in range(QK_K // LANES)]
        mag = [builder.and_(builder.bitcast(v, _VI), _vi(0x7FFFFFFF)) for v in vx]  # |x| as ordered int bits
        m = mag[0]
        for v in mag[1:]:
            m = builder.select(builder.icmp_signed(">", v, m), v, m)
        amax = _max_lanes(builder, m)
        # the first element of that magnitude: vector k's equality mask, the lowest k that has one
        first = _ci(0)
        splat = _splat_scalar(builder, amax, LANES)
        for k in reversed(range(QK_K // LANES)):
            mask = builder.zext(builder.bitcast(builder.icmp_signed("==", mag[k], splat), _I16), _I32)
            at = builder.add(_ci(LANES * k), _call(builder, "llvm.cttz.i32", _I32, [mask, ir.Constant(ir.IntType(1), 0)]))
            first = builder.select(builder.icmp_unsigned("!=", mask, _ci(0)), at, first)
        vmax = builder.load(builder.gep(px, [first]), align=4)
        finite = builder.icmp_signed("<=", amax, _ci(0x7F7FFFFF))
        nonzero = builder.icmp_signed("!=", amax, _ci(0))
        ok = builder.and_(finite, nonzero)
        iscale = builder.fdiv(ir.Constant(_F, -127.0), builder.select(ok, vmax, ir.Constant(_F, 1.0)), flags=("nsz",))
        iscale = builder.select(ok, iscale, ir.Constant(_F, 0.0))  # 0: every quant 0 (NaN * 0 too, below)
        d = builder.fdiv(ir.Constant(_F, 1.0), iscale, flags=("nsz",))
        d = builder.select(finite, builder.select(nonzero, d, ir.Constant(_F, 0.0)), ir.Constant(_F, float("nan")))
        builder.store(d, pd, align=4)
        pvq = builder.bitcast(pq, ir.PointerType(_vec(_I8, LANES)))
        quants = _quants(builder, vx, _splat_scalar(builder, iscale, LANES), pvq)
        s = _sums_of_16(builder, quants)  # b_0 .. b_15
        even = builder.shuffle_vector(s, s, ir.Constant(_vec(_I32, 8), list(range(0, 16, 2))))
        odd = builder.shuffle_vector(s, s, ir.Constant(_vec(_I32, 8), list(range(1, 16, 2))))
        low = builder.shuffle_vector(s, s, ir.Constant(_vec(_I32, 8), list(range(8))))
        high = builder.shuffle_vector(s, s, ir.Constant(_vec(_I32, 8), list(range(8, 16))))
        v8 = _vec(_I32, 8)
        pairs = builder.or_(builder.and_(low, ir.Constant(v8, [0xFFFF] * 8)), builder.shl(high, ir.Constant(v8, [16] * 8)))
        slots = builder.shuffle_vector(builder.add(even, odd), pairs, ir.Constant(_VI, list(range(16))))
        builder.store(slots, ps, align=4)
        return context.get_dummy_value()

    return types.void(x, t, b, xq, xd, xs), codegen


QK8_0 = 32


@intrinsic
def q8_0_block(typingctx, x, t, o, xq):
    """(d, s) of the 32 elements x[t, o:o+32] in q8_0 / q8_1 form, the quants stored in xq[t, o:o+32]:
    d = amax / 127 (NaN if the block holds NaN or Inf), q = clamp(round-half-even(x 127/amax),
    -127, 127) (0 for an all-zero or non-finite block), s the sum of the quants (int64)."""
    if not (_is(x, types.float32) and _is(xq, types.int8)):
        return None
    ret = types.Tuple((types.float32, types.int64))

    def codegen(context, builder, sig, args):
        x, t, o, xq = args
        xty, _, _, qty = sig.args
        pvx = builder.bitcast(_row_ptr(context, builder, xty, x, t, o), ir.PointerType(_VF))
        pvq = builder.bitcast(_row_ptr(context, builder, qty, xq, t, o), ir.PointerType(_vec(_I8, LANES)))
        vx = [builder.load(builder.gep(pvx, [_ci(k)]), align=4) for k in range(QK8_0 // LANES)]
        mag = [builder.and_(builder.bitcast(v, _VI), _vi(0x7FFFFFFF)) for v in vx]
        m = builder.select(builder.icmp_signed(">", mag[1], mag[0]), mag[1], mag[0])
        amax_bits = _max_lanes(builder, m)
        finite = builder.icmp_signed("<=", amax_bits, _ci(0x7F7FFFFF))
        amax = builder.bitcast(amax_bits, _F)
        d = builder.fdiv(amax, ir.Constant(_F, 127.0), flags=("nsz",))
        d = builder.select(finite, d, ir.Constant(_F, float("nan")))
        nonzero = builder.icmp_signed("!=", amax_bits, _ci(0))
        idv = builder.fdiv(ir.Constant(_F, 127.0), builder.select(nonzero, amax, ir.Constant(_F, 1.0)), flags=("nsz",))
        idv = builder.select(builder.and_(finite, nonzero), idv, ir.Constant(_F, 0.0))
        q = _quants(builder, vx, _splat_scalar(builder, idv, LANES), pvq)
        total = _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [builder.add(q[0], q[1])])
        return context.make_tuple(builder, sig.return_type, [d, builder.sext(total, _I64)])

    return ret(x, t, o, xq), codegen
