"""`kernel`: the one way qllama compiles a Numba function.

It is `numba.njit` with two choices fixed for every kernel in the package:

- `cache=True`: compiled code is kept on disk, so only the first run pays for compilation.
- `error_model="numpy"`: float arithmetic follows IEEE rules (x/0 gives inf or nan) instead of
  raising ZeroDivisionError from inside a kernel. A damaged file (a NaN or Inf scale, a NaN
  norm weight) then yields non-finite numbers that the caller can detect and report, never a
  Python exception thrown from the middle of a hot loop. It also drops the division-by-zero
  checks from the inner loops.

Use it as `@kernel` or `@kernel(parallel=True, fastmath=True)`.
"""

from __future__ import annotations

from numba import njit

FIXED_OPTIONS = {"cache": True, "error_model": "numpy"}


def kernel(func=None, **options):
    """numba.njit with cache=True and error_model="numpy" (see the module docstring)."""
    clash = set(options) & set(FIXED_OPTIONS)
    if clash:
        raise TypeError(f"kernel() fixes {sorted(clash)}; do not pass them")
    opts = {**FIXED_OPTIONS, **options}
    if func is None:
        return njit(**opts)
    return njit(**opts)(func)
