"""fp16 -> float32 conversion for Numba kernels.

Numba has no float16 on the CPU, so fp16 fields are read as uint16 (two bytes, little endian)
and converted through a 65536-entry float32 table (256 KiB, as ggml does on x86). The table is
built with NumPy's own conversion, so it equals `np.float16(...).astype(np.float32)` for every
bit pattern, NaN payloads included.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
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


@intrinsic
def u32_as_f32(typingctx, bits):
    """Reinterpret uint32 bits as a float32 (a register bitcast, no memory)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0], ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_as_u32(typingctx, value):
    """Reinterpret a float32 as its uint32 bits."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(value), codegen
