"""The x86 instruction sets of the int8 kernels (kernels/_x86.py `ISA`): which one a CPU gets, and
that every one gives the same bits.

- The choice: a pure function of the CPU features and QLLAMA_ISA.
- The values: tests/isa_probe.py runs every int8 kernel shape and a small Q4_K_M model in a
  fresh process per ISA. With QLLAMA_ISA_EMULATE=1 an instruction the CPU lacks is emitted as
  exact generic IR, so an AVX2-only host runs the VNNI and 512-bit code shapes; a host that has
  the instructions runs them for real in the same test.
- The machine code: with NUMBA_CPU_NAME / NUMBA_CPU_FEATURES naming a VNNI CPU, the kernels are
  compiled (never run) and must contain vpdpbusd / vpdpwssd, and zmm registers in the q4_K gemm
  on AVX-512.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qllama.kernels._x86 import ISA, ISA_NAMES, choose_isa
from qllama.qtensor import int8_activations

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("isa_probe.py")

AVX2 = {"+avx", "+avx2", "+f16c", "+fma"}
AVX_VNNI = AVX2 | {"+avxvnni"}
AVX512 = AVX2 | {"+avx512f", "+avx512bw", "+avx512vl", "+avx512dq", "+avx512cd"}
AVX512_VNNI = AVX512 | {"+avx512vnni"}
COMMON = "+64bit,+bmi,+bmi2,+cmov,+cx16,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave"


def test_each_cpu_gets_the_best_isa_it_has():
    for features, want in ((AVX2, "avx2"), (AVX_VNNI, "avx2-vnni"), (AVX512, "avx512"),
                           (AVX512_VNNI, "avx512-vnni"), (AVX512 | {"+avxvnni"}, "avx512")):
        assert choose_isa({}, features) == (want, None), features
        assert choose_isa({"QLLAMA_ISA": "auto"}, features) == (want, None)


def test_qllama_isa_picks_a_supported_one_and_refuses_the_rest():
    assert choose_isa({"QLLAMA_ISA": "avx2"}, AVX512_VNNI) == ("avx2", None)
    assert choose_isa({"QLLAMA_ISA": "AVX2-VNNI"}, AVX512_VNNI) == ("avx2-vnni", None)  # VNNI on 256-bit (VL)
    assert choose_isa({"QLLAMA_ISA": "avx512"}, AVX512_VNNI) == ("avx512", None)
    isa, problem = choose_isa({"QLLAMA_ISA": "avx512-vnni"}, AVX512)
    assert isa == "avx512" and "lacks" in problem
    isa, problem = choose_isa({"QLLAMA_ISA": "avx2-vnni"}, AVX2)
    assert isa == "avx2" and problem == "QLLAMA_ISA=avx2-vnni needs CPU features this CPU lacks (it can run avx2)"
    isa, problem = choose_isa({"QLLAMA_ISA": "sse"}, AVX2)
    assert isa == "avx2" and "not one of" in problem
    assert choose_isa({"QLLAMA_ISA": "avx512-vnni", "QLLAMA_ISA_EMULATE": "1"}, AVX2) == ("avx512-vnni", None)


def test_cli_refuses_a_bad_qllama_isa_in_one_line():
    env = {**os.environ, "QLLAMA_ISA": "avx9000"}
    r = subprocess.run([sys.executable, "-m", "qllama", "version"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: QLLAMA_ISA='avx9000' is not one of: auto, avx2, avx2-vnni, avx512, avx512-vnni"
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("isa")


def _probe(workdir: Path, isa: str | None, compile_for: tuple[str, set[str]] | None = None) -> Path:
    """Run the probe with QLLAMA_ISA=isa (None: this process's choice and Numba cache), or compile
    only, for the CPU `compile_for` = (name, features)."""
    env = {**os.environ, "QLLAMA_ISA_EMULATE": "1"}
    env.pop("QLLAMA_ISA", None)
    if isa is not None:
        env["QLLAMA_ISA"] = isa
    tag, extra = isa or "default", []
    if compile_for is not None:
        cpu, features = compile_for
        env.update(NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=",".join(sorted(features)) + "," + COMMON)
        tag, extra = cpu, ["--compile-only"]
    if isa is not None or compile_for is not None:  # (its own cache: another ISA's entries would
        env["NUMBA_CACHE_DIR"] = str(workdir / f"cache-{tag}")  # replace this one's in a shared index)
    out = workdir / (f"{tag}.json" if extra else f"{tag}.npz")
    r = subprocess.run([sys.executable, str(PROBE), *extra, str(out), str(workdir)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _assert_same_bits(workdir: Path, isa: str) -> None:
    base = np.load(_probe(workdir, None))
    other = np.load(_probe(workdir, isa))
    assert str(other["isa"]) == isa and str(base["isa"]) == ISA
    keys = [k for k in base.files if k != "isa"]
    assert len(keys) == len(other.files) - 1 and len(keys) >= 40
    differ = [k for k in keys if not np.array_equal(base[k], other[k], equal_nan=True)]
    assert not differ, f"{isa} differs from {ISA} in {differ}"
    assert np.isfinite(base["model/prompt"]).all() and np.isfinite(base["model/decode"]).all()


@pytest.mark.skipif(not int8_activations(), reason="no int8 kernels on this CPU (needs AVX2 + F16C)")
def test_another_isa_gives_the_same_bits(workdir):
    """This process's ISA against one other (avx512-vnni, or avx2 where that is this one's): every
    int8 kernel shape (one token, 4-token tiles, the q4_K gemm at odd and even batches, extremes
    that would saturate a wider int16 sum) and a Q4_K_M model's prompt and decode logits."""
    _assert_same_bits(workdir, "avx2" if ISA != "avx2" else "avx512-vnni")


@pytest.mark.slow
@pytest.mark.skipif(not int8_activations(), reason="no int8 kernels on this CPU (needs AVX2 + F16C)")
@pytest.mark.parametrize("isa", ISA_NAMES)
def test_every_isa_gives_the_same_bits(workdir, isa):
    if isa == ISA:
        pytest.skip(f"{isa} is this process's own ISA")
    _assert_same_bits(workdir, isa)


def _cross_compile(workdir: Path, cpu: str, features: set[str]) -> dict:
    return json.loads(_probe(workdir, None, (cpu, features)).read_text())


def _instructions(found: dict, kernel: str) -> set[str]:
    hits = [set(v) for k, v in found.items() if k.startswith(kernel)]
    assert hits, f"{kernel} was not compiled: {sorted(found)}"
    return set.union(*hits)


@pytest.mark.skipif(not int8_activations(), reason="no int8 kernels on this CPU (needs AVX2 + F16C)")
def test_avx512_vnni_kernels_compile_to_vpdpbusd_and_zmm(workdir):
    """Compiled for an Ice Lake server: the dispatch picks avx512-vnni, the legacy row kernels use
    vpdpbusd (but q8_0's, measured faster with pmaddubsw), the K-quant ones vpdpwssd, and the
    gemms 512-bit vectors."""
    found = _cross_compile(workdir, "icelake-server", AVX512_VNNI)
    assert found["isa"] == "avx512-vnni"
    for legacy in (2, 3, 6, 7):  # q4_0 q4_1 q5_0 q5_1
        assert "vpdpbusd" in _instructions(found, f"qllama.kernels.int8.ROWS_INT8[{legacy}]"), legacy
    assert "vpdpbusd" not in _instructions(found, "qllama.kernels.int8.ROWS_INT8[8]")
    for k in (12, 13, 14):  # q4_K q5_K q6_K
        assert "vpdpwssd" in _instructions(found, f"qllama.kernels.int8.ROWS_INT8[{k}]"), k
    for k in (12, 14):  # the q4_K and q6_K gemms
        assert {"vpdpwssd", "%zmm"} <= _instructions(found, f"qllama.kernels.int8.GEMM_ROWS[{k}]"), k
    for legacy in (2, 6, 8):  # q4_0, q5_0, q8_0: 16 rows of quads into vpdpbusd
        assert {"vpdpbusd", "%zmm"} <= _instructions(found, f"qllama.kernels.int8.GEMM_ROWS[{legacy}]"), legacy
    assert "vpdpwssd" in _instructions(found, "qllama.kernels.int8.matmul_q2_q3_k")


@pytest.mark.slow
@pytest.mark.skipif(not int8_activations(), reason="no int8 kernels on this CPU (needs AVX2 + F16C)")
def test_avx_vnni_kernels_compile_to_256_bit_vpdpbusd(workdir):
    """Compiled for an Alder Lake (AVX-VNNI, no AVX-512; never run here)."""
    found = _cross_compile(workdir, "alderlake", AVX_VNNI)
    assert found["isa"] == "avx2-vnni"
    assert "vpdpbusd" in _instructions(found, "qllama.kernels.int8.ROWS_INT8[2]")
    for gemm in (12, 14):
        found_in = _instructions(found, f"qllama.kernels.int8.GEMM_ROWS[{gemm}]")
        assert "vpdpwssd" in found_in and "%zmm" not in found_in
    assert not any("%zmm" in v for v in found.values() if isinstance(v, list))
