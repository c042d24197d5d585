"""x86 mat-mat for batches of the i-quants (iq4_xs, iq4_nl, iq3_s, iq2_xxs; `iquants.matmul_int8`
drives them through `int8.gemm`), on the machinery of `_x86_gemm.py`: TILE_ROWS rows per pass,
rows in the lanes, a pack per group of rows then a tile per token.

Two roundings, both llama.cpp's:

- `pack_<type>` / `tile_<type>`: every row bit for bit the one-token row kernel's (`_x86_iq`),
  which is ggml's vec_dot: decode, steps of several streams, drafts to verify.
- `SUMS | type` (iq4_xs, iq3_s, iq2_xxs, iq3_xxs): a prompt's rows as llama.cpp's own prompt kernels
  round them (below), which is not its vec_dot.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from ..gguf.types import IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, Q4_K, Q5_K, type_name
from ._x86 import (
    _I8,
    _I32,
    _I64,
    VNNI,
    _dot4,
    _exact,
    _fma,
    _gep8,
    _loop,
    _madd_add,
    _maddubs,
    _psign,
    _splat,
    _vec,
)
from ._x86_gemm import (
    _D0,
    _LEGACY_BYTES,
    _V8F,
    _V8I,
    _V16H,
    _V32B,
    CHAINS,
    HALVES,
    SUMS,
    TILE_ROWS,
    _abs,
    _c64,
    _in_half,
    _load,
    _pack_half_legacy,
    _pack_intrinsic,
    _rows_f16,
    _signed_quads,
    _sums_tile_intrinsic,
    _Tile,
    _tile_intrinsic,
    _transpose8,
    scaled_sums,
)
from ._x86_iq import GRID_ROWS, _iq4_values, _xs_scales, odd_scale

# scratch bytes per iq4_xs super-block of 8 rows: d (8 f32), 8 scale vectors (lane r = ls_rj - 32
# as an i16 in both halves), 8 x 8 sign masks (512-bit ISA: sub-block j, quad k: an i32, bit 4r + i
# set where byte i of row r's quad is negative; the two halves' side by side, one kmovq), then
# 64 vectors of transposed kvalues (sub-blocks j, byte quads k; on a 512-bit ISA their absolute values)
_DX4, _SCALESX4, _MASKSX4, _QUANTSX4 = 0, 32, 288, 544
# the i-quants' gemms (`kernels/iquants.py` drives them); iq4_nl's unit is a pair of blocks, each
# laid out as q4_0's (d, 8 quad vectors of signed kvalues); iq3_s and iq2_xxs as iq4_xs (their
# 32-element chunks' scales 2s + 1, the grid values with their signs)
IQ_PACKED_BYTES = {IQ4_XS: 2592 * HALVES, IQ4_NL: 2 * _LEGACY_BYTES * HALVES, IQ3_S: 2592 * HALVES, IQ2_XXS: 2592 * HALVES}



# -- i-quants: iq4_xs and iq4_nl (rows equal to `_x86_iq`'s row kernels bit for bit) --


def _put_signed_quads(builder, rows, put, j):
    """Sub-block j's signed values of 8 rows (rows: 8 x <8 x i32>, 32 int8 each) transposed into its
    8 quad vectors; on a 512-bit ISA as |w| and the sign masks the tile negates x by (`_iq4_xs_block`:
    the sign test and vpabsb paid once here, not per token)."""
    for k, v in enumerate(_transpose8(builder, rows)):
        if HALVES > 1:
            v = builder.bitcast(v, _V32B)
            neg = builder.icmp_signed("<", v, ir.Constant(_V32B, [0] * 32))
            put(builder.bitcast(neg, _I32), builder.add(builder.mul(j, _c64(32)), _c64(_MASKSX4 + 4 * k)), step=4)
            v = _abs(builder, v)
        put(v, builder.add(builder.mul(j, _c64(256)), _c64(_QUANTSX4 + 32 * k)))


def _pack_half_iq4_xs(builder, blks, put):
    put(_rows_f16(builder, blks, 0), _DX4)
    scales = [builder.sext(_xs_scales(builder, p), _V8I) for p in blks]  # row r: its 8 scales - 32
    for j, v in enumerate(_transpose8(builder, scales)):  # sub-block j: lane r = ls_rj in both i16 halves
        put(builder.or_(builder.and_(v, ir.Constant(_V8I, [0xFFFF] * 8)), builder.shl(v, ir.Constant(_V8I, [16] * 8))),
            _SCALESX4 + 32 * j)

    def sub_block(j, _):
        rows = [builder.bitcast(_iq4_values(builder, _gep8(builder, p, builder.add(builder.mul(j, _c64(16)), _c64(8)))), _V8I)
                for p in blks]
        _put_signed_quads(builder, rows, put, j)
        return []

    _loop(builder, _c64(0), _c64(8), sub_block, [])


def _pack_half_iq4_nl(builder, blks, put):
    for h in range(2):  # the pair's even block, then its odd one, each as q4_0's layout
        _pack_half_legacy(builder, [_gep8(builder, p, 18 * h) for p in blks], lambda v, off, h=h: put(v, _LEGACY_BYTES * h + off), "iq4_nl")


def _pack_half_grid(builder, blks, put, type_id):
    """iq3_s / iq2_xxs as iq4_xs's layout, the quads always signed, and in the masks' place the
    correction `_iq4_xs_block(grid=True)` subtracts: quad k, lane r = 128 * sum over chunks c of
    (2s + 1)_rc * (the sum of row r's 4 values of quad k in chunk c)."""
    _, chunk, _, block_scales = GRID_ROWS[type_id]
    put(_rows_f16(builder, blks, 0), _DX4)
    corr = [ir.Constant(_V8I, [0] * 8)] * 8
    by_chunk = _transpose8(builder, [odd_scale(builder, block_scales(builder, p)) for p in blks])  # chunk c: lane r
    for c in range(8):  # 32-element chunk c of each row: grid values signed, its scale
        rows = []
        for p in blks:
            q, m, _ = chunk(builder, p, c)  # (m: -1 where negative)
            rows.append(builder.bitcast(builder.sub(builder.xor(q, m), m), _V8I))
        pair = builder.or_(by_chunk[c], builder.shl(by_chunk[c], ir.Constant(_V8I, [16] * 8)))
        put(pair, _SCALESX4 + 32 * c)
        for k, v in enumerate(_transpose8(builder, rows)):
            put(v, _QUANTSX4 + 256 * c + 32 * k)  # lane r += (2s+1) * row r's 4 values' sum (pmaddubsw by ones, pmaddwd)
            corr[k] = _madd_add(builder, corr[k], _maddubs(builder, _splat(_I8, 32, 1), builder.bitcast(v, _V32B)),
                                builder.bitcast(pair, _V16H))
    for k in range(8):
        put(builder.shl(corr[k], ir.Constant(_V8I, [7] * 8)), _MASKSX4 + 32 * k)


def _iq4_xs_block(tile, b, accs, grid=False):
    """iq4_xs (and iq3_s, iq2_xxs, packed alike): per super-block acc_l = fma(d*dx, isum_l, acc_l),
    isum_l = sum over the 8 sub-blocks of their scale * (4 products |q| . sign(x, q)), exact in
    int32, as `_x86_iq._row_iq4_xs` (`_row_grid`). The grid types (|q| <= 43) as
    `pmaddubsw(x + 128, q)` instead (pair sums at most 2 * 255 * 43: no saturation; x + 128 made
    once per super-block and token), less the pack's correction: the same exact isum_l with no
    sign step per product."""
    builder = tile.b
    vi = _vec(_I32, TILE_ROWS)
    src = tile.src(b, IQ_PACKED_BYTES[IQ4_XS])  # (= iq3_s's, iq2_xxs's)
    xq_off = builder.mul(b, _c64(256))
    if grid:  # the super-block's x + 128 (x ^ 0x80) in a stack buffer the products broadcast from
        n = 4 * TILE_ROWS
        xu = cgutils.alloca_once(builder, ir.ArrayType(_vec(_I8, n), 256 // n))
        for i in range(256 // n):
            v = _load(builder, _vec(_I8, n), tile.xq, builder.add(xq_off, _c64(n * i)))
            builder.store(builder.xor(v, _splat(_I8, n, -128)), builder.gep(xu, [ir.Constant(_I32, 0), ir.Constant(_I32, i)]))
        tile, xq_off = _Tile(builder, tile.pbase, builder.bitcast(xu, ir.PointerType(_I8)), tile.xd, tile.xs), _c64(0)

    def sub_block(j, isums):
        scale = tile.load(_V16H, src, builder.add(builder.mul(j, _c64(32)), _c64(_SCALESX4)))
        wj = builder.add(builder.mul(j, _c64(256)), _c64(_QUANTSX4))
        mj = _in_half(builder, builder.add(builder.mul(j, _c64(32)), _c64(_MASKSX4)))

        def neg(k):  # quad k's sign masks, rows 0-15: one kmovq
            return builder.bitcast(_load(builder, _I64, src, builder.add(mj, _c64(8 * k))), _vec(ir.IntType(1), 64))

        return tile.dot_quads(isums, lambda k: tile.load(_V32B, src, builder.add(wj, _c64(32 * k))),
                              builder.add(xq_off, builder.mul(j, _c64(32))), lambda k: scale, signed=not grid,
                              neg_at=neg if HALVES > 1 and not grid else None, x_unsigned=grid)

    isums = _loop(builder, _c64(0), _c64(8), sub_block, [ir.Constant(vi, [0] * TILE_ROWS)] * 8)
    if grid:
        isums = [builder.sub(isum, tile.load(_V8I, src, _MASKSX4 + 32 * k)) for k, isum in enumerate(isums)]
    db = _exact("fmul", builder, tile.load(_V8F, src, _DX4), tile.dx(b))
    return [_fma(builder, db, builder.sitofp(isum, _vec(ir.FloatType(), TILE_ROWS)), acc) for isum, acc in zip(isums, accs)]


def _iq4_nl_pair(tile, pair, accs):
    """iq4_nl: blocks 2p (accumulators 0-7) and 2p+1 (8-15), each acc_l = fma(d*dx, isum_l, acc_l)
    with isum_l the 4 products of quad l, as `_x86_iq._row_iq4_nl`'s two accumulators."""
    builder = tile.b
    src = tile.src(pair, IQ_PACKED_BYTES[IQ4_NL])
    out = []
    for h in range(2):
        b = builder.add(builder.mul(pair, _c64(2)), _c64(h))
        isums = _signed_quads(tile, src, _LEGACY_BYTES * h, b)
        db = _exact("fmul", builder, tile.load(_V8F, src, _LEGACY_BYTES * h + _D0), tile.dx(b))
        out += [_fma(builder, db, builder.sitofp(isum, _vec(ir.FloatType(), TILE_ROWS)), acc)
                for isum, acc in zip(isums, accs[8 * h:8 * h + 8])]
    return out


pack_iq4_xs = _pack_intrinsic(IQ4_XS, _pack_half_iq4_xs, IQ_PACKED_BYTES[IQ4_XS])
pack_iq4_nl = _pack_intrinsic(IQ4_NL, _pack_half_iq4_nl, IQ_PACKED_BYTES[IQ4_NL])
tile_iq4_xs = _tile_intrinsic(_iq4_xs_block, "iq4_xs", "q8_K")
tile_iq4_nl = _tile_intrinsic(_iq4_nl_pair, "iq4_nl", "q8_0", n_acc=16)
pack_iq3_s = _pack_intrinsic(IQ3_S, lambda b, blks, put: _pack_half_grid(b, blks, put, IQ3_S), IQ_PACKED_BYTES[IQ3_S])
pack_iq2_xxs = _pack_intrinsic(IQ2_XXS, lambda b, blks, put: _pack_half_grid(b, blks, put, IQ2_XXS),
                              IQ_PACKED_BYTES[IQ2_XXS])
tile_iq3_s = _tile_intrinsic(lambda t, blk, accs: _iq4_xs_block(t, blk, accs, grid=True), "iq3_s", "q8_K")
tile_iq2_xxs = _tile_intrinsic(lambda t, blk, accs: _iq4_xs_block(t, blk, accs, grid=True), "iq2_xxs", "q8_K",
                               factor=GRID_ROWS[IQ2_XXS][2])


# -- the i-quants' prompt kernels with llama.cpp's prompt arithmetic: one int32 per super-block --
#
# llama.cpp's own prompts (ggml-cpu/tiled: batches of 8+ tokens of the k-quants and the
# super-block i-quants) do not round as its vec_dot. Per row, token and super-block it sums every
# product into one int32, s = sum over the sub-blocks of scale * (the sub-block's products), exact,
# and then out = fma(float(s) * d, dx, out) over the super-blocks in order (its AVX-512 VNNI kernel
# as built: GCC fuses the last multiply and add; iq2_xxs's 1/8 is folded into d). With one int32
# per super-block a product of 4 costs one `vpdpbusd`; vec_dot's 8 int32 lanes, each scaled per
# sub-block, cost a `pmaddubsw` and a `pmaddwd` per 64 products (measured: ~155 G products/s at
# most on Zen 5, one thread). These kernels compute that arithmetic on every ISA.
#
# Scratch bytes per super-block of 8 rows: d (8 f32; iq2_xxs: d / 8), 8 scale vectors (sub-block
# s: lane r = row r's scale as an i32), 8 correction vectors (lane r = -128 * the sum of row r's 32
# values of sub-block s: the products run against x + 128 on a VNNI ISA), then 64 vectors of the
# signed values (sub-block s, byte quads k).
_DS, _SCS, _CORRS, _QUANTSS = 0, 32, 288, 544
SUMS_PACKED_BYTES = {SUMS | t: 2592 * HALVES for t in (IQ4_XS, IQ3_S, IQ2_XXS, IQ3_XXS)}


def _put_sum_values(builder, rows, put, s):
    """Sub-block s of 8 rows (rows: 8 x <8 x i32>, 32 signed values each) as its 8 quad vectors and
    the correction vector (-128 * each row's sum of the 32)."""
    ones = _splat(_I8, 32, 1)
    totals = [ir.Constant(_V8I, [0] * 8)] * 2  # (two chains: vpdpbusd's latency)
    for k, v in enumerate(_transpose8(builder, rows)):
        put(v, builder.add(builder.mul(s, _c64(256)), _c64(_QUANTSS + 32 * k)))
        totals[k % 2] = _dot4(builder, ones, builder.bitcast(v, _V32B), totals[k % 2])
    total = builder.add(totals[0], totals[1])
    put(builder.mul(total, ir.Constant(_V8I, [-128] * 8)), builder.add(builder.mul(s, _c64(32)), _c64(_CORRS)))


def _pack_sums_iq4_xs(builder, blks, put):
    put(_rows_f16(builder, blks, 0), _DS)
    scales = [builder.sext(_xs_scales(builder, p), _V8I) for p in blks]  # row r: its 8 scales - 32
    for s, v in enumerate(_transpose8(builder, scales)):
        put(v, _SCS + 32 * s)

    def sub_block(s, _):
        rows = [builder.bitcast(_iq4_values(builder, _gep8(builder, p, builder.add(builder.mul(s, _c64(16)), _c64(8)))), _V8I)
                for p in blks]
        _put_sum_values(builder, rows, put, s)
        return []

    _loop(builder, _c64(0), _c64(8), sub_block, [])


def _pack_sums_grid(builder, blks, put, type_id):
    _, chunk, factor, block_scales = GRID_ROWS[type_id]
    d = _rows_f16(builder, blks, 0)
    if factor != 1.0:  # (a power of two: exact)
        d = _exact("fmul", builder, d, ir.Constant(_V8F, [factor] * 8))
    put(d, _DS)
    by_chunk = _transpose8(builder, [odd_scale(builder, block_scales(builder, p)) for p in blks])  # chunk c: lane r
    for c in range(8):
        rows = []
        for p in blks:
            q, m, _ = chunk(builder, p, c)  # (m: -1 where negative)
            rows.append(builder.bitcast(builder.sub(builder.xor(q, m), m), _V8I))
        put(by_chunk[c], _SCS + 32 * c)
        _put_sum_values(builder, rows, put, _c64(c))


def _sums_block(tiles, b, accs):
    """One super-block for each token of `tiles` (each weight vector loaded once for them): s = sum
    over sub-blocks of scale * (its 32 products), exact in int32 (on a VNNI ISA one `vpdpbusd` of x
    + 128 by the signed values per quad, from the pack's correction; else |w| . sign(x, w));
    acc = fma(float(s) * d, dx, acc)."""
    builder = tiles[0].b
    vi, vf = _vec(_I32, TILE_ROWS), _vec(ir.FloatType(), TILE_ROWS)
    zero = ir.Constant(vi, [0] * TILE_ROWS)
    tile = tiles[0]
    src = tile.src(b, 2592 * HALVES)
    xq_off = builder.mul(b, _c64(256))  # (on a VNNI ISA the caller passes x + 128, FLIPPED_X: broadcasts from memory)

    def sub_block(s, isums):
        corr = tile.load(_V8I, src, builder.add(builder.mul(s, _c64(32)), _c64(_CORRS))) if VNNI else zero
        a = [[corr] + [zero] * (CHAINS - 1) for _ in tiles]
        x_off = builder.add(xq_off, builder.mul(s, _c64(32)))
        for k in range(8):
            w = tile.load(_V32B, src, builder.add(builder.mul(s, _c64(256)), _c64(_QUANTSS + 32 * k)))
            if not VNNI:
                if HALVES == 1:
                    u = _psign(builder, w, w)
                else:  # (AVX-512 has no vpsignb; x is never -128 in q8_K)
                    wz = ir.Constant(w.type, [0] * w.type.count)
                    neg, u = builder.icmp_signed("<", w, wz), _abs(builder, w)
            for i, t in enumerate(tiles):
                xv = t.x_quad(x_off, k)
                if VNNI:
                    a[i][k % CHAINS] = _dot4(builder, xv, w, a[i][k % CHAINS])
                    continue
                sx = _psign(builder, xv, w) if HALVES == 1 else builder.select(neg, builder.sub(wz, xv), xv)
                a[i][k % CHAINS] = _dot4(builder, u, sx, a[i][k % CHAINS])
        return scaled_sums(builder, isums, a, tile.load(_V8I, src, builder.add(builder.mul(s, _c64(32)), _c64(_SCS))))

    isums = _loop(builder, _c64(0), _c64(8), sub_block, [zero] * len(tiles))
    d = tile.load(_V8F, src, _DS)
    return [_fma(builder, _exact("fmul", builder, builder.sitofp(isum, vf), d), t.dx(b), acc)
            for isum, t, acc in zip(isums, tiles, accs)]


_SUMS_PACK = {IQ4_XS: _pack_sums_iq4_xs, IQ3_S: lambda b, blks, put: _pack_sums_grid(b, blks, put, IQ3_S),
              IQ2_XXS: lambda b, blks, put: _pack_sums_grid(b, blks, put, IQ2_XXS),
              IQ3_XXS: lambda b, blks, put: _pack_sums_grid(b, blks, put, IQ3_XXS)}


def sums_kernels(type_id):
    """(pack, tile) intrinsics of the super-block sums of type_id (iq4_xs, iq3_s, iq2_xxs, iq3_xxs; the tile
    reads x + 128 on a VNNI ISA, `FLIPPED_X`)."""
    name = type_name(type_id) + "_sums"
    return (_pack_intrinsic(type_id, _SUMS_PACK[type_id], SUMS_PACKED_BYTES[SUMS | type_id], name),
            _sums_tile_intrinsic(_sums_block, name))


# the sums kernels whose activations the caller passes as x + 128 on a VNNI ISA (`int8.gemm`)
FLIPPED_X = frozenset({*SUMS_PACKED_BYTES, SUMS | Q4_K, SUMS | Q5_K}) if VNNI else frozenset()
