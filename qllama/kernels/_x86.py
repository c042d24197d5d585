"""AVX2 building blocks for the int8-activation dot products, as Numba intrinsics.

Each intrinsic computes the integer dot product of one weight block with int8 activations,
emitting LLVM IR that calls the x86 AVX2 intrinsics `pmaddubsw` (32 u8 x i8 products summed in
pairs to i16) and `pmaddwd` (i16 x i16 summed in pairs to i32), which is how ggml does it.
(Generic LLVM vector IR was tried first: LLVM lowers `pmaddwd` patterns but not `pmaddubsw`,
which halves the speed.) These are only compiled when the host has AVX2 (`HAVE_AVX2`); other
hosts use the portable float kernels of `rows.py`.

Arguments are arrays plus element offsets; the caller guarantees the ranges are in bounds.
All return an int64 holding the exact int32 sum.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

HAVE_AVX2: bool = "+avx2" in llvm.get_host_cpu_features().flatten().split(",")

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(t: ir.Type, n: int, v: int) -> ir.Constant:
    return ir.Constant(_vec(t, n), [v] * n)


def _ptr(context, builder, aty, aval, off, elty):
    """Pointer to element `off` of array `aval`, cast to `elty*`."""
    data = context.make_array(aty)(context, builder, aval).data
    return builder.bitcast(builder.gep(data, [off]), ir.PointerType(elty))


def _load32(builder, p, k=0):
    """Load the k-th <32 x i8> from p (unaligned)."""
    return builder.load(builder.gep(p, [ir.Constant(_I32, k)]) if k else p, align=1)


def _maddubs(builder, a, b):
    fn = builder.module.declare_intrinsic(
        "llvm.x86.avx2.pmadd.ub.sw", fnty=ir.FunctionType(_vec(_I16, 16), [_vec(_I8, 32), _vec(_I8, 32)])
    )
    return builder.call(fn, [a, b])


def _maddwd(builder, a, b):
    fn = builder.module.declare_intrinsic(
        "llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16), _vec(_I16, 16)])
    )
    return builder.call(fn, [a, b])


def _hsum(builder, v):
    """Horizontal sum of <n x i32> -> i64."""
    n = v.type.count
    fn = builder.module.declare_intrinsic(f"llvm.vector.reduce.add.v{n}i32", fnty=ir.FunctionType(_I32, [v.type]))
    return builder.sext(builder.call(fn, [v]), _I64)


def _lanes(builder, v, idx):
    """Shuffle v into a new vector with lanes v[idx[0]], v[idx[1]], ..."""
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, len(idx)), list(idx)))


def _is_arr(t, dtype):
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype


def _kquant_nibbles(context, builder, signature, args, qh_off):
    """Shared codegen of dot_q4_k / dot_q5_k; qh_off: byte offset of qh[32] relative to the quants, or None."""
    qp = _ptr(context, builder, signature.args[0], args[0], args[1], _vec(_I8, 32))
    xp = _ptr(context, builder, signature.args[2], args[2], args[3], _vec(_I8, 32))
    sc = builder.zext(builder.bitcast(args[4], _vec(_I8, 8)), _vec(_I16, 8))  # (8,) i16
    qh = None
    if qh_off is not None:
        base = _ptr(context, builder, signature.args[0], args[0], args[1], _I8)
        qh = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I64, qh_off)]), ir.PointerType(_vec(_I8, 32))), align=1)
    acc = ir.Constant(_vec(_I32, 8), None)
    for j in range(4):
        v = _load32(builder, qp, j)
        lo = builder.and_(v, _splat(_I8, 32, 15))
        hi = builder.lshr(v, _splat(_I8, 32, 4))
        if qh is not None:  # 5th bit of element 64j+32h+l is bit 2j+h of qh[l]
            for h in range(2):
                bit = builder.and_(builder.lshr(qh, _splat(_I8, 32, 2 * j + h)), _splat(_I8, 32, 1))
                bit = builder.shl(bit, _splat(_I8, 32, 4))
                if h == 0:
                    lo = builder.or_(lo, bit)
                else:
                    hi = builder.or_(hi, bit)
        plo = _maddubs(builder, lo, _load32(builder, xp, 2 * j))  # (16,) i16 pair sums
        phi = _maddubs(builder, hi, _load32(builder, xp, 2 * j + 1))
        acc = builder.add(acc, _maddwd(builder, plo, _lanes(builder, sc, [2 * j] * 16)))
        acc = builder.add(acc, _maddwd(builder, phi, _lanes(builder, sc, [2 * j + 1] * 16)))
    return _hsum(builder, acc)


@intrinsic
def dot_q4_k(typingctx, row, qo, xq, xo, scales):
    """sum_j sc[j] * sum_l nib(q)[j, l] * xq[...] over one q4_K super-block.

    row[qo:qo+128] holds the nibbles (byte 32j+l: low nibble = element 64j+l, high = 64j+32+l),
    xq[xo:xo+256] the int8 activations, `scales` the 8 six-bit sub-block scales packed as bytes
    of an int64 (scale k in bits 8k..8k+7).
    """
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8)):
        return None
    sig = types.int64(row, qo, xq, xo, scales)
    return sig, lambda context, builder, signature, args: _kquant_nibbles(context, builder, signature, args, None)


@intrinsic
def dot_q5_k(typingctx, row, qo, xq, xo, scales):
    """As dot_q4_k for q5_K: quants at row[qo:qo+128], their 5th bits in qh = row[qo-32:qo]."""
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8)):
        return None
    sig = types.int64(row, qo, xq, xo, scales)
    return sig, lambda context, builder, signature, args: _kquant_nibbles(context, builder, signature, args, -32)


@intrinsic
def dot_q6_k(typingctx, row, bo, xq, xo, xs, so):
    """sum_k sc[k] * sum_l (q[16k+l] - 32) * xq[xo+16k+l] over one q6_K super-block at row[bo:].

    The 6-bit quants enter pmaddubsw unsigned (0..63); the -32 offset is applied through the
    activation's 16-element sums xs[so:so+16] (int32): - 32 * sum_k sc[k] * xs[so+k].
    """
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8) and _is_arr(xs, types.int32)):
        return None
    sig = types.int64(row, bo, xq, xo, xs, so)

    def codegen(context, builder, signature, args):
        base = _ptr(context, builder, signature.args[0], args[0], args[1], _I8)
        xp = _ptr(context, builder, signature.args[2], args[2], args[3], _vec(_I8, 32))
        v32 = ir.PointerType(_vec(_I8, 32))
        scp = builder.bitcast(builder.gep(base, [ir.Constant(_I32, 192)]), ir.PointerType(_vec(_I8, 16)))
        sc = builder.sext(builder.load(scp, align=1), _vec(_I16, 16))  # (16,) i16
        m15 = _splat(_I8, 32, 15)
        m3 = _splat(_I8, 32, 3)
        acc = ir.Constant(_vec(_I32, 8), None)
        for n in range(2):  # 128-element halves
            a = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I32, 64 * n)]), v32), align=1)
            b = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I32, 64 * n + 32)]), v32), align=1)
            h = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I32, 128 + 32 * n)]), v32), align=1)
            lows = [builder.and_(a, m15), builder.and_(b, m15), builder.lshr(a, _splat(_I8, 32, 4)), builder.lshr(b, _splat(_I8, 32, 4))]
            for s in range(4):  # 32-element groups
                hs = builder.and_(builder.lshr(h, _splat(_I8, 32, 2 * s)) if s else h, m3)
                q = builder.or_(lows[s], builder.shl(hs, _splat(_I8, 32, 4)))
                p = _maddubs(builder, q, _load32(builder, xp, 4 * n + s))
                k = 8 * n + 2 * s
                acc = builder.add(acc, _maddwd(builder, p, _lanes(builder, sc, [k] * 8 + [k + 1] * 8)))
        bs = builder.load(_ptr(context, builder, signature.args[4], args[4], args[5], _vec(_I32, 16)), align=4)
        corr = _hsum(builder, builder.mul(builder.sext(sc, _vec(_I32, 16)), bs))
        return builder.sub(_hsum(builder, acc), builder.shl(corr, ir.Constant(_I64, 5)))

    return sig, codegen


@intrinsic
def dot_q8_0(typingctx, row, qo, xq, xo):
    """sum_l int8(row[qo+l]) * xq[xo+l] for l < 32 (one q8_0 block's quants)."""
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8)):
        return None
    sig = types.int64(row, qo, xq, xo)

    def codegen(context, builder, signature, args):
        w = _load32(builder, _ptr(context, builder, signature.args[0], args[0], args[1], _vec(_I8, 32)))
        x = _load32(builder, _ptr(context, builder, signature.args[2], args[2], args[3], _vec(_I8, 32)))
        # u8 x i8 trick: |w| * (x * sign(w)); |w| = 128 for w = -128 is fine as unsigned
        neg = builder.icmp_signed("<", w, _splat(_I8, 32, 0))
        aw = builder.select(neg, builder.sub(_splat(_I8, 32, 0), w), w)
        sx = builder.select(neg, builder.sub(_splat(_I8, 32, 0), x), x)
        sx = builder.select(builder.icmp_signed("==", w, _splat(_I8, 32, 0)), _splat(_I8, 32, 0), sx)
        p = _maddubs(builder, aw, sx)
        return _hsum(builder, _maddwd(builder, p, _splat(_I16, 16, 1)))

    return sig, codegen


@intrinsic
def dot_mins_q4_k(typingctx, mins, xs, so):
    """sum_k mins[k] * (xs[so+2k] + xs[so+2k+1]) for k < 8: the min term of a q4_K/q5_K block.

    `mins` packs the 8 six-bit mins one per byte of an int64; xs holds 16-element sums (int32).
    """
    if not _is_arr(xs, types.int32):
        return None
    sig = types.int64(mins, xs, so)

    def codegen(context, builder, signature, args):
        m = builder.zext(builder.bitcast(args[0], _vec(_I8, 8)), _vec(_I32, 8))
        bs = builder.load(_ptr(context, builder, signature.args[1], args[1], args[2], _vec(_I32, 16)), align=4)
        pairs = builder.add(_lanes(builder, bs, range(0, 16, 2)), _lanes(builder, bs, range(1, 16, 2)))
        return _hsum(builder, builder.mul(m, pairs))

    return sig, codegen


def _legacy_codegen(context, builder, signature, args, with_qh):
    """sum over one 32-element q4_0/q4_1 (or q5_*) block of the *unsigned* quants times xq."""
    base = _ptr(context, builder, signature.args[0], args[0], args[1], _I8)
    v = builder.load(builder.bitcast(base, ir.PointerType(_vec(_I8, 16))), align=1)
    lo = builder.and_(v, _splat(_I8, 16, 15))
    hi = builder.lshr(v, _splat(_I8, 16, 4))
    q = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))  # elements 0..31
    if with_qh:  # bit e of the uint32 qh is the 5th bit of element e
        qh = builder.trunc(args[4], _I32)
        spl = builder.shuffle_vector(builder.insert_element(ir.Constant(_vec(_I32, 32), None), qh, ir.Constant(_I32, 0)),
                                     ir.Constant(_vec(_I32, 32), None), ir.Constant(_vec(_I32, 32), [0] * 32))
        bits = builder.and_(spl, ir.Constant(_vec(_I32, 32), [1 << i for i in range(31)] + [-(1 << 31)]))
        set_ = builder.icmp_unsigned("!=", bits, ir.Constant(_vec(_I32, 32), [0] * 32))
        q = builder.or_(q, builder.select(set_, _splat(_I8, 32, 16), _splat(_I8, 32, 0)))
    x = _load32(builder, _ptr(context, builder, signature.args[2], args[2], args[3], _vec(_I8, 32)))
    return _hsum(builder, _maddwd(builder, _maddubs(builder, q, x), _splat(_I16, 16, 1)))


@intrinsic
def dot_q4_legacy(typingctx, row, qo, xq, xo):
    """sum_l q_l * xq[xo+l] for the 16 nibble bytes at row[qo:] (q4_0 / q4_1 quants, unsigned 0..15)."""
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8)):
        return None
    return types.int64(row, qo, xq, xo), lambda c, b, sg, a: _legacy_codegen(c, b, sg, a, False)


@intrinsic
def dot_q5_legacy(typingctx, row, qo, xq, xo, qh):
    """As dot_q4_legacy with 5th bits from qh (the block's uint32): q5_0 / q5_1 quants, 0..31."""
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8)):
        return None
    return types.int64(row, qo, xq, xo, qh), lambda c, b, sg, a: _legacy_codegen(c, b, sg, a, True)


def _two_bit_codegen(context, builder, signature, args, kind):
    """Shared codegen of dot_q2_k / dot_q3_k over one super-block at row[bo:].

    Group (n, s) of 32 elements e = 128n + 32s + l has low bits (qs[32n+l] >> 2s) & 3; q3_K adds
    4 * bit (4n+s) of hmask[l]. The 16 sub-block scales (i16) multiply pmaddubsw pair sums; lanes
    0-7 of a group belong to sub-block 8n+2s, lanes 8-15 to 8n+2s+1.
    """
    base = _ptr(context, builder, signature.args[0], args[0], args[1], _I8)
    xp = _ptr(context, builder, signature.args[2], args[2], args[3], _vec(_I8, 32))
    v32 = ir.PointerType(_vec(_I8, 32))
    lo_s, hi_s = (builder.bitcast(a, _vec(_I8, 8)) for a in (args[4], args[5]))
    sc = builder.shuffle_vector(lo_s, hi_s, ir.Constant(_vec(_I32, 16), list(range(16))))
    sc = (builder.zext if kind == "q2" else builder.sext)(sc, _vec(_I16, 16))
    qs_off, hm = (16, None) if kind == "q2" else (32, builder.load(builder.bitcast(base, v32), align=1))
    acc = ir.Constant(_vec(_I32, 8), None)
    for n in range(2):
        q = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I32, qs_off + 32 * n)]), v32), align=1)
        for s in range(4):
            v = builder.and_(builder.lshr(q, _splat(_I8, 32, 2 * s)) if s else q, _splat(_I8, 32, 3))
            if hm is not None:
                h = builder.and_(builder.lshr(hm, _splat(_I8, 32, 4 * n + s)), _splat(_I8, 32, 1))
                v = builder.or_(v, builder.shl(h, _splat(_I8, 32, 2)))
            p = _maddubs(builder, v, _load32(builder, xp, 4 * n + s))
            k = 8 * n + 2 * s
            acc = builder.add(acc, _maddwd(builder, p, _lanes(builder, sc, [k] * 8 + [k + 1] * 8)))
    return _hsum(builder, acc)


@intrinsic
def dot_q2_k(typingctx, row, bo, xq, xo, sc_lo, sc_hi):
    """sum_k sc[k] * sum_l q[16k+l] * xq[xo+16k+l] for the q2_K block at row[bo:] (q = 0..3).

    sc_lo / sc_hi pack the 16 four-bit scales one per byte (sub-blocks 0-7, 8-15).
    """
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8)):
        return None
    return types.int64(row, bo, xq, xo, sc_lo, sc_hi), lambda c, b, sg, a: _two_bit_codegen(c, b, sg, a, "q2")


@intrinsic
def dot_q3_k(typingctx, row, bo, xq, xo, sc_lo, sc_hi):
    """sum_k sc[k] * sum_l (q+4)[16k+l] * xq[xo+16k+l] for the q3_K block at row[bo:] (q+4 = 0..7).

    sc_lo / sc_hi pack the 16 signed six-bit scales (-32..31) one per byte. The caller subtracts
    4 * sum_k sc[k] * bsum[k].
    """
    if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8)):
        return None
    return types.int64(row, bo, xq, xo, sc_lo, sc_hi), lambda c, b, sg, a: _two_bit_codegen(c, b, sg, a, "q3")
