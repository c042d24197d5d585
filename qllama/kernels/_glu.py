"""The gated FFN's activation times up: the intrinsic `glu16`.

out[t, :n] = act(gate[t, :n]) * up[t, :n] for the n // 16 whole 16-lane vectors of row t.

- SiLU: g / (1 + exp(-g)) with exp as ggml's `ggml_v_expf` on AVX-512 (vec.h: the Arm optimized
  routine's polynomial, then a scaling by 2^n; |n| > 192 gives 0 or inf), so that a row's
  activations are llama.cpp's on that ISA bit for bit, given the same gate and up. It matters more
  than its rounding suggests: the result is rounded to 8 bits for ffn_down, and every element
  that lands on the other side of a rounding step moves the output by a whole step (on the golden
  Q4_K_M model, an exp 1 ulp off llama.cpp's doubled the largest prompt-logit difference).
  (llama.cpp's AVX2 build rounds the last step differently, k + k j instead of (1 + j) 2^n.)
- GELU (tanh form): g / (1 + exp(z)) with z = -2 sqrt(2/pi) g (1 + 0.044715 g^2) and exp the
  Cephes-style `_softmax._vexp` (clamped to [-87.3, 88.37]). (ggml reads GELU from a table of fp16
  values.)

Why vector code: `layer_ops._glu_row` did this in three scalar-written passes through scratch
arrays (Numba cannot reinterpret a float's bits in a loop it vectorises): ~4.5 ns per element, 17
ms per layer of a 512-token prompt on the 1B shape, on the calling thread while the other threads
wait (4.7% of a two-thread prompt). This is one pass of vector operations.

Explicit LLVM vector operations without fast-math freedom (each step rounded as written: fused
multiply-adds where written, an IEEE division): the same bits on every ISA, and for a token
whatever batch it is in. Arguments: gate, up, out (T, N) float32 C-contiguous (out may be gate);
t int64 the row; n_vec int64 the number of 16-lane vectors from the row's start; gelu bool.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._scores import _row_ptr
from ._softmax import _EXP_MAX, _EXP_MIN, LANES, _VF, _VI, _vc, _vexp
from ._x86 import _loop
from ._x86_gemm import _c64, _exact, _fma

_GELU_K = -2.0 * 0.79788456080286535587989211986876  # -2 sqrt(2/pi)
_GELU_A = 0.044715

# ggml_v_expf's constants (hexadecimal floats in ggml's source)
_SHIFTER = float.fromhex("0x1.8p23")  # adding it rounds to an integer
_INV_LN2 = float.fromhex("0x1.715476p+0")
_LN2_HI, _LN2_LO = float.fromhex("0x1.62e4p-1"), float.fromhex("0x1.7f7d1cp-20")
_C = [float.fromhex(h) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")]


def _pow2(builder, k):
    """2.0^k for an integer-valued float vector k in [-126, 127], from its IEEE bits."""
    bits = builder.shl(builder.add(builder.fptosi(k, _VI), ir.Constant(_VI, [127] * LANES)), ir.Constant(_VI, [23] * LANES))
    return builder.bitcast(bits, _VF)


def _exp_ggml(builder, x):
    """exp(x) lane-wise as ggml_v_expf (AVX-512) computes it: n = round(x / ln 2) by the shifter,
    b = x - n ln 2 (two fused steps), j = 1 + b P(b) (fused multiply-adds in ggml's order), then
    j 2^n rounded once (vscalefps); |n| > 192: inf for n > 0, else 0."""
    z = _fma(builder, x, _vc(_INV_LN2), _vc(_SHIFTER))
    n = _exact("fsub", builder, z, _vc(_SHIFTER))
    nn = builder.fneg(n)
    b = _fma(builder, nn, _vc(_LN2_LO), _fma(builder, nn, _vc(_LN2_HI), x))
    u = _exact("fmul", builder, b, b)
    c0, c1, c2, c3, c4 = (_vc(c) for c in _C)
    j = _fma(builder, _fma(builder, _fma(builder, c0, b, c1), u, _fma(builder, c2, b, c3)), u,
             _fma(builder, c4, b, _vc(1.0)))
    # j 2^n with one rounding: j 2^a is exact (a = n / 2 rounded toward zero, both powers normal for
    # |n| <= 192), and the product by 2^(n - a) rounds as vscalefps does (into the subnormals too)
    big = builder.fcmp_ordered(">", builder.call(builder.module.declare_intrinsic(
        "llvm.fabs.v16f32", fnty=ir.FunctionType(_VF, [_VF])), [n]), _vc(192.0))
    n_ok = builder.select(big, _vc(0.0), n)  # (keeps the bit arithmetic in range; the lane is replaced)
    a = builder.call(builder.module.declare_intrinsic("llvm.trunc.v16f32", fnty=ir.FunctionType(_VF, [_VF])),
                     [_exact("fmul", builder, n_ok, _vc(0.5))])
    res = _exact("fmul", builder, _exact("fmul", builder, j, _pow2(builder, a)),
                 _pow2(builder, _exact("fsub", builder, n_ok, a)))
    alt = builder.select(builder.fcmp_ordered("<=", n, _vc(0.0)), _vc(0.0), _vc(float("inf")))
    return builder.select(big, alt, res)


def _f32_2d(t) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.dtype == types.float32 and t.layout == "C"


@intrinsic
def glu16(typingctx, gate, up, out, t, n_vec, gelu):
    if not (_f32_2d(gate) and _f32_2d(up) and _f32_2d(out)):
        return None

    def codegen(context, builder, sig, args):
        gate, up, out, t, n_vec, gelu = args
        pg, pu, po = (builder.bitcast(_row_ptr(context, builder, ty, a, t), ir.PointerType(_VF))
                      for ty, a in zip(sig.args[:3], (gate, up, out)))
        lo, hi, one = _vc(_EXP_MIN), _vc(_EXP_MAX), _vc(1.0)

        def exp_gelu(g):  # z = (K g) (1 + (A g) g), Cephes exp
            z = _exact("fmul", builder, _exact("fmul", builder, _vc(_GELU_K), g),
                       _fma(builder, _exact("fmul", builder, _vc(_GELU_A), g), g, one))
            z = builder.select(builder.fcmp_ordered("<", z, lo), lo, z)
            z = builder.select(builder.fcmp_ordered(">", z, hi), hi, z)
            return _vexp(builder, z)

        def exp_silu(g):  # ggml's exp(0 - g)
            return _exp_ggml(builder, _exact("fsub", builder, _vc(0.0), g))

        def row(exp):
            def step(i, _):
                g = builder.load(builder.gep(pg, [i]), align=4)
                u = builder.load(builder.gep(pu, [i]), align=4)
                # an IEEE division ("nsz" only keeps Numba from adding its fast-math flags)
                a = builder.fdiv(g, _exact("fadd", builder, one, exp(g)), flags=("nsz",))
                builder.store(_exact("fmul", builder, a, u), builder.gep(po, [i]), align=4)
                return []

            _loop(builder, _c64(0), n_vec, step, [])

        with builder.if_else(gelu) as (then, otherwise):  # one loop per activation: only its exp runs
            with then:
                row(exp_gelu)
            with otherwise:
                row(exp_silu)
        return context.get_dummy_value()

    return types.void(gate, up, out, t, n_vec, gelu), codegen
