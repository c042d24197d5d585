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

Compiled kernels live in the user's cache (`kernel_cache_dir()`: `~/.cache/qllama/kernels/<digest>`
on Linux, QLLAMA_CACHE_DIR to move it), never inside the installed package: a `__pycache__` written
into site-packages outlives `pip uninstall` and shadows a later editable install. Numba's disk
cache keys a function on its own source file only; a kernel that calls an intrinsic from
`_x86.py` or an `@kernel` function from another module compiles that code into itself, and would
keep the old code after only the other file changed. So every kernel of this package is stamped
with the digest of all of `qllama/kernels/*.py` (and of the settings choosing `_x86.ISA`), and
that digest names the directory: changing any kernel source recompiles the package's kernels on
the next run, while reinstalling the same sources finds them again.

Kernels are optimised at LLVM level `OPT_LEVEL` (1), not Numba's default 3: the hot loops are
explicit vector intrinsics (`_x86.py`) that need no further optimisation, and a cold compile costs
about a third less (docs/measurements.md). Numba's optimisation passes run at this level around
each of qllama's compiles only; its machine-code generation has one level per process, set when
this module creates the code generator (`_machine_code_at_opt_level`). NUMBA_OPT, when set, wins.
The level is not part of Numba's cache key, so a cache filled at another level is used as it is.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from llvmlite import ir
from numba import njit, types
from numba.core import config as numba_config
from numba.core.caching import CacheImpl, _CacheLocator
from numba.core.compiler_lock import global_compiler_lock
from numba.extending import intrinsic

# libgomp's spin before a waiting thread sleeps, for Numba's OpenMP layer. libgomp reads it once,
# when Numba first starts its threads (importing Numba starts none), so it is chosen as this module
# loads, before any kernel exists; a libgomp already loaded by something else keeps its setting.
# libgomp's own default (300000 spins, some ms) makes each parallel region's barrier hold a core
# while its other thread waits for one: with one core taken by another process, an explicit
# `-t 2` decoded at 0.05-0.1x of `-t 1`. 1000 spins (~50 us) remove that collapse, but on a quiet
# machine the threads then sleep between a decode step's regions: the 1B shape at `-t 2` lost ~12%
# of its decode and ~8% of its prompt speed (`qllama bench`, A B A B). So the short spin is set
# only when other processes hold CPUs as qllama starts; a process started on a quiet machine
# keeps libgomp's default (and a fixed `-t N` still slows down if the machine gets busy later).
GOMP_SPINCOUNT = "1000"


def _runnable_elsewhere() -> int:
    """Tasks of other processes running or waiting for a CPU right now: the kernel's count of
    runnable tasks (/proc/loadavg's 4th field, this thread included) less one, the least of three
    reads 1 ms apart (a momentary blip is not a busy machine). 0 where there is no /proc."""
    least = None
    for i in range(3):
        try:
            with open("/proc/loadavg") as f:
                n = int(f.read().split()[3].split("/")[0]) - 1
        except (OSError, ValueError, IndexError):
            return 0
        least = n if least is None else min(least, n)
        if least <= 0:
            break
        if i < 2:
            time.sleep(0.001)
    return max(0, least or 0)


def _gomp_spin_default(environ=os.environ, busy: bool | None = None) -> None:
    """Set GOMP_SPINCOUNT to the short spin when other processes hold CPUs (busy; None: look now),
    unless the user chose a spin count or a wait policy."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return
    if busy if busy is not None else _runnable_elsewhere() > 0:
        environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT


_gomp_spin_default()

KERNELS_DIR = Path(__file__).resolve().parent


def _sources_digest() -> bytes:
    """sha256 over the names and contents of qllama/kernels/*.py, in name order, and the settings
    that choose the ISA the x86 intrinsics are emitted for (`_x86.ISA`: QLLAMA_ISA and
    QLLAMA_ISA_EMULATE change it without changing the CPU, which Numba's own cache key covers)."""
    h = hashlib.sha256(repr([os.environ.get(k, "") for k in ("QLLAMA_ISA", "QLLAMA_ISA_EMULATE")]).encode())
    for path in sorted(KERNELS_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.digest()


SOURCES_DIGEST = _sources_digest()


def cache_root() -> Path:
    """qllama's cache directory: QLLAMA_CACHE_DIR, else the platform's user cache directory
    (`$XDG_CACHE_HOME/qllama` or `~/.cache/qllama` on Linux, `~/Library/Caches/qllama` on macOS,
    `%LOCALAPPDATA%\\qllama\\Cache` on Windows). Never inside the installed package: a cache there
    outlives `pip uninstall` and shadows a later editable install."""
    override = os.environ.get("QLLAMA_CACHE_DIR", "").strip()
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "qllama"
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / "qllama" / "Cache"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "qllama"


def kernel_cache_dir() -> Path:
    """Where the compiled kernels of this very source tree live: `<cache>/kernels/<digest>`, the
    digest covering the kernel sources and the ISA settings (so a reinstall of the same version
    finds its kernels, and two versions never overwrite each other's). NUMBA_CACHE_DIR, when set,
    takes the place of `<cache>` (the tools use it for cold-start runs)."""
    numba_dir = os.environ.get("NUMBA_CACHE_DIR", "").strip()
    root = Path(numba_dir).expanduser() / "qllama" if numba_dir and not os.environ.get("QLLAMA_CACHE_DIR") else cache_root()
    return root / "kernels" / SOURCES_DIGEST.hex()[:16]


def check_cache_dir() -> Path:
    """Create the kernel cache directory and make sure it takes files; a QllamaError-shaped
    OSError message otherwise (the caller turns it into one `error:` line)."""
    path = kernel_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        raise CacheDirError(f"the kernel cache {path} is not writable ({exc.strerror or exc}); "
                            "set QLLAMA_CACHE_DIR to a writable directory") from None
    return path


class CacheDirError(OSError):
    """The kernel cache directory cannot be created or written."""


class KernelCacheLocator(_CacheLocator):
    """Numba's cache locator for the kernels of this package: every kernel's compiled code goes to
    `kernel_cache_dir()`, stamped with the digest of all kernel sources (see the module docstring).
    Functions defined elsewhere are left to Numba's own locators."""

    def __init__(self, py_func):
        self._lineno = py_func.__code__.co_firstlineno
        self._path = str(kernel_cache_dir())

    def ensure_cache_path(self):
        os.makedirs(self._path, exist_ok=True)

    def get_cache_path(self):
        return self._path

    def get_source_stamp(self):
        return SOURCES_DIGEST

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            ours = Path(py_file).resolve().parent == KERNELS_DIR
        except (OSError, TypeError):
            ours = False
        return cls(py_func) if ours else None


if KernelCacheLocator not in CacheImpl._locator_classes:
    CacheImpl._locator_classes.insert(0, KernelCacheLocator)

FIXED_OPTIONS = {"cache": True, "error_model": "numpy"}
OPT_LEVEL = 1  # LLVM optimisation level of qllama's kernels (see the module docstring)


def _opt_level():
    """The level kernels compile at: NUMBA_OPT if the user set it, else OPT_LEVEL."""
    if os.environ.get("NUMBA_OPT", "").strip():
        return None
    return type(numba_config.OPT)(OPT_LEVEL)  # (Numba's _OptLevel int subclass)


def _machine_code_at_opt_level() -> None:
    """Create Numba's CPU code generator now, at `_opt_level()`, if nothing created it yet: it
    fixes the level of its machine-code generation for the process. Kernels compiled here then
    match those of a compile worker (compile_pool.py), whose whole process runs at that level,
    instruction for instruction: fused multiply-adds and the like could otherwise differ with
    the process that compiled a kernel. (Numba code of the user's compiled in this process also
    gets its machine code at this level; its optimisation passes keep NUMBA_OPT's or 3.)"""
    from numba.core.registry import cpu_target

    level = _opt_level()
    if level is None or "_toplevel_target_context" in vars(cpu_target):
        return
    with global_compiler_lock:
        before = numba_config.OPT
        numba_config.OPT = level
        try:
            cpu_target.target_context  # noqa: B018 - creates the code generator
        finally:
            numba_config.OPT = before


def _compiling_at_opt_level(dispatcher):
    """Make `dispatcher.compile` (each specialisation, nested ones included) run with Numba's
    optimisation level set to `_opt_level()`. Numba reads the level when it optimises each
    compiled module; the global compiler lock keeps other threads' compiles out meanwhile."""
    level = _opt_level()
    if level is None:
        return dispatcher
    _machine_code_at_opt_level()
    compile_at_default = dispatcher.compile

    def compile(sig):
        with global_compiler_lock:
            before = numba_config.OPT
            numba_config.OPT = level
            try:
                return compile_at_default(sig)
            finally:
                numba_config.OPT = before

    dispatcher.compile = compile
    return dispatcher


def variant_of(dispatcher):
    """(module, attribute, key) of a kernel made by `Variants`, else None."""
    return getattr(dispatcher, "_qllama_variant", None)


class Variants(dict):
    """key -> kernel(**options)(make(key)), made on first use (see the module docstring)."""

    def __init__(self, make, name: str, **options):
        super().__init__()
        self._make, self._name, self._options = make, name, options

    def __missing__(self, key):
        func = self._make(key)
        # Each variant its own qualified name: Numba names compiled code after it, its argument
        # types and a counter of the compiling process. Two variants compiled in different
        # processes (compile_pool's workers, or two runs filling the disk cache) could otherwise
        # get one symbol name, and `compiled_address`, which looks the code up by that name, gave
        # one variant's address for both: an IQ3_XXS model gave NaN when its iq3_xxs and iq2_s
        # row kernels were compiled one in a worker and one in the main process. (The disk
        # cache's files are named after it too.)
        func.__qualname__ = f"{func.__qualname__}_{re.sub(r'[^0-9A-Za-z]+', '_', str(key))}"
        d = kernel(func, **self._options)
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
        return lambda f: _compiling_at_opt_level(njit(**opts)(f))
    return _compiling_at_opt_level(njit(**opts)(func))


# -- calling a compiled kernel by its address ---------------------------------------------------


def argument_kinds(args) -> tuple:
    """What decides the Numba types of these arguments, cheaper to get than the types: for an
    array its dtype, dimensions, layout, writability and alignment; for anything else its class."""
    import numpy as np

    return tuple((a.dtype.num, a.ndim, a.flags.c_contiguous, a.flags.f_contiguous, a.flags.writeable, a.flags.aligned)
                 if isinstance(a, np.ndarray) else type(a) for a in args)


_ADDRESSES: dict = {}  # (kernel, argument kinds) -> address, for `address_of`


def address_of(dispatcher, args, prepare) -> int:
    """`compiled_address(dispatcher, args)`, remembered by the arguments' kinds. `prepare()` first
    calls dispatcher on arguments of these types, which compiles or loads it. 0 while
    compile_pool records a warm-up (not remembered: the caller asks again next time)."""
    key = (dispatcher, argument_kinds(args))
    address = _ADDRESSES.get(key, 0)
    if not address:
        prepare()
        address = compiled_address(dispatcher, args)
        if address:
            _ADDRESSES[key] = address
    return address


def compiled_address(dispatcher, args) -> int:
    """The address of `dispatcher`'s compiled code for exactly the types of `args` (its C-ABI
    wrapper, which `call_address` calls), or 0 when this process holds no such code (e.g. while
    compile_pool records what a warm-up would compile)."""
    from numba import typeof

    cres = dispatcher.overloads.get(tuple(typeof(a) for a in args))
    if cres is None:
        return 0
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)


@intrinsic
def call_address(typingctx, address, *args):
    """In a kernel: call the compiled function at `address` (from `compiled_address`, for these
    very argument types: nothing checks them; see `address_of`) with `args`; its result is dropped.

    Why: a kernel that calls another kernel by name links that kernel's code into its own and
    optimises it again, every caller, and a parallel loop twice over. Called by address, a long
    body compiles once (layer_ops.attention's parallel form: ~3 s less on a first run)."""
    tup = types.StarArgTuple.from_types(args)

    def codegen(context, builder, signature, llargs):
        argtys = signature.args[1].types
        values = [builder.extract_value(llargs[1], i) for i in range(len(argtys))]
        fnty = ir.FunctionType(context.get_value_type(types.none), [context.get_value_type(t) for t in argtys])
        builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), values)
        return context.get_dummy_value()

    return types.none(address, tup), codegen
