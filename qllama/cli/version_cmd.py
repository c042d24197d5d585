"""`qllama version` (and `qllama --version`): what is installed and which kernels this CPU runs."""

from __future__ import annotations

import platform

import click


def simd_path() -> str:
    """The kernel path the matrix products take on this host, named honestly.

    The int8-activation kernels run when the host has AVX2 and F16C (`qtensor.int8_activations`),
    in the instruction set `kernels._x86.ISA` (avx2, avx2-vnni, avx512, avx512-vnni: the best the
    CPU has, or QLLAMA_ISA); otherwise every type takes the portable float kernels.
    """
    import warnings

    import llvmlite.binding as llvm

    from ..qtensor import int8_activations

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ..kernels._x86 import EMULATED, ISA, ISA_PROBLEM

    cpu = llvm.get_host_cpu_name()
    if int8_activations():
        notes = {"avx2": "pmaddubsw + pmaddwd", "avx2-vnni": "vpdpbusd / vpdpwssd, 256-bit",
                 "avx512": "pmaddubsw + pmaddwd; 512-bit q4_K batches",
                 "avx512-vnni": "vpdpbusd / vpdpwssd; 512-bit q4_K batches"}
        path = f"{ISA} (int8 dot products: {notes[ISA]})"
        if EMULATED:
            path += "; emulated in generic code (QLLAMA_ISA_EMULATE=1, for tests: slow)"
        if ISA_PROBLEM:
            path += f"; {ISA_PROBLEM}"
    else:
        path = "portable (float kernels; no AVX2 + F16C on this CPU)"
    return f"{path} [CPU: {cpu}]"


def version_text() -> str:
    import numba
    import numpy

    from .. import __version__
    from ..kernels.jit import kernel_cache_dir

    return "\n".join([
        f"qllama {__version__}",
        f"numba {numba.__version__}, numpy {numpy.__version__}, python {platform.python_version()}",
        f"SIMD: {simd_path()}",
        f"kernel cache: {kernel_cache_dir()} (QLLAMA_CACHE_DIR to move it)",
    ])


@click.command("version")
def command() -> None:
    """Print the versions of qllama, Numba and NumPy, the SIMD path this CPU uses and the kernel cache."""
    click.echo(version_text())
