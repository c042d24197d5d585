"""x86 intrinsics of MXFP4's int8 dot product, as ggml's AVX2 `ggml_vec_dot_mxfp4_q8_0`.

The shape of iq4_nl's (`_x86_iq.py`): the 4-bit codes index the 16 doubled e2m1 values
`KVALUES_MXFP4` (`vpshufb`, low nibbles = elements 0-15, high = 16-31), the products are
`pmaddubsw(|q|, sign(x, q))` summed per lane of 4 in int32 (exact), and block b's 8 lane sums are
multiplied by dx_b * E8M0_HALF(e_b) (rounded once) and added with one fma into accumulator b % 2;
the row's value is the horizontal sum of the two accumulators' sum. ggml's scalar tail block (an
odd block count) is `tail_mxfp4`. The block scale is the exponent byte e decoded as ggml's
`GGML_E8M0_TO_FP32_HALF` (the float32 with bits (e - 1) << 23, or 0x00200000 << e for e < 2),
from a table of the 256 values.
Every ISA runs these 256-bit shapes, so every ISA gives the same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from ..dequant.mxfp4_rows import BLOCK_BYTES, E8M0_HALF, KVALUES_MXFP4
from ._x86 import _I32
from ._x86_iq import Pairs, _at, _row_pairs, _table, row_intrinsics, tail_intrinsic


def _e8m0_half(builder, blk):
    """float32 scale of the mxfp4 block at i8* blk (its exponent byte, ggml's E8M0_TO_FP32_HALF),
    looked up in `E8M0_HALF`'s 256 bit patterns (one load, where the decode took six integer
    instructions and a move to the vector unit per block)."""
    e = builder.zext(builder.load(blk, align=1), _I32)
    table = _table(builder, "qllama_e8m0_half", E8M0_HALF.view(np.int32), _I32)
    return builder.bitcast(_at(builder, table, e), ir.FloatType())


# the e8m0 byte, then 16 bytes of 4-bit codes of the doubled e2m1 values
MXFP4_PAIRS = Pairs(BLOCK_BYTES, 1, _e8m0_half, KVALUES_MXFP4)

row_dot_mxfp4, row_dot4_mxfp4 = row_intrinsics(lambda c, b, sg, a: _row_pairs(c, b, sg, a, MXFP4_PAIRS), "mxfp4",
                                               "The first nb (even) blocks of an mxfp4 row times q8_0 activations")
tail_mxfp4 = tail_intrinsic(MXFP4_PAIRS, "mxfp4")
