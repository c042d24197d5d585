"""Attention scores of a block of keys, keys d-major: the intrinsics `scores16xR` (16 keys, R query
rows) and `scores32xR` (32 keys).

Why: with keys row-major, a score is a 64-long dot product and each one ends in a horizontal
sum (about 40% of the instructions of a prompt's attention, which at depth 8192 is most of the
prompt's time). With the keys stored d-major (kt[kvh, d, slot], as the values already are), the
scores of 16 consecutive slots are one vector: for d = 0..D-1, acc = fma(q[d], kt[d, slot:slot+16],
acc), no horizontal step, each converted key element used by every query head of the call (up to
8). A call keeps R x (keys / 16) chains of multiply-adds in flight: with fewer than 8, each waits on
the latency of its previous step (`scores16x8` for groups of 5-8 heads, `scores32x4`: 32 keys for
groups of 2-4).

Order: each lane (key) is a chain of fused multiply-adds over d = 0, 1, ..., D-1 from 0, then one
multiplication by `scale`, written as explicit LLVM vector operations. So a score's bits depend on
neither the vector width of the ISA nor how many tokens or keys are computed together: a decoded
token and the same token inside a prompt batch get the same scores on every ISA.

Arguments (all checked at compile time for their types): kt (Hkv, D, ring) uint16 (f16 bits) or
float32, C-contiguous; kvh, slot int64 (slots slot..slot+15, or +31, are read); q (R', D) float32
rows, r0 int64 the first of the R rows used; scale float32; out (R', N) float32, j int64: out[r0 + i,
j:j+16] (or j+32) receives the scores of query row r0 + i.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._x86 import _loop, _vec
from ._x86_gemm import _c64, _fma, _splat_scalar

LANES = 16  # keys per block


def _row_ptr(context, builder, aty, aval, i, j=None):
    """float/element pointer to aval[i] (2-D) or aval[i, j] (j given, 2-D), i8*-based with the strides."""
    ary = context.make_array(aty)(context, builder, aval)
    base = builder.bitcast(ary.data, ir.PointerType(ir.IntType(8)))
    off = builder.mul(i, builder.extract_value(ary.strides, 0))
    if j is not None:
        off = builder.add(off, builder.mul(j, builder.extract_value(ary.strides, 1)))
    return builder.gep(base, [off])


def _codegen(n_rows, n_blocks=1):
    def codegen(context, builder, sig, args):
        kt_ty, _, _, q_ty, _, _, out_ty, _ = sig.args
        kt, kvh, slot, q, r0, scale, out, j = args
        half = kt_ty.dtype == types.uint16
        ary = context.make_array(kt_ty)(context, builder, kt)
        strides = [builder.extract_value(ary.strides, i) for i in range(3)]
        head_dim = builder.extract_value(ary.shape, 1)
        base = builder.gep(builder.bitcast(ary.data, ir.PointerType(ir.IntType(8))),
                           [builder.add(builder.mul(kvh, strides[0]), builder.mul(slot, strides[2]))])
        elem = ir.HalfType() if half else ir.FloatType()
        vf = _vec(ir.FloatType(), LANES)
        qrows = [builder.bitcast(_row_ptr(context, builder, q_ty, q, builder.add(r0, _c64(i))), ir.PointerType(ir.FloatType()))
                 for i in range(n_rows)]

        def step(d, accs):
            p = builder.bitcast(builder.gep(base, [builder.mul(d, strides[1])]), ir.PointerType(_vec(elem, LANES)))
            keys = []
            for b in range(n_blocks):
                x = builder.load(builder.gep(p, [ir.Constant(ir.IntType(32), b)]), align=2 if half else 4)
                keys.append(builder.fpext(x, vf) if half else x)
            new = []
            for i in range(n_rows):
                qd = _splat_scalar(builder, builder.load(builder.gep(qrows[i], [d]), align=4), LANES)
                new += [_fma(builder, qd, keys[b], accs[i * n_blocks + b]) for b in range(n_blocks)]
            return new

        accs = _loop(builder, _c64(0), head_dim, step, [ir.Constant(vf, [0.0] * LANES)] * (n_rows * n_blocks))
        s = _splat_scalar(builder, scale, LANES)
        for i in range(n_rows):
            for b in range(n_blocks):
                y = builder.fmul(accs[i * n_blocks + b], s, flags=("arcp",))  # (a flag of its own: Numba adds no fast-math ones)
                p = _row_ptr(context, builder, out_ty, out, builder.add(r0, _c64(i)), builder.add(j, _c64(LANES * b)))
                builder.store(y, builder.bitcast(p, ir.PointerType(vf)), align=4)
        return context.get_dummy_value()

    return codegen


def _typer(n_rows, n_blocks=1):
    def typer(typingctx, kt, kvh, slot, q, r0, scale, out, j):
        ok = (isinstance(kt, types.Array) and kt.ndim == 3 and kt.dtype in (types.uint16, types.float32)
              and isinstance(q, types.Array) and q.ndim == 2 and q.dtype == types.float32
              and isinstance(out, types.Array) and out.ndim == 2 and out.dtype == types.float32)
        if not ok:
            return None
        return types.void(kt, kvh, slot, q, r0, scale, out, j), _codegen(n_rows, n_blocks)

    return typer


def _named(fn, name):
    fn.__name__ = fn.__qualname__ = name
    return fn


scores16x1 = intrinsic(_named(_typer(1), "scores16x1"))
scores16x4 = intrinsic(_named(_typer(4), "scores16x4"))
scores16x8 = intrinsic(_named(_typer(8), "scores16x8"))
scores32x4 = intrinsic(_named(_typer(4, 2), "scores32x4"))  # 4 rows x 2 blocks: 8 chains
