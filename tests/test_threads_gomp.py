"""libgomp's spin count (`qllama.kernels.jit.GOMP_SPINCOUNT`): qllama's short spin only when other
processes hold CPUs as it starts and the user set neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY, and in
place before Numba loads libgomp (libgomp reads it once, when it loads). Its speed effect is a benchmark (`tools/bench_busy.py --spin`), not a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qllama.kernels.jit import GOMP_SPINCOUNT, _gomp_spin_default, _runnable_elsewhere

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "env, busy, want",
    [
        ({}, True, {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}),  # other processes hold CPUs: the short spin
        ({}, False, {}),  # a quiet machine: libgomp's own default
        ({"GOMP_SPINCOUNT": "300000"}, True, {"GOMP_SPINCOUNT": "300000"}),  # the user's count stays
        ({"GOMP_SPINCOUNT": ""}, True, {"GOMP_SPINCOUNT": ""}),  # set, even empty: the user's
        ({"OMP_WAIT_POLICY": "active"}, True, {"OMP_WAIT_POLICY": "active"}),  # a policy: libgomp derives the count
        ({"OMP_WAIT_POLICY": "passive"}, True, {"OMP_WAIT_POLICY": "passive"}),
    ],
)
def test_spin_default_only_on_a_busy_machine_where_the_user_chose_nothing(env, busy, want):
    _gomp_spin_default(env, busy=busy)
    assert env == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/loadavg")
def test_a_busy_loop_counts_as_a_busy_machine():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 20\nwhile time.time() < t: pass"])
    try:
        deadline = time.monotonic() + 10
        while _runnable_elsewhere() < 1 and time.monotonic() < deadline:  # (until it is scheduled)
            time.sleep(0.05)
        assert _runnable_elsewhere() >= 1
    finally:
        spinner.kill()
        spinner.wait()


_PROBE = """
import json, os
def gomp_loaded():
    with open("/proc/self/maps") as f:
        return "libgomp" in f.read()
import qllama.kernels.jit, qllama.qtensor
before = gomp_loaded()
import numpy as np
from numba import prange, threading_layer
from qllama.kernels.jit import kernel
@kernel(parallel=True)
def total(a):
    s = 0.0
    for i in prange(a.size):
        s += a[i]
    return s
total(np.ones(8))
print(json.dumps({"before": before, "after": gomp_loaded(), "layer": threading_layer(),
                  "spin": os.environ.get("GOMP_SPINCOUNT")}))
"""


def _probe(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(extra, PYTHONPATH=str(REPO), QLLAMA_CACHE_DIR=str(tmp_path))
    probe = tmp_path / "probe.py"  # a file: Numba's disk cache needs one
    probe.write_text(_PROBE)
    out = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh processes, each compiling a kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_count_is_in_place_before_numba_loads_libgomp(tmp_path):
    got = _probe(tmp_path, GOMP_SPINCOUNT="777")  # (the machine's state would pick the default)
    assert got["spin"] == "777"
    assert not got["before"]  # importing the kernels' modules loads no libgomp: it will read our setting
    if got["layer"] == "omp":
        assert got["after"]  # the first parallel kernel loaded it, with the setting in the environment
    assert _probe(tmp_path, GOMP_SPINCOUNT="20")["spin"] == "20"
