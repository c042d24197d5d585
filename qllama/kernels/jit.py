"""`kernel`: the one way qllama compiles a Numba function.

It is `numba.njit` with two choices fixed for every kernel in the package:

- `cache=True`: compiled code is kept on disk, so only the first run pays for compilation.
- `error_model="numpy"`: float arithmetic follows IEEE rules (x/0 gives inf or nan) instead of
  raising ZeroDivisionError from inside a kernel. A damaged file (a NaN or Inf scale, a NaN
  norm weight) then yields non-finite numbers that the caller can detect and report, never a
  Python exception thrown from the middle of a hot loop. It also drops the division-by-zero
  checks from the inner loops.

Use it as `@kernel` or `@kernel(parallel=True, fastmath=True)`.

`Variants(make, name, **options)` is a family of kernels from one source, one per value of a
constant (e.g. a block type): `family[key]` is `kernel(**options)(make(key))`, made on first use.
Where a kernel would branch on a type id at run time, every branch is compiled, and linked and
optimised again in each caller; a variant compiles only its own (`dequantize.py`: 1 decoder
instead of 10). `make(key)` returns a closure over `key` (an int): Numba types it as a literal,
and its disk cache keys the closure on that value. `name` is the family's attribute in its
module, so that compile_pool's workers can find a variant (`variant_of`).

Numba's disk cache keys a function on its own source file only. A kernel that calls an
intrinsic from `_x86.py` or an `@kernel` function from another module compiles that code into
itself, and would keep the old code after only the other file changed (seen while editing
`_x86.py`: fused and int8 kernels ran stale intrinsics). So every kernel of this package is
keyed on the digest of all of `qllama/kernels/*.py` as well: changing any of them recompiles
the package's kernels on the next run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba import njit
from numba.core.caching import CacheImpl

KERNELS_DIR = Path(__file__).resolve().parent


def _sources_digest() -> bytes:
    """sha256 over the names and contents of qllama/kernels/*.py, in name order."""
    h = hashlib.sha256()
    for path in sorted(KERNELS_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.digest()


SOURCES_DIGEST = _sources_digest()


class PackageStampLocator:
    """The cache locator Numba would choose for a kernel of this package, with a source stamp
    that also covers every other kernel module (see the module docstring). Functions defined
    elsewhere are left to Numba's own locators."""

    def __init__(self, inner):
        self._inner = inner

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            ours = Path(py_file).resolve().parent == KERNELS_DIR
        except (OSError, TypeError):
            ours = False
        if not ours:
            return None
        for other in CacheImpl._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
        return None

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), SOURCES_DIGEST)

    def __getattr__(self, name):
        return getattr(self._inner, name)


if PackageStampLocator not in CacheImpl._locator_classes:
    CacheImpl._locator_classes.insert(0, PackageStampLocator)

FIXED_OPTIONS = {"cache": True, "error_model": "numpy"}


def variant_of(dispatcher):
    """(module, attribute, key) of a kernel made by `Variants`, else None."""
    return getattr(dispatcher, "_qllama_variant", None)


class Variants(dict):
    """key -> kernel(**options)(make(key)), made on first use (see the module docstring)."""

    def __init__(self, make, name: str, **options):
        super().__init__()
        self._make, self._name, self._options = make, name, options

    def __missing__(self, key):
        d = kernel(self._make(key), **self._options)
        d._qllama_variant = (self._make.__module__, self._name, key)
        self[key] = d
        return d


def kernel(func=None, **options):
    """numba.njit with cache=True and error_model="numpy" (see the module docstring)."""
    clash = set(options) & set(FIXED_OPTIONS)
    if clash:
        raise TypeError(f"kernel() fixes {sorted(clash)}; do not pass them")
    opts = {**FIXED_OPTIONS, **options}
    if func is None:
        return njit(**opts)
    return njit(**opts)(func)
