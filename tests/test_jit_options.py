"""Every Numba function of qllama is compiled with cache=True and error_model="numpy".

error_model="numpy" makes float arithmetic follow IEEE rules inside kernels (x/0 -> inf/nan)
instead of raising ZeroDivisionError from a hot loop, so a damaged file yields non-finite
numbers that callers detect and report (issue 17). cache=True keeps compiled code on disk.
Both come from `qllama.kernels.jit.kernel`; these tests fail on a plain `@njit` anywhere.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

numba = pytest.importorskip("numba")
from numba.core.caching import NullCache  # noqa: E402
from numba.core.dispatcher import Dispatcher  # noqa: E402

import qllama  # noqa: E402

PACKAGE = Path(qllama.__file__).parent
# modules that need an optional extra to import; they define no kernels (checked by the source scan)
OPTIONAL = ("qllama.server",)


def _qllama_modules() -> list[str]:
    names = ["qllama"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="qllama."):
        if not info.name.endswith("__main__"):  # importing it runs the CLI
            names.append(info.name)
    return sorted(names)


def _dispatchers() -> dict[str, Dispatcher]:
    """Every Numba dispatcher defined at module level in a qllama module: "module.name" -> dispatcher."""
    found = {}
    for name in _qllama_modules():
        try:
            mod = importlib.import_module(name)
        except ImportError:
            if name.startswith(OPTIONAL):
                continue
            raise
        for attr, obj in vars(mod).items():
            if isinstance(obj, Dispatcher) and obj.py_func.__module__ == name:
                found[f"{name}.{attr}"] = obj
    return found


def test_the_walk_finds_the_kernels():
    found = _dispatchers()
    # one known kernel of each kernel family, so that an empty walk cannot pass
    for name in ("qllama.kernels.floats.matvec_f32", "qllama.kernels.int8.matmul_q4_k",
                 "qllama.kernels.kquants.matvec_q6_k", "qllama.kernels.legacy.matvec_q8_0",
                 "qllama.kernels.dequantize.dequantize_rows", "qllama.kernels.quantize_k.quantize_q6_k"):
        assert name in found
    assert len(found) >= 40


def test_every_dispatcher_caches_and_uses_the_numpy_error_model():
    bad = []
    for name, d in _dispatchers().items():
        if d.targetoptions.get("error_model") != "numpy":
            bad.append(f"{name}: error_model={d.targetoptions.get('error_model')!r}")
        if isinstance(d._cache, NullCache):
            bad.append(f"{name}: cache=False")
    assert not bad, "use qllama.kernels.jit.kernel, not numba.njit:\n" + "\n".join(bad)


def test_no_numba_decorator_outside_jit_py():
    """Catches kernels the walk cannot see (defined inside functions): only jit.py calls numba's jit."""
    pattern = re.compile(r"^\s*(@\s*(numba\.)?(njit|jit|generated_jit|vectorize|guvectorize|cfunc)\b"
                         r"|.*\b(numba\.)?(njit|jit)\s*\()", re.M)
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "kernels" / "jit.py":
            continue
        for m in pattern.finditer(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE)}: {m.group(0).strip()}")
    assert not offenders, "\n".join(offenders)


def test_kernel_refuses_to_override_the_fixed_options():
    from qllama.kernels.jit import kernel

    for opt in ({"cache": False}, {"error_model": "python"}):
        with pytest.raises(TypeError, match="fixes"):
            kernel(**opt)


def test_a_kernel_divides_by_zero_without_raising():
    from qllama.kernels.jit import kernel

    @kernel
    def ratio(a, b):
        return a / b

    assert ratio(1.0, 0.0) == float("inf")
    assert ratio(0.0, 0.0) != ratio(0.0, 0.0)  # NaN
