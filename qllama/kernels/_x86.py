"""x86 building blocks for the int8-activation dot products, as Numba intrinsics.

Each intrinsic computes the integer dot product of one weight block with int8 activations,
emitting LLVM IR that calls the x86 intrinsics `pmaddubsw` (32 u8 x i8 products summed in
pairs to i16) and `pmaddwd` (i16 x i16 summed in pairs to i32), which is how ggml does it.
(Generic LLVM vector IR was tried first: LLVM lowers `pmaddwd` patterns but not `pmaddubsw`,
which halves the speed.) These are only compiled when the host has AVX2 (`HAVE_AVX2`); other
hosts use the portable float kernels of `rows.py`.

Instruction sets (`ISA`, chosen once per process from the CPU Numba compiles for):

- `avx2`: `pmaddubsw` + `pmaddwd` + `paddd`.
- `avx2-vnni` (AVX-VNNI, or AVX-512 VNNI with VL, on 256-bit vectors): `vpdpbusd` (u8 x i8
  quads summed into i32, accumulating) and `vpdpwssd` (`pmaddwd` + `paddd` in one).
- `avx512`, `avx512-vnni`: the same, and the batch gemms (`_x86_gemm.py`) take 16 rows per
  512-bit vector (8 per 256-bit one elsewhere).

Every ISA computes the same exact int32 lane sums (no `pmaddubsw` pair sum saturates for the
quant ranges used here: at most 2 * 128 * 127), and the float steps after them are the same
instructions lane for lane, so every ISA gives the same bits. `QLLAMA_ISA` (auto, or one of
`ISA_NAMES`) picks another ISA the CPU supports. With `QLLAMA_ISA_EMULATE=1` (for tests) it
may name one the CPU lacks: each missing instruction is then emitted as exact generic IR, so
a host with only AVX2 runs the VNNI and 512-bit code shapes and checks their values; speed
means nothing there.

Arguments are arrays plus element offsets; the caller guarantees the ranges are in bounds.
All return an int64 holding the exact int32 sum.
"""

from __future__ import annotations

import os
import warnings

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import config as numba_config
from numba.extending import intrinsic

from ..gguf.types import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0


def _target_features() -> frozenset[str]:
    """The CPU features Numba compiles for: NUMBA_CPU_FEATURES when set, else the host's."""
    if numba_config.CPU_FEATURES is not None:
        return frozenset(numba_config.CPU_FEATURES.split(","))
    return frozenset(llvm.get_host_cpu_features().flatten().split(","))


_FEATURES = _target_features()
HAVE_AVX2: bool = {"+avx2", "+f16c"} <= _FEATURES  # f16c: fp16 scales converted in vector code

ISA_NAMES = ("avx2", "avx2-vnni", "avx512", "avx512-vnni")
_ZMM_FEATURES = frozenset({"+avx512f", "+avx512bw", "+avx512vl"})


def _vnni256(f) -> bool:
    return "+avxvnni" in f or {"+avx512vnni", "+avx512vl"} <= f


def _supports(isa: str, f) -> bool:
    zmm = isa.startswith("avx512")
    return (not zmm or _ZMM_FEATURES <= f) and (not isa.endswith("-vnni") or (
        "+avx512vnni" in f if zmm else _vnni256(f)))


def choose_isa(env, features) -> tuple[str, str | None]:
    """(the ISA to compile for, a one-line problem with QLLAMA_ISA or None)."""
    best = next(i for i in reversed(ISA_NAMES) if _supports(i, features))
    want = (env.get("QLLAMA_ISA") or "auto").strip().lower()
    if want == "auto":
        return best, None
    if want not in ISA_NAMES:
        return best, f"QLLAMA_ISA={want!r} is not one of: auto, {', '.join(ISA_NAMES)}"
    if env.get("QLLAMA_ISA_EMULATE") == "1" or _supports(want, features):
        return want, None
    return best, f"QLLAMA_ISA={want} needs CPU features this CPU lacks (it can run {best})"


ISA, ISA_PROBLEM = choose_isa(os.environ, _FEATURES)
if ISA_PROBLEM:  # (the CLI turns this into an error before it gets here)
    warnings.warn(f"{ISA_PROBLEM}; using {ISA}", RuntimeWarning, stacklevel=2)
EMULATED: bool = not _supports(ISA, _FEATURES)  # (QLLAMA_ISA_EMULATE=1: generic IR for what the CPU lacks)
VNNI: bool = ISA.endswith("-vnni")
ZMM: bool = ISA.startswith("avx512")
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


def _call(builder, name, ret, args):
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ret, [a.type for a in args]))
    return builder.call(fn, args)


def _halves(builder, v):
    n = v.type.count // 2
    return [builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), list(range(h * n, h * n + n)))) for h in range(2)]


def _concat(builder, a, b):
    return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 2 * a.type.count), list(range(2 * a.type.count))))


def _by_halves(fn, builder, a, b):
    """fn on each 256-bit half of a and b, joined: a 512-bit lane-wise instruction emulated."""
    return _concat(builder, *(fn(builder, x, y) for x, y in zip(_halves(builder, a), _halves(builder, b))))


def _pair_sums(builder, a, b, out, zmm_name, ymm_name):
    """Adjacent lane pairs of a 256- or 512-bit a*b summed into lanes of type `out` (half as
    many): the 512-bit instruction `zmm_name` (by 256-bit halves where the ISA lacks zmm) or
    the 256-bit `ymm_name`."""
    zmm = a.type.count * a.type.element.width == 512
    if zmm and not _ZMM_FEATURES <= _FEATURES:
        return _by_halves(lambda bl, x, y: _pair_sums(bl, x, y, out, zmm_name, ymm_name), builder, a, b)
    return _call(builder, zmm_name if zmm else ymm_name, _vec(out, a.type.count // 2), [a, b])


def _maddubs(builder, a, b):
    """pmaddubsw: <32 or 64 x i8> u8 a, i8 b -> <16 or 32 x i16> saturated pair sums."""
    return _pair_sums(builder, a, b, _I16, "llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx2.pmadd.ub.sw")


def _maddwd(builder, a, b):
    """pmaddwd: <16 or 32 x i16> -> <8 or 16 x i32> pair sums."""
    return _pair_sums(builder, a, b, _I32, "llvm.x86.avx512.pmaddw.d.512", "llvm.x86.avx2.pmadd.wd")


def _native_vnni(n_lanes: int) -> bool:
    """Whether this ISA uses VNNI and the CPU has it for <n_lanes x i32> (else: emulated, or none)."""
    return VNNI and _supports("avx512-vnni" if n_lanes == 16 else "avx2-vnni", _FEATURES)


def _madd_add(builder, acc, p, s):
    """acc + pmaddwd(p, s): <8 or 16 x i32>; one `vpdpwssd` on a VNNI ISA (emulated: the same sums)."""
    n = acc.type.count
    if not _native_vnni(n):
        return builder.add(acc, _maddwd(builder, p, s))
    vi = _vec(_I32, n)
    return _call(builder, f"llvm.x86.avx512.vpdpwssd.{32 * n}", vi, [acc, builder.bitcast(p, vi), builder.bitcast(s, vi)])


def _dot4(builder, u, s, acc=None, vnni=True):
    """<4n x i8> u8 u, i8 s -> <n x i32>: lane l = (acc's lane l +) the sum of the 4 products of
    bytes 4l..4l+3, exact (`vpdpbusd` on a VNNI ISA unless vnni=False; `pmaddubsw` + `pmaddwd` by
    ones, whose pair sums never saturate for the quant ranges here)."""
    n = u.type.count // 4
    vi = _vec(_I32, n)
    if not (VNNI and vnni):
        quads = _maddwd(builder, _maddubs(builder, u, s), _splat(_I16, 2 * n, 1))
    elif _native_vnni(n):
        return _call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * n}", vi,
                     [acc or ir.Constant(vi, [0] * n), builder.bitcast(u, vi), builder.bitcast(s, vi)])
    else:  # emulated
        prod = builder.mul(builder.zext(u, _vec(_I32, 4 * n)), builder.sext(s, _vec(_I32, 4 * n)))
        q = [_lanes(builder, prod, range(k, 4 * n, 4)) for k in range(4)]
        quads = builder.add(builder.add(q[0], q[1]), builder.add(q[2], q[3]))
    return quads if acc is None else builder.add(acc, quads)


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


def _shift_halves(builder, v, lo, hi):
    """<64 x i8> v, each byte shifted right by lo in the low 32 bytes and hi in the high 32 (as
    16-bit words, `vpsrlvw`: a byte takes bits of its neighbour only above bit 7 - lo; callers mask)."""
    words = builder.bitcast(v, _vec(_I16, 32))
    return builder.bitcast(builder.lshr(words, ir.Constant(_vec(_I16, 32), [lo] * 16 + [hi] * 16)), v.type)


def _fold(builder, acc):
    """<16 x i32> -> <8 x i32>: lane l + lane l+8 (exact: the 256-bit kernels' lane l)."""
    return builder.add(_lanes(builder, acc, range(8)), _lanes(builder, acc, range(8, 16)))


def _token_pairs(builder, accs):
    """Per-token lane sums (<8 x i32> each, or the 512-bit cores' unfolded <16 x i32>) -> two
    tokens per <16 x i32> (token 2i in lanes 0-7, 2i+1 in lanes 8-15; an odd last one alone in
    an <8 x i32>), each lane the value `_fold` gives. Why: a token's float steps after its integer
    sums (convert, scale, accumulate) then run on two tokens per instruction, lane for lane the
    same operations as on one token's eight lanes, so the same bits."""
    out = []
    for i in range(0, len(accs) - 1, 2):
        a, b = accs[i], accs[i + 1]
        if a.type.count == 16:  # [a0..7 | b0..7] + [a8..15 | b8..15]
            lo = builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 16), list(range(8)) + list(range(16, 24))))
            hi = builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, 16), list(range(8, 16)) + list(range(24, 32))))
            out.append(builder.add(lo, hi))
        else:
            out.append(_concat(builder, a, b))
    if len(accs) % 2:
        last = accs[-1]
        out.append(_fold(builder, last) if last.type.count == 16 else last)
    return out


def _per_pair(builder, vals):
    """Scalars, one per token -> per pair of tokens a <16 x float> (token 2i's value in lanes
    0-7, 2i+1's in lanes 8-15), an odd last one splatted to <8 x float> (as `_token_pairs`)."""
    out = []
    for i in range(0, len(vals) - 1, 2):
        v = ir.Constant(_vec(ir.FloatType(), 16), None)
        v = builder.insert_element(v, vals[i], ir.Constant(_I32, 0))
        v = builder.insert_element(v, vals[i + 1], ir.Constant(_I32, 8))
        out.append(_lanes(builder, v, [0] * 8 + [8] * 8))
    if len(vals) % 2:
        out.append(_splat_f(builder, vals[-1]))
    return out


def _pairs_of(builder, vecs):
    """Per-token vectors -> per pair their concatenation (an odd last one as it is)."""
    out = [_concat(builder, vecs[i], vecs[i + 1]) for i in range(0, len(vecs) - 1, 2)]
    return out + ([vecs[-1]] if len(vecs) % 2 else [])


def _nibbles_core(builder, qp, xps, sc, qh_off):
    """Per token, <8 x i32> partial sums of sum_j sc[j] * nib . x over one q4_K/q5_K super-block
    (on a 512-bit ISA <16 x i32> whose `_fold` they are).

    qp: <32 x i8>* to the 128 quant bytes; xps: one <32 x i8>* per token to its 256 int8
    activations (the weights are unpacked once for all of them); sc: <8 x i16>.
    """
    if ZMM:
        return _nibbles_core_zmm(builder, qp, xps, sc, qh_off)
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
            accs[i] = _madd_add(builder, _madd_add(builder, accs[i], plo, slo), phi, shi)
    return accs


def _nibbles_core_zmm(builder, qp, xps, sc, qh_off):
    """_nibbles_core on 512-bit vectors: the 32 bytes of group j hold its low nibbles (elements
    64j..64j+31) and high ones (64j+32..64j+63), so one vector takes both, against the 64
    consecutive activations; the lanes' sums, folded (`_token_pairs`), are those of the 256-bit form."""
    m15 = _splat(_I8, 64, 15)
    qh = None
    if qh_off is not None:
        base = builder.bitcast(qp, ir.PointerType(_I8))
        qh = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I64, qh_off)]), ir.PointerType(_vec(_I8, 32))), align=1)
        qh = _concat(builder, qh, qh)
    accs = [ir.Constant(_vec(_I32, 16), None)] * len(xps)
    for j in range(4):
        v = _load32(builder, qp, j)
        q = builder.and_(_shift_halves(builder, _concat(builder, v, v), 0, 4), m15)
        if qh is not None:  # 5th bit of element 64j+32h+l is bit 2j+h of qh[l]
            bit = builder.and_(_shift_halves(builder, qh, 2 * j, 2 * j + 1), _splat(_I8, 64, 1))
            q = builder.or_(q, builder.shl(bit, _splat(_I8, 64, 4)))
        scl = _lanes(builder, sc, [2 * j] * 16 + [2 * j + 1] * 16)
        for i, xp in enumerate(xps):
            x = builder.load(builder.gep(builder.bitcast(xp, ir.PointerType(_vec(_I8, 64))), [ir.Constant(_I32, j)]), align=1)
            accs[i] = _madd_add(builder, accs[i], _maddubs(builder, q, x), scl)
    return accs


def _q6_core(builder, base, xps, sc):
    """Per token, <8 x i32> partial sums of sum_k sc[k] * sum_l q * x over one q6_K block at i8* base
    (on a 512-bit ISA <16 x i32> whose `_fold` they are).

    q unsigned 0..63 (unpacked once for all tokens); xps: one <32 x i8>* per token to its 256
    activations; sc: <16 x i16> the block's scales.
    """
    if ZMM:
        return _q6_core_zmm(builder, base, xps, sc)
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
                accs[i] = _madd_add(builder, accs[i], p, scl)
    return accs


def _q6_core_zmm(builder, base, xps, sc):
    """_q6_core on 512-bit vectors: groups s = 2p and 2p+1 of each 128-element half in one vector
    (their low 4 bits are the low (p = 0) or high (p = 1) nibbles of 64 consecutive bytes, their
    activations 64 consecutive bytes); the lanes' sums are those of the 256-bit form, folded."""
    v64 = ir.PointerType(_vec(_I8, 64))
    m15, m3 = _splat(_I8, 64, 15), _splat(_I8, 64, 3)
    accs = [ir.Constant(_vec(_I32, 16), None)] * len(xps)
    for n in range(2):  # 128-element halves
        ab = builder.load(builder.bitcast(_gep8(builder, base, 64 * n), v64), align=1)
        h = builder.load(builder.bitcast(_gep8(builder, base, 128 + 32 * n), ir.PointerType(_vec(_I8, 32))), align=1)
        hh = _concat(builder, h, h)
        for p in range(2):
            low = builder.and_(ab if p == 0 else _shift_halves(builder, ab, 4, 4), m15)
            hs = builder.and_(_shift_halves(builder, hh, 4 * p, 4 * p + 2), m3)
            q = builder.or_(low, builder.shl(hs, _splat(_I8, 64, 4)))
            k = 8 * n + 4 * p  # sub-blocks k, k+1 (group 2p), k+2, k+3 (group 2p+1)
            scl = _lanes(builder, sc, [k] * 8 + [k + 1] * 8 + [k + 2] * 8 + [k + 3] * 8)
            for i, xp in enumerate(xps):
                x = builder.load(builder.bitcast(_gep8(builder, builder.bitcast(xp, ir.PointerType(_I8)), 128 * n + 64 * p), v64), align=1)
                accs[i] = _madd_add(builder, accs[i], _maddubs(builder, q, x), scl)
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
            acc = _madd_add(builder, acc, p, _lanes(builder, sc, [k] * 8 + [k + 1] * 8))
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


def _splat_f16(builder, p):
    """<8 x float> with the fp16 at i8* p in every lane (vpbroadcastw + vcvtph2ps)."""
    v8h = _vec(ir.HalfType(), 8)
    h = builder.load(builder.bitcast(p, ir.PointerType(ir.HalfType())), align=1)
    splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v8h, None), h, ir.Constant(_I32, 0)),
                                   ir.Constant(v8h, None), ir.Constant(_vec(_I32, 8), [0] * 8))
    return builder.fpext(splat, _vec(ir.FloatType(), 8))


def _gep8(builder, p, off):
    return builder.gep(p, [off if isinstance(off, ir.Value) else ir.Constant(_I64, off)])


def _splat_f(builder, v, n=8):
    vf = _vec(ir.FloatType(), n)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), v, ir.Constant(_I32, 0)),
                                  ir.Constant(vf, None), ir.Constant(_vec(_I32, n), [0] * n))


def _loop(builder, lo, hi, body, inits):
    """Emit `for i in range(lo, hi): vals = body(i, vals)` (i64 bounds) from the values `inits`;
    return the values after the loop (`inits` when it runs no iteration)."""
    entry = builder.block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("loop_done")
    builder.cbranch(builder.icmp_signed("<", lo, hi), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(_I64)
    vals = [builder.phi(z.type) for z in inits]
    vals2 = body(i, vals)
    i1 = builder.add(i, ir.Constant(_I64, 1))
    last = builder.block
    i.add_incoming(lo, entry)
    i.add_incoming(i1, last)
    for v, v2, z in zip(vals, vals2, inits):
        v.add_incoming(z, entry)
        v.add_incoming(v2, last)
    builder.cbranch(builder.icmp_signed("<", i1, hi), loop, done)
    builder.position_at_end(done)
    finals = []
    for v2, z in zip(vals2, inits):  # all phi nodes first
        f = builder.phi(z.type)
        f.add_incoming(z, entry)
        f.add_incoming(v2, last)
        finals.append(f)
    return finals


def _hsum8(builder, v):
    """The pairwise horizontal sum of <8 x float> v in this order, rounded as written (ggml's
    hsum_float_8, and the gemms' tiles): (lanes 0-3 + 4-7), then (0-1 + 2-3), then 0 + 1."""
    for n in (4, 2, 1):
        v = _exact("fadd", builder, _lanes(builder, v, range(n)), _lanes(builder, v, range(n, 2 * n)))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _row_loop(builder, nb, body, n_acc, n_scalar=0):
    """Emit `for b in range(nb): accs = body(b, accs)` over vector float accumulators (then
    n_scalar float ones); return the vector ones' 8-lane groups' sums, then the scalar ones.

    n_acc: how many <8 x float> accumulators, or a list of their widths (8 or 16: a 16-lane one
    holds two tokens' eight lanes, summed as two 8-lane ones). Keeping the partial sums in vector
    registers for the whole row (one horizontal sum per row, not per block) is what makes these
    row kernels fast.
    """
    widths = [8] * n_acc if isinstance(n_acc, int) else list(n_acc)
    zeros = [ir.Constant(_vec(ir.FloatType(), w), [0.0] * w) for w in widths] + [ir.Constant(ir.FloatType(), 0.0)] * n_scalar
    phis = _loop(builder, ir.Constant(_I64, 0), nb, body, zeros)
    sums = []
    for acc in phis[:len(widths)]:
        for h in range(acc.type.count // 8):
            sums.append(_hsum8(builder, _lanes(builder, acc, range(8 * h, 8 * h + 8)) if acc.type.count > 8 else acc))
    return sums + phis[len(widths):]


def _row_ptrs(context, builder, signature, args):
    """(row u8*, [per token: (xq i8*, xd f32*, xs i32* or f32*)]) from a row intrinsic's arguments.

    1-D activations: one token. 2-D (n_tok, .) activations plus a first token t0 (args[5]):
    tokens t0 .. t0+n-1, n the size of the returned tuple (N_TILE, or row_dotn's n).
    """
    z = ir.Constant(_I64, 0)
    rowp = _ptr(context, builder, signature.args[0], args[0], z, _I8)
    sty = ir.FloatType() if signature.args[4].dtype == types.float32 else _I32
    tys = ((2, _I8), (3, ir.FloatType()), (4, sty))
    if signature.args[2].ndim == 1:
        return rowp, [tuple(_ptr(context, builder, signature.args[k], args[k], z, ty) for k, ty in tys)]
    toks = []
    for i in range(signature.return_type.count):
        t = builder.add(args[5], ir.Constant(_I64, i))
        ptrs = []
        for k, ty in tys:
            ary = context.make_array(signature.args[k])(context, builder, args[k])
            stride = builder.extract_value(ary.strides, 0)  # bytes between tokens
            p = builder.gep(builder.bitcast(ary.data, ir.PointerType(_I8)), [builder.mul(t, stride)])
            ptrs.append(builder.bitcast(p, ir.PointerType(ty)))
        toks.append(tuple(ptrs))
    return rowp, toks


# The row kernels (every int8 row intrinsic: k-quants, 32-element types, i-quants, mxfp4) ask, at
# every block, for the lines PREFETCH_BYTES ahead of it (the rows of a thread's chunk lie end to
# end, so this runs on into the next rows). Asking once per row for a whole row further ahead (as
# the row loops did before) issued a burst of up to ~100 prefetches at each row start, too many to
# keep in flight: on Zen 5 the 1B shape's ffn_down (rows of 4.6-6.7 KB) read at 20 GB/s from
# memory at one thread, 37 GB/s this way; four tokens' rows 9 -> 22 GB/s; q8_0 rows of 8192, one
# token, 14 -> 34 GB/s (the same bits: a prefetch computes nothing).
PREFETCH_BYTES = 8192


def _prefetch_block(builder, blk, size):
    """Ask for the cache lines PREFETCH_BYTES ahead of the `size` bytes at i8* blk (never faults)."""
    for off in range(0, size, 64):
        _call(builder, "llvm.prefetch", ir.VoidType(), [_gep8(builder, blk, PREFETCH_BYTES + off), ir.Constant(_I32, 0),
                                                         ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


N_TILE = 4  # tokens per call of the multi-token row intrinsics (weights unpacked once for all)


def _row_kquant45(context, builder, signature, args, kind):
    """q4_K / q5_K row(s) times q8_K activation(s): sum_b dx_b * (d_b*isum_b - dmin_b*msum_b).

    args: row (u8[]), nb, xq (i8), xd (f32), xs (i32 16-element sums) [, t0: see _row_ptrs].
    """
    bsz, qoff, qh_off = (144, 16, None) if kind == "q4" else (176, 48, -32)
    rowp, toks = _row_ptrs(context, builder, signature, args)

    def c(v):
        return ir.Constant(_I32, v)

    def body(b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, bsz)))
        _prefetch_block(builder, blk, bsz)
        d = _load_f16(builder, blk)
        dmin = _load_f16(builder, _gep8(builder, blk, 2))
        u = [builder.load(builder.bitcast(_gep8(builder, blk, 4 + 4 * i), ir.PointerType(_I32)), align=1) for i in range(3)]
        # 6-bit scales and mins, one per byte (ggml's utmp unpacking)
        sc_lo = builder.and_(u[0], c(0x3F3F3F3F))
        mn_lo = builder.and_(u[1], c(0x3F3F3F3F))
        sc_hi = builder.or_(builder.and_(u[2], c(0x0F0F0F0F)), builder.shl(builder.and_(builder.lshr(u[0], c(6)), c(0x03030303)), c(4)))
        mn_hi = builder.or_(builder.and_(builder.lshr(u[2], c(4)), c(0x0F0F0F0F)),
                            builder.shl(builder.and_(builder.lshr(u[1], c(6)), c(0x03030303)), c(4)))

        def bytes8(lo, hi):
            v = builder.insert_element(ir.Constant(_vec(_I32, 2), None), lo, c(0))
            return builder.bitcast(builder.insert_element(v, hi, c(1)), _vec(_I8, 8))

        sc = builder.zext(bytes8(sc_lo, sc_hi), _vec(_I16, 8))
        mn16 = builder.bitcast(builder.zext(bytes8(mn_lo, mn_hi), _vec(_I32, 8)), _vec(_I16, 16))  # (m_l, 0) pairs
        qp = builder.bitcast(_gep8(builder, blk, qoff), ir.PointerType(_vec(_I8, 32)))
        xps = [builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))), ir.PointerType(_vec(_I8, 32)))
               for xq, _, _ in toks]
        isums = _token_pairs(builder, _nibbles_core(builder, qp, xps, sc, qh_off))
        xds = _per_pair(builder, [builder.load(builder.gep(xd, [b]), align=4) for _, xd, _ in toks])
        # (slots 0-7 of each token's 16 sums: the sums of 32, act_quant.Q8K_SUMS)
        sums32 = _pairs_of(builder, [builder.load(builder.bitcast(builder.gep(xs, [builder.mul(b, ir.Constant(_I64, 16))]),
                                                                  ir.PointerType(_vec(_I16, 16))), align=4) for _, _, xs in toks])
        out = []
        for acc, isum, xdb, pairs in zip(accs, isums, xds, sums32):
            n = isum.type.count  # 8 lanes per token: one token, or two
            vf = _vec(ir.FloatType(), n)
            mins = mn16 if n == 8 else _concat(builder, mn16, mn16)
            msum = _maddwd(builder, pairs, mins)  # m_l * (sum of 32): each sum's high half meets a 0
            # acc = fma(-dmin*dx, msum, fma(d*dx, isum, acc)), written out: with the fast-math
            # freedom the kernels compile with, LLVM factored dx out of the pair form (other bits)
            dx = _exact("fmul", builder, _splat_f(builder, d, n), xdb)
            neg_mx = _exact("fmul", builder, _splat_f(builder, builder.fneg(dmin), n), xdb)
            acc = _fma(builder, dx, builder.sitofp(isum, vf), acc)
            out.append(_fma(builder, neg_mx, builder.sitofp(msum, vf), acc))
        return out

    return _pack(context, builder, signature, _row_loop(builder, args[1], body, _widths(len(toks))))


def _widths(n_tok):
    """The accumulators' widths for n_tok tokens paired as `_token_pairs` pairs them."""
    return [16] * (n_tok // 2) + [8] * (n_tok % 2)


def _row_q6_k(context, builder, signature, args):
    """q6_K row(s) times q8_K activation(s): sum_b d_b*dx_b*(sum_k sc_k*(sum q x - 32*bsum_k))."""
    rowp, toks = _row_ptrs(context, builder, signature, args)

    def body(b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, 210)))
        _prefetch_block(builder, blk, 210)
        d = _load_f16(builder, _gep8(builder, blk, 208))
        sc = builder.sext(builder.load(builder.bitcast(_gep8(builder, blk, 192), ir.PointerType(_vec(_I8, 16))), align=1), _vec(_I16, 16))
        sc_pairs = _lanes(builder, sc, [k // 2 + 8 * (k % 2) for k in range(16)])  # (s_l, s_l+8), as the q8_K sums' slots 8-15
        xps = [builder.bitcast(_gep8(builder, xq, builder.mul(b, ir.Constant(_I64, 256))), ir.PointerType(_vec(_I8, 32)))
               for xq, _, _ in toks]
        isums = _token_pairs(builder, _q6_core(builder, blk, xps, sc))
        xds = _per_pair(builder, [builder.load(builder.gep(xd, [b]), align=4) for _, xd, _ in toks])
        sums16 = _pairs_of(builder, [builder.load(builder.bitcast(builder.gep(xs, [builder.add(builder.mul(b, ir.Constant(_I64, 16)), ir.Constant(_I64, 8))]),
                                                                  ir.PointerType(_vec(_I16, 16))), align=4) for _, _, xs in toks])
        out = []
        for acc, isum, xdb, pairs in zip(accs, isums, xds, sums16):
            n = isum.type.count  # 8 lanes per token: one token, or two
            scs = sc_pairs if n == 8 else _concat(builder, sc_pairs, sc_pairs)
            corr = _maddwd(builder, pairs, scs)
            isum = builder.sub(isum, builder.shl(corr, ir.Constant(_vec(_I32, n), [5] * n)))
            db = _exact("fmul", builder, _splat_f(builder, d, n), xdb)
            out.append(_fma(builder, db, builder.sitofp(isum, _vec(ir.FloatType(), n)), acc))
        return out

    return _pack(context, builder, signature, _row_loop(builder, args[1], body, _widths(len(toks))))


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
    """a negated where b < 0, zeroed where b == 0 (vpsignb; AVX-512 has none: select on 64 bytes)."""
    v = a.type
    if v.count == 32:
        fn = builder.module.declare_intrinsic("llvm.x86.avx2.psign.b", fnty=ir.FunctionType(v, [v, v]))
        return builder.call(fn, [a, b])
    zero = ir.Constant(v, [0] * v.count)
    kept = builder.select(builder.icmp_signed("==", b, zero), zero, a)
    return builder.select(builder.icmp_signed("<", b, zero), builder.sub(zero, a), kept)


def _fifth_bits(builder, p):
    """<32 x i8>: 16 where bit e of the uint32 at i8* p is set (element e's fifth bit), else 0."""
    qh = builder.bitcast(builder.load(builder.bitcast(p, ir.PointerType(_I32)), align=1), _vec(_I8, 4))
    spread = _lanes(builder, qh, [e // 8 for e in range(32)])  # byte e // 8 in lane e
    mask = ir.Constant(_vec(_I8, 32), [((1 << (e % 8)) ^ 128) - 128 for e in range(32)])  # bit e % 8 as a signed i8
    is_set = builder.icmp_unsigned("!=", builder.and_(spread, mask), _splat(_I8, 32, 0))
    return builder.select(is_set, _splat(_I8, 32, 16), _splat(_I8, 32, 0))


def _fma(builder, a, b, c):
    """a * b + c rounded once (vfmadd), float32 or lane-wise on a float32 vector."""
    name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(a.type, [a.type] * 3))
    return builder.call(fn, [a, b, c])


def _exact(op, builder, a, b):
    """a op b with no fast-math freedom (the kernels compile with fastmath; Numba adds its flags
    only to float instructions that have none, and `arcp` changes nothing here)."""
    return getattr(builder, op)(a, b, flags=("arcp",))


def _row_legacy(context, builder, signature, args, kind):
    """q4_0 / q4_1 / q5_0 / q5_1 / q8_0 row(s) times q8_0 or q8_1 activation(s), as ggml's vec_dot:

    per block b, isum = sum_l q_l x_l in int32 (pmaddubsw + pmaddwd; q unsigned, or |w| and sign(x, w)
    for q8_0), minus off * xs_b for q4_0/q5_0 (xs: int32 sums of x); then acc += d_b*dx_b*isum
    (8 lanes), and for q4_1/q5_1 a scalar sum of m_b * s_b (xs: float32 s of q8_1), added at the
    end. The weights are unpacked once for all tokens. The two-row form (`row2_*`: two row
    arguments, one token) runs both rows' chains in one loop, each row's arithmetic unchanged.
    """
    bsz, qoff, qh_off, m_off, off = _LEGACY[kind]
    v8f = _vec(ir.FloatType(), 8)
    if signature.args[1] == signature.args[0]:  # two rows (row2_* intrinsics), one token
        rowps = [_ptr(context, builder, signature.args[k], args[k], ir.Constant(_I64, 0), _I8) for k in (0, 1)]
        _, toks = _row_ptrs(context, builder, signature.replace(args=signature.args[1:]), args[1:])
    else:
        rowp, toks = _row_ptrs(context, builder, signature, args)
        rowps = [rowp]
    v32 = ir.PointerType(_vec(_I8, 32))
    n = len(toks)
    nv = n * len(rowps)  # vector accumulators: row-major over (rows, tokens); then as many scalar ones (q4_1 / q5_1)

    def body(b, accs):
        outs = [row_body(rowp, b, accs[j * n:(j + 1) * n] + accs[nv + j * n:nv + (j + 1) * n])
                for j, rowp in enumerate(rowps)]
        return [v for o, _ in outs for v in o] + [v for _, om in outs for v in om]

    def row_body(rowp, b, accs):
        blk = _gep8(builder, rowp, builder.mul(b, ir.Constant(_I64, bsz)))
        _prefetch_block(builder, blk, 1)  # (blocks of 18-34 bytes: one line ahead per block covers every line)
        d = _splat_f16(builder, blk)
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
            corr = None  # lane 0 starts at -off * xs_b (exact: the dot adds to it)
            if off:
                corr = builder.mul(builder.load(builder.gep(xs, [b]), align=4), ir.Constant(_I32, -off))
                corr = builder.insert_element(ir.Constant(_vec(_I32, 8), [0] * 8), corr, ir.Constant(_I32, 0))
            # (q8_0: `pmaddubsw` + `pmaddwd`, 30 GB/s at one thread on Zen 5, against 17 with `vpdpbusd`)
            isum = _dot4(builder, q, x, acc=corr, vnni=kind != "q8_0")  # (8,) i32
            # flags of our own, so that Numba's fast-math adds none: d * dx rounded as ggml rounds it,
            # then one fma (as ggml's `_mm256_fmadd_ps`: the products equal ggml's bit for bit)
            db = builder.fmul(d, _splat_f(builder, builder.load(builder.gep(xd, [b]), align=4)), flags=("arcp",))
            prod = builder.fmul(db, builder.sitofp(isum, v8f), flags=("contract",))
            out.append(builder.fadd(accs[i], prod, flags=("contract",)))
            if m is not None:
                outm.append(_fma(builder, m, builder.load(builder.gep(xs, [b]), align=4), accs[n + i]))
        return out, outm

    sums = _row_loop(builder, args[len(rowps)], body, nv, nv if m_off is not None else 0)
    if m_off is not None:
        sums = [builder.fadd(a, ms) for a, ms in zip(sums[:nv], sums[nv:])]
    return _pack(context, builder, signature, sums)


def _row2_sig(one, row_a, row_b):
    """(signature, codegen) of a two-row intrinsic from its one-row form `one` (or None)."""
    if one is None or row_b != row_a:
        return None
    sig = types.UniTuple(types.float32, 2)(row_a, *one[0].args)
    return sig, one[1]


def _pack(context, builder, signature, sums):
    """Return one float32, or a UniTuple of them for the multi-token variants."""
    if len(sums) == 1 and not isinstance(signature.return_type, types.UniTuple):
        return sums[0]
    return context.make_tuple(builder, signature.return_type, sums)


def _row_sig(row, nb, xq, xd, xs, t0=None, xs_dtypes=(types.int32,), n=N_TILE):
    """Signature of a row intrinsic: 1-D activations -> float32; 2-D plus t0 -> n float32s."""
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
    return types.UniTuple(types.float32, n)(row, nb, xq, xd, xs, t0) if ok else None


@intrinsic
def row_dot_q4_k(typingctx, row, nb, xq, xd, xs):
    """A q4_K row (nb super-blocks) times one q8_K activation (xq, xd, xs = 16-element sums) -> float32."""
    sig = _row_sig(row, nb, xq, xd, xs)
    return (sig, lambda c, b, sg, a: _row_kquant45(c, b, sg, a, "q4")) if sig else None


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
def row_dot4_q4_k(typingctx, row, nb, xq, xd, xs, t0):
    """A q4_K row times tokens t0..t0+3 of 2-D q8_K activations -> 4 float32 (weights unpacked once).

    Each token's arithmetic is exactly that of row_dot_q4_k (same results, bit for bit).
    """
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, lambda c, b, sg, a: _row_kquant45(c, b, sg, a, "q4")) if sig else None


@intrinsic
def row_dot4_q5_k(typingctx, row, nb, xq, xd, xs, t0):
    """As row_dot4_q4_k for q5_K."""
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, lambda c, b, sg, a: _row_kquant45(c, b, sg, a, "q5")) if sig else None


@intrinsic
def row_dot4_q6_k(typingctx, row, nb, xq, xd, xs, t0):
    """As row_dot4_q4_k for q6_K."""
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, _row_q6_k) if sig else None


def _q8_0_sig(row, nb, xq, xd, xs, t0=None):
    """(signature, codegen) of a q8_0 row intrinsic (q8_0 activations), or None."""
    sig = _row_sig(row, nb, xq, xd, xs, t0)
    return (sig, lambda c, b, sg, a: _row_legacy(c, b, sg, a, "q8_0")) if sig else None


@intrinsic
def row_dot_q8_0(typingctx, row, nb, xq, xd, xs):
    """A q8_0 row (nb blocks) times one q8_0 activation (xd per 32; xs unused) -> float32."""
    return _q8_0_sig(row, nb, xq, xd, xs)


@intrinsic
def row_dot4_q8_0(typingctx, row, nb, xq, xd, xs, t0):
    """As row_dot4_q4_k for q8_0 (q8_0 activations)."""
    return _q8_0_sig(row, nb, xq, xd, xs, t0)


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


_TAIL_KINDS = {Q4_K: "q4", Q5_K: "q5", Q6_K: "q6", Q8_0: "q8_0", Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0",
               Q5_1: "q5_1"}


@intrinsic(prefer_literal=True)
def row_dotn(typingctx, type_id, row, nb, xq, xd, xs, t0, n):
    """The row_dot4 intrinsic of type_id (a literal, in _TAIL_KINDS) for the n tokens t0..t0+n-1
    (n a literal) of 2-D activations -> n float32: a tile's tail of 2 or 3 tokens with the
    weights unpacked once (not once per token), each token bit for bit its one-token value."""
    if not (isinstance(type_id, types.IntegerLiteral) and isinstance(n, types.IntegerLiteral)):
        return None
    kind = _TAIL_KINDS.get(type_id.literal_value)
    sig = _row_sig(row, nb, xq, xd, xs, t0, xs_dtypes=(types.int32, types.float32), n=n.literal_value)
    if kind is None or sig is None:
        return None
    if kind in ("q4", "q5"):
        def gen(c, b, sg, a):
            return _row_kquant45(c, b, sg, a, kind)
    elif kind == "q6":
        gen = _row_q6_k
    else:
        def gen(c, b, sg, a):
            return _row_legacy(c, b, sg, a, kind)
    full = sig.return_type(type_id, *sig.args, n)
    return full, lambda c, b, sg, a: gen(c, b, sg.replace(args=sg.args[1:]), a[1:])


# Two rows, one token: two independent chains of fmas (one row's chain, an fma per 32 weights,
# is bound by the fma's latency), each bit for bit the one-row intrinsic's value. Give them rows
# far apart: two rows next to each other, read in lockstep, ran at a third of the speed from
# memory on Zen 5 (the prefetcher), while rows half a chunk apart ran 1.23x one row.


@intrinsic
def row2_dot_q4_legacy(typingctx, row_a, row_b, nb, xq, xd, xs):
    """row_dot_q4_legacy of two rows -> 2 float32."""
    return _row2_sig(_legacy_sig(4, row_a, nb, xq, xd, xs), row_a, row_b)


@intrinsic
def row2_dot_q5_legacy(typingctx, row_a, row_b, nb, xq, xd, xs):
    """row_dot_q5_legacy of two rows -> 2 float32."""
    return _row2_sig(_legacy_sig(5, row_a, nb, xq, xd, xs), row_a, row_b)


@intrinsic
def row2_dot_q8_0(typingctx, row_a, row_b, nb, xq, xd, xs):
    """row_dot_q8_0 of two rows -> 2 float32."""
    return _row2_sig(_q8_0_sig(row_a, nb, xq, xd, xs), row_a, row_b)
