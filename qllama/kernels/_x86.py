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

_FEATURES = set(llvm.get_host_cpu_features().flatten().split(","))
HAVE_AVX2: bool = {"+avx2", "+f16c"} <= _FEATURES  # f16c: fp16 scales converted in vector code

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


def _reduce2_i32(builder, a, b):
    """(sum of a's lanes, sum of b's lanes) for two <8 x i32>, as i32, reduced together."""
    def sh(x, y, idx):
        return builder.shuffle_vector(x, y, ir.Constant(_vec(_I32, 8), idx))
    v = builder.add(sh(a, b, [0, 1, 2, 3, 8, 9, 10, 11]), sh(a, b, [4, 5, 6, 7, 12, 13, 14, 15]))  # a in 0-3, b in 4-7
    v = builder.add(v, sh(v, v, [2, 3, 0, 1, 6, 7, 4, 5]))
    v = builder.add(v, sh(v, v, [1, 0, 3, 2, 5, 4, 7, 6]))
    return builder.extract_element(v, ir.Constant(_I32, 0)), builder.extract_element(v, ir.Constant(_I32, 4))


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


def _nibbles_core(builder, qp, xps, sc, qh_off):
    """Per token, <8 x i32> partial sums of sum_j sc[j] * nib . x over one q4_K/q5_K super-block.

    qp: <32 x i8>* to the 128 quant bytes; xps: one <32 x i8>* per token to its 256 int8
    activations (the weights are unpacked once for all of them); sc: <8 x i16>.
    """
    qh = None
    if qh_off is not None:
        base = builder.bitcast(qp, ir.PointerType(_I8))
        qh = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I64, qh_off)]), ir.PointerType(_vec(_I8, 32))), align=1)
    accs = [ir.Constant(_vec(_I32, 8), None)] * len(xps)
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
        slo = _lanes(builder, sc, [2 * j] * 16)
        shi = _lanes(builder, sc, [2 * j + 1] * 16)
        for i, xp in enumerate(xps):
            plo = _maddubs(builder, lo, _load32(builder, xp, 2 * j))  # (16,) i16 pair sums
            phi = _maddubs(builder, hi, _load32(builder, xp, 2 * j + 1))
            accs[i] = builder.add(accs[i], builder.add(_maddwd(builder, plo, slo), _maddwd(builder, phi, shi)))
    return accs


def _q6_core(builder, base, xps, sc):
    """Per token, <8 x i32> partial sums of sum_k sc[k] * sum_l q * x over one q6_K block at i8* base.

    q unsigned 0..63 (unpacked once for all tokens); xps: one <32 x i8>* per token to its 256
    activations; sc: <16 x i16> the block's scales.
    """
    v32 = ir.PointerType(_vec(_I8, 32))
    m15 = _splat(_I8, 32, 15)
    m3 = _splat(_I8, 32, 3)
    accs = [ir.Constant(_vec(_I32, 8), None)] * len(xps)
    for n in range(2):  # 128-element halves
        a = builder.load(builder.bitcast(_gep8(builder, base, 64 * n), v32), align=1)
        b = builder.load(builder.bitcast(_gep8(builder, base, 64 * n + 32), v32), align=1)
        h = builder.load(builder.bitcast(_gep8(builder, base, 128 + 32 * n), v32), align=1)
        lows = [builder.and_(a, m15), builder.and_(b, m15), builder.lshr(a, _splat(_I8, 32, 4)), builder.lshr(b, _splat(_I8, 32, 4))]
        for s in range(4):  # 32-element groups: sub-blocks 8n+2s (lanes 0-7) and 8n+2s+1 (lanes 8-15)
            hs = builder.and_(builder.lshr(h, _splat(_I8, 32, 2 * s)) if s else h, m3)
            q = builder.or_(lows[s], builder.shl(hs, _splat(_I8, 32, 4)))
            k = 8 * n + 2 * s
            scl = _lanes(builder, sc, [k] * 8 + [k + 1] * 8)
            for i, xp in enumerate(xps):
                p = _maddubs(builder, q, _load32(builder, xp, 4 * n + s))
                accs[i] = builder.add(accs[i], _maddwd(builder, p, scl))
    return accs


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


def _load_f16(builder, p):
    """float32 value of the fp16 at i8* p (F16C: vcvtph2ps)."""
    h = builder.load(builder.bitcast(p, ir.PointerType(ir.HalfType())), align=1)
    return builder.fpext(h, ir.FloatType())


def _gep8(builder, p, off):
    return builder.gep(p, [off if isinstance(off, ir.Value) else ir.Constant(_I64, off)])


def _splat_f(builder, v):
    v8f = _vec(ir.FloatType(), 8)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(v8f, None), v, ir.Constant(_I32, 0)),
                                  ir.Constant(v8f, None), ir.Constant(_vec(_I32, 8), [0] * 8))


def _vec_loop(builder, nb, body, inits):
    """Emit `for b in range(nb): vals = body(b, vals)` from `inits`; return the final values."""
    entry = builder.block
    loop = builder.append_basic_block("blk_loop")
    done = builder.append_basic_block("blk_done")
    builder.cbranch(builder.icmp_signed(">", nb, ir.Constant(_I64, 0)), loop, done)
    builder.position_at_end(loop)
    b = builder.phi(_I64)
    vals = [builder.phi(z.type) for z in inits]
    vals2 = body(b, vals)
    b1 = builder.add(b, ir.Constant(_I64, 1))
    last = builder.block
    b.add_incoming(ir.Constant(_I64, 0), entry)
    b.add_incoming(b1, last)
    for v, v2, z in zip(vals, vals2, inits):
        v.add_incoming(z, entry)
        v.add_incoming(v2, last)
    builder.cbranch(builder.icmp_signed("<", b1, nb), loop, done)
    builder.position_at_end(done)
    finals = []
    for v2, z in zip(vals2, inits):
        f = builder.phi(z.type)
        f.add_incoming(z, entry)
        f.add_incoming(v2, last)
        finals.append(f)
    return finals


def _row_loop(builder, nb, body, n_acc, n_scalar=0):
    """Emit `for b in range(nb): accs = body(b, accs)` over n_acc <8 x float> accumulators (then
    n_scalar float ones); return the vector ones' lane sums, then the scalar ones.

    Keeping the partial sums in vector registers for the whole row (one horizontal sum per row,
    not per block) is what makes these row kernels fast.
    """
    v8f = _vec(ir.FloatType(), 8)
    zeros = [ir.Constant(v8f, [0.0] * 8)] * n_acc + [ir.Constant(ir.FloatType(), 0.0)] * n_scalar
    entry = builder.block
    loop = builder.append_basic_block("row_loop")
    done = builder.append_basic_block("row_done")
    builder.cbranch(builder.icmp_signed(">", nb, ir.Constant(_I64, 0)), loop, done)
    builder.position_at_end(loop)
    b = builder.phi(_I64)
    accs = [builder.phi(z.type) for z in zeros]
    accs2 = body(b, accs)
    b1 = builder.add(b, ir.Constant(_I64, 1))
    last = builder.block
    b.add_incoming(ir.Constant(_I64, 0), entry)
    b.add_incoming(b1, last)
    for a, a2, z in zip(accs, accs2, zeros):
        a.add_incoming(z, entry)
        a.add_incoming(a2, last)
    builder.cbranch(builder.icmp_signed("<", b1, nb), loop, done)
    builder.position_at_end(done)
    phis = []
    for a2, z in zip(accs2, zeros):  # all phi nodes first
        v = builder.phi(z.type)
        v.add_incoming(z, entry)
        v.add_incoming(a2, last)
        phis.append(v)
    sums = []
    for v in phis[:n_acc]:
        for n in (4, 2, 1):  # pairwise horizontal sum
            v = builder.fadd(_lanes(builder, v, range(n)), _lanes(builder, v, range(n, 2 * n)))
        sums.append(builder.extract_element(v, ir.Constant(_I32, 0)))
    return sums + phis[n_acc:]


def _row_ptrs(context, builder, signature, args):
    """(row u8*, [per token: (xq i8*, xd f32*, xs i32* or f32*)]) from a row intrinsic's arguments.

    1-D activations: one token. 2-D (n_tok, .) activations plus a first token t0 (args[5]):
    N_TILE tokens t0 .. t0+N_TILE-1.
    """
    z = ir.Constant(_I64, 0)
    rowp = _ptr(context, builder, signature.args[0], args[0], z, _I8)
    sty = ir.FloatType() if signature.args[4].dtype == types.float32 else _I32
    tys = ((2, _I8), (3, ir.FloatType()), (4, sty))
    if signature.args[2].ndim == 1:
        return rowp, [tuple(_ptr(context, builder, signature.args[k], args[k], z, ty) for k, ty in tys)]
    toks = []
    for i in range(N_TILE):
        t = builder.add(args[5], ir.Constant(_I64, i))
        ptrs = []
        for k, ty in tys:
            ary = context.make_array(signature.args[k])(context, builder, args[k])
            stride = builder.extract_value(ary.strides, 0)  # bytes between tokens
            p = builder.gep(builder.bitcast(ary.data, ir.PointerType(_I8)), [builder.mul(t, stride)])
            ptrs.append(builder.bitcast(p, ir.PointerType(ty)))
        toks.append(tuple(ptrs))
    return rowp, toks


N_TILE = 4  # tokens per call of the multi-token row intrinsics (weights unpacked once for all)


def _kquant45_head(builder, blk):
    """(d, dmin as float, the 8 six-bit scales <8 x i16>, the 8 mins <8 x i32>) of the q4_K / q5_K
    block at i8* blk (ggml's utmp unpacking of the 12 scale bytes)."""
    def c(v):
        return ir.Constant(_I32, v)

    d = _load_f16(builder, blk)
    dmin = _load_f16(builder, _gep8(builder, blk, 2))
    u = [builder.load(builder.bitcast(_gep8(builder, blk, 4 + 4 * i), ir.PointerType(_I32)), align=1) for i in range(3)]
    sc_lo = builder.and_(u[0], c(0x3F3F3F3F))
    mn_lo = builder.and_(u[1], c(0x3F3F3F3F))
    sc_hi = builder.or_(builder.and_(u[2], c(0x0F0F0F0F)), builder.shl(builder.and_(builder.lshr(u[0], c(6)), c(0x03030303)), c(4)))
    mn_hi = builder.or_(builder.and_(builder.lshr(u[2], c(4)), c(0x0F0F0F0F)),
                        builder.shl(builder.and_(builder.lshr(u[1], c(6)), c(0x03030303)), c(4)))

    def bytes8(lo, hi):
        v = builder.insert_element(ir.Constant(_vec(_I32, 2), None), lo, c(0))
        return builder.bitcast(builder.insert_element(v, hi, c(1)), _vec(_I8, 8))

    return d, dmin, builder.zext(bytes8(sc_lo, sc_hi), _vec(_I16, 8)), builder.zext(bytes8(mn_lo, mn_hi), _vec(_I32, 8))


def _reduce8(builder, vs):
    """8 x <8 x i32> -> <8 x i32> whose lane r is the sum of vs[r]'s lanes (exact while it fits)."""
    def sh(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 8), idx))
    h = [builder.add(sh(vs[r], vs[r + 1], [0, 8, 2, 10, 4, 12, 6, 14]), sh(vs[r], vs[r + 1], [1, 9, 3, 11, 5, 13, 7, 15]))
         for r in range(0, 8, 2)]
    g = [builder.add(sh(h[p], h[p + 1], [0, 1, 8, 9, 4, 5, 12, 13]), sh(h[p], h[p + 1], [2, 3, 10, 11, 6, 7, 14, 15]))
         for p in range(0, 4, 2)]
    return builder.add(sh(g[0], g[1], [0, 1, 2, 3, 8, 9, 10, 11]), sh(g[0], g[1], [4, 5, 6, 7, 12, 13, 14, 15]))


def _row_kquant45(context, builder, signature, args, kind, exact=False):
    """q4_K / q5_K row(s) times q8_K activation(s): sum_b dx_b * (d_b*isum_b - dmin_b*msum_b).

    args: row (u8[]), nb, xq (i8), xd (f32), xs (i32 16-element sums) [, t0: see _row_ptrs].
    exact: per block the exact int32 isum_b and msum_b, and a scalar float sum (`_block_step`, as
    `_q4k_tile`); otherwise 8 lanes of partial sums are accumulated in float and summed at the end.
    """
    bsz, qoff, qh_off = (144, 16, None) if kind == "q4" else (176, 48, -32)
    v8f = _vec(ir.FloatType(), 8)
    rowp, toks = _row_ptrs(context, builder, signature, args)

    def body(b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, bsz)))
        d, dmin, sc, mn = _kquant45_head(builder, blk)
        qp = builder.bitcast(_gep8(builder, blk, qoff), ir.PointerType(_vec(_I8, 32)))
        xps = [builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))), ir.PointerType(_vec(_I8, 32)))
               for xq, _, _ in toks]
        isums = _nibbles_core(builder, qp, xps, sc, qh_off)
        out = []
        for acc, isum, (_, xd, xs) in zip(accs, isums, toks):
            xdb = builder.load(builder.gep(xd, [b]), align=4)
            bsp = builder.gep(xs, [builder.mul(b, ir.Constant(_I64, 16))])
            bs = builder.load(builder.bitcast(bsp, ir.PointerType(_vec(_I32, 16))), align=4)
            msum = builder.mul(mn, builder.add(_lanes(builder, bs, range(0, 16, 2)), _lanes(builder, bs, range(1, 16, 2))))
            if exact:  # the block's exact sums, then the float steps of `_q4k_tile` (bit for bit the same)
                isum_b, msum_b = _reduce2_i32(builder, isum, msum)
                return list(_block_step(builder, accs[0], accs[1], d, dmin, xdb, isum_b, msum_b))
            acc = builder.fadd(acc, builder.fmul(_splat_f(builder, builder.fmul(d, xdb)), builder.sitofp(isum, v8f)))
            out.append(builder.fsub(acc, builder.fmul(_splat_f(builder, builder.fmul(dmin, xdb)), builder.sitofp(msum, v8f))))
        return out

    if exact:  # two scalar sums (the block terms and the min terms), subtracted at the end
        acc, accm = _row_loop(builder, args[1], body, 0, 2)
        return _exact_fsub(builder, acc, accm)
    return _pack(context, builder, signature, _row_loop(builder, args[1], body, len(toks)))


def _row_q6_k(context, builder, signature, args):
    """q6_K row(s) times q8_K activation(s): sum_b d_b*dx_b*(sum_k sc_k*(sum q x - 32*bsum_k))."""
    v8f = _vec(ir.FloatType(), 8)
    rowp, toks = _row_ptrs(context, builder, signature, args)

    def body(b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, 210)))
        d = _load_f16(builder, _gep8(builder, blk, 208))
        sc = builder.sext(builder.load(builder.bitcast(_gep8(builder, blk, 192), ir.PointerType(_vec(_I8, 16))), align=1), _vec(_I16, 16))
        sc32 = builder.sext(sc, _vec(_I32, 16))
        xps = [builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))), ir.PointerType(_vec(_I8, 32)))
               for xq, _, _ in toks]
        isums = _q6_core(builder, blk, xps, sc)
        out = []
        for acc, isum, (_, xd, xs) in zip(accs, isums, toks):
            bsp = builder.gep(xs, [builder.mul(b, ir.Constant(_I64, 16))])
            corr = builder.mul(sc32, builder.load(builder.bitcast(bsp, ir.PointerType(_vec(_I32, 16))), align=4))
            corr = builder.add(_lanes(builder, corr, range(8)), _lanes(builder, corr, range(8, 16)))
            isum = builder.sub(isum, builder.shl(corr, ir.Constant(_vec(_I32, 8), [5] * 8)))
            db = builder.fmul(d, builder.load(builder.gep(xd, [b]), align=4))
            out.append(builder.fadd(acc, builder.fmul(_splat_f(builder, db), builder.sitofp(isum, v8f))))
        return out

    return _pack(context, builder, signature, _row_loop(builder, args[1], body, len(toks)))


# 32-element blocks: kind -> (block bytes, offset of the quants, of the 32 fifth bits (or None),
# of the fp16 min m (or None), offset subtracted from the unsigned quants)
_LEGACY = {
    "q4_0": (18, 2, None, None, 8),
    "q4_1": (20, 4, None, 2, 0),
    "q5_0": (22, 6, 2, None, 16),
    "q5_1": (24, 8, 4, 2, 0),
    "q8_0": (34, 2, None, None, 0),
}


def _psign(builder, a, b):
    """a negated where b < 0, zeroed where b == 0 (vpsignb)."""
    v = _vec(_I8, 32)
    fn = builder.module.declare_intrinsic("llvm.x86.avx2.psign.b", fnty=ir.FunctionType(v, [v, v]))
    return builder.call(fn, [a, b])


def _fifth_bits(builder, p):
    """<32 x i8>: 16 where bit e of the uint32 at i8* p is set (element e's fifth bit), else 0."""
    qh = builder.bitcast(builder.load(builder.bitcast(p, ir.PointerType(_I32)), align=1), _vec(_I8, 4))
    spread = _lanes(builder, qh, [e // 8 for e in range(32)])  # byte e // 8 in lane e
    mask = ir.Constant(_vec(_I8, 32), [((1 << (e % 8)) ^ 128) - 128 for e in range(32)])  # bit e % 8 as a signed i8
    is_set = builder.icmp_unsigned("!=", builder.and_(spread, mask), _splat(_I8, 32, 0))
    return builder.select(is_set, _splat(_I8, 32, 16), _splat(_I8, 32, 0))


def _fma(builder, a, b, c):
    """a * b + c rounded once (vfmadd), float32 or <n x float>."""
    name = "llvm.fma.f32" if isinstance(a.type, ir.FloatType) else f"llvm.fma.v{a.type.count}f32"
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(a.type, [a.type] * 3))
    return builder.call(fn, [a, b, c])


def _exact_fmul(builder, a, b):
    """a * b with no fast-math freedom: the kernels are compiled with fastmath, and Numba adds its
    flags (reassoc, contract) only to float instructions that have none; `arcp` changes nothing
    for a product. Used where two kernels must round identically."""
    return builder.fmul(a, b, flags=("arcp",))


def _block_step(builder, acc, accm, d, dmin, dx, isum, msum):
    """(acc + (d*dx)*isum, accm + (dmin*dx)*msum), each one fused multiply-add: the float steps
    per q4_K block, the same in `row_dot_q4_k` (scalars) and `tile_q4_k` (8 rows in the lanes).
    As ggml's vec_dot, the min terms have their own sum, subtracted at the end (`_exact_fsub`)."""
    fty = acc.type
    if isinstance(fty, ir.FloatType):  # as <1 x float>: Numba adds fast-math flags to calls returning a float
        v1, z = _vec(fty, 1), ir.Constant(_I32, 0)
        one = [builder.insert_element(ir.Constant(v1, None), v, z) for v in (acc, accm, d, dmin, dx)]
        ints = [builder.insert_element(ir.Constant(_vec(_I32, 1), None), v, z) for v in (isum, msum)]
        return tuple(builder.extract_element(v, z) for v in _block_step(builder, *one, *ints))
    return (_fma(builder, _exact_fmul(builder, d, dx), builder.sitofp(isum, fty), acc),
            _fma(builder, _exact_fmul(builder, dmin, dx), builder.sitofp(msum, fty), accm))


def _exact_fsub(builder, a, b):
    """a - b, kept from Numba's fast-math flags (see `_exact_fmul`)."""
    return builder.fsub(a, b, flags=("arcp",))


def _row_legacy(context, builder, signature, args, kind):
    """q4_0 / q4_1 / q5_0 / q5_1 / q8_0 row(s) times q8_0 or q8_1 activation(s), as ggml's vec_dot:

    per block b, isum = sum_l q_l x_l in int32 (pmaddubsw + pmaddwd; q unsigned, or |w| and sign(x, w)
    for q8_0), minus off * xs_b for q4_0/q5_0 (xs: int32 sums of x); then acc += d_b*dx_b*isum
    (8 lanes), and for q4_1/q5_1 a scalar sum of m_b * s_b (xs: float32 s of q8_1), added at the
    end. The weights are unpacked once for all tokens.
    """
    bsz, qoff, qh_off, m_off, off = _LEGACY[kind]
    v8f = _vec(ir.FloatType(), 8)
    rowp, toks = _row_ptrs(context, builder, signature, args)
    v32 = ir.PointerType(_vec(_I8, 32))
    ones = _splat(_I16, 16, 1)
    n = len(toks)

    def body(b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, bsz)))
        d = _load_f16(builder, blk)
        qp = _gep8(builder, blk, qoff)
        if kind == "q8_0":
            w = builder.load(builder.bitcast(qp, v32), align=1)
            q = _psign(builder, w, w)  # |w| (|-128| = 128 read unsigned)
        else:
            v = builder.load(builder.bitcast(qp, ir.PointerType(_vec(_I8, 16))), align=1)
            lo, hi = builder.and_(v, _splat(_I8, 16, 15)), builder.lshr(v, _splat(_I8, 16, 4))
            q = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))  # elements 0..31
            if qh_off is not None:
                q = builder.or_(q, _fifth_bits(builder, _gep8(builder, blk, qh_off)))
        m = _load_f16(builder, _gep8(builder, blk, m_off)) if m_off is not None else None
        out, outm = [], []
        for i, (xq, xd, xs) in enumerate(toks):
            x = builder.load(builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 32))), v32), align=1)
            if kind == "q8_0":
                x = _psign(builder, x, w)
            isum = _maddwd(builder, _maddubs(builder, q, x), ones)  # (8,) i32
            if off:
                corr = builder.mul(builder.load(builder.gep(xs, [b]), align=4), ir.Constant(_I32, off))
                isum = builder.sub(isum, builder.insert_element(ir.Constant(_vec(_I32, 8), [0] * 8), corr, ir.Constant(_I32, 0)))
            db = builder.fmul(d, builder.load(builder.gep(xd, [b]), align=4))
            out.append(builder.fadd(accs[i], builder.fmul(_splat_f(builder, db), builder.sitofp(isum, v8f))))
            if m is not None:
                outm.append(_fma(builder, m, builder.load(builder.gep(xs, [b]), align=4), accs[n + i]))
        return out + outm

    sums = _row_loop(builder, args[1], body, n, n if m_off is not None else 0)
    if m_off is not None:
        sums = [builder.fadd(a, ms) for a, ms in zip(sums[:n], sums[n:])]
    return _pack(context, builder, signature, sums)


def _pack(context, builder, signature, sums):
    """Return one float32, or a UniTuple of them for the multi-token variants."""
    if len(sums) == 1 and not isinstance(signature.return_type, types.UniTuple):
        return sums[0]
    return context.make_tuple(builder, signature.return_type, sums)


def _row_sig(row, nb, xq, xd, xs, t0=None, xs_dtypes=(types.int32,)):
    """Signature of a row intrinsic: 1-D activations -> float32; 2-D plus t0 -> N_TILE float32s."""
    if not (_is_arr(row, types.uint8) and isinstance(nb, types.Integer)):
        return None
    if not (isinstance(xs, types.Array) and xs.dtype in xs_dtypes):
        return None
    acts = (xq, xd, xs)
    dtypes = (types.int8, types.float32, xs.dtype)
    if t0 is None:
        ok = all(_is_arr(a, dt) for a, dt in zip(acts, dtypes))
        return types.float32(row, nb, xq, xd, xs) if ok else None
    ok = isinstance(t0, types.Integer) and all(
        isinstance(a, types.Array) and a.ndim == 2 and a.dtype == dt and a.layout == "C" for a, dt in zip(acts, dtypes))
    return types.UniTuple(types.float32, N_TILE)(row, nb, xq, xd, xs, t0) if ok else None


@intrinsic
def row_dot_q4_k(typingctx, row, nb, xq, xd, xs):
    """A q4_K row (nb super-blocks) times one q8_K activation (xq, xd, xs = 16-element sums) -> float32.

    Per block exact integer sums and scalar float steps: the same value as `tile_q4_k`, bit for bit.
    """
    sig = _row_sig(row, nb, xq, xd, xs)
    return (sig, lambda c, b, sg, a: _row_kquant45(c, b, sg, a, "q4", exact=True)) if sig else None


@intrinsic
def row_dot_q5_k(typingctx, row, nb, xq, xd, xs):
    """As row_dot_q4_k for a q5_K row."""
    sig = _row_sig(row, nb, xq, xd, xs)
    return (sig, lambda c, b, sg, a: _row_kquant45(c, b, sg, a, "q5")) if sig else None


@intrinsic
def row_dot_q6_k(typingctx, row, nb, xq, xd, xs):
    """A q6_K row (nb super-blocks) times one q8_K activation -> float32."""
    sig = _row_sig(row, nb, xq, xd, xs)
    return (sig, _row_q6_k) if sig else None


@intrinsic
def row_dot4_q5_k(typingctx, row, nb, xq, xd, xs, t0):
    """A q5_K row times tokens t0..t0+3 of 2-D q8_K activations -> 4 float32 (weights unpacked once).

    Each token's arithmetic is exactly that of row_dot_q5_k (same results, bit for bit).
    """
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, lambda c, b, sg, a: _row_kquant45(c, b, sg, a, "q5")) if sig else None


@intrinsic
def row_dot4_q6_k(typingctx, row, nb, xq, xd, xs, t0):
    """As row_dot4_q5_k for q6_K."""
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, _row_q6_k) if sig else None


@intrinsic
def row_dot_q8_0(typingctx, row, nb, xq, xd, xs):
    """A q8_0 row (nb blocks) times one q8_0 activation (xd per 32; xs unused) -> float32."""
    sig = _row_sig(row, nb, xq, xd, xs)
    return (sig, lambda c, b, sg, a: _row_legacy(c, b, sg, a, "q8_0")) if sig else None


@intrinsic
def row_dot4_q8_0(typingctx, row, nb, xq, xd, xs, t0):
    """As row_dot4_q5_k for q8_0 (q8_0 activations)."""
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, lambda c, b, sg, a: _row_legacy(c, b, sg, a, "q8_0")) if sig else None


def _legacy_sig(bits, row, nb, xq, xd, xs, t0=None):
    """(signature, codegen) of a q4_0/q4_1 (bits 4) or q5_0/q5_1 (bits 5) row intrinsic.

    The activation form picks the variant, as the types pair in ggml: q8_0 activations (int32
    sums xs) go with q4_0 / q5_0, q8_1 activations (float32 s) with q4_1 / q5_1.
    """
    sig = _row_sig(row, nb, xq, xd, xs, t0, xs_dtypes=(types.int32, types.float32))
    if sig is None:
        return None
    kind = f"q{bits}_{0 if xs.dtype == types.int32 else 1}"
    return sig, lambda c, b, sg, a: _row_legacy(c, b, sg, a, kind)


@intrinsic
def row_dot_q4_legacy(typingctx, row, nb, xq, xd, xs):
    """A q4_0 row times one q8_0 activation (int32 xs), or a q4_1 row times one q8_1 activation
    (float32 xs) -> float32."""
    return _legacy_sig(4, row, nb, xq, xd, xs)


@intrinsic
def row_dot_q5_legacy(typingctx, row, nb, xq, xd, xs):
    """As row_dot_q4_legacy for q5_0 / q5_1 rows."""
    return _legacy_sig(5, row, nb, xq, xd, xs)


@intrinsic
def row_dot4_q4_legacy(typingctx, row, nb, xq, xd, xs, t0):
    """row_dot_q4_legacy for tokens t0..t0+3 of 2-D activations -> 4 float32 (bit for bit the same)."""
    return _legacy_sig(4, row, nb, xq, xd, xs, t0)


@intrinsic
def row_dot4_q5_legacy(typingctx, row, nb, xq, xd, xs, t0):
    """row_dot_q5_legacy for tokens t0..t0+3 of 2-D activations -> 4 float32."""
    return _legacy_sig(5, row, nb, xq, xd, xs, t0)


# -- q4_K: 8 rows x 4 tokens per call, rows in the lanes ------------------------------------------
#
# The row kernels above hold one row's 32 consecutive quants per vector, so every pmaddubsw needs
# its own pmaddwd to apply the sub-block scale. Here a vector holds 4 quants of each of 8 rows (one
# 32-bit lane per row), the activations' matching 4 bytes are broadcast to every lane, and the 8
# pmaddubsw of a 32-element sub-block are summed in int16 (|sum| <= 16 * 15 * 127 = 30480) before
# one pmaddwd applies the 8 rows' scales: about half the instructions per product. The weights are
# transposed in registers (no repacked copy in memory) once per 4 tokens.

TILE_ROWS = 8


def _transpose8(builder, vs):
    """8 x <8 x i32> (row r: lanes k) -> 8 x <8 x i32> (k: lanes r)."""
    def sh(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 8), idx))
    a = []
    for r in range(0, 8, 2):  # interleave dwords within 128-bit halves
        a.append((sh(vs[r], vs[r + 1], [0, 8, 1, 9, 4, 12, 5, 13]), sh(vs[r], vs[r + 1], [2, 10, 3, 11, 6, 14, 7, 15])))
    b = []
    for p in range(0, 4, 2):  # then 64-bit pairs: rows 4p'..4p'+3, dwords {k, k+4}
        for h in range(2):
            b.append(sh(a[p][h], a[p + 1][h], [0, 1, 8, 9, 4, 5, 12, 13]))
            b.append(sh(a[p][h], a[p + 1][h], [2, 3, 10, 11, 6, 7, 14, 15]))
    # b[0..3]: rows 0-3, dwords (0,4), (1,5), (2,6), (3,7); b[4..7]: rows 4-7, the same
    out = [None] * 8
    for k in range(4):
        out[k] = sh(b[k], b[4 + k], [0, 1, 2, 3, 8, 9, 10, 11])
        out[k + 4] = sh(b[k], b[4 + k], [4, 5, 6, 7, 12, 13, 14, 15])
    return out


def _prefetch(builder, p):
    """A read prefetch of the cache line at i8* p into all cache levels."""
    fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [ir.PointerType(_I8), _I32, _I32, _I32]))
    builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _prefetch_next_rows(builder, blks, rstride):
    """Prefetch the same 144-byte block of the next 8 rows: 8 interleaved row streams defeat the
    hardware prefetcher (an address past the matrix's end is a harmless hint)."""
    ahead = builder.mul(rstride, ir.Constant(_I64, TILE_ROWS))
    for p in blks:
        q = builder.gep(p, [ahead])
        for off in (0, 64, 128):
            _prefetch(builder, _gep8(builder, q, off))


def _transpose4x2(builder, vs):
    """4 x <8 x i32> (vector r: row r in lanes 0-3, row r+4 in lanes 4-7) -> 4 x <8 x i32> (k: lane r = dword k of row r)."""
    def sh(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 8), idx))
    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    a0, a1, a2, a3 = sh(vs[0], vs[1], lo), sh(vs[0], vs[1], hi), sh(vs[2], vs[3], lo), sh(vs[2], vs[3], hi)
    p, q = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    return [sh(a0, a2, p), sh(a0, a2, q), sh(a1, a3, p), sh(a1, a3, q)]


def _q4k_tile(context, builder, signature, args):
    """out[t0+i, r0+r] = row (r0+r) . x[t0+i] for r < 8, i < 4 (q4_K rows, q8_K activations).

    args: raw (u8 (n_rows, nb*144)), r0, nb, xq, xd, xs, t0, out (f32 (n_tok, n_rows)).
    Per block and (row, token): the exact int32 isum and msum, then `_block_step`, as
    `row_dot_q4_k` does.
    """
    v8f, v8i, v32b, v16h = _vec(ir.FloatType(), 8), _vec(_I32, 8), _vec(_I8, 32), _vec(_I16, 16)
    raw = context.make_array(signature.args[0])(context, builder, args[0])
    r0, nb, t0 = args[1], args[2], args[6]
    base = builder.bitcast(raw.data, ir.PointerType(_I8))
    rstride = builder.extract_value(raw.strides, 0)
    rowps = [builder.gep(base, [builder.mul(builder.add(r0, ir.Constant(_I64, r)), rstride)]) for r in range(TILE_ROWS)]
    toks = []
    for i in range(N_TILE):
        t = builder.add(t0, ir.Constant(_I64, i))
        ptrs = []
        for k, ty in ((3, _I8), (4, ir.FloatType()), (5, _I32)):
            ary = context.make_array(signature.args[k])(context, builder, args[k])
            p = builder.gep(builder.bitcast(ary.data, ir.PointerType(_I8)), [builder.mul(t, builder.extract_value(ary.strides, 0))])
            ptrs.append(builder.bitcast(p, ir.PointerType(ty)))
        toks.append(tuple(ptrs))

    def c32(v):
        return ir.Constant(v8i, [v] * 8)

    def body(b, accs):
        boff = builder.mul(b, ir.Constant(_I64, 144))
        blks = [builder.gep(p, [boff]) for p in rowps]
        _prefetch_next_rows(builder, blks, rstride)
        # the 16-byte heads (d, dmin, 12 bytes of scales and mins) of the 8 rows, transposed: lane r = row r
        heads = [builder.load(builder.bitcast(p, ir.PointerType(_vec(_I32, 4))), align=1) for p in blks]
        hv = _transpose4x2(builder, [builder.shuffle_vector(heads[r], heads[r + 4], ir.Constant(v8i, list(range(8))))
                                     for r in range(4)])  # hv[k]: lane r = dword k of row r's head
        dd = builder.bitcast(hv[0], _vec(_I16, 16))
        d = builder.fpext(builder.bitcast(_lanes(builder, dd, range(0, 16, 2)), _vec(ir.HalfType(), 8)), v8f)
        dmin = builder.fpext(builder.bitcast(_lanes(builder, dd, range(1, 16, 2)), _vec(ir.HalfType(), 8)), v8f)
        u0, u1, u2 = hv[1], hv[2], hv[3]
        sc_lo = builder.and_(u0, c32(0x3F3F3F3F))
        mn_lo = builder.and_(u1, c32(0x3F3F3F3F))
        sc_hi = builder.or_(builder.and_(u2, c32(0x0F0F0F0F)), builder.shl(builder.and_(builder.lshr(u0, c32(6)), c32(0x03030303)), c32(4)))
        mn_hi = builder.or_(builder.and_(builder.lshr(u2, c32(4)), c32(0x0F0F0F0F)),
                            builder.shl(builder.and_(builder.lshr(u1, c32(6)), c32(0x03030303)), c32(4)))
        scales = []  # sub-block k: lane r = s_rk in both int16 halves (the pmaddwd operand)
        for k in range(8):
            v = builder.and_(builder.lshr(sc_lo if k < 4 else sc_hi, c32(8 * (k % 4))), c32(0xFF))
            scales.append(builder.bitcast(builder.or_(v, builder.shl(v, c32(16))), v16h))
        mins = []  # pair p: lane r = (m_r,2p, m_r,2p+1) as int16
        for p in range(4):
            v = mn_lo if p < 2 else mn_hi
            sh = 16 * (p % 2)
            lo = builder.and_(builder.lshr(v, c32(sh)), c32(0xFF))
            hi = builder.and_(builder.lshr(v, c32(sh + 8)), c32(0xFF))
            mins.append(builder.bitcast(builder.or_(lo, builder.shl(hi, c32(16))), v16h))
        isums = [c32(0)] * N_TILE
        xbs = [_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))) for xq, _, _ in toks]
        for j in range(4):  # 64-element groups: sub-blocks 2j (low nibbles) and 2j+1 (high)
            rows = [builder.load(builder.bitcast(_gep8(builder, p, 16 + 32 * j), ir.PointerType(v8i)), align=1) for p in blks]
            tq = [builder.bitcast(v, v32b) for v in _transpose8(builder, rows)]  # tq[k]: bytes 4k..4k+3 of each row
            for hnib in range(2):
                w = [builder.and_(builder.lshr(v, _splat(_I8, 32, 4)) if hnib else v, _splat(_I8, 32, 15)) for v in tq]
                for i in range(N_TILE):
                    acc16 = None
                    for k in range(8):
                        xp = builder.bitcast(_gep8(builder, xbs[i], 64 * j + 32 * hnib + 4 * k), ir.PointerType(_I32))
                        xw = builder.load(xp, align=1)
                        xv = builder.bitcast(builder.shuffle_vector(builder.insert_element(ir.Constant(v8i, None), xw, ir.Constant(_I32, 0)),
                                                                    ir.Constant(v8i, None), ir.Constant(v8i, [0] * 8)), v32b)
                        p16 = _maddubs(builder, w[k], xv)
                        acc16 = p16 if acc16 is None else builder.add(acc16, p16)
                    isums[i] = builder.add(isums[i], _maddwd(builder, acc16, scales[2 * j + hnib]))
        out = []
        for i, (_, xd, xs) in enumerate(toks):
            bsp = builder.gep(xs, [builder.mul(b, ir.Constant(_I64, 16))])
            bs = builder.load(builder.bitcast(bsp, ir.PointerType(_vec(_I32, 16))), align=4)
            b32 = builder.add(_lanes(builder, bs, range(0, 16, 2)), _lanes(builder, bs, range(1, 16, 2)))  # 32-element sums
            bp = builder.bitcast(builder.trunc(b32, _vec(_I16, 8)), _vec(_I32, 4))  # pair p: (sum 2p, sum 2p+1) as int16
            msum = None
            for p in range(4):
                spl = builder.bitcast(_lanes(builder, bp, [p] * 8), v16h)
                m = _maddwd(builder, mins[p], spl)
                msum = m if msum is None else builder.add(msum, m)
            dx = _splat_f(builder, builder.load(builder.gep(xd, [b]), align=4))
            out.extend(_block_step(builder, accs[2 * i], accs[2 * i + 1], d, dmin, dx, isums[i], msum))
        return out

    sums = _vec_loop(builder, nb, body, [ir.Constant(v8f, [0.0] * 8)] * (2 * N_TILE))
    finals = [_exact_fsub(builder, sums[2 * i], sums[2 * i + 1]) for i in range(N_TILE)]
    oary = context.make_array(signature.args[7])(context, builder, args[7])
    obase = builder.bitcast(oary.data, ir.PointerType(_I8))
    ostride = builder.extract_value(oary.strides, 0)
    for i, v in enumerate(finals):
        off = builder.add(builder.mul(builder.add(t0, ir.Constant(_I64, i)), ostride), builder.mul(r0, ir.Constant(_I64, 4)))
        builder.store(v, builder.bitcast(builder.gep(obase, [off]), ir.PointerType(v8f)), align=4)
    return context.get_dummy_value()


@intrinsic
def tile_q4_k(typingctx, raw, r0, nb, xq, xd, xs, t0, out):
    """out[t0:t0+4, r0:r0+8] = the q4_K rows r0..r0+7 of raw (n_rows, nb*144) times tokens
    t0..t0+3 of 2-D q8_K activations; each value bit for bit row_dot_q4_k's. The caller
    guarantees the ranges are in bounds."""
    arrs = ((raw, types.uint8), (xq, types.int8), (xd, types.float32), (xs, types.int32), (out, types.float32))
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == dt and a.layout == "C" for a, dt in arrs):
        return None
    if not all(isinstance(v, types.Integer) for v in (r0, nb, t0)):
        return None
    return types.none(raw, r0, nb, xq, xd, xs, t0, out), _q4k_tile


def _q4k_rows8(context, builder, signature, args):
    """Rows r0..r0+7 of raw (q4_K) times one q8_K activation -> 8 float32.

    Each row's block sums are computed as in `row_dot_q4_k` (8 lanes of partial int32 sums), then
    `_reduce8` puts row r's exact block sums in lane r and `_block_step` runs on the 8 rows at once:
    the arithmetic of `tile_q4_k`, bit for bit, with one reduction per 8 rows instead of per row.
    """
    v8f, v8i = _vec(ir.FloatType(), 8), _vec(_I32, 8)
    raw = context.make_array(signature.args[0])(context, builder, args[0])
    r0, nb = args[1], args[2]
    base = builder.bitcast(raw.data, ir.PointerType(_I8))
    rstride = builder.extract_value(raw.strides, 0)
    rowps = [builder.gep(base, [builder.mul(builder.add(r0, ir.Constant(_I64, r)), rstride)]) for r in range(TILE_ROWS)]
    z = ir.Constant(_I64, 0)
    xq, xd, xs = (_ptr(context, builder, signature.args[k], args[k], z, ty) for k, ty in ((3, _I8), (4, ir.FloatType()), (5, _I32)))

    def body(b, accs):
        boff = builder.mul(b, ir.Constant(_I64, 144))
        xp = builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))), ir.PointerType(_vec(_I8, 32)))
        bs = builder.load(builder.bitcast(builder.gep(xs, [builder.mul(b, ir.Constant(_I64, 16))]), ir.PointerType(_vec(_I32, 16))), align=4)
        b32 = builder.add(_lanes(builder, bs, range(0, 16, 2)), _lanes(builder, bs, range(1, 16, 2)))  # 32-element sums
        isums, msums, ds, dmins = [], [], [], []
        blks = [builder.gep(p, [boff]) for p in rowps]
        _prefetch_next_rows(builder, blks, rstride)
        for blk in blks:
            d, dmin, sc, mn = _kquant45_head(builder, blk)
            qp = builder.bitcast(_gep8(builder, blk, 16), ir.PointerType(_vec(_I8, 32)))
            isums.append(_nibbles_core(builder, qp, [xp], sc, None)[0])
            msums.append(builder.mul(mn, b32))
            ds.append(d)
            dmins.append(dmin)
        dv, dmv = ir.Constant(v8f, None), ir.Constant(v8f, None)
        for r in range(TILE_ROWS):
            dv = builder.insert_element(dv, ds[r], ir.Constant(_I32, r))
            dmv = builder.insert_element(dmv, dmins[r], ir.Constant(_I32, r))
        dx = _splat_f(builder, builder.load(builder.gep(xd, [b]), align=4))
        return list(_block_step(builder, accs[0], accs[1], dv, dmv, dx, _reduce8(builder, isums), _reduce8(builder, msums)))

    acc = _exact_fsub(builder, *_vec_loop(builder, nb, body, [ir.Constant(v8f, [0.0] * 8)] * 2))
    return context.make_tuple(builder, signature.return_type, [builder.extract_element(acc, ir.Constant(_I32, r)) for r in range(TILE_ROWS)])


@intrinsic
def rows8_dot_q4_k(typingctx, raw, r0, nb, xq, xd, xs):
    """The q4_K rows r0..r0+7 of raw (n_rows, nb*144) times one q8_K activation (1-D xq, xd, xs)
    -> 8 float32, each bit for bit row_dot_q4_k's (and tile_q4_k's). The caller guarantees the
    rows exist."""
    if not (isinstance(raw, types.Array) and raw.ndim == 2 and raw.dtype == types.uint8 and raw.layout == "C"):
        return None
    if not (isinstance(r0, types.Integer) and isinstance(nb, types.Integer)):
        return None
    if not all(_is_arr(a, dt) for a, dt in ((xq, types.int8), (xd, types.float32), (xs, types.int32))):
        return None
    return types.UniTuple(types.float32, TILE_ROWS)(raw, r0, nb, xq, xd, xs), _q4k_rows8
