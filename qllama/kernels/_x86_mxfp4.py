"""x86 intrinsics of MXFP4's int8 dot product, as ggml's AVX2 `ggml_vec_dot_mxfp4_q8_0`.

The shape of iq4_nl's (`_x86_iq.py`): the 4-bit codes index the 16 doubled e2m1 values
`KVALUES_MXFP4` (`vpshufb`, low nibbles = elements 0-15, high = 16-31), the products are
`pmaddubsw(|q|, sign(x, q))` summed per lane of 4 in int32 (exact), and block b's 8 lane sums are
multiplied by dx_b * E8M0_HALF(e_b) (rounded once) and added with one fma into accumulator b % 2;
the row's value is the horizontal sum of the two accumulators' sum. ggml's scalar tail block (an
odd block count) is `tail_mxfp4`. The block scale is the exponent byte e decoded as ggml's
`GGML_E8M0_TO_FP32_HALF`: the float32 with bits (e - 1) << 23, or 0x00200000 << e for e < 2.
Every ISA runs these 256-bit shapes, so every ISA gives the same bits.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..dequant.mxfp4_rows import BLOCK_BYTES, KVALUES_MXFP4
from ._x86 import _I8, _I32, _I64, _call, _dot4, _gep8, _hsum, _is_arr, _loop, _pack, _psign, _ptr, _row_ptrs, _row_sig, _splat, _vec
from ._x86_iq import _fma8, _hsum8, _splat8

_V8F = ir.VectorType(ir.FloatType(), 8)


def _e8m0_half(builder, blk):
    """float32 scale of the mxfp4 block at i8* blk (its exponent byte, ggml's E8M0_TO_FP32_HALF)."""
    e = builder.zext(builder.load(blk, align=1), _I32)
    small = builder.shl(ir.Constant(_I32, 0x00200000), e)
    big = builder.shl(builder.sub(e, ir.Constant(_I32, 1)), ir.Constant(_I32, 23))
    bits = builder.select(builder.icmp_unsigned("<", e, ir.Constant(_I32, 2)), small, big)
    return builder.bitcast(bits, ir.FloatType())


def _values(builder, p):
    """<32 x i8> signed doubled e2m1 values of the 16 packed bytes at i8* p."""
    v = builder.load(builder.bitcast(p, ir.PointerType(_vec(_I8, 16))), align=1)
    lo, hi = builder.and_(v, _splat(_I8, 16, 15)), builder.lshr(v, _splat(_I8, 16, 4))
    idx = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))
    table = ir.Constant(_vec(_I8, 32), [int(k) for k in KVALUES_MXFP4] * 2)
    return _call(builder, "llvm.x86.avx2.pshuf.b", _vec(_I8, 32), [table, idx])


def _row_mxfp4(context, builder, signature, args):
    """mxfp4 row(s) of nb blocks (nb even: the caller adds ggml's tail block) times q8_0 activation(s)."""
    rowp, toks = _row_ptrs(context, builder, signature, args)
    n = len(toks)
    v32 = ir.PointerType(_vec(_I8, 32))
    pairs = builder.ashr(args[1], ir.Constant(_I64, 1))

    def body(i, accs):  # accs: per token accumulator 1 (even blocks), then per token accumulator 2 (odd)
        out = list(accs)
        for h in range(2):
            b = builder.add(builder.shl(i, ir.Constant(_I64, 1)), ir.Constant(_I64, h))
            blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, BLOCK_BYTES)))
            d = _e8m0_half(builder, blk)
            q = _values(builder, _gep8(builder, blk, 1))
            aq = _psign(builder, q, q)  # |q|
            for t, (xq, xd, _) in enumerate(toks):
                x = builder.load(builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 32))), v32), align=1)
                isum = _dot4(builder, aq, _psign(builder, x, q))  # (8,) i32: 4 products per lane
                db = builder.fmul(builder.load(builder.gep(xd, [b]), align=4), d)  # dy * e, as ggml
                out[h * n + t] = _fma8(builder, _splat8(builder, db), builder.sitofp(isum, _V8F), accs[h * n + t])
        return out

    zero = ir.Constant(_V8F, [0.0] * 8)
    accs = _loop(builder, ir.Constant(_I64, 0), pairs, body, [zero] * (2 * n))
    sums = [_hsum8(builder, builder.fadd(accs[t], accs[n + t])) for t in range(n)]
    return _pack(context, builder, signature, sums)


@intrinsic
def row_dot_mxfp4(typingctx, row, nb, xq, xd, xs):
    """The first nb (even) blocks of an mxfp4 row times one q8_0 activation -> float32."""
    sig = _row_sig(row, nb, xq, xd, xs)
    return (sig, _row_mxfp4) if sig else None


@intrinsic
def row_dot4_mxfp4(typingctx, row, nb, xq, xd, xs, t0):
    """row_dot_mxfp4 for tokens t0..t0+3 of 2-D activations -> 4 float32 (bit for bit the same)."""
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, _row_mxfp4) if sig else None


@intrinsic
def tail_mxfp4(typingctx, row, nb, xq, xd, y):
    """ggml's scalar tail of an mxfp4 row of nb (odd) blocks: y + (dy * e) * sumi of block nb - 1,
    one rounding (`sumf += d * (sumi1 + sumi2)` compiled with FMA) -> float32. One token."""
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8) and _is_arr(xd, types.float32) and y == types.float32):
        return None

    def codegen(context, builder, signature, args):
        b = builder.sub(args[1], ir.Constant(_I64, 1))
        blk = _gep8(builder, _ptr(context, builder, signature.args[0], args[0], ir.Constant(_I64, 0), _I8),
                    builder.mul(b, ir.Constant(_I64, BLOCK_BYTES)))
        xp = _ptr(context, builder, signature.args[2], args[2], builder.mul(b, ir.Constant(_I64, 32)), _vec(_I8, 32))
        q = _values(builder, _gep8(builder, blk, 1))
        isum = _hsum(builder, _dot4(builder, _psign(builder, q, q), _psign(builder, builder.load(xp, align=1), q)))
        dx = builder.load(_ptr(context, builder, signature.args[3], args[3], b, ir.FloatType()), align=4)
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma.f32", fnty=ir.FunctionType(f, [f] * 3))
        return builder.call(fn, [builder.fmul(dx, _e8m0_half(builder, blk)), builder.sitofp(isum, f), args[4]])

    return types.float32(row, nb, xq, xd, y), codegen
