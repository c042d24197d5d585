"""x86 intrinsics of the i-quants' int8 dot products (iq4_nl, iq4_xs), as ggml's AVX2 vec_dot.

Both types hold 4-bit indices into the 16 values `kvalues_iq4nl` (`qllama.dequant.iq_grids`), looked up
32 at a time with `vpshufb` (the table in both 128-bit lanes). As ggml (`mul_add_epi8`): the
products of the signed values q and activations x are `pmaddubsw(|q|, sign(x, q))` (pair sums at
most 2 * 127 * 127: no saturation), lanes of 4 products each summed exactly in int32:

- iq4_nl x q8_0 (`ggml_vec_dot_iq4_nl_q8_0`): block b's 8 int32 lane sums, times d_b * dx_b in
  one fma into accumulator b % 2 (two of them, 8 floats each); the row's value is the horizontal
  sum of their sum. ggml's scalar tail for an odd block count is the caller's (`iquants.py`).
- iq4_xs x q8_K (`ggml_vec_dot_iq4_xs_q8_K`): per super-block, sum over its 8 sub-blocks of
  (6-bit scale - 32) * the pair sums (`pmaddwd`, or `vpdpwssd` on a VNNI ISA: the same int32
  lanes), then one fma of d * dx into one accumulator; the horizontal sum at the end.

Every ISA runs these 256-bit shapes (integer lanes exact, float steps the same instructions), so
every ISA gives the same bits; on a 512-bit ISA iq4_nl (and MXFP4) take two blocks per vector,
ggml's two accumulators side by side in one (`_row_pairs_zmm`), lane for lane the same steps. Signatures follow `_x86._row_sig`: one token (1-D activations) ->
float32, or 2-D activations and a first token -> `N_TILE` float32s (weights unpacked once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..dequant.iq_grids import KSIGNS_IQ2XS, KVALUES_IQ4NL, grid
from ._x86 import (
    _I8,
    _I16,
    _I32,
    _I64,
    _call,
    _dot4,
    _gep8,
    _hsum,
    _prefetch_block,
    _is_arr,
    _lanes,
    _loop,
    _madd_add,
    _maddubs,
    _pack,
    _psign,
    _ptr,
    _row_ptrs,
    _row_sig,
    _splat,
    _vec,
    ZMM,
    _exact,
    _fma,
    _hsum8,
)

_V8F = ir.VectorType(ir.FloatType(), 8)
_G3S32 = np.ascontiguousarray(grid(21)).view(np.uint32).reshape(-1)  # iq3_s: (512,) 4 values an entry
_G2XXS64 = np.ascontiguousarray(grid(16)).view(np.uint64).reshape(-1)  # iq2_xxs: (256,) 8 values an entry
_G3XXS32 = np.ascontiguousarray(grid(18)).view(np.uint32).reshape(-1)  # iq3_xxs: (256,) 4 values an entry
_G2S64 = np.ascontiguousarray(grid(22)).view(np.uint64).reshape(-1)  # iq2_s: (1024,) 8 values an entry
# ksigns_iq2xs as sign masks: (128,) int64, byte e = -1 where bit e of ksigns[i] is set (one load a group of 8,
# as ggml's keven_signs_q2xs, instead of a byte looked up, spread and tested)
_KSIGN_MASKS64 = (np.unpackbits(np.asarray(KSIGNS_IQ2XS, np.uint8)[:, None], axis=1, bitorder="little") * 255).astype(
    np.uint8).view(np.int64).reshape(-1)


def _fma8(builder, a, b, c):
    """a * b + c on <8 x float>, rounded once (`vfmadd`, as ggml's `_mm256_fmadd_ps`)."""
    fn = builder.module.declare_intrinsic("llvm.fma.v8f32", fnty=ir.FunctionType(_V8F, [_V8F] * 3))
    return builder.call(fn, [a, b, c])


def _splat8(builder, v):
    """<8 x float> with the float v in every lane."""
    z = ir.Constant(_V8F, None)
    return builder.shuffle_vector(builder.insert_element(z, v, ir.Constant(_I32, 0)), z, ir.Constant(_vec(_I32, 8), [0] * 8))


def _load_f16(builder, p):
    h = builder.load(builder.bitcast(p, ir.PointerType(ir.HalfType())), align=1)
    return builder.fpext(h, ir.FloatType())


def _lookup16(builder, table, idx):
    """<32 x i8> table[idx] for 16 int8 table values and <32 x i8> indices 0..15 (`vpshufb`)."""
    return _call(builder, "llvm.x86.avx2.pshuf.b", _vec(_I8, 32), [ir.Constant(_vec(_I8, 32), [int(k) for k in table] * 2), idx])


def nibble_lookup(builder, p, table):
    """<32 x i8> the values of the 32 elements of the 16 packed bytes at i8* p: the low nibbles
    (elements 0-15), then the high ones (16-31), each looked up in the 16 int8s `table` (`vpshufb`)."""
    v = builder.load(builder.bitcast(p, ir.PointerType(_vec(_I8, 16))), align=1)
    lo, hi = builder.and_(v, _splat(_I8, 16, 15)), builder.lshr(v, _splat(_I8, 16, 4))
    return _lookup16(builder, table, builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32)))))


def nibble_lookup_abs(builder, p, table):
    """(<32 x i8> q, <32 x i8> |q|): `nibble_lookup`'s values and their magnitudes, each one `vpshufb`
    (|q| from the table of magnitudes, not `vpsignb`: on 256-bit vectors the shuffle port has room
    where the multiply ports have none). The 16 bytes are loaded into both 128-bit halves and
    the high half shifted right by 4 (`vbroadcasti128`, `vpsrlvw`), not inserted."""
    v = builder.load(builder.bitcast(p, ir.PointerType(_vec(_I8, 16))), align=1)
    both = builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, 32), list(range(16)) * 2))
    shifted = builder.lshr(builder.bitcast(both, _vec(_I16, 16)), ir.Constant(_vec(_I16, 16), [0] * 8 + [4] * 8))
    idx = builder.and_(builder.bitcast(shifted, _vec(_I8, 32)), _splat(_I8, 32, 15))
    return _lookup16(builder, table, idx), _lookup16(builder, [abs(int(k)) for k in table], idx)


def _iq4_values(builder, p):
    """<32 x i8> signed kvalues_iq4nl of the 32 elements packed at i8* p."""
    return nibble_lookup(builder, p, KVALUES_IQ4NL)


class Pairs(NamedTuple):
    """A 32-element type whose row kernel takes blocks in pairs (ggml's two accumulators): iq4_nl, mxfp4."""

    block_bytes: int
    qs: int  # offset of the 16 packed bytes in a block
    scale: Callable  # (builder, i8* block) -> its float32 scale
    table: np.ndarray  # (16,) int8: the values the 4-bit codes index
    f16_scale: bool = False  # the scale is the fp16 at the block's start (`_row_pairs_zmm` converts two at once)

    def values(self, builder, p):
        """<32 x i8> the signed values of the 32 elements packed at i8* p."""
        return nibble_lookup(builder, p, self.table)


IQ4_NL_PAIRS = Pairs(18, 2, lambda builder, blk: _load_f16(builder, blk), KVALUES_IQ4NL, f16_scale=True)


def _row_pairs(context, builder, signature, args, kind):
    """Row(s) of nb blocks (nb even: the caller adds ggml's tail block) times q8_0 activation(s):
    block b's 8 lane sums times dx_b * d_b (rounded once) added with one fma into accumulator b % 2."""
    rowp, toks = _row_ptrs(context, builder, signature, args)
    pairs = builder.ashr(args[1], ir.Constant(_I64, 1))
    if ZMM:
        return _pack(context, builder, signature, _row_pairs_zmm(builder, rowp, toks, pairs, kind))
    n = len(toks)
    v32 = ir.PointerType(_vec(_I8, 32))

    def body(i, accs):  # accs: per token accumulator 1 (even blocks), then per token accumulator 2 (odd)
        out = list(accs)
        for h in range(2):
            b = builder.add(builder.shl(i, ir.Constant(_I64, 1)), ir.Constant(_I64, h))
            blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, kind.block_bytes)))
            _prefetch_block(builder, blk, 1)  # (blocks of 17-18 bytes: one line ahead per block covers every line)
            d = kind.scale(builder, blk)
            q, aq = nibble_lookup_abs(builder, _gep8(builder, blk, kind.qs), kind.table)  # q, |q|
            for t, (xq, xd, _) in enumerate(toks):
                x = builder.load(builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 32))), v32), align=1)
                isum = _dot4(builder, aq, _psign(builder, x, q))  # (8,) i32: 4 products per lane
                db = builder.fmul(builder.load(builder.gep(xd, [b]), align=4), d)  # dx * d, as ggml
                out[h * n + t] = _fma8(builder, _splat8(builder, db), builder.sitofp(isum, _V8F), accs[h * n + t])
        return out

    zero = ir.Constant(_V8F, [0.0] * 8)
    accs = _loop(builder, ir.Constant(_I64, 0), pairs, body, [zero] * (2 * n))
    sums = [_hsum8(builder, builder.fadd(accs[t], accs[n + t])) for t in range(n)]
    return _pack(context, builder, signature, sums)


def _row_pairs_zmm(builder, rowp, toks, pairs, kind):
    """`_row_pairs` on a 512-bit ISA: a pair of blocks per vector, block 2i in lanes 0-7 and 2i+1
    in lanes 8-15, so one 16-lane accumulator per token holds ggml's two (lanes 0-7 its
    accumulator of even blocks, 8-15 of odd ones). Lane for lane the same integer sums and float
    steps as the 256-bit form (dx * d rounded, one fma), so the same bits; the final sum as
    ggml's: the two accumulators added, then `_hsum8`'s order. Why: half the instructions per
    block (one 64-byte `vpdpbusd`, convert, multiply and fma per pair, not two of each)."""
    v64 = _vec(_I8, 64)
    v16f = _vec(ir.FloatType(), 16)
    bsz = kind.block_bytes
    # the tables' negative values are codes 0-7 (iq4_nl) or 8-15 (mxfp4, whose 8 is -0: |q| = 0 there)
    low_negative = "<" if int(kind.table[0]) < 0 else ">="
    masked = [(c < 8) == (low_negative == "<") for c in range(16)]  # the codes whose x the kernel negates
    assert all((k < 0 and m) or (k > 0 and not m) or k == 0 for m, k in zip(masked, map(int, kind.table))), kind.table

    def body(i, accs):
        b = builder.shl(i, ir.Constant(_I64, 1))
        blk0 = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, bsz)))
        blk1 = _gep8(builder, blk0, bsz)
        _prefetch_block(builder, blk0, 1)  # (pairs of 34-36 bytes: one line ahead per pair covers every line)
        # the pair's 2 * bsz bytes as two overlapping 32-byte loads (lo: bytes 0-31, hi: the last 32),
        # then its 16 packed bytes of each block, each in two 128-bit lanes (low nibbles, then high:
        # a block's elements 0-15, 16-31), indices looked up in both tables (`vpshufb` per 128 bits)
        v32 = ir.PointerType(_vec(_I8, 32))
        lo = builder.load(builder.bitcast(blk0, v32), align=1)
        hi = builder.load(builder.bitcast(_gep8(builder, blk0, 2 * bsz - 32), v32), align=1)
        q1 = 32 + kind.qs + 32 - bsz  # block 2i+1's packed bytes in hi, as an index into (lo, hi)
        both = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 64), list(range(kind.qs, kind.qs + 16)) * 2
                                                          + list(range(q1, q1 + 16)) * 2))
        shifted = builder.lshr(builder.bitcast(both, _vec(_I16, 32)), ir.Constant(_vec(_I16, 32), ([0] * 8 + [4] * 8) * 2))
        idx = builder.and_(builder.bitcast(shifted, v64), _splat(_I8, 64, 15))
        aq = _call(builder, "llvm.x86.avx512.pshuf.b.512", v64, [ir.Constant(v64, [abs(int(k)) for k in kind.table] * 4), idx])
        negative = builder.icmp_unsigned(low_negative, idx, _splat(_I8, 64, 8))  # q < 0 (one compare, no second lookup)
        if kind.f16_scale:  # [d_2i x 8 | d_2i+1 x 8]: their fp16 bytes from lo, one vcvtph2ps
            h = builder.shuffle_vector(lo, lo, ir.Constant(_vec(_I32, 32), [0, 1] * 8 + [bsz, bsz + 1] * 8))
            d = builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), 16)), v16f)
        else:
            d = builder.insert_element(ir.Constant(v16f, None), kind.scale(builder, blk0), ir.Constant(_I32, 0))
            d = builder.insert_element(d, kind.scale(builder, blk1), ir.Constant(_I32, 8))
            d = _lanes(builder, d, [0] * 8 + [8] * 8)
        out = []
        for (xq, xd, _), acc in zip(toks, accs):
            x = builder.load(builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 32))), ir.PointerType(v64)), align=1)
            x = builder.select(negative, builder.sub(ir.Constant(v64, [0] * 64), x), x)  # sign(x, q) (where q = 0, |q| = 0)
            isum = _dot4(builder, aq, x)  # (16,) i32: 4 products per lane
            dx = builder.load(builder.bitcast(builder.gep(xd, [b]), ir.PointerType(_vec(ir.FloatType(), 2))), align=4)
            dx = builder.shuffle_vector(dx, dx, ir.Constant(_vec(_I32, 16), [0] * 8 + [1] * 8))
            db = _exact("fmul", builder, dx, d)  # dx * d, as ggml
            out.append(_fma(builder, db, builder.sitofp(isum, v16f), acc))
        return out

    zero = ir.Constant(v16f, [0.0] * 16)
    accs = _loop(builder, ir.Constant(_I64, 0), pairs, body, [zero] * len(toks))
    return [_hsum8(builder, _exact("fadd", builder, _lanes(builder, acc, range(8)), _lanes(builder, acc, range(8, 16))))
            for acc in accs]


def row_intrinsics(codegen, name: str, what: str):
    """(row_dot_<name>, row_dot4_<name>): codegen(context, builder, signature, args) for one token
    (1-D activations) -> float32, and for tokens t0..t0+3 of 2-D ones -> 4 float32, each bit for
    bit the one-token value (`_x86._row_sig`). what: the rows and activations, for the docstring."""

    def one(typingctx, row, nb, xq, xd, xs):
        sig = _row_sig(row, nb, xq, xd, xs)
        return (sig, codegen) if sig else None

    def four(typingctx, row, nb, xq, xd, xs, t0):
        sig = _row_sig(row, nb, xq, xd, xs, t0)
        return (sig, codegen) if sig else None

    for fn, n in ((one, ""), (four, "4")):
        fn.__name__ = fn.__qualname__ = f"row_dot{n}_{name}"
        fn.__doc__ = f"{what} -> float32" + (" (tokens t0..t0+3 of 2-D activations: 4 of them)" if n else "")
    return intrinsic(one), intrinsic(four)


def tail_intrinsic(kind: Pairs, name: str):
    """tail_<name>: ggml's scalar tail of a row of nb (odd) blocks, y + (dx * d) * sumi of block
    nb - 1 with one rounding (`sumf += d * (sumi1 + sumi2)` compiled with FMA) -> float32. One
    token (1-D xq, xd)."""

    def tail(typingctx, row, nb, xq, xd, y):
        if not (_is_arr(row, types.uint8) and _is_arr(xq, types.int8) and _is_arr(xd, types.float32) and y == types.float32):
            return None

        def codegen(context, builder, signature, args):
            b = builder.sub(args[1], ir.Constant(_I64, 1))
            blk = _gep8(builder, _ptr(context, builder, signature.args[0], args[0], ir.Constant(_I64, 0), _I8),
                        builder.mul(b, ir.Constant(_I64, kind.block_bytes)))
            xp = _ptr(context, builder, signature.args[2], args[2], builder.mul(b, ir.Constant(_I64, 32)), _vec(_I8, 32))
            q = kind.values(builder, _gep8(builder, blk, kind.qs))
            isum = _hsum(builder, _dot4(builder, _psign(builder, q, q), _psign(builder, builder.load(xp, align=1), q)))
            dx = builder.load(_ptr(context, builder, signature.args[3], args[3], b, ir.FloatType()), align=4)
            f = ir.FloatType()
            fn = builder.module.declare_intrinsic("llvm.fma.f32", fnty=ir.FunctionType(f, [f] * 3))
            return builder.call(fn, [builder.fmul(dx, kind.scale(builder, blk)), builder.sitofp(isum, f), args[4]])

        return types.float32(row, nb, xq, xd, y), codegen

    tail.__name__ = tail.__qualname__ = f"tail_{name}"
    tail.__doc__ = tail_intrinsic.__doc__.replace("tail_<name>", f"tail_{name}")
    return intrinsic(tail)


def _xs_scales(builder, blk):
    """<8 x i16> the 8 sub-block scales (6 bits - 32) of the iq4_xs block at i8* blk."""
    sh = builder.zext(builder.load(builder.bitcast(_gep8(builder, blk, 2), ir.PointerType(_I16)), align=1), _I32)
    sl = builder.load(builder.bitcast(_gep8(builder, blk, 4), ir.PointerType(_vec(_I8, 4))), align=1)
    lo = builder.zext(_lanes(builder, sl, [j // 2 for j in range(8)]), _vec(_I32, 8))
    lo = builder.and_(builder.lshr(lo, ir.Constant(_vec(_I32, 8), [4 * (j & 1) for j in range(8)])), _splat(_I32, 8, 15))
    shv = _lanes(builder, builder.insert_element(ir.Constant(_vec(_I32, 1), None), sh, ir.Constant(_I32, 0)), [0] * 8)
    hi = builder.and_(builder.lshr(shv, ir.Constant(_vec(_I32, 8), [2 * j for j in range(8)])), _splat(_I32, 8, 3))
    ls = builder.sub(builder.or_(lo, builder.shl(hi, _splat(_I32, 8, 4))), _splat(_I32, 8, 32))
    return builder.trunc(ls, _vec(_I16, 8))


def _row_iq4_xs(context, builder, signature, args):
    """iq4_xs row(s) of nb super-blocks times q8_K activation(s)."""
    rowp, toks = _row_ptrs(context, builder, signature, args)
    v32 = ir.PointerType(_vec(_I8, 32))

    def body(b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, 136)))
        _prefetch_block(builder, blk, 136)
        d = _load_f16(builder, blk)
        ls = _xs_scales(builder, blk)
        xps = [builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))), v32) for xq, _, _ in toks]
        isums = [ir.Constant(_vec(_I32, 8), [0] * 8)] * len(toks)
        for j in range(8):
            q, aq = nibble_lookup_abs(builder, _gep8(builder, blk, 8 + 16 * j), KVALUES_IQ4NL)
            s = _lanes(builder, ls, [j] * 16)
            for t, xp in enumerate(xps):
                x = builder.load(builder.gep(xp, [ir.Constant(_I32, j)]), align=1)
                isums[t] = _madd_add(builder, isums[t], _maddubs(builder, aq, _psign(builder, x, q)), s)
        out = []
        for acc, isum, (_, xd, _) in zip(accs, isums, toks):
            db = builder.fmul(d, builder.load(builder.gep(xd, [b]), align=4))  # d * dx, as ggml
            out.append(_fma8(builder, _splat8(builder, db), builder.sitofp(isum, _V8F), acc))
        return out

    zero = ir.Constant(_V8F, [0.0] * 8)
    accs = _loop(builder, ir.Constant(_I64, 0), args[1], body, [zero] * len(toks))
    return _pack(context, builder, signature, [_hsum8(builder, a) for a in accs])


row_dot_iq4_nl, row_dot4_iq4_nl = row_intrinsics(lambda c, b, sg, a: _row_pairs(c, b, sg, a, IQ4_NL_PAIRS), "iq4_nl",
                                                  "The first nb (even) blocks of an iq4_nl row times q8_0 activations")
row_dot_iq4_xs, row_dot4_iq4_xs = row_intrinsics(_row_iq4_xs, "iq4_xs", "An iq4_xs row (nb super-blocks) times q8_K activations")
tail_iq4_nl = tail_intrinsic(IQ4_NL_PAIRS, "iq4_nl")


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c for float32 scalars, rounded once (as ggml's `_mm256_fmadd_ps` lane, or C's
    `s += d * x` compiled with FMA)."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma.f32", fnty=ir.FunctionType(f, [f] * 3))
        return builder.call(fn, list(args))

    return types.float32(a, b, c), codegen


# -- the grid types (`iquants_grid.py`): a decoded super-block's signs and int8 dot products --


def _arr_ptr(context, builder, aty, aval, elty, off=None):
    return _ptr(context, builder, aty, aval, off if off is not None else ir.Constant(_I64, 0), elty)


@intrinsic
def apply_signs(typingctx, wb, sb):
    """wb (256,) int8 negated where bit e % 8 of sb[e // 8] (sb (32,) uint8) is set, 32 bytes at a
    time: each sign byte spread over its 8 elements, tested against 1 << (e % 8), (w ^ m) - m."""
    if not (_is_arr(wb, types.int8) and _is_arr(sb, types.uint8)):
        return None

    def codegen(context, builder, signature, args):
        wp = _arr_ptr(context, builder, signature.args[0], args[0], _vec(_I8, 32))
        sp = _arr_ptr(context, builder, signature.args[1], args[1], _vec(_I8, 4))
        bit = ir.Constant(_vec(_I8, 32), [1 << (e % 8) for e in range(32)])
        zero = ir.Constant(_vec(_I8, 32), [0] * 32)
        for c in range(8):
            s = _lanes(builder, builder.load(builder.gep(sp, [ir.Constant(_I32, c)]), align=1), [e // 8 for e in range(32)])
            m = builder.sext(builder.icmp_unsigned("!=", builder.and_(s, bit), zero), _vec(_I8, 32))
            p = builder.gep(wp, [ir.Constant(_I32, c)])
            builder.store(builder.sub(builder.xor(builder.load(p, align=1), m), m), p, align=1)
        return context.get_dummy_value()

    return types.none(wb, sb), codegen


@intrinsic
def block_isums(typingctx, wb, sc, x, xo, out):
    """out (8,) int32 = ggml's 8 lane sums of one decoded grid super-block: lane l = sum over the
    32-element chunks c of sc[2c + l // 4] * (the 4 products w . x of elements 32c+4l..32c+4l+3),
    exact (`pmaddubsw(|w|, sign(x, w))`, then `pmaddwd` by the scales). wb (256,) int8 signed
    weights, sc (16,) int32 scales, x int8 activations from element xo."""
    if not (_is_arr(wb, types.int8) and _is_arr(sc, types.int32) and _is_arr(x, types.int8)
            and isinstance(xo, types.Integer) and _is_arr(out, types.int32)):
        return None

    def codegen(context, builder, signature, args):
        sa = signature.args
        wp = _arr_ptr(context, builder, sa[0], args[0], _vec(_I8, 32))
        scv = builder.trunc(builder.load(_arr_ptr(context, builder, sa[1], args[1], _vec(_I32, 16)), align=4), _vec(_I16, 16))
        xp = _arr_ptr(context, builder, sa[2], args[2], _vec(_I8, 32), args[3])
        isum = ir.Constant(_vec(_I32, 8), [0] * 8)
        for c in range(8):
            w = builder.load(builder.gep(wp, [ir.Constant(_I32, c)]), align=1)
            xv = builder.load(builder.gep(xp, [ir.Constant(_I32, c)]), align=1)
            s = _lanes(builder, scv, [2 * c] * 8 + [2 * c + 1] * 8)
            isum = _madd_add(builder, isum, _maddubs(builder, _psign(builder, w, w), _psign(builder, xv, w)), s)
        builder.store(isum, _arr_ptr(context, builder, sa[4], args[4], _vec(_I32, 8)), align=4)
        return context.get_dummy_value()

    return types.none(wb, sc, x, xo, out), codegen


def _table(builder, name, values, elty):
    """A constant global array of the module (made once per module): ggml's grid or sign table."""
    g = builder.module.globals.get(name)
    if g is None:
        ty = ir.ArrayType(elty, len(values))
        g = ir.GlobalVariable(builder.module, ty, name)
        g.linkage, g.global_constant = "internal", True
        g.initializer = ir.Constant(ty, [int(v) for v in values])
    return g


def _at(builder, table, idx):
    return builder.load(builder.gep(table, [ir.Constant(_I32, 0), idx]))


def _u8(builder, blk, off):
    return builder.zext(builder.load(_gep8(builder, blk, off)), _I32)


# iq3_s's 8 grid entries of a chunk by one AVX2 gather where that measured faster than 8 loads: on
# Zen 5 (this CPU name) the prompt pack of an 8192 x 2048 matrix took 3.7-4.1 -> 1.6-1.8 ms; on an
# Intel host AVX2 gathers of these grids were 2x slower than the loads (iq2_xxs's 4 x 64-bit
# entries: no gain on Zen 5 either). The same values either way: a choice of speed, not of bits.
GATHER_IQ3S = llvm_binding.get_host_cpu_name() == "znver5"


def _chunk_iq3_s(builder, blk, c):
    """Chunk c (32 elements) of an iq3_s block: (<32 x i8> grid values, <32 x i8> -1 where negative, its
    scale's 4 bits)."""
    g = _table(builder, "qllama_iq3s_grid", _G3S32, _I32)
    if GATHER_IQ3S:  # the 8 9-bit indices (qs bytes, high bit k of qh) in one vector, one `vpgatherdd`
        v8 = _vec(_I32, 8)
        qs = builder.zext(builder.load(builder.bitcast(_gep8(builder, blk, 2 + 8 * c), ir.PointerType(_vec(_I8, 8))), align=1), v8)
        qh = builder.insert_element(ir.Constant(v8, None), _u8(builder, blk, 66 + c), ir.Constant(_I32, 0))
        qh = builder.shuffle_vector(qh, ir.Constant(v8, None), ir.Constant(v8, [0] * 8))
        idx = builder.or_(qs, builder.shl(builder.and_(builder.lshr(qh, ir.Constant(v8, list(range(8)))), ir.Constant(v8, [1] * 8)),
                                          ir.Constant(v8, [8] * 8)))
        base = builder.bitcast(builder.gep(g, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]), ir.PointerType(_I8))
        fn = builder.module.declare_intrinsic("llvm.x86.avx2.gather.d.d.256",
                                              fnty=ir.FunctionType(v8, [v8, ir.PointerType(_I8), v8, v8, _I8]))
        v = builder.call(fn, [ir.Constant(v8, [0] * 8), base, idx, ir.Constant(v8, [-1] * 8), ir.Constant(_I8, 4)])
    else:
        qh = _u8(builder, blk, 66 + c)
        v = ir.Constant(_vec(_I32, 8), None)
        for k in range(8):  # 9-bit index: qs byte, high bit k of qh
            idx = builder.or_(_u8(builder, blk, 2 + 8 * c + k), builder.shl(builder.and_(builder.lshr(qh, ir.Constant(_I32, k)),
                                                                                    ir.Constant(_I32, 1)), ir.Constant(_I32, 8)))
            v = builder.insert_element(v, _at(builder, g, idx), ir.Constant(_I32, k))
    signs = builder.load(builder.bitcast(_gep8(builder, blk, 74 + 4 * c), ir.PointerType(_I32)), align=1)
    s = builder.and_(builder.lshr(_u8(builder, blk, 106 + c // 2), ir.Constant(_I32, 4 * (c & 1))), ir.Constant(_I32, 15))
    return builder.bitcast(v, _vec(_I8, 32)), sign_mask(builder, signs), s


def _scales_iq3_s(builder, blk):
    """<8 x i32> the 8 chunks' scale bits of an iq3_s block (chunk c: nibble c of bytes 106-109)."""
    v8 = _vec(_I32, 8)
    word = builder.load(builder.bitcast(_gep8(builder, blk, 106), ir.PointerType(_I32)), align=1)
    word = builder.shuffle_vector(builder.insert_element(ir.Constant(v8, None), word, ir.Constant(_I32, 0)),
                                  ir.Constant(v8, None), ir.Constant(v8, [0] * 8))
    return builder.and_(builder.lshr(word, ir.Constant(v8, [4 * c for c in range(8)])), ir.Constant(v8, [15] * 8))


def _scales_iq2_xxs(builder, blk):
    """<8 x i32> the 8 chunks' scale bits of an iq2_xxs block (chunk c: the top 4 bits of the
    uint32 at 6 + 8c)."""
    v8, v16 = _vec(_I32, 8), _vec(_I32, 16)
    words = builder.load(builder.bitcast(_gep8(builder, blk, 2), ir.PointerType(v16)), align=1)
    odd = builder.shuffle_vector(words, ir.Constant(v16, None), ir.Constant(v8, [2 * c + 1 for c in range(8)]))
    return builder.lshr(odd, ir.Constant(v8, [28] * 8))


def _chunk_iq2_xxs(builder, blk, c):
    """Chunk c of an iq2_xxs block: 4 grid rows of 8 (indices: the bytes of the first uint32), their
    sign masks (of ksigns[7 bits of the second uint32 each]), its scale from the top 4 bits."""
    g, ks = _table(builder, "qllama_iq2xxs_grid", _G2XXS64, _I64), _table(builder, "qllama_ksign_masks", _KSIGN_MASKS64, _I64)
    a0 = builder.load(builder.bitcast(_gep8(builder, blk, 2 + 8 * c), ir.PointerType(_I32)), align=1)
    a1 = builder.load(builder.bitcast(_gep8(builder, blk, 6 + 8 * c), ir.PointerType(_I32)), align=1)
    v, masks = ir.Constant(_vec(_I64, 4), None), ir.Constant(_vec(_I64, 4), None)
    for k in range(4):
        idx = builder.and_(builder.lshr(a0, ir.Constant(_I32, 8 * k)), ir.Constant(_I32, 255))
        v = builder.insert_element(v, _at(builder, g, idx), ir.Constant(_I32, k))
        sidx = builder.and_(builder.lshr(a1, ir.Constant(_I32, 7 * k)), ir.Constant(_I32, 127))
        masks = builder.insert_element(masks, _at(builder, ks, sidx), ir.Constant(_I32, k))
    return builder.bitcast(v, _vec(_I8, 32)), builder.bitcast(masks, _vec(_I8, 32)), builder.lshr(a1, ir.Constant(_I32, 28))


def _chunk_iq3_xxs(builder, blk, c):
    """Chunk c of an iq3_xxs block: 8 grid entries of 4 (indices: bytes 2 + 8c ..), their sign masks
    (ksigns[7 bits each of the uint32 at 66 + 4c]), its scale from that uint32's top 4 bits."""
    g, ks = _table(builder, "qllama_iq3xxs_grid", _G3XXS32, _I32), _table(builder, "qllama_ksign_masks", _KSIGN_MASKS64, _I64)
    aux = builder.load(builder.bitcast(_gep8(builder, blk, 66 + 4 * c), ir.PointerType(_I32)), align=1)
    v, masks = ir.Constant(_vec(_I32, 8), None), ir.Constant(_vec(_I64, 4), None)
    for k in range(8):
        v = builder.insert_element(v, _at(builder, g, _u8(builder, blk, 2 + 8 * c + k)), ir.Constant(_I32, k))
    for k in range(4):
        sidx = builder.and_(builder.lshr(aux, ir.Constant(_I32, 7 * k)), ir.Constant(_I32, 127))
        masks = builder.insert_element(masks, _at(builder, ks, sidx), ir.Constant(_I32, k))
    return builder.bitcast(v, _vec(_I8, 32)), builder.bitcast(masks, _vec(_I8, 32)), builder.lshr(aux, ir.Constant(_I32, 28))


def _chunk_iq2_s(builder, blk, c):
    """Chunk c of an iq2_s block: 4 grid entries of 8 (10-bit indices: byte 2 + 4c + k, bits 2k, 2k + 1
    of qh byte 66 + c), the sign bits at 34 + 4c as masks, and the madd operand of its two scales
    (byte 74 + c: the low nibble for elements 0-15, the high one for 16-31, each 2s + 1 in 8 i16 lanes)."""
    g = _table(builder, "qllama_iq2s_grid", _G2S64, _I64)
    qh = _u8(builder, blk, 66 + c)
    v = ir.Constant(_vec(_I64, 4), None)
    for k in range(4):
        idx = builder.or_(_u8(builder, blk, 2 + 4 * c + k),
                          builder.shl(builder.and_(builder.lshr(qh, ir.Constant(_I32, 2 * k)), ir.Constant(_I32, 3)),
                                      ir.Constant(_I32, 8)))
        v = builder.insert_element(v, _at(builder, g, idx), ir.Constant(_I32, k))
    signs = builder.load(builder.bitcast(_gep8(builder, blk, 34 + 4 * c), ir.PointerType(_I32)), align=1)
    sc = _u8(builder, blk, 74 + c)
    lo = builder.trunc(odd_scale(builder, builder.and_(sc, ir.Constant(_I32, 15))), _I16)
    hi = builder.trunc(odd_scale(builder, builder.lshr(sc, ir.Constant(_I32, 4))), _I16)
    pair = builder.insert_element(builder.insert_element(ir.Constant(_vec(_I16, 2), None), lo, ir.Constant(_I32, 0)),
                                  hi, ir.Constant(_I32, 1))
    return builder.bitcast(v, _vec(_I8, 32)), sign_mask(builder, signs), _lanes(builder, pair, [0] * 8 + [1] * 8)


def _scales_iq3_xxs(builder, blk):
    """<8 x i32> the 8 chunks' scale bits of an iq3_xxs block (chunk c: the top 4 bits of the uint32
    at 66 + 4c)."""
    v8 = _vec(_I32, 8)
    words = builder.load(builder.bitcast(_gep8(builder, blk, 66), ir.PointerType(v8)), align=1)
    return builder.lshr(words, ir.Constant(v8, [28] * 8))


# type -> (block bytes, chunk decoder, the row's final factor, the 8 chunks' scale bits of a block):
# ggml's AVX2 vec_dot_iq3_s_q8_K / vec_dot_iq2_xxs_q8_K / vec_dot_iq3_xxs_q8_K / vec_dot_iq2_s_q8_K
# (8 int32 lanes of 2s + 1 times the chunk's pmaddubsw pairs (iq2_s: a scale per 16 elements), fma(d, lanes) per block, the factor times hsum_float_8;
# llama.cpp's prompt kernels take d times the factor)
GRID_ROWS = {21: (110, _chunk_iq3_s, 1.0, _scales_iq3_s), 16: (66, _chunk_iq2_xxs, 0.125, _scales_iq2_xxs),
             18: (98, _chunk_iq3_xxs, 0.25, _scales_iq3_xxs), 22: (82, _chunk_iq2_s, 0.125, None)}


def sign_mask(builder, signs):
    """i32 sign bits (4 little-endian bytes) -> <32 x i8> -1 where bit e is set, else 0. (As a
    mask register where the ISA has them: one kmovd and one vpmovm2b on AVX-512BW.)"""
    return builder.sext(builder.bitcast(signs, _vec(ir.IntType(1), 32)), _vec(_I8, 32))


def odd_scale(builder, s):
    """2 s + 1, the grid types' scale from its stored bits (any integer type or vector)."""
    return builder.add(builder.shl(s, ir.Constant(s.type, 1)), ir.Constant(s.type, 1))


def _row_grid(context, builder, signature, args, type_id):
    """Grid-type row(s) of nb super-blocks times q8_K activation(s), as ggml: per 32-element chunk,
    x signed by the weights' sign bits ((x ^ m) - m), `pmaddubsw(grid, x)`, `pmaddwd` by 2s+1 into
    8 int32 lanes; per super-block one fma of fp16(d) * dx; the row: factor * hsum_float_8."""
    bb, chunk, factor, _ = GRID_ROWS[type_id]
    rowp, toks = _row_ptrs(context, builder, signature, args)
    v32 = ir.PointerType(_vec(_I8, 32))

    def body(b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, bb)))
        _prefetch_block(builder, blk, bb)
        xps = [builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))), v32) for xq, _, _ in toks]
        isums = [ir.Constant(_vec(_I32, 8), [0] * 8)] * len(toks)
        for c in range(8):
            q, m, s = chunk(builder, blk, c)
            if isinstance(s.type, ir.VectorType):  # (iq2_s: a scale per 16 elements, the madd operand already)
                scale = s
            else:
                s16 = builder.trunc(odd_scale(builder, s), _I16)
                scale = _lanes(builder, builder.insert_element(ir.Constant(_vec(_I16, 1), None), s16, ir.Constant(_I32, 0)),
                               [0] * 16)
            for t, xp in enumerate(xps):
                x = builder.load(builder.gep(xp, [ir.Constant(_I32, c)]), align=1)
                isums[t] = _madd_add(builder, isums[t], _maddubs(builder, q, builder.sub(builder.xor(x, m), m)), scale)
        d = _load_f16(builder, blk)
        out = []
        for acc, isum, (_, xd, _) in zip(accs, isums, toks):
            db = builder.fmul(d, builder.load(builder.gep(xd, [b]), align=4))  # fp16(d) * dx, as ggml
            out.append(_fma8(builder, _splat8(builder, db), builder.sitofp(isum, _V8F), acc))
        return out

    zero = ir.Constant(_V8F, [0.0] * 8)
    accs = _loop(builder, ir.Constant(_I64, 0), args[1], body, [zero] * len(toks))
    sums = [_hsum8(builder, a) for a in accs]
    if factor != 1.0:
        sums = [builder.fmul(ir.Constant(ir.FloatType(), factor), v, flags=("arcp",)) for v in sums]
    return _pack(context, builder, signature, sums)


row_dot_iq3_s, row_dot4_iq3_s = row_intrinsics(lambda c, b, sg, a: _row_grid(c, b, sg, a, 21), "iq3_s",
                                                "An iq3_s row (nb super-blocks) times q8_K activations (ggml vec_dot)")
row_dot_iq2_xxs, row_dot4_iq2_xxs = row_intrinsics(lambda c, b, sg, a: _row_grid(c, b, sg, a, 16), "iq2_xxs",
                                                    "An iq2_xxs row (nb super-blocks) times q8_K activations (ggml vec_dot)")
row_dot_iq2_s, row_dot4_iq2_s = row_intrinsics(lambda c, b, sg, a: _row_grid(c, b, sg, a, 22), "iq2_s",
                                                "An iq2_s row (nb super-blocks) times q8_K activations (ggml vec_dot)")
row_dot_iq3_xxs, row_dot4_iq3_xxs = row_intrinsics(lambda c, b, sg, a: _row_grid(c, b, sg, a, 18), "iq3_xxs",
                                                    "An iq3_xxs row (nb super-blocks) times q8_K activations (ggml vec_dot)")
