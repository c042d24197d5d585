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
from qllama.kernels.jit import Variants  # noqa: E402

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
            if isinstance(obj, Variants):  # a family of kernels from one source: its members made so far, and one more
                for key in set(obj) | set(list(getattr(mod, "DECODERS", getattr(mod, "BLOCK_DOTS", {})))[:1]):
                    found[f"{name}.{attr}[{key}]"] = obj[key]
    return found


def test_the_walk_finds_the_kernels():
    found = _dispatchers()
    # one known kernel of each kernel family, so that an empty walk cannot pass
    for name in ("qllama.kernels.floats.matvec_f32", "qllama.kernels.int8._row_chunks",
                 "qllama.kernels.block_matvec.MATVEC[2]",
                 "qllama.kernels.dequantize.ROWS[12]", "qllama.kernels.quantize_k.quantize_kquant"):
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


# -- the first-run compile in worker processes (qllama/compile_pool.py) ------------------------

POOL_KERNELS = '''
import numpy as np
from qllama.kernels.jit import Variants, kernel


@kernel
def scale(x, f):
    for i in range(x.shape[0]):
        x[i] *= f


@kernel
def total(x, out):
    s = 0.0
    for i in range(x.shape[0]):
        s += x[i]
    out[0] = s


@kernel
def _half(v):
    return v * 0.5


@kernel
def halve(x):
    for i in range(x.shape[0]):
        x[i] = _half(x[i])


def _make_add(k):
    def add(x):
        for i in range(x.shape[0]):
            x[i] += k

    return add


ADD = Variants(_make_add, "ADD")
'''


@pytest.fixture
def pool_kernels(tmp_path, monkeypatch):
    """A fresh module of three small kernels (nothing compiled, nothing cached) that worker
    processes can import, and a toy 'model' whose forward pass calls them."""
    import importlib
    import uuid

    name = f"poolk_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(POOL_KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(PACKAGE.parent)]))
    mod = importlib.import_module(name)
    yield mod
    sys.modules.pop(name, None)


class ToyCache:
    def __init__(self):
        self.n_ctx, self.n_past = 16, 0


class ToyModel:
    """forward: scale (float64 and float32 inputs: two specialisations), total, halve."""

    def __init__(self, mod):
        self.mod = mod

    def new_cache(self):
        return ToyCache()

    def forward(self, ids, cache, prompt=False):
        x = np.arange(len(ids) + 1, dtype=np.float64)
        self.mod.scale(x, 2.0)
        self.mod.scale(x.astype(np.float32), 2.0)
        out = np.zeros(1)
        self.mod.total(x, out)
        self.mod.halve(x)
        cache.n_past += len(ids)
        return out


def _misses(mod) -> dict[str, int]:
    """Specialisations each kernel compiled in this process (not loaded from the disk cache)."""
    return {k: sum(getattr(mod, k).stats.cache_misses.values()) for k in ("scale", "total", "halve")}


import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402


def test_the_recording_notes_each_specialisation_once_without_compiling(pool_kernels):
    from qllama.runtime import compile_pool

    model = ToyModel(pool_kernels)
    jobs = compile_pool.record_jobs([lambda: model.forward([0, 0], model.new_cache())] * 2)
    got = sorted((j.name, tuple(str(a) for a in j.argtypes)) for j in jobs)
    assert got == [("halve", ("array(float64, 1d, C)",)),
                   ("scale", ("array(float32, 1d, C)", "float64")),
                   ("scale", ("array(float64, 1d, C)", "float64")),
                   ("total", ("array(float64, 1d, C)", "array(float64, 1d, C)"))]
    assert all(j.module == pool_kernels.__name__ for j in jobs)
    assert all(not getattr(pool_kernels, k).overloads for k in ("scale", "total", "halve"))  # nothing compiled


def test_a_pool_warm_up_leaves_every_kernel_compiled_and_loads_it_from_the_cache(pool_kernels):
    from qllama.runtime.warmup import warm_up

    model = ToyModel(pool_kernels)
    warm_up(model, workers=2)
    # every specialisation was compiled once, here or by a worker (then loaded from the disk cache)
    assert all(n <= 1 for k in ("scale", "total", "halve") for n in getattr(pool_kernels, k).stats.cache_misses.values())
    assert len(pool_kernels.scale.overloads) == 2 and pool_kernels.total.overloads and pool_kernels.halve.overloads
    before = {k: len(getattr(pool_kernels, k).overloads) for k in ("scale", "total", "halve")}
    out = model.forward([0, 0, 0], model.new_cache())  # what a generation calls: nothing more to compile
    assert out[0] == 2 * (0 + 1 + 2 + 3)  # the loaded code computes (x doubled, then summed)
    assert {k: len(getattr(pool_kernels, k).overloads) for k in before} == before


def test_workers_alone_compile_every_job_into_the_disk_cache(pool_kernels):
    """With here=False this process compiles nothing: all it runs afterwards comes from the cache."""
    from qllama.runtime import compile_pool

    model = ToyModel(pool_kernels)
    jobs = compile_pool.record_jobs([lambda: model.forward([0], model.new_cache())])
    assert compile_pool.compile_jobs(jobs, 2, here=False) == []
    assert {s["worker"] for s in compile_pool.STATS} - {os.getpid()} and os.getpid() not in {s["worker"] for s in compile_pool.STATS}
    model.forward([0], model.new_cache())
    assert _misses(pool_kernels) == {"scale": 0, "total": 0, "halve": 0}


def test_this_process_compiles_alongside_the_workers(pool_kernels, monkeypatch):
    """With workers that never answer, this process compiles every job itself, in compile_jobs."""
    from qllama.runtime import compile_pool

    monkeypatch.setattr(compile_pool, "WORKER_CMD", [sys.executable, "-c", FAILING_WORKERS["exits at once"]])
    model = ToyModel(pool_kernels)
    jobs = compile_pool.record_jobs([lambda: model.forward([0], model.new_cache())])
    assert compile_pool.compile_jobs(jobs, 1) == []
    assert {s["worker"] for s in compile_pool.STATS} == {os.getpid()} and len(compile_pool.STATS) == 4
    assert _misses(pool_kernels) == {"scale": 2, "total": 1, "halve": 1}


def test_variants_compile_in_workers_and_load_from_the_cache(pool_kernels):
    """Members of a kernels/jit.py Variants family are jobs of their own (module, family, key)."""
    import importlib

    from qllama.runtime import compile_pool

    def step():
        for k in (3, 5):
            pool_kernels.ADD[k](np.zeros(2))

    jobs = compile_pool.record_jobs([step])
    assert sorted((j.name, j.key, j.label.split(".")[-1]) for j in jobs) == [("ADD", 3, "ADD[3]"), ("ADD", 5, "ADD[5]")]
    assert compile_pool.compile_jobs(jobs, 2) == []
    fresh = importlib.reload(pool_kernels)  # new dispatchers: both variants come from the disk cache
    for k in (3, 5):
        x = np.ones(2)
        fresh.ADD[k](x)
        assert x.tolist() == [1 + k, 1 + k]  # each variant kept its own constant
        assert sum(fresh.ADD[k].stats.cache_misses.values()) == 0 and fresh.ADD[k].stats.cache_hits


def test_variants_compiled_by_different_processes_keep_their_own_code(pool_kernels):
    """Two variants of one family with the same argument types, one compiled in another process
    (as by a compile worker, or an earlier run) and loaded from the disk cache, one compiled in
    this process: each keeps its own code, also at the address that `jit.address_of` hands to the
    kernels that call it (`call_address`). Numba names compiled code after the function's
    qualified name, its argument types and a per-process counter; two fresh processes count
    alike, so without a name of its own per variant both got one symbol, and the address looked
    up by that name was the other variant's (an IQ3_XXS model gave NaN)."""
    import subprocess

    run = ("import sys, numpy as np, {m} as k\nfrom qllama.kernels.jit import compiled_address\n"
           "keys = {keys}\nx = np.ones(2)\nfor key in keys:\n    y = np.ones(2); k.ADD[key](y); print(y[0])\n"
           "print(len({{compiled_address(k.ADD[key], (x,)) for key in keys}}))")
    first = subprocess.run([sys.executable, "-c", run.format(m=pool_kernels.__name__, keys=(3,))],
                           capture_output=True, text=True, check=True)
    assert first.stdout.split() == ["4.0", "1"]
    # a second fresh process: ADD[5] compiled here (its counter as the first process's), ADD[3] loaded
    second = subprocess.run([sys.executable, "-c", run.format(m=pool_kernels.__name__, keys=(5, 3))],
                            capture_output=True, text=True, check=True)
    assert second.stdout.split() == ["6.0", "4.0", "2"]  # two variants, two addresses


def _spawned(monkeypatch) -> list:
    """Record the worker processes compile_pool starts."""
    import subprocess

    from qllama.runtime import compile_pool

    procs = []
    real = subprocess.Popen

    def popen(*a, **k):
        p = real(*a, **k)
        procs.append(p)
        return p

    monkeypatch.setattr(compile_pool.subprocess, "Popen", popen)
    return procs


FAILING_WORKERS = {
    "exits at once": "import sys; sys.exit(3)",
    "dies on its first job": "import sys; sys.stdin.readline(); sys.exit(3)",
    "answers err": "import sys\nfor line in sys.stdin: print('err simulated', flush=True)",
    "hangs": "import sys, time; sys.stdin.readline(); time.sleep(120)",
}


@pytest.mark.parametrize("how", [pytest.param(h, marks=pytest.mark.slow) if h in ("exits at once", "answers err") else h
                                 for h in FAILING_WORKERS])  # (two in the default suite keep it fast)
def test_the_warm_up_falls_back_to_compiling_itself_when_workers_fail(pool_kernels, monkeypatch, how):
    from qllama.runtime import compile_pool
    from qllama.runtime.warmup import warm_up

    monkeypatch.setattr(compile_pool, "WORKER_CMD", [sys.executable, "-c", FAILING_WORKERS[how]])
    monkeypatch.setattr(compile_pool, "JOB_TIMEOUT_S", 2.0)
    procs = _spawned(monkeypatch)
    model = ToyModel(pool_kernels)
    warm_up(model, workers=2)
    assert len(procs) == 2
    assert all(p.poll() is not None for p in procs)  # no worker left behind (the hung one was killed)
    assert _misses(pool_kernels) == {"scale": 2, "total": 1, "halve": 1}  # compiled here instead
    before = {k: len(getattr(pool_kernels, k).overloads) for k in ("scale", "total", "halve")}
    model.forward([0], model.new_cache())
    assert {k: len(getattr(pool_kernels, k).overloads) for k in before} == before


def test_one_failing_worker_leaves_its_jobs_to_the_others(pool_kernels, monkeypatch):
    from qllama.runtime import compile_pool

    real = list(compile_pool.WORKER_CMD)
    cmds = iter([[sys.executable, "-c", FAILING_WORKERS["dies on its first job"]], real])
    monkeypatch.setattr(compile_pool.subprocess, "Popen",
                        lambda cmd, _p=compile_pool.subprocess.Popen, **k: _p(next(cmds), **k))
    model = ToyModel(pool_kernels)
    jobs = compile_pool.record_jobs([lambda: model.forward([0], model.new_cache())])
    assert len(jobs) == 4
    assert compile_pool.compile_jobs(jobs, 2, here=False) == []  # the healthy worker compiled all four
    model.forward([0], model.new_cache())
    assert _misses(pool_kernels) == {"scale": 0, "total": 0, "halve": 0}


def test_ctrl_c_while_workers_compile_kills_them(pool_kernels, monkeypatch):
    import selectors

    from qllama.runtime import compile_pool

    monkeypatch.setattr(compile_pool, "WORKER_CMD", [sys.executable, "-c", FAILING_WORKERS["hangs"]])
    procs = _spawned(monkeypatch)

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(selectors.DefaultSelector, "select", interrupted)
    model = ToyModel(pool_kernels)
    jobs = compile_pool.record_jobs([lambda: model.forward([0], model.new_cache())])
    with pytest.raises(KeyboardInterrupt):
        compile_pool.compile_jobs(jobs, 2)
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)


def test_no_pool_for_kernels_already_in_the_disk_cache(pool_kernels, monkeypatch):
    """A second process (here: fresh dispatchers of the same module) finds the cache warm: no workers."""
    import importlib

    from qllama.runtime import compile_pool
    from qllama.runtime.warmup import warm_up

    warm_up(ToyModel(pool_kernels), workers=0)  # compiles here and fills the disk cache
    fresh = importlib.reload(pool_kernels)  # new dispatchers with nothing in memory
    procs = _spawned(monkeypatch)
    assert compile_pool.record_jobs([lambda: ToyModel(fresh).forward([0], ToyCache())]) == []
    warm_up(ToyModel(fresh))
    assert procs == [] and _misses(fresh) == {"scale": 0, "total": 0, "halve": 0}


def test_a_failing_step_does_not_end_the_recording(pool_kernels):
    """The model's own checks may reject the garbage that skipped kernels leave: later steps still run."""
    from qllama.runtime import compile_pool

    model = ToyModel(pool_kernels)

    def rejects():
        model.forward([0], model.new_cache())
        raise ValueError("non-finite")

    def halves():
        pool_kernels.halve(np.zeros(3, np.float32))

    jobs = compile_pool.record_jobs([rejects, halves])
    assert sorted((j.name, str(j.argtypes[0])) for j in jobs if j.name == "halve") == [
        ("halve", "array(float32, 1d, C)"), ("halve", "array(float64, 1d, C)")]


def test_no_worker_can_start(pool_kernels, monkeypatch):
    from qllama.runtime import compile_pool
    from qllama.runtime.warmup import warm_up

    def refuse(*a, **k):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(compile_pool.subprocess, "Popen", refuse)
    warm_up(ToyModel(pool_kernels), workers=2)
    assert _misses(pool_kernels) == {"scale": 2, "total": 1, "halve": 1}  # all compiled here


def test_compile_workers_setting(monkeypatch):
    from qllama.runtime import compile_pool

    monkeypatch.setenv("QLLAMA_COMPILE_WORKERS", "0")
    assert compile_pool.default_workers() == 0
    assert compile_pool.precompile([lambda: pytest.fail("recorded although disabled")]) == (0, 0)
    monkeypatch.setenv("QLLAMA_COMPILE_WORKERS", "3")
    assert compile_pool.default_workers() == 3
    monkeypatch.delenv("QLLAMA_COMPILE_WORKERS")
    assert compile_pool.default_workers() == len(os.sched_getaffinity(0)) - 1  # (this process compiles too)


# -- the cache key covers every kernel module -------------------------------------------------


def test_a_change_in_another_kernel_module_recompiles_the_cached_kernel(tmp_path):
    """Numba alone keys a cached function on its own file: `caller` (in caller.py) would keep
    the inlined old `helper` after only helper.py changed. With jit.py's locator the stamp covers
    every module beside jit.py, so the second run sees the new helper."""
    import subprocess
    import sys

    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "jit.py").write_text((Path(qllama.__file__).parent / "kernels" / "jit.py").read_text())
    (pkg / "caller.py").write_text(
        "from .jit import kernel\nfrom .helper import helper\n\n\n@kernel\ndef caller(x):\n    return helper(x) + 1\n"
    )
    helper = pkg / "helper.py"
    run = [sys.executable, "-c", "from kpkg.caller import caller; print(caller(1), caller.stats.cache_hits.total())"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def result():
        out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, check=True).stdout.split()
        return int(out[0]), int(out[1])

    helper.write_text("from .jit import kernel\n\n\n@kernel\ndef helper(x):\n    return x * 10\n")
    assert result() == (11, 0)  # compiled
    assert result() == (11, 1)  # loaded from the cache
    helper.write_text("from .jit import kernel\n\n\n@kernel\ndef helper(x):\n    return x * 100\n")
    assert result() == (101, 0)  # recompiled, not the stale 11


def test_prestarted_workers_serve_the_next_compile_or_are_stopped(pool_kernels, monkeypatch):
    from qllama.runtime import compile_pool

    procs = _spawned(monkeypatch)
    assert compile_pool.prestart(1) == 1 and len(procs) == 1
    model = ToyModel(pool_kernels)
    jobs = compile_pool.record_jobs([lambda: model.forward([0], model.new_cache())])
    assert compile_pool.compile_jobs(jobs, 1, here=False) == []
    assert len(procs) == 1 and procs[0].poll() is not None  # the prestarted worker compiled, then stopped
    model.forward([0], model.new_cache())
    assert _misses(pool_kernels) == {"scale": 0, "total": 0, "halve": 0}
    assert compile_pool.prestart(2) == 2
    compile_pool.stop_prestarted()  # no compile came (also run at exit)
    assert len(procs) == 3 and all(p.wait(5) is not None for p in procs)


def test_only_a_load_that_announces_a_warm_up_starts_compile_workers(tmp_path, monkeypatch):
    import qllama
    from qllama import api
    from qllama.runtime import compile_pool
    from tools.make_model import ModelSpec, write_model

    path = tmp_path / "m.gguf"
    write_model(path, ModelSpec(weight_type="q8_0", seed=5, n_ctx=32))
    started = []
    monkeypatch.setattr(compile_pool, "prestart", lambda n=None: started.append(n) or 1)
    monkeypatch.setattr(compile_pool, "default_workers", lambda: 1)
    monkeypatch.setattr(api.Model, "kernels_cached", lambda self: False)  # a first run
    qllama.load(path)
    assert started == []
    qllama.load(path, warmup_next=True)
    assert started == [None]
    monkeypatch.setattr(api.Model, "kernels_cached", lambda self: True)  # a later run
    qllama.load(path, warmup_next=True)
    assert started == [None]
