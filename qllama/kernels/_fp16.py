"""fp16 <-> float32 conversion for Numba kernels.

Numba has no float16 on the CPU, so fp16 fields are read as uint16 (two bytes, little endian)
and converted through a 65536-entry float32 table (256 KiB, as ggml does on x86). The table is
built with NumPy's own conversion, so it equals `np.float16(...).astype(np.float32)` for every
bit pattern, NaN payloads included. Values held as f16 bits (the KV cache) convert in registers:
`f16_value` (portable) or `f16c_load` (F16C), and back, rounded to nearest even, with `f16_bits`
(portable) or `f16c_store` (F16C); `HAVE_F16C` says which the host runs.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
import llvmlite.binding as llvm
from numba import types

from .jit import kernel
from numba.extending import intrinsic

# (65536,) float32: FP16_TO_F32[bits] is the value of the fp16 with those bits
FP16_TO_F32: np.ndarray = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
FP16_TO_F32.flags.writeable = False


@kernel(boundscheck=False, inline="always")
def f16_at(row, off, tab):
    """The fp16 stored little-endian at row[off:off+2], as float32 (via the table `tab`)."""
    return tab[np.int64(row[off]) | (np.int64(row[off + 1]) << 8)]


def _bit_intrinsic(name: str, doc: str, accepts, result, emit):
    """An intrinsic of one argument x, accepted when accepts(Numba type of x), returning the
    Numba type `result` as emit(builder, llvm value of x): the bit reinterpretations below."""

    def typer(typingctx, x):
        if not accepts(x):
            return None

        def codegen(context, builder, sig, args):
            return emit(builder, args[0])

        return result(x), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


u32_as_f32 = _bit_intrinsic(
    "u32_as_f32", "Reinterpret uint32 bits as a float32 (a register bitcast, no memory).",
    lambda t: isinstance(t, types.Integer), types.float32,
    lambda b, v: b.bitcast(b.trunc(v, ir.IntType(32)) if v.type.width > 32 else v, ir.FloatType()))
f32_as_u32 = _bit_intrinsic(
    "f32_as_u32", "Reinterpret a float32 as its uint32 bits.",
    lambda t: t == types.float32, types.uint32, lambda b, v: b.bitcast(v, ir.IntType(32)))


# -- f16 values (the KV cache, fp16 weights): bits <-> float32 in registers --------------

@kernel(inline="always", boundscheck=False)
def f16_value(h):
    """The float32 value of fp16 bits h (int32 0..65535), branch-free so loops vectorise.

    Shift exponent+mantissa into place and multiply by 2^112 (exact for normals and subnormals);
    Inf/NaN (exponent all ones) get the float32 all-ones exponent, keeping the mantissa.
    """
    sign = np.uint32((h & 0x8000) << 16)
    mag = np.uint32((h & 0x7FFF) << 13)
    bits = f32_as_u32(u32_as_f32(mag) * np.float32(2.0**112))
    if (h & 0x7C00) == 0x7C00:
        bits = mag | np.uint32(0x7F800000)
    return u32_as_f32(bits | sign)


HAVE_F16C = "+f16c" in llvm.get_host_cpu_features().flatten().split(",")


f16c_load = _bit_intrinsic(
    "f16c_load", "uint16 f16 bits -> float32 as LLVM's fpext from half (F16C: vcvtph2ps, vectorised).",
    lambda t: t == types.uint16, types.float32, lambda b, v: b.fpext(b.bitcast(v, ir.HalfType()), ir.FloatType()))
f16c_store = _bit_intrinsic(
    "f16c_store", "float32 -> uint16 f16 bits as LLVM's fptrunc to half: round to nearest even (F16C: vcvtps2ph).",
    lambda t: t == types.float32, types.uint16, lambda b, v: b.bitcast(b.fptrunc(v, ir.HalfType()), ir.IntType(16)))


@kernel
def f16_bits(x):
    """float32 x -> its f16 bits (uint16), rounded to nearest even, in integer arithmetic (for
    hosts without F16C; equals NumPy's float32 -> float16 for every non-NaN input)."""
    a = f32_as_u32(np.float32(x))
    sign = (a >> np.uint32(16)) & np.uint32(0x8000)
    a &= np.uint32(0x7FFFFFFF)
    if a >= 0x7F800000:  # inf stays inf; NaN stays a (quiet) NaN
        return np.uint16(sign | 0x7C00 | (0x200 | ((a >> 13) & 0x1FF) if a > 0x7F800000 else 0))
    if a >= 0x38800000:  # a normal f16 (>= 2^-14): rebias the exponent, round away 13 mantissa bits
        m = a - np.uint32(0x38000000)
        r = (m + np.uint32(0x0FFF) + ((m >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        return np.uint16(sign | min(r, np.uint32(0x7C00)))  # a carry past 65504 is inf
    e = a >> np.uint32(23)  # subnormal f16 or zero: the value in units of 2^-24, rounded
    shift = np.uint32(126) - e
    if shift > 31:
        return np.uint16(sign)
    mant = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    q = mant >> shift
    rem = mant & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    if rem > half or (rem == half and (q & np.uint32(1)) == 1):
        q += np.uint32(1)
    return np.uint16(sign | q)
