"""x86 mat-mat for batches (`int8.gemm`: q4_K, q6_K, q4_0, q5_0, q8_0; the i-quants' in `_x86_gemm_iq.py`, on
the machinery here; each type's pair of intrinsics in `_x86_gemms.py`): TILE_ROWS rows per pass, rows in the lanes.

The row intrinsics of `_x86.py` hold 32 consecutive quants of one row per vector and read each
token's activations once per row; with many tokens that activation traffic (L2) is what bounds
them. Here a vector holds 4 quants of each of TILE_ROWS rows (one 32-bit lane per row) and the
matching 4 activation bytes are broadcast to every lane (llama.cpp's repacked "q4_Kx8"
arrangement), so each activation byte is loaded once for all those rows.

Unlike llama.cpp, no repacked copy of the weights is kept: `pack_q4_k` writes the rows'
transposed quants (unpacked to bytes) and decoded scales into a small per-thread scratch, and
`tile_q4_k` then reads that scratch for every token of the batch, so the transposition is paid
once per TILE_ROWS rows and batch. The tile goes through the blocks in ranges whose packed bytes
stay in L1 (`L1_BLOCK_BYTES`), every token through a range before the next, its 8 accumulators
waiting in a scratch in between.

TILE_ROWS is 8 on AVX2 (256-bit vectors) and 16 on a 512-bit ISA (`_x86.ZMM`): there the scratch
holds two 8-row layouts interleaved 32 bytes at a time (rows 0-7 in the low half of each 64-byte
vector, rows 8-15 in the high half), so one broadcast of the token's activation quad meets 16 rows
per instruction. (An earlier form put two tokens in the halves against 8 rows: inserting the
second token's quad cost two shuffles per product, and 16 rows measured 1.4x faster.)

Rounding: each row's value is bit for bit that of the one-token row kernel (`_x86._row_kquant45`):
the same 8 lanes of exact int32 partial sums, the same two fused multiply-adds per block and the
same pairwise sum at the end (see `_tile_codegen`). So a prompt, a batch of lookup drafts and
the server's steps of several streams give every row the logits of one-token decode, as the
other int8 kernels do, on every ISA. Keeping those 8 lanes costs one `pmaddwd` per `pmaddubsw`
(summing 8 `pmaddubsw` in int16 first, as llama.cpp does, measured ~25% faster but rounds
differently). q4_0, q5_0 and q8_0 take `vpdpbusd` on a VNNI ISA (one instruction per product of 4).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..gguf.types import (
    GGML_TYPES,
    IQ4_NL,
    Q2_K,
    Q4_0,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    type_name,
)
from ._x86 import (
    _I8,
    _I16,
    _I32,
    _I64,
    VNNI,
    ZMM,
    _dot4,
    _exact,
    _fifth_bits,
    _fma,
    _gep8,
    _lanes,
    _loop,
    _madd_add,
    _maddubs,
    _maddwd,
    _psign,
    _splat,
    _vec,
)
from ._x86_iq import _iq4_values

HALVES = 2 if ZMM else 1  # 8-row layouts per pass, one per 256 bits of a vector
TILE_ROWS = 8 * HALVES  # rows per pass (lane r of a vector: row r)
# The layouts below are those of 8 rows; with HALVES = 2 every 32-byte item at offset o of one
# lies at 2o (rows 0-7) and 2o + 32 (rows 8-15), and a block takes twice the bytes.
L1_BLOCK_BYTES = 32768  # packed bytes that every token reads before the next range of blocks (L1: 32-48 KiB)
# scratch bytes per q4_K block of 8 rows (lane r = row r): d and dmin (8 f32 each), 8 scale vectors
# (16 x i16), 8 min vectors (8 f32), then 64 vectors of transposed quants (groups of 64
# elements j, low/high nibbles, byte quads k)
_D, _DMIN, _SCALES, _MINS, _QUANTS = 0, 32, 64, 320, 576
# the prompt kernels' q4_K pack (`_pack_half_q4_k(sums=True)`): then 8 correction vectors and 4 vectors of
# the mins in int16 pairs (lane r = m_r,2i | m_r,2i+1 << 16)
_CORR4, _MINPAIRS4 = 2624, 2880
Q4_K_SUMS_BYTES = (2880 + 128) * HALVES
# scratch bytes per q6_K block of 8 rows: d (8 f32), 16 scale vectors (lane r = s_rj as an i16 in
# both halves), then 64 vectors of transposed quants (32-element groups g, byte quads k) as 0..63
_D6, _SCALES6, _QUANTS6 = 0, 32, 544
# scratch bytes per q4_0, q5_0 or q8_0 block of 8 rows: d (8 f32), then 8 vectors of transposed
# quants (byte quads k): q4_0 as 0..15, q5_0 as 0..31, q8_0 as they are (-128..127); for the signed
# ones (q8_0, iq4_nl) 8 more vectors: quad k, lane r = -128 * (the sum of row r's 4 quants), the
# start of the tile's sums against x + 128 on a VNNI ISA (`_signed_quads`)
_D0, _QUANTS0, _CORR0 = 0, 32, 288
_LEGACY_BYTES = 544  # (the layout above, with the correction vectors)
# type id -> scratch bytes per block of TILE_ROWS rows (the 8-row layouts above, HALVES times)
PACKED_BYTES = {Q4_K: 2624 * HALVES, Q6_K: 2592 * HALVES, Q4_0: 288 * HALVES, Q5_0: 288 * HALVES,
                Q8_0: _LEGACY_BYTES * HALVES}
_V8F = _vec(ir.FloatType(), 8)
_V8I = _vec(_I32, 8)
_V32B = _vec(_I8, 32)
_V16H = _vec(_I16, 16)


def _c64(v):
    return ir.Constant(_I64, v)


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(_V8I, idx))


def _transpose8(builder, vs):
    """8 x <8 x i32> (vector r: row r, lanes k) -> 8 x <8 x i32> (vector k: lane r = dword k of row r)."""
    a = []
    for r in range(0, 8, 2):  # interleave dwords within 128-bit halves
        a.append((_shuffle(builder, vs[r], vs[r + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
                  _shuffle(builder, vs[r], vs[r + 1], [2, 10, 3, 11, 6, 14, 7, 15])))
    b = []
    for p in range(0, 4, 2):  # then 64-bit pairs: rows 4p'..4p'+3, dwords {k, k+4}
        for h in range(2):
            b.append(_shuffle(builder, a[p][h], a[p + 1][h], [0, 1, 8, 9, 4, 5, 12, 13]))
            b.append(_shuffle(builder, a[p][h], a[p + 1][h], [2, 3, 10, 11, 6, 7, 14, 15]))
    # b[0..3]: rows 0-3, dwords (0,4), (1,5), (2,6), (3,7); b[4..7]: rows 4-7, the same
    out = [None] * 8
    for k in range(4):
        out[k] = _shuffle(builder, b[k], b[4 + k], [0, 1, 2, 3, 8, 9, 10, 11])
        out[k + 4] = _shuffle(builder, b[k], b[4 + k], [4, 5, 6, 7, 12, 13, 14, 15])
    return out


def _transpose4x2(builder, vs):
    """4 x <8 x i32> (vector r: row r in lanes 0-3, row r+4 in lanes 4-7) -> 4 x <8 x i32>
    (vector k: lane r = dword k of row r)."""
    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    a0, a1 = _shuffle(builder, vs[0], vs[1], lo), _shuffle(builder, vs[0], vs[1], hi)
    a2, a3 = _shuffle(builder, vs[2], vs[3], lo), _shuffle(builder, vs[2], vs[3], hi)
    p, q = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    return [_shuffle(builder, a0, a2, p), _shuffle(builder, a0, a2, q), _shuffle(builder, a1, a3, p),
            _shuffle(builder, a1, a3, q)]


def _store(builder, v, p, off):
    builder.store(v, builder.bitcast(_gep8(builder, p, off), ir.PointerType(v.type)), align=1)


def _load(builder, ty, p, off):
    return builder.load(builder.bitcast(_gep8(builder, p, off), ir.PointerType(ty)), align=1)


def _pack_codegen(context, builder, signature, args, block_bytes, packed_bytes, pack_half):
    """A pack intrinsic (raw, r0, nb, pack): for each block b, `pack_half(blks, put)` for each 8
    rows r0+8h.. (blks: i8* to block b of each; put(v, off): store the 32-byte vector v at offset
    off of the 8-row layout, which lands at HALVES * off + 32h of the block's scratch; put(v, off,
    step=4): a 4-byte v at HALVES * off + 4h, next to the other half's)."""
    raw = context.make_array(signature.args[0])(context, builder, args[0])
    r0, nb = args[1], args[2]
    pack = context.make_array(signature.args[3])(context, builder, args[3])
    base = builder.bitcast(raw.data, ir.PointerType(_I8))
    rstride = builder.extract_value(raw.strides, 0)
    rowps = [builder.gep(base, [builder.mul(builder.add(r0, _c64(r)), rstride)]) for r in range(TILE_ROWS)]
    pbase = builder.bitcast(pack.data, ir.PointerType(_I8))

    def body(b, _):
        dst = builder.gep(pbase, [builder.mul(b, _c64(packed_bytes))])
        for h in range(HALVES):
            blks = [builder.gep(p, [builder.mul(b, _c64(block_bytes))]) for p in rowps[8 * h:8 * h + 8]]
            pack_half(blks, lambda v, off, step=32, h=h: _store(builder, v, dst, _in_half(builder, off, h, step)))
        return []

    _loop(builder, _c64(0), nb, body, [])
    return context.get_dummy_value()


def _in_half(builder, off, h=0, step=32):
    """Where offset off of an 8-row layout lies in the scratch (half h: rows 8h..8h+7; the halves
    of a 32-byte item step = 32 bytes apart, of a 4-byte one 4)."""
    if isinstance(off, int):
        return HALVES * off + step * h
    return builder.add(builder.mul(off, _c64(HALVES)), _c64(step * h)) if HALVES > 1 else off


def _rows_f16(builder, blks, off):
    """<8 x float>: lane r = the fp16 at byte off of blks[r]."""
    d = ir.Constant(_vec(ir.HalfType(), 8), None)
    for r, p in enumerate(blks):
        d = builder.insert_element(d, _load(builder, ir.HalfType(), p, off), ir.Constant(_I32, r))
    return builder.fpext(d, _V8F)


def _pack_half_q4_k(builder, blks, put, sums=False, q5=False):
    """q4_K's layout above; with sums (its prompt kernels on a VNNI ISA, `_sums_block_q4_k`) also
    the 8 correction vectors at _CORR4: sub-block s, lane r = -128 * row r's sum of its 32 quants.
    q5: a q5_K block (with sums: its prompt kernel is q4_K's), the same head, the 5th bits (qh, 32
    bytes at 16: group j's low nibbles take bit 2j, its high nibbles bit 2j + 1) added to the quants
    (0..31), which start at 48."""
    def c32(v):
        return ir.Constant(_V8I, [v] * 8)

    # the 16-byte heads (d, dmin, 12 bytes of scales and mins) of the 8 rows, transposed: lane r = row r
    heads = [_load(builder, _vec(_I32, 4), p, 0) for p in blks]
    hv = _transpose4x2(builder, [builder.shuffle_vector(heads[r], heads[r + 4], ir.Constant(_V8I, list(range(8))))
                                 for r in range(4)])
    dd = builder.bitcast(hv[0], _V16H)
    for off, lanes in ((_D, range(0, 16, 2)), (_DMIN, range(1, 16, 2))):
        put(builder.fpext(builder.bitcast(_lanes(builder, dd, lanes), _vec(ir.HalfType(), 8)), _V8F), off)
    u0, u1, u2 = hv[1], hv[2], hv[3]  # ggml's utmp unpacking of the 6-bit scales and mins, 8 rows at once
    sc_lo = builder.and_(u0, c32(0x3F3F3F3F))
    mn_lo = builder.and_(u1, c32(0x3F3F3F3F))
    sc_hi = builder.or_(builder.and_(u2, c32(0x0F0F0F0F)), builder.shl(builder.and_(builder.lshr(u0, c32(6)), c32(0x03030303)), c32(4)))
    mn_hi = builder.or_(builder.and_(builder.lshr(u2, c32(4)), c32(0x0F0F0F0F)),
                        builder.shl(builder.and_(builder.lshr(u1, c32(6)), c32(0x03030303)), c32(4)))
    for k in range(8):  # sub-block k: lane r = s_rk in both int16 halves (the pmaddwd operand)
        v = builder.and_(builder.lshr(sc_lo if k < 4 else sc_hi, c32(8 * (k % 4))), c32(0xFF))
        put(builder.or_(v, builder.shl(v, c32(16))), _SCALES + 32 * k)
    mins = []
    for k in range(8):  # sub-block k: lane r = m_rk as a float (m * a 32-element sum is exact in float32)
        mins.append(builder.and_(builder.lshr(mn_lo if k < 4 else mn_hi, c32(8 * (k % 4))), c32(0xFF)))
        put(builder.sitofp(mins[k], _V8F), _MINS + 32 * k)
    for i in range(4 if sums else 0):
        put(builder.or_(mins[2 * i], builder.shl(mins[2 * i + 1], c32(16))), _MINPAIRS4 + 32 * i)

    def group(j, qh):  # 64-element group j: its 32 packed bytes, bytes 4k..4k+3 of each row in vector k
        rows = [_load(builder, _V8I, p, builder.add(builder.mul(j, _c64(32)), _c64(48 if q5 else 16))) for p in blks]
        dj = builder.add(builder.mul(j, _c64(512)), _c64(_QUANTS))
        totals = [ir.Constant(_V8I, [0] * 8)] * 2  # (the low and the high nibbles' sub-blocks)
        for k, v in enumerate(_transpose8(builder, rows)):
            v = builder.bitcast(v, _V32B)
            halves = [builder.and_(v, _splat(_I8, 32, 15)), builder.lshr(v, _splat(_I8, 32, 4))]
            if q5:  # (qh[k]: bits 2j and 2j + 1 of these bytes, now at bits 0 and 1) -> + 16
                high = builder.bitcast(qh[k], _V32B)
                halves = [builder.or_(halves[0], builder.shl(builder.and_(high, _splat(_I8, 32, 1)), _splat(_I8, 32, 4))),
                          builder.or_(halves[1], builder.shl(builder.and_(high, _splat(_I8, 32, 2)), _splat(_I8, 32, 3)))]
            for h, q in enumerate(halves):
                put(q, builder.add(dj, _c64(256 * h + 32 * k)))
                if sums:
                    totals[h] = _dot4(builder, _splat(_I8, 32, 1), q, totals[h], vnni=False)
        for h in range(2 if sums else 0):
            put(builder.mul(totals[h], c32(-128)), builder.add(builder.mul(j, _c64(64)), _c64(_CORR4 + 32 * h)))
        return [builder.lshr(v, c32(2)) for v in qh]  # (bits 0 and 1 of each byte, the ones read, stay in it)

    # q5_K: the 32 qh bytes of the 8 rows transposed as the quants are (vector k, lane r: bytes 4k..4k+3)
    qh = _transpose8(builder, [_load(builder, _V8I, p, _c64(16)) for p in blks]) if q5 else []
    _loop(builder, _c64(0), _c64(4), group, qh)


def _pack_half_q6_k(builder, blks, put):
    m15, m3 = _splat(_I8, 32, 15), _splat(_I8, 32, 3)
    put(_rows_f16(builder, blks, 208), _D6)
    for j in range(16):  # sub-block j's scale of each row, in both i16 halves of its lane
        v = ir.Constant(_V8I, None)
        for r, p in enumerate(blks):
            v = builder.insert_element(v, builder.sext(_load(builder, _I8, p, 192 + j), _I32), ir.Constant(_I32, r))
        pair = builder.or_(builder.and_(v, ir.Constant(_V8I, [0xFFFF] * 8)), builder.shl(v, ir.Constant(_V8I, [16] * 8)))
        put(pair, _SCALES6 + 32 * j)
    for n in range(2):  # 128-element halves, unpacked as `_x86._q6_core` does
        lows, highs = [], []
        for p in blks:
            a, c = _load(builder, _V32B, p, 64 * n), _load(builder, _V32B, p, 64 * n + 32)
            lows.append([builder.and_(a, m15), builder.and_(c, m15), builder.lshr(a, _splat(_I8, 32, 4)),
                         builder.lshr(c, _splat(_I8, 32, 4))])
            highs.append(_load(builder, _V32B, p, 128 + 32 * n))
        for s in range(4):  # group g = 4n + s: elements 32g..32g+31
            rows = []
            for low, h in zip(lows, highs):
                hs = builder.and_(builder.lshr(h, _splat(_I8, 32, 2 * s)) if s else h, m3)
                rows.append(builder.bitcast(builder.or_(low[s], builder.shl(hs, _splat(_I8, 32, 4))), _V8I))
            for k, v in enumerate(_transpose8(builder, rows)):
                put(v, _QUANTS6 + 256 * (4 * n + s) + 32 * k)


def _pack_half_legacy(builder, blks, put, kind):
    rows = []
    for p in blks:
        if kind == "q8_0":
            rows.append(_load(builder, _V8I, p, 2))
            continue
        if kind == "iq4_nl":  # the 32 signed kvalues
            rows.append(builder.bitcast(_iq4_values(builder, _gep8(builder, p, 2)), _V8I))
            continue
        qs = 2 if kind == "q4_0" else 6  # (q5_0: the 32 fifth bits first, at byte 2)
        v = _load(builder, _vec(_I8, 16), p, qs)  # elements 0..15 in the low nibbles, 16..31 in the high
        lo, hi = builder.and_(v, _splat(_I8, 16, 15)), builder.lshr(v, _splat(_I8, 16, 4))
        q = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))
        if kind == "q5_0":
            q = builder.or_(q, _fifth_bits(builder, _gep8(builder, p, 2)))
        rows.append(builder.bitcast(q, _V8I))
    put(_rows_f16(builder, blks, 0), _D0)
    for k, v in enumerate(_transpose8(builder, rows)):
        put(v, _QUANTS0 + 32 * k)
        if VNNI and kind in ("q8_0", "iq4_nl"):  # -128 * the quad's sum (exact: pmaddubsw by ones, pmaddwd by
            # ones), read only by the VNNI tile
            quad_sums = _maddwd(builder, _maddubs(builder, _splat(_I8, 32, 1), builder.bitcast(v, _V32B)), _splat(_I16, 16, 1))
            put(builder.mul(quad_sums, _splat(_I32, 8, -128)), _CORR0 + 32 * k)


def _pack_sig(raw, r0, nb, pack):
    if not (isinstance(raw, types.Array) and raw.ndim == 2 and raw.dtype == types.uint8 and raw.layout == "C"):
        return None
    if not (isinstance(pack, types.Array) and pack.ndim == 1 and pack.dtype == types.uint8 and pack.layout == "C"):
        return None
    if not all(isinstance(v, types.Integer) for v in (r0, nb)):
        return None
    return types.none(raw, r0, nb, pack)


def _pack_intrinsic(type_id, pack_half, packed_bytes=None, kind=None):
    packed_bytes = packed_bytes or PACKED_BYTES[type_id]
    kind = kind or type_name(type_id)
    block_bytes = GGML_TYPES[type_id].type_size * (2 if type_id == IQ4_NL else 1)  # (iq4_nl: pairs of blocks)

    def pack(typingctx, raw, r0, nb, pack):
        sig = _pack_sig(raw, r0, nb, pack)
        return (sig, lambda c, b, sg, a: _pack_codegen(c, b, sg, a, block_bytes, packed_bytes,
                                                        lambda blks, put: pack_half(b, blks, put))) if sig else None

    pack.__name__ = pack.__qualname__ = f"pack_{kind.lower()}"
    pack.__doc__ = (f"Write rows r0..r0+TILE_ROWS-1 of raw ({kind}, (n_rows, nb*{block_bytes})) into pack (>= nb * "
                    f"{packed_bytes} bytes) in the layout `tile_{kind.lower()}` reads. The caller guarantees the "
                    "ranges are in bounds.")
    return intrinsic(pack)


pack_q4_k = _pack_intrinsic(Q4_K, _pack_half_q4_k)
pack_q4_k_sums = _pack_intrinsic(Q4_K, lambda b, blks, put: _pack_half_q4_k(b, blks, put, sums=True), Q4_K_SUMS_BYTES, "q4_K_sums")
pack_q5_k_sums = _pack_intrinsic(Q5_K, lambda b, blks, put: _pack_half_q4_k(b, blks, put, sums=True, q5=True),
                                 Q4_K_SUMS_BYTES, "q5_K_sums")
pack_q6_k = _pack_intrinsic(Q6_K, _pack_half_q6_k)
pack_q4_0 = _pack_intrinsic(Q4_0, lambda b, blks, put: _pack_half_legacy(b, blks, put, "q4_0"))
pack_q5_0 = _pack_intrinsic(Q5_0, lambda b, blks, put: _pack_half_legacy(b, blks, put, "q5_0"))
pack_q8_0 = _pack_intrinsic(Q8_0, lambda b, blks, put: _pack_half_legacy(b, blks, put, "q8_0"))


def _abs(builder, v):
    """|v| lane-wise (vpabsb): |-128| = 128, read as unsigned by `pmaddubsw` / `vpdpbusd`."""
    fn = builder.module.declare_intrinsic(f"llvm.abs.v{v.type.count}i8", fnty=ir.FunctionType(v.type, [v.type, ir.IntType(1)]))
    return builder.call(fn, [v, ir.Constant(ir.IntType(1), 0)])


def _token_ptr(context, builder, aty, aval, t, elty):
    """elty* to row t of the 2-D C array aval."""
    ary = context.make_array(aty)(context, builder, aval)
    p = builder.gep(builder.bitcast(ary.data, ir.PointerType(_I8)), [builder.mul(t, builder.extract_value(ary.strides, 0))])
    return builder.bitcast(p, ir.PointerType(elty))


def _splat_scalar(builder, x, n=None):
    """<n x T> (n: the tile's lanes, TILE_ROWS) with x in every lane."""
    n = n or TILE_ROWS
    v = builder.insert_element(ir.Constant(_vec(x.type, n), None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(v.type, None), ir.Constant(_vec(_I32, n), [0] * n))


def _tile_prologue(context, builder, signature, args):
    """What a tile codegen reads of its arguments: (pack base i8*, nb, b0, b1, t0, t1, r0, b0 == 0,
    b1 == nb, a zero accumulator)."""
    pack = context.make_array(signature.args[0])(context, builder, args[0])
    nb, b0, b1, t0, t1, r0 = args[1], args[2], args[3], args[7], args[8], args[10]
    pbase = builder.bitcast(pack.data, ir.PointerType(_I8))
    first = builder.icmp_signed("==", b0, _c64(0))
    last = builder.icmp_signed("==", b1, nb)
    return pbase, nb, b0, b1, t0, t1, r0, first, last, ir.Constant(_vec(ir.FloatType(), TILE_ROWS), [0.0] * TILE_ROWS)


def _tile_codegen(context, builder, signature, args, block_sum, n_acc=8, factor=1.0):
    """Blocks b0..b1-1 of the packed rows times tokens t0..t1-1, one token per iteration, so that
    each weight vector is loaded for one `pmaddubsw` (with the weights reused for several tokens
    in registers, LLVM hoisted and spilled them).

    `block_sum(tile, b, accs)` adds block b to the 8 accumulators (vector l, lane r: the row
    kernel's lane l of row r). They start at zero when b0 = 0, else from the token's row of the
    scratch `acc` (n_tok, 8 * TILE_ROWS) where the previous range left them; after the last block
    (b1 = nb) each row gets the row kernel's pairwise sum ((0+4)+(2+6)) + ((1+5)+(3+7)) in out,
    else they go back to `acc`. (A range of blocks whose packed bytes stay in L1 is read by every
    token before the next: a whole long row's would not fit.) With n_acc = 16 (iq4_nl: the row
    kernel's accumulators of even and odd blocks) vector l + vector 8 + l is summed first, as there;
    a factor other than 1 (iq2_xxs: 0.125) multiplies the sum, as the row kernel's last step."""
    vf = _vec(ir.FloatType(), TILE_ROWS)
    pbase, nb, b0, b1, t0, t1, r0, first, last, zero = _tile_prologue(context, builder, signature, args)
    sa = signature.args

    def token(t, _):
        tile = _Tile(builder, pbase, _token_ptr(context, builder, sa[4], args[4], t, _I8),
                     _token_ptr(context, builder, sa[5], args[5], t, ir.FloatType()),
                     _token_ptr(context, builder, sa[6], args[6], t, _I32))
        saved = builder.bitcast(_token_ptr(context, builder, sa[11], args[11], t, ir.FloatType()), ir.PointerType(_I8))
        start = [builder.select(first, zero, _load(builder, vf, saved, 4 * TILE_ROWS * k)) for k in range(n_acc)]
        acc = _loop(builder, b0, b1, lambda b, accs: block_sum(tile, b, accs), start)
        with builder.if_else(last) as (then, otherwise):
            with then:
                a = acc if n_acc == 8 else [_exact("fadd", builder, acc[k], acc[8 + k]) for k in range(8)]
                s04, s26 = _exact("fadd", builder, a[0], a[4]), _exact("fadd", builder, a[2], a[6])
                s15, s37 = _exact("fadd", builder, a[1], a[5]), _exact("fadd", builder, a[3], a[7])
                y = _exact("fadd", builder, _exact("fadd", builder, s04, s26), _exact("fadd", builder, s15, s37))
                if factor != 1.0:
                    y = _exact("fmul", builder, _splat_scalar(builder, ir.Constant(ir.FloatType(), factor)), y)
                orow = _token_ptr(context, builder, sa[9], args[9], t, ir.FloatType())
                _store(builder, y, builder.bitcast(orow, ir.PointerType(_I8)), builder.mul(r0, _c64(4)))
            with otherwise:
                for k in range(n_acc):
                    _store(builder, acc[k], saved, 4 * TILE_ROWS * k)
        return []

    _loop(builder, t0, t1, token, [])
    return context.get_dummy_value()


class _Tile:
    """What a block's code needs in the token loop: the packed rows and the token's activations
    (xq i8*, xd f32*, xs i32*). Vectors have TILE_ROWS lanes, lane r = row r."""

    def __init__(self, builder, pbase, xq, xd, xs):
        self.b, self.pbase, self.xq, self.xd, self.xs = builder, pbase, xq, xd, xs

    def src(self, blk, block_bytes):
        return self.b.gep(self.pbase, [self.b.mul(blk, _c64(block_bytes))])

    def load(self, ty, src, off):
        """The item of the 8-row layout at offset off (a 32-byte vector type ty), for all TILE_ROWS rows."""
        return _load(self.b, _vec(ty.element, ty.count * HALVES), src, _in_half(self.b, off))

    def x_quad(self, x_off, k, flip=False):
        """The token's 4 activation bytes at x_off + 4k in every row lane: <4 TILE_ROWS x i8> (flip: x +
        128 as unsigned bytes, made on the scalar: an xor of the broadcast vector instead made LLVM's
        code generation of the q8_0 gemm run for over 15 minutes)."""
        b = self.b
        x4 = _load(b, _I32, self.xq, b.add(x_off, _c64(4 * k)))
        if flip:
            x4 = b.xor(x4, ir.Constant(_I32, -0x7F7F7F80))
        return b.bitcast(_splat_scalar(b, x4), _vec(_I8, 4 * TILE_ROWS))

    def dot_quads(self, isums, w_at, x_off, scale_of=None, signed=False, neg_at=None, x_unsigned=False, flip_x=False):
        """isums[k] += scale_of(k) * (4 quants of each row . the token's 4 activations at x_off + 4k),
        k = 0..7, with w_at(k) the rows' quad k (unsigned bytes; signed ones, with signed=True, as
        |w| . sign(x, w); or |w| with neg_at(k) the <4 TILE_ROWS x i1> mask of the negative w, x
        negated there; or signed ones against unsigned activations, x_unsigned=True, or against x + 128
        made here, flip_x=True); with no scale_of, the plain sums of 4 products (`vpdpbusd` on VNNI)."""
        b = self.b
        out = []
        for k in range(8):
            xv = self.x_quad(x_off, k, flip_x)
            w = w_at(k)
            if flip_x:
                out.append(_dot4(b, xv, w, isums[k]))
                continue
            if neg_at is not None:  # (one masked vpsubb: the sign test and |w| were paid once, in the pack)
                xv = b.select(neg_at(k), b.sub(ir.Constant(xv.type, [0] * xv.type.count), xv), xv)
            elif signed and HALVES == 1:
                w, xv = _psign(b, w, w), _psign(b, xv, w)
            elif signed:  # (AVX-512 has no vpsignb) |w|, and x negated where w < 0 (where w = 0 the product is 0 anyway)
                zero = ir.Constant(w.type, [0] * w.type.count)
                xv = b.select(b.icmp_signed("<", w, zero), b.sub(zero, xv), xv)
                w = _abs(b, w)
            pairs = _maddubs(b, xv, w) if x_unsigned else _maddubs(b, w, xv)
            out.append(_dot4(b, w, xv, isums[k]) if scale_of is None else _madd_add(b, isums[k], pairs, scale_of(k)))
        return out

    def dx(self, blk):
        return _splat_scalar(self.b, self.b.load(self.b.gep(self.xd, [blk]), align=4))

    def sums32(self, blk):
        """The token's 8 sums of 32 activations of block blk (q8_K sum slots 0-7, act_quant.Q8K_SUMS): <8 x i32>."""
        b = self.b
        return b.load(b.bitcast(b.gep(self.xs, [b.mul(blk, _c64(16))]), ir.PointerType(_vec(_I32, 8))), align=4)

    def sum_pair(self, blk, k):
        """The token's q8_K sum slot 8 + k of block blk: the int16 pair (b_k, b_k+8) as one i32."""
        b = self.b
        return b.load(b.gep(self.xs, [b.add(b.mul(blk, _c64(16)), _c64(8 + k))]), align=4)

    def lane(self, v, k):
        """Lane k of v in every lane of the tile."""
        return _lanes(self.b, v, [k] * TILE_ROWS)


def _q4_k_block(tile, b, accs):
    """q4_K: per block acc_l = fma(-dmin*dx, m*bsum, fma(d*dx, isum_l, acc_l)), the row kernel's
    two fused multiply-adds (`_x86._row_kquant45`); isum_l = sum over sub-blocks of scale * (4
    products), exact in int32."""
    builder = tile.b
    vf, vi = _vec(ir.FloatType(), TILE_ROWS), _vec(_I32, TILE_ROWS)
    src = tile.src(b, PACKED_BYTES[Q4_K])
    xq_off = builder.mul(b, _c64(256))

    def sub_block(sb, isums):  # sub-block sb = 2j + h: group j's low (h = 0) or high nibbles
        scale = tile.load(_V16H, src, builder.add(builder.mul(sb, _c64(32)), _c64(_SCALES)))
        wsb = builder.add(builder.mul(sb, _c64(256)), _c64(_QUANTS))
        return tile.dot_quads(isums, lambda k: tile.load(_V32B, src, builder.add(wsb, _c64(32 * k))),
                              builder.add(xq_off, builder.mul(sb, _c64(32))), lambda k: scale)

    # (a loop, not unrolled: an eighth of the code for LLVM to compile, at no measured cost)
    isums = _loop(builder, _c64(0), _c64(8), sub_block, [ir.Constant(vi, [0] * TILE_ROWS)] * 8)
    bsums = builder.sitofp(tile.sums32(b), _V8F)
    dx = tile.dx(b)
    a = _exact("fmul", builder, tile.load(_V8F, src, _D), dx)
    neg_b = _exact("fmul", builder, builder.fneg(tile.load(_V8F, src, _DMIN)), dx)
    out = []
    for k in range(8):
        msum = _exact("fmul", builder, tile.load(_V8F, src, _MINS + 32 * k), tile.lane(bsums, k))
        out.append(_fma(builder, neg_b, msum, _fma(builder, a, builder.sitofp(isums[k], vf), accs[k])))
    return out


def _q6_k_block(tile, b, accs):
    """q6_K: per block acc_l = fma(d*dx, isum_l - 32 * (s_l*bsum_l + s_(l+8)*bsum_(l+8)), acc_l), as
    the row kernel (`_x86._row_q6_k`); isum_l = sum over the 8 groups of 32 of the scale of its
    16 * (4 products): quads 0-3 of a group are sub-block 2g, 4-7 sub-block 2g+1."""
    builder = tile.b
    vf, vi = _vec(ir.FloatType(), TILE_ROWS), _vec(_I32, TILE_ROWS)
    src = tile.src(b, PACKED_BYTES[Q6_K])
    xq_off = builder.mul(b, _c64(256))

    def scale(j):
        return tile.load(_V16H, src, builder.add(builder.mul(j, _c64(32)), _c64(_SCALES6)))

    def group(g, isums):
        lo, hi = scale(builder.mul(g, _c64(2))), scale(builder.add(builder.mul(g, _c64(2)), _c64(1)))
        wg = builder.add(builder.mul(g, _c64(256)), _c64(_QUANTS6))
        return tile.dot_quads(isums, lambda k: tile.load(_V32B, src, builder.add(wg, _c64(32 * k))),
                              builder.add(xq_off, builder.mul(g, _c64(32))), lambda k: lo if k < 4 else hi)

    isums = _loop(builder, _c64(0), _c64(8), group, [ir.Constant(vi, [0] * TILE_ROWS)] * 8)
    db = _exact("fmul", builder, tile.load(_V8F, src, _D6), tile.dx(b))
    n16 = 2 * TILE_ROWS
    out = []
    for k in range(8):
        # s_k b_k + s_k+8 b_k+8 in one pmaddwd: each row's (s_k, s_k+8) against the token's int16 pair
        # (b_k, b_k+8), q8_K sum slot 8 + k broadcast (the pack holds each scale in both halves)
        lo, hi = (tile.load(_V16H, src, _SCALES6 + 32 * j) for j in (k, k + 8))
        pairs = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, n16), [i if i % 2 == 0 else n16 + i for i in range(n16)]))
        bk = builder.bitcast(_splat_scalar(builder, tile.sum_pair(b, k)), _vec(_I16, n16))
        corr = _maddwd(builder, pairs, bk)
        isum = builder.sub(isums[k], builder.shl(corr, ir.Constant(vi, [5] * TILE_ROWS)))
        out.append(_fma(builder, db, builder.sitofp(isum, vf), accs[k]))
    return out


def _signed_quads(tile, src, off, b):
    """The 8 exact quad sums of the signed 32-element block at offset off of src (q8_0, or an iq4_nl
    block of a pair) times block b of the token's q8_0 activations. On a VNNI ISA one `vpdpbusd` per
    quad of x + 128 (unsigned) by the signed quants, starting from the pack's -128 * (quad sum): no
    sign step per product. (Without VNNI, x + 128 against quants down to -128 would saturate
    `pmaddubsw`: there |w| . sign(x, w).)"""
    builder = tile.b
    x_off = builder.mul(b, _c64(32))

    def w_at(k):
        return tile.load(_V32B, src, off + _QUANTS0 + 32 * k)

    if VNNI:
        return tile.dot_quads([tile.load(_V8I, src, off + _CORR0 + 32 * k) for k in range(8)], w_at, x_off, flip_x=True)
    vi = _vec(_I32, TILE_ROWS)
    return tile.dot_quads([ir.Constant(vi, [0] * TILE_ROWS)] * 8, w_at, x_off, signed=True)


def _legacy_block(tile, b, accs, kind):
    """q4_0 / q5_0 / q8_0 (32 elements, q8_0 activations): per block acc_l = fma(d*dx, isum_l, acc_l)
    with isum_l the 4 products of quad l (exact: q4_0 / q5_0 unsigned, less 8 / 16 * the block's
    activation sum in lane 0; q8_0 as |w| . sign(x, w)), as the row kernel (`_x86._row_legacy`)."""
    builder = tile.b
    vf, vi = _vec(ir.FloatType(), TILE_ROWS), _vec(_I32, TILE_ROWS)
    src = tile.src(b, PACKED_BYTES[Q4_0 if kind != "q8_0" else Q8_0])
    isums = _signed_quads(tile, src, 0, b) if kind == "q8_0" else tile.dot_quads(
        [ir.Constant(vi, [0] * TILE_ROWS)] * 8, lambda k: tile.load(_V32B, src, _QUANTS0 + 32 * k), builder.mul(b, _c64(32)))
    if kind != "q8_0":
        corr = builder.mul(builder.load(builder.gep(tile.xs, [b]), align=4), ir.Constant(_I32, 8 if kind == "q4_0" else 16))
        isums[0] = builder.sub(isums[0], _splat_scalar(builder, corr))
    db = _exact("fmul", builder, tile.load(_V8F, src, _D0), tile.dx(b))
    return [_fma(builder, db, builder.sitofp(isum, vf), acc) for isum, acc in zip(isums, accs)]


def _tile_sig(pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc):
    if not (isinstance(pack, types.Array) and pack.ndim == 1 and pack.dtype == types.uint8 and pack.layout == "C"):
        return None
    arrs = ((xq, types.int8), (xd, types.float32), (xs, types.int32), (out, types.float32), (acc, types.float32))
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == dt and a.layout == "C" for a, dt in arrs):
        return None
    if not all(isinstance(v, types.Integer) for v in (nb, b0, b1, t0, t1, r0)):
        return None
    return types.none(pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc)


def _tile_intrinsic(block_sum, kind, form, n_acc=8, factor=1.0):
    def tile(typingctx, pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc):
        sig = _tile_sig(pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc)
        return (sig, lambda c, b, sg, a: _tile_codegen(c, b, sg, a, block_sum, n_acc, factor)) if sig else None

    tile.__name__ = tile.__qualname__ = f"tile_{kind.lower()}"
    tile.__doc__ = (f"Blocks b0..b1-1 of the rows packed by `pack_{kind.lower()}` (nb blocks) times tokens t0..t1-1 "
                    f"of 2-D {form} activations (xq (n_tok, ne0) int8, xd float32 and xs int32 per block or, for "
                    "q8_K, per 16 elements); at b1 = nb, out[t0:t1, r0:r0+TILE_ROWS] = the sums, else they wait "
                    "in acc (n_tok, 8 * TILE_ROWS) float32 (see `_tile_codegen`). The caller guarantees the "
                    "ranges are in bounds.")
    return intrinsic(tile)


tile_q4_k = _tile_intrinsic(_q4_k_block, "q4_K", "q8_K")
tile_q6_k = _tile_intrinsic(_q6_k_block, "q6_K", "q8_K")
tile_q4_0 = _tile_intrinsic(lambda t, blk, accs: _legacy_block(t, blk, accs, "q4_0"), "q4_0", "q8_0")
tile_q5_0 = _tile_intrinsic(lambda t, blk, accs: _legacy_block(t, blk, accs, "q5_0"), "q5_0", "q8_0")
tile_q8_0 = _tile_intrinsic(lambda t, blk, accs: _legacy_block(t, blk, accs, "q8_0"), "q8_0", "q8_0")


# -- prompts in llama.cpp's prompt arithmetic: one int32 per row, token and super-block --
#
# llama.cpp's own prompts (ggml-cpu/tiled: batches of 8+ tokens of the k-quants and the
# super-block i-quants) do not round as its vec_dot. Per row, token and super-block it sums every
# product into one int32, s1 = sum over the sub-blocks of scale * (the sub-block's products), and
# for the types with mins s2 = sum of min * (the sub-block's activation sum), both exact; then
# r = fl(s1) * d (less fl(s2) * dmin, fused) and out = fma(r, dx, out) over the super-blocks in
# order, from 0 (its AVX-512 VNNI kernel as GCC builds it: the last multiply and add are fused).
# With one int32 per super-block a product of 4 costs one `vpdpbusd`; vec_dot's 8 int32 lanes,
# each scaled per sub-block, cost a `pmaddubsw` and a `pmaddwd` per 64 products. These kernels
# (`int8.gemm(SUMS | type)`) compute that arithmetic on every ISA: a prompt's rows
# (`QTensor.matmul(prompt=...)`) equal llama.cpp's prompt rows bit for bit.
SUMS = 0x100  # gemm key flag: type id | SUMS = that type's prompt kernels (`_x86_gemms.GEMM_KERNELS`)
# tokens per pass over a super-block's packed rows (each weight vector loaded once for them) and
# the dependency chains of a token's products per sub-block (on Zen 5, 512 tokens of an 8192 x 2048
# iq4_xs matrix, one thread, with another benchmark on the other core: 1 token 212, 2: 285, 4: 339,
# 8: 368 G products/s; alone, 8: 344 and vec_dot's rounding 154, `tools/bench_gemm.py`). AVX2 has 16
# vector registers, not 32.
TOKENS_PER_PASS = 8 if ZMM else 2
CHAINS = 2


def _sums_codegen(context, builder, signature, args, block_sum):
    """`_tile_codegen` for the super-block sums (llama.cpp's prompt arithmetic, below): one
    accumulator per row and token, tokens in groups of TOKENS_PER_PASS (a weight vector loaded
    once for them), then one by one; `block_sum(tiles, b, accs)` adds super-block b for each."""
    vf = _vec(ir.FloatType(), TILE_ROWS)
    pbase, nb, b0, b1, t0, t1, r0, first, last, zero = _tile_prologue(context, builder, signature, args)
    sa = signature.args

    def run(ts):
        tiles = [_Tile(builder, pbase, _token_ptr(context, builder, sa[4], args[4], t, _I8),
                       _token_ptr(context, builder, sa[5], args[5], t, ir.FloatType()),
                       _token_ptr(context, builder, sa[6], args[6], t, _I32)) for t in ts]
        saved = [builder.bitcast(_token_ptr(context, builder, sa[11], args[11], t, ir.FloatType()), ir.PointerType(_I8))
                 for t in ts]
        start = [builder.select(first, zero, _load(builder, vf, p, 0)) for p in saved]
        acc = _loop(builder, b0, b1, lambda b, accs: block_sum(tiles, b, accs), start)
        with builder.if_else(last) as (then, otherwise):
            with then:
                for t, y in zip(ts, acc):
                    orow = _token_ptr(context, builder, sa[9], args[9], t, ir.FloatType())
                    _store(builder, y, builder.bitcast(orow, ir.PointerType(_I8)), builder.mul(r0, _c64(4)))
            with otherwise:
                for p, y in zip(saved, acc):
                    _store(builder, y, p, 0)

    g = TOKENS_PER_PASS
    n_groups = builder.sdiv(builder.sub(t1, t0), _c64(g))

    def group(i, _):
        t = builder.add(t0, builder.mul(i, _c64(g)))
        run([builder.add(t, _c64(j)) for j in range(g)])
        return []

    _loop(builder, _c64(0), n_groups, group, [])
    _loop(builder, builder.add(t0, builder.mul(n_groups, _c64(g))), t1, lambda t, _: run([t]) or [], [])
    return context.get_dummy_value()


def scaled_sums(builder, isums, chains, scale):
    """isums[i] + scale * (the sum of token i's product chains): a sub-block's step of the sums."""
    out = []
    for isum, ai in zip(isums, chains):
        while len(ai) > 1:
            ai = [builder.add(ai[j], ai[j + 1]) for j in range(0, len(ai), 2)]
        out.append(builder.add(isum, builder.mul(ai[0], scale)))
    return out


def _sums_tile_intrinsic(block_sum, kind):
    def tile(typingctx, pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc):
        sig = _tile_sig(pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc)
        return (sig, lambda c, b, sg, a: _sums_codegen(c, b, sg, a, block_sum)) if sig else None

    tile.__name__ = tile.__qualname__ = f"tile_{kind.lower()}"
    tile.__doc__ = ("Blocks b0..b1-1 of the packed rows times tokens t0..t1-1 of q8_K activations in llama.cpp's "
                    "prompt arithmetic, arguments as `_tile_intrinsic`'s tiles (acc (n_tok, TILE_ROWS)).")
    return intrinsic(tile)


def _sums_block_q4_k(tiles, b, accs):
    """q4_K's super-block (the gemm's pack with corrections): s1 = sum over sub-blocks of scale *
    (its 32 products), s2 = sum of min * (its 32 activations' sum) (exact in
    int32: `vpdpwssd` of the mins and the sums in int16 pairs); acc = fma(fma(-fl(s2), dmin, fl(s1) * d), dx, acc)."""
    builder = tiles[0].b
    vi, vf = _vec(_I32, TILE_ROWS), _vec(ir.FloatType(), TILE_ROWS)
    zero = ir.Constant(vi, [0] * TILE_ROWS)
    tile = tiles[0]
    src = tile.src(b, Q4_K_SUMS_BYTES)
    xq_off = builder.mul(b, _c64(256))
    low16 = ir.Constant(vi, [0xFFFF] * TILE_ROWS)

    def sub_block(sb, isums):  # sub-block sb = 2j + h: group j's low (h = 0) or high nibbles
        corr = tile.load(_V8I, src, builder.add(builder.mul(sb, _c64(32)), _c64(_CORR4))) if VNNI else zero
        a = [[corr] + [zero] * (CHAINS - 1) for _ in tiles]
        x_off = builder.add(xq_off, builder.mul(sb, _c64(32)))
        for k in range(8):
            w = tile.load(_V32B, src, builder.add(builder.mul(sb, _c64(256)), _c64(_QUANTS + 32 * k)))
            for i, t in enumerate(tiles):
                xv = t.x_quad(x_off, k)
                # (on VNNI x + 128 by the quants (0..15) as signed bytes, from the pack's correction, as the
                # i-quants: the broadcast x a register operand; as `vpdpbusd`'s memory operand 281 vs 288 G/s)
                a[i][k % CHAINS] = _dot4(builder, xv, w, a[i][k % CHAINS]) if VNNI else _dot4(builder, w, xv, a[i][k % CHAINS])
        scale = builder.and_(tile.load(_V8I, src, builder.add(builder.mul(sb, _c64(32)), _c64(_SCALES))), low16)
        return scaled_sums(builder, isums, a, scale)

    isums = _loop(builder, _c64(0), _c64(8), sub_block, [zero] * len(tiles))
    d, dmin = tile.load(_V8F, src, _D), tile.load(_V8F, src, _DMIN)
    pairs = [tile.load(_V16H, src, _MINPAIRS4 + 32 * i) for i in range(4)]
    out = []
    for isum, t, acc in zip(isums, tiles, accs):
        msum = zero
        for i in range(4):  # (the caller's xs holds the sums of 32 in int16 pairs in slots 0-3, `int8.gemm`)
            bpair = builder.load(builder.gep(t.xs, [builder.add(builder.mul(b, _c64(16)), _c64(i))]), align=4)
            msum = _madd_add(builder, msum, pairs[i], builder.bitcast(_splat_scalar(builder, bpair), pairs[i].type))
        r = _fma(builder, builder.fneg(builder.sitofp(msum, vf)), dmin, _exact("fmul", builder, builder.sitofp(isum, vf), d))
        out.append(_fma(builder, r, t.dx(b), acc))
    return out


def _sums_of_16(tiles, b, src, quants, scale_of):
    """Per token of `tiles`: the sum over the 16 sub-blocks of 16 of super-block b of scale_of(s) *
    (its products of the packed quants at `quants` (8 groups of 32, quads 0-3 sub-block 2g, 4-7
    sub-block 2g + 1; unsigned) and x, `vpdpbusd`), exact in int32 (q6_K's and q2_K's s1)."""
    builder, tile = tiles[0].b, tiles[0]
    zero = ir.Constant(_vec(_I32, TILE_ROWS), [0] * TILE_ROWS)
    xq_off = builder.mul(b, _c64(256))

    def group(g, isums):
        a = [[zero, zero] for _ in tiles]
        x_off = builder.add(xq_off, builder.mul(g, _c64(32)))
        for k in range(8):
            w = tile.load(_V32B, src, builder.add(builder.mul(g, _c64(256)), _c64(quants + 32 * k)))
            for i, t in enumerate(tiles):
                xv = t.x_quad(x_off, k)
                a[i][k // 4] = _dot4(builder, w, xv, a[i][k // 4])
        sc = [scale_of(builder.add(builder.mul(g, _c64(2)), _c64(h))) for h in range(2)]
        return [builder.add(isum, builder.add(builder.mul(ai[0], sc[0]), builder.mul(ai[1], sc[1]))) for isum, ai in zip(isums, a)]

    return _loop(builder, _c64(0), _c64(8), group, [zero] * len(tiles))


def _pair_sums(tile, b, pairs):
    """The token's sum over k < 8 of pairs[k] (each row's int16 pair for sub-blocks (k, k + 8)) times
    its q8_K sum slot 8 + k (the sums of 16 of those sub-blocks), `vpdpwssd`: <TILE_ROWS x i32>."""
    builder = tile.b
    n16 = 2 * TILE_ROWS
    acc = ir.Constant(_vec(_I32, TILE_ROWS), [0] * TILE_ROWS)
    for k in range(8):
        acc = _madd_add(builder, acc, pairs[k], builder.bitcast(_splat_scalar(builder, tile.sum_pair(b, k)), _vec(_I16, n16)))
    return acc


def _sums_block_q6_k(tiles, b, accs):
    """q6_K's super-block (the gemm's pack): s1 = sum over the 16 sub-blocks of 16 of scale * (its
    products of the unsigned quants (0..63) and x, `vpdpbusd`) less 32 * sum of scale * (its
    activations' sum) (`vpdpwssd` of the scales and the sums of 16 in the pairs (l, l + 8) of the
    q8_K sum slots 8-15), exact; acc = fma(fl(s1) * d, dx, acc)."""
    builder = tiles[0].b
    vi, vf = _vec(_I32, TILE_ROWS), _vec(ir.FloatType(), TILE_ROWS)
    tile = tiles[0]
    src = tile.src(b, PACKED_BYTES[Q6_K])
    sixteen = ir.Constant(vi, [16] * TILE_ROWS)
    isums = _sums_of_16(tiles, b, src, _QUANTS6,
                        lambda s: builder.ashr(tile.load(_V8I, src, builder.add(builder.mul(s, _c64(32)), _c64(_SCALES6))), sixteen))
    n16 = 2 * TILE_ROWS
    pairs = []
    for k in range(8):  # each row's (s_k, s_k+8) in the int16 halves of its lane (the pack holds each in both)
        lo, hi = (tile.load(_V16H, src, _SCALES6 + 32 * j) for j in (k, k + 8))
        pairs.append(builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, n16), [i if i % 2 == 0 else n16 + i for i in range(n16)])))
    d = tile.load(_V8F, src, _D6)
    out = []
    for isum, t, acc in zip(isums, tiles, accs):
        isum = builder.sub(isum, builder.shl(_pair_sums(t, b, pairs), ir.Constant(vi, [5] * TILE_ROWS)))
        out.append(_fma(builder, _exact("fmul", builder, builder.sitofp(isum, vf), d), t.dx(b), acc))
    return out


# q2_K's prompt pack per super-block of 8 rows: d, dmin (8 f32 each), 16 scale vectors (sub-block s:
# lane r = its 4-bit scale as an i32), 8 min-pair vectors (lane r = m_l | m_l+8 << 16), then 64 quad
# vectors of the 2-bit quants (32-element groups g, byte quads k; 0..3)
_D2, _DMIN2, _SC2, _MP2, _Q2 = 0, 32, 64, 576, 832
Q2_K_SUMS_BYTES = 2880 * HALVES


def _pack_half_q2_k(builder, blks, put):
    put(_rows_f16(builder, blks, 80), _D2)
    put(_rows_f16(builder, blks, 82), _DMIN2)
    packed = [ir.Constant(_V8I, None)] * 16  # sub-block s: lane r = row r's scale byte (scale | min << 4)
    for s in range(16):
        for r, p in enumerate(blks):
            packed[s] = builder.insert_element(packed[s], builder.zext(_load(builder, _I8, p, s), _I32), ir.Constant(_I32, r))
    c15 = ir.Constant(_V8I, [15] * 8)
    for s in range(16):
        put(builder.and_(packed[s], c15), _SC2 + 32 * s)
    for k in range(8):  # the mins of sub-blocks k and k + 8: the q8_K sum slot 8 + k's pair (b_k, b_k+8)
        lo = builder.lshr(packed[k], ir.Constant(_V8I, [4] * 8))
        hi = builder.lshr(packed[k + 8], ir.Constant(_V8I, [4] * 8))
        put(builder.or_(lo, builder.shl(hi, ir.Constant(_V8I, [16] * 8))), _MP2 + 32 * k)
    for g in range(8):  # group g = 4n + j: elements 128n + 32j .. +31, bits 2j of qs[32n ..]
        n, j = divmod(g, 4)
        rows = []
        for p in blks:
            v = _load(builder, _V32B, p, 16 + 32 * n)
            rows.append(builder.bitcast(builder.and_(builder.lshr(v, _splat(_I8, 32, 2 * j)) if j else v, _splat(_I8, 32, 3)), _V8I))
        for k, v in enumerate(_transpose8(builder, rows)):
            put(v, _Q2 + 256 * g + 32 * k)


def _sums_block_q2_k(tiles, b, accs):
    """q2_K's super-block: s1 = sum over the 16 sub-blocks of 16 of scale * (its products of the
    quants (0..3) and x, `vpdpbusd`), s2 = sum of min * (its activations' sum) (`vpdpwssd` of the
    min pairs and the q8_K sum slots 8-15), both exact; acc = fma(fma(-fl(s2), dmin, fl(s1) * d), dx, acc)."""
    builder = tiles[0].b
    vf = _vec(ir.FloatType(), TILE_ROWS)
    tile = tiles[0]
    src = tile.src(b, Q2_K_SUMS_BYTES)
    isums = _sums_of_16(tiles, b, src, _Q2, lambda s: tile.load(_V8I, src, builder.add(builder.mul(s, _c64(32)), _c64(_SC2))))
    pairs = [tile.load(_V16H, src, _MP2 + 32 * k) for k in range(8)]
    d, dmin = tile.load(_V8F, src, _D2), tile.load(_V8F, src, _DMIN2)
    out = []
    for isum, t, acc in zip(isums, tiles, accs):
        msum = _pair_sums(t, b, pairs)
        r = _fma(builder, builder.fneg(builder.sitofp(msum, vf)), dmin, _exact("fmul", builder, builder.sitofp(isum, vf), d))
        out.append(_fma(builder, r, t.dx(b), acc))
    return out


tile_q4_k_sums = _sums_tile_intrinsic(_sums_block_q4_k, "q4_K_sums")
tile_q6_k_sums = _sums_tile_intrinsic(_sums_block_q6_k, "q6_K_sums")
tile_q2_k_sums = _sums_tile_intrinsic(_sums_block_q2_k, "q2_K_sums")
pack_q2_k_sums = _pack_intrinsic(Q2_K, _pack_half_q2_k, Q2_K_SUMS_BYTES, "q2_K_sums")
