"""The batch kernel of each type (`int8.gemm`): GEMM_KERNELS, type id -> (pack, tile), and the
intrinsics `pack_rows` / `tile_rows` that emit a type's pair in place (the k-quants' and legacy
types' from `_x86_gemm.py`, the i-quants' from `_x86_gemm_iq.py`)."""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic

from ..gguf.types import (
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q4_0,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
)
from ._x86_gemm import (
    PACKED_BYTES,
    Q2_K_SUMS_BYTES,
    Q4_K_SUMS_BYTES,
    SUMS,
    pack_q2_k_sums,
    pack_q4_0,
    pack_q4_k,
    pack_q4_k_sums,
    pack_q5_0,
    pack_q5_k_sums,
    pack_q6_k,
    pack_q8_0,
    tile_q2_k_sums,
    tile_q4_0,
    tile_q4_k,
    tile_q4_k_sums,
    tile_q5_0,
    tile_q6_k,
    tile_q6_k_sums,
    tile_q8_0,
)
from ._x86_gemm_iq import (
    IQ_PACKED_BYTES,
    SUMS_PACKED_BYTES,
    pack_iq2_xxs,
    pack_iq3_s,
    pack_iq4_nl,
    pack_iq4_xs,
    sums_kernels,
    tile_iq2_xxs,
    tile_iq3_s,
    tile_iq4_nl,
    tile_iq4_xs,
)

# type id -> scratch bytes per block (per pair of iq4_nl blocks) of TILE_ROWS rows
ALL_PACKED_BYTES = {**PACKED_BYTES, **IQ_PACKED_BYTES, **SUMS_PACKED_BYTES, SUMS | Q4_K: Q4_K_SUMS_BYTES,
                    SUMS | Q5_K: Q4_K_SUMS_BYTES, SUMS | Q6_K: PACKED_BYTES[Q6_K], SUMS | Q2_K: Q2_K_SUMS_BYTES}

# type id -> (pack, tile) of the batch kernels, chosen by `pack_rows` / `tile_rows` at compile time
GEMM_KERNELS = {Q4_K: (pack_q4_k, tile_q4_k), Q6_K: (pack_q6_k, tile_q6_k), Q4_0: (pack_q4_0, tile_q4_0),
                Q5_0: (pack_q5_0, tile_q5_0), Q8_0: (pack_q8_0, tile_q8_0), IQ4_NL: (pack_iq4_nl, tile_iq4_nl),
                IQ4_XS: (pack_iq4_xs, tile_iq4_xs), IQ3_S: (pack_iq3_s, tile_iq3_s), IQ2_XXS: (pack_iq2_xxs, tile_iq2_xxs)}
# a prompt's rows in llama.cpp's prompt arithmetic
GEMM_KERNELS.update({SUMS | t: sums_kernels(t) for t in (IQ4_XS, IQ3_S, IQ2_XXS, IQ3_XXS)})
GEMM_KERNELS[SUMS | Q4_K] = (pack_q4_k_sums, tile_q4_k_sums)
GEMM_KERNELS[SUMS | Q5_K] = (pack_q5_k_sums, tile_q4_k_sums)  # (llama.cpp's q5_K prompts: q4_K's arithmetic)
GEMM_KERNELS[SUMS | Q6_K] = (pack_q6_k, tile_q6_k_sums)  # (the gemm's pack)
GEMM_KERNELS[SUMS | Q2_K] = (pack_q2_k_sums, tile_q2_k_sums)


def _of_type(which, typingctx, type_id, args):
    """(signature, codegen) of `GEMM_KERNELS[type_id][which](*args)` emitted in place, for a call
    with the type id first; None unless type_id is a literal (a closure constant of the caller) of
    a type that has a gemm."""
    if not (isinstance(type_id, types.IntegerLiteral) and type_id.literal_value in GEMM_KERNELS):
        return None
    found = GEMM_KERNELS[type_id.literal_value][which]._defn(typingctx, *args)
    if found is None:
        return None
    sig, codegen = found
    return types.none(type_id, *sig.args), lambda c, b, _, a: codegen(c, b, sig, a[1:])


# Intrinsics rather than overloads: an overload's implementation compiles as a function of its own
# before it is inlined, which cost ~1 s of every cold compile of the gemm driver.
@intrinsic(prefer_literal=True)
def pack_rows(typingctx, type_id, raw, r0, nb, pack):
    """`pack_<type>(raw, r0, nb, pack)` of the type type_id (a compile-time constant in a kernel)."""
    return _of_type(0, typingctx, type_id, (raw, r0, nb, pack))


@intrinsic(prefer_literal=True)
def tile_rows(typingctx, type_id, pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc):
    """`tile_<type>(pack, nb, ..., acc)` of the type type_id (a compile-time constant in a kernel)."""
    return _of_type(1, typingctx, type_id, (pack, nb, b0, b1, xq, xd, xs, t0, t1, out, r0, acc))
