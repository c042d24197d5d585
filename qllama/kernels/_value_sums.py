"""Attention's weighted sums of the values, values d-major: the intrinsics `value_block{1,2,4}`
and `lane_sum16`.

Why: out[h, d] = sum_j p[h, j] * v[d, j] read as one long dot per (h, d) streams every
probability row once per d: at depth 16384 that is 64 passes over 7 rows of 64 KB, from L2, and
it was half of a prompt's attention time there. Here the keys go in blocks of 64: a block's
probabilities (R rows x 64) are loaded into registers once, then every d adds its 64 products
into a 16-lane accumulator per (d, row) kept in a small scratch (D, R, 16), and each converted
value element serves the R rows.

Order (explicit LLVM vector operations, so the same bits on every ISA and for every batch):
lane l of acc[d, r] is a chain of fused multiply-adds over the keys j = l, l + 16, l + 32, ...
in key order, from 0; `lane_sum16` then adds the 16 lanes as a fixed tree (halves, quarters,
...). Keys past the last one are zero products (zero-padded probabilities and values), which
leave every lane as it was.

Arguments (checked at compile time for their types):
- vrows (D, N) uint16 (f16 bits) or float32, rows C-contiguous; col int64: columns
  col..col+63 are read;
- probs (R', N') float32, C-contiguous; r0 int64: rows r0..r0+R-1; pj int64: columns pj..pj+63;
- acc (D, R', 16) float32, C-contiguous: acc[d, r0 + i, :] += the block's products. (d-major: with
  the rows 4 KB apart, (R', 64, 16), each row's load hit the store of the row before it at the
  same address modulo 4096, and the block ran at half the speed.)
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._scores import _named, _row_ptr
from ._softmax import _hsum
from ._x86 import _loop, _vec
from ._x86_gemm import _c64, _fma

LANES = 16  # keys per vector
BLOCK = 64  # keys per call
_CHUNKS = BLOCK // LANES


def _value_codegen(n_rows):
    def codegen(context, builder, sig, args):
        v_ty, _, p_ty, _, _, acc_ty = sig.args
        vrows, col, probs, r0, pj, acc = args
        half = v_ty.dtype == types.uint16
        elem = ir.HalfType() if half else ir.FloatType()
        vf = _vec(ir.FloatType(), LANES)
        vary = context.make_array(v_ty)(context, builder, vrows)
        head_dim = builder.extract_value(vary.shape, 0)
        vstride = builder.extract_value(vary.strides, 0)
        vbase = builder.gep(builder.bitcast(vary.data, ir.PointerType(ir.IntType(8))),
                            [builder.mul(col, builder.extract_value(vary.strides, 1))])
        aary = context.make_array(acc_ty)(context, builder, acc)
        astr = [builder.extract_value(aary.strides, i) for i in range(2)]
        abase = builder.bitcast(aary.data, ir.PointerType(ir.IntType(8)))
        # the block's probabilities, R x 4 vectors, loaded once for every d
        probs_v = []
        for i in range(n_rows):
            rowp = builder.bitcast(_row_ptr(context, builder, p_ty, probs, builder.add(r0, _c64(i)), pj),
                                   ir.PointerType(vf))
            probs_v.append([builder.load(builder.gep(rowp, [ir.Constant(ir.IntType(32), c)]), align=4)
                            for c in range(_CHUNKS)])

        def step(d, _):
            vp = builder.bitcast(builder.gep(vbase, [builder.mul(d, vstride)]), ir.PointerType(_vec(elem, LANES)))
            vals = []
            for c in range(_CHUNKS):
                x = builder.load(builder.gep(vp, [ir.Constant(ir.IntType(32), c)]), align=2 if half else 4)
                vals.append(builder.fpext(x, vf) if half else x)
            for i in range(n_rows):
                off = builder.add(builder.mul(d, astr[0]), builder.mul(builder.add(r0, _c64(i)), astr[1]))
                ap = builder.bitcast(builder.gep(abase, [off]), ir.PointerType(vf))
                a = builder.load(ap, align=4)
                for c in range(_CHUNKS):
                    a = _fma(builder, probs_v[i][c], vals[c], a)
                builder.store(a, ap, align=4)
            return []

        _loop(builder, _c64(0), head_dim, step, [])
        return context.get_dummy_value()

    return codegen


def _value_typer(n_rows):
    def typer(typingctx, vrows, col, probs, r0, pj, acc):
        ok = (isinstance(vrows, types.Array) and vrows.ndim == 2 and vrows.dtype in (types.uint16, types.float32)
              and vrows.layout == "C"
              and isinstance(probs, types.Array) and probs.ndim == 2 and probs.dtype == types.float32
              and probs.layout == "C"
              and isinstance(acc, types.Array) and acc.ndim == 3 and acc.dtype == types.float32 and acc.layout == "C")
        if not ok:
            return None
        return types.void(vrows, col, probs, r0, pj, acc), _value_codegen(n_rows)

    return typer


value_block4 = intrinsic(_named(_value_typer(4), "value_block4"))
value_block2 = intrinsic(_named(_value_typer(2), "value_block2"))
value_block1 = intrinsic(_named(_value_typer(1), "value_block1"))


@intrinsic
def lane_sum16(typingctx, acc, d, r):
    """float32: acc[d, r, 0:16] summed as a fixed tree: lanes l and l + 8, then l and l + 4, ..."""
    if not (isinstance(acc, types.Array) and acc.ndim == 3 and acc.dtype == types.float32 and acc.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        acc, d, r = args
        aary = context.make_array(sig.args[0])(context, builder, acc)
        off = builder.add(builder.mul(d, builder.extract_value(aary.strides, 0)),
                          builder.mul(r, builder.extract_value(aary.strides, 1)))
        p = builder.bitcast(builder.gep(builder.bitcast(aary.data, ir.PointerType(ir.IntType(8))), [off]),
                            ir.PointerType(_vec(ir.FloatType(), LANES)))
        return _hsum(builder, builder.load(p, align=4))

    return types.float32(acc, d, r), codegen
