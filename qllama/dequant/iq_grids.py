"""The lookup tables of the i-quants, as data of their types (ggml's published tables, ggml-common.h).

- `KVALUES_IQ4NL`: the 16 non-linear values of iq4_nl / iq4_xs (written here: 16 numbers).
- `grid(type_id)`: the grid of a grid type (iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s, iq1_m)
  as int8 (n_entries, 8 or 4): the values one index stands for. The source is gguf-py's copy of
  ggml's tables (`gguf.quants.<TYPE>.grid_hex`, decoded by gguf-py's `init_grid`), imported on
  first use and kept (gguf is already a dependency: the reader's format, not its code, is ours).
- `KSIGNS_IQ2XS`: ggml's 128 sign patterns (7 bits + parity bit): computed, it is a rule.

Import-light (NumPy only): used by the NumPy row decoders and by the kernels.
"""

from __future__ import annotations

import numpy as np

from ..gguf.types import GGML_TYPES

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)  # (16,)

# ksigns_iq2xs[i]: i's 7 bits, and bit 7 set when i has an odd number of ones (so every pattern
# has an even number of minus signs)
KSIGNS_IQ2XS = np.array([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], np.uint8)  # (128,)

_GRIDS: dict[int, np.ndarray] = {}


def grid(type_id: int) -> np.ndarray:
    """The grid of an i-quant grid type, int8 (n_entries, values per entry), loaded once."""
    g = _GRIDS.get(type_id)
    if g is None:
        from gguf import quants as gq

        cls = getattr(gq, GGML_TYPES[type_id].name.upper())
        cls.init_grid()
        g = np.ascontiguousarray(np.asarray(cls.grid).reshape(cls.grid_shape)).astype(np.int8)
        g.flags.writeable = False
        _GRIDS[type_id] = g
    return g
