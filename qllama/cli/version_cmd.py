"""`qllama version` (and `qllama --version`): what is installed and which kernels this CPU runs."""

from __future__ import annotations

import platform

import click


def simd_path() -> str:
    """The kernel path the matrix products take on this host, named honestly.

    The int8-activation kernels (AVX2 `pmaddubsw`/`pmaddwd`) run when the host has AVX2 and
    F16C (`qtensor.int8_activations`); otherwise every type takes the portable float kernels.
    qllama has no AVX-512 kernel: an AVX-512 host runs the AVX2 ones, and we say so.
    """
    import llvmlite.binding as llvm

    from ..qtensor import int8_activations

    features = set(llvm.get_host_cpu_features().flatten().split(","))
    cpu = llvm.get_host_cpu_name()
    if int8_activations():
        path = "AVX2 (int8 dot products)"
        if "+avx512vnni" in features:
            path += "; the CPU has AVX-512 VNNI, which no qllama kernel uses yet"
    else:
        path = "portable (float kernels; no AVX2 + F16C on this CPU)"
    return f"{path} [CPU: {cpu}]"


def version_text() -> str:
    import numba
    import numpy

    from .. import __version__

    return "\n".join([
        f"qllama {__version__}",
        f"numba {numba.__version__}, numpy {numpy.__version__}, python {platform.python_version()}",
        f"SIMD: {simd_path()}",
    ])


@click.command("version")
def command() -> None:
    """Print the versions of qllama, Numba and NumPy, and the SIMD path this CPU uses."""
    click.echo(version_text())
