"""The one table of ggml tensor types: id, name, elements per block, bytes per block.

Byte sizes are written as sums of the block's fields (see ggml-common.h), so that a
reader can check them against the struct layout. Every type ggml has ever assigned an id
is listed, also those qllama cannot execute, so that byte sizes (and thus tensor offsets
and file validation) are right for any tensor. This module must stay import-light: it is
used by `qllama inspect`, which never imports numba.
"""

from __future__ import annotations

from typing import NamedTuple


class GGMLType(NamedTuple):
    id: int
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block
    # byte offsets, within a block, of its fp16 scale fields (d, dmin/m): the only fields of a
    # quantized block that can hold a non-finite number (`qllama inspect --check` reads them)
    scale_fields: tuple[int, ...] = ()

    def row_bytes(self, n_elements: int) -> int:
        """Bytes of a row of `n_elements` (which must be a multiple of block_size)."""
        return (n_elements // self.block_size) * self.type_size


QK_K = 256  # super-block size of the k-quants and i-quants
_H = 2  # one fp16 / bf16 field

_TYPES = [
    GGMLType(0, "f32", 1, 4),
    GGMLType(1, "f16", 1, 2),
    GGMLType(2, "q4_0", 32, _H + 16, (0,)),  # d, qs[16] (nibbles)
    GGMLType(3, "q4_1", 32, _H + _H + 16, (0, 2)),  # d, m, qs[16]
    GGMLType(4, "q4_2", 16, _H + 8),  # removed from ggml in 2023
    GGMLType(5, "q4_3", 16, _H + _H + 8),  # removed from ggml in 2023
    GGMLType(6, "q5_0", 32, _H + 4 + 16, (0,)),  # d, qh[4], qs[16]
    GGMLType(7, "q5_1", 32, _H + _H + 4 + 16, (0, 2)),  # d, m, qh[4], qs[16]
    GGMLType(8, "q8_0", 32, _H + 32, (0,)),  # d, qs[32]
    GGMLType(9, "q8_1", 32, _H + _H + 32),  # d, s, qs[32] (gguf-py still says 40: the old float layout)
    GGMLType(10, "q2_K", QK_K, 16 + 64 + _H + _H, (80, 82)),  # scales[16], qs[64], d, dmin
    GGMLType(11, "q3_K", QK_K, 32 + 64 + 12 + _H, (108,)),  # hmask[32], qs[64], scales[12], d
    GGMLType(12, "q4_K", QK_K, _H + _H + 12 + 128, (0, 2)),  # d, dmin, scales[12], qs[128]
    GGMLType(13, "q5_K", QK_K, _H + _H + 12 + 32 + 128, (0, 2)),  # d, dmin, scales[12], qh[32], qs[128]
    GGMLType(14, "q6_K", QK_K, 128 + 64 + 16 + _H, (208,)),  # ql[128], qh[64], scales[16], d
    GGMLType(15, "q8_K", QK_K, 4 + 256 + 32),  # float d, qs[256], bsums[16] (int16)
    GGMLType(16, "iq2_xxs", QK_K, _H + 64, (0,)),  # d, qs[32] (u16)
    GGMLType(17, "iq2_xs", QK_K, _H + 64 + 8, (0,)),  # d, qs[32] (u16), scales[8]
    GGMLType(18, "iq3_xxs", QK_K, _H + 96, (0,)),  # d, qs[96]
    GGMLType(19, "iq1_s", QK_K, _H + 32 + 16, (0,)),  # d, qs[32], qh[8] (u16)
    GGMLType(20, "iq4_nl", 32, _H + 16, (0,)),  # d, qs[16]
    GGMLType(21, "iq3_s", QK_K, _H + 64 + 8 + 32 + 4, (0,)),  # d, qs[64], qh[8], signs[32], scales[4]
    GGMLType(22, "iq2_s", QK_K, _H + 64 + 8 + 8, (0,)),  # d, qs[64], qh[8], scales[8]
    GGMLType(23, "iq4_xs", QK_K, _H + 2 + 4 + 128, (0,)),  # d, scales_h, scales_l[4], qs[128]
    GGMLType(24, "i8", 1, 1),
    GGMLType(25, "i16", 1, 2),
    GGMLType(26, "i32", 1, 4),
    GGMLType(27, "i64", 1, 8),
    GGMLType(28, "f64", 1, 8),
    GGMLType(29, "iq1_m", QK_K, 32 + 16 + 8),  # qs[32], qh[16], scales[8] (its fp16 d spread over the scales' top nibbles)
    GGMLType(30, "bf16", 1, 2),
    GGMLType(31, "q4_0_4_4", 32, _H + 16),  # repacked q4_0, removed from files in 2024
    GGMLType(32, "q4_0_4_8", 32, _H + 16),
    GGMLType(33, "q4_0_8_8", 32, _H + 16),
    GGMLType(34, "tq1_0", QK_K, 48 + 4 + _H, (52,)),  # qs[48] (base-3), qh[4], d
    GGMLType(35, "tq2_0", QK_K, 64 + _H, (64,)),  # qs[64], d
    GGMLType(36, "iq4_nl_4_4", 32, _H + 16),  # repacked, removed from files
    GGMLType(37, "iq4_nl_4_8", 32, _H + 16),
    GGMLType(38, "iq4_nl_8_8", 32, _H + 16),
    GGMLType(39, "mxfp4", 32, 1 + 16),  # e8m0 scale, qs[16]
    GGMLType(40, "nvfp4", 64, 4 + 32),
    GGMLType(41, "q1_0", 128, _H + 16),
]

GGML_TYPES: dict[int, GGMLType] = {t.id: t for t in _TYPES}
GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in _TYPES}

# Named ids for the types the runtime refers to in code (no magic ints elsewhere).
F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = 10, 11, 12, 13, 14, 15
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0 = 16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35
MXFP4 = 39


def type_name(type_id: int) -> str:
    """The ggml name of a type id, or `unknown(<id>)` for an id ggml never assigned."""
    t = GGML_TYPES.get(type_id)
    return t.name if t else f"unknown({type_id})"


def type_by_name(name: str) -> GGMLType:
    """Look up a type by its ggml name (case-insensitive, e.g. `Q4_K` or `q4_k`)."""
    for t in _TYPES:
        if t.name.lower() == name.lower():
            return t
    raise KeyError(name)


# llama.cpp's `general.file_type` values (enum llama_ftype), for display.
FILE_TYPES: dict[int, str] = {
    0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0",
    8: "MOSTLY_Q5_0", 9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 11: "MOSTLY_Q3_K_S",
    12: "MOSTLY_Q3_K_M", 13: "MOSTLY_Q3_K_L", 14: "MOSTLY_Q4_K_S", 15: "MOSTLY_Q4_K_M",
    16: "MOSTLY_Q5_K_S", 17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K", 19: "MOSTLY_IQ2_XXS",
    20: "MOSTLY_IQ2_XS", 21: "MOSTLY_Q2_K_S", 22: "MOSTLY_IQ3_XS", 23: "MOSTLY_IQ3_XXS",
    24: "MOSTLY_IQ1_S", 25: "MOSTLY_IQ4_NL", 26: "MOSTLY_IQ3_S", 27: "MOSTLY_IQ3_M",
    28: "MOSTLY_IQ2_S", 29: "MOSTLY_IQ2_M", 30: "MOSTLY_IQ4_XS", 31: "MOSTLY_IQ1_M",
    32: "MOSTLY_BF16", 36: "MOSTLY_TQ1_0", 37: "MOSTLY_TQ2_0", 38: "MOSTLY_MXFP4_MOE",
}
