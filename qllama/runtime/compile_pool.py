"""A first-run Numba compile spread over this process and worker processes (one per other CPU).

Numba compiles one function at a time, on one core, under a global lock, so a cold warm-up
(tens of seconds) leaves every other core idle. `precompile(steps)` splits that work:

1. Record. The warm-up's forward passes run once with every kernel that has no
   compiled code in this process replaced by a recorder: the call notes (kernel, argument types)
   and returns without computing anything. Kernels that Numba's disk cache already holds are not
   noted (loading them is cheap).
2. Compile. This process and worker processes (`python -m qllama.runtime.compile_pool`, started ahead
   by `prestart` while the model loads) take the noted specialisations one at a time, most
   expensive first (`MEASURED_S`), and compile them into the disk cache that this process uses
   (`kernels.jit.kernel_cache_dir()`, which the workers compute the same way).
3. The caller then runs the real warm-up, which loads the workers' kernels from the disk cache.

Nothing here is needed for correctness: whatever the pool did not compile (a worker failed,
was killed, timed out; a kernel the recording could not reach) is compiled by the real warm-up
in this process, as without a pool. Workers are killed when this returns or raises (Ctrl-C
included), and exit by themselves when their input closes.

Numba's cache writes each file by an atomic rename, but adding an entry to a function's index
is read-modify-write: two processes saving different specialisations of one function at the
same time can lose one entry or, worse, point it at the other's code. Workers therefore save
under an exclusive lock on a file in the cache directory (`_locked_cache_saves`).

QLLAMA_COMPILE_WORKERS=N sets the number of worker processes besides this one (0: compile in
this process only, during the warm-up itself).
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import os
import pickle
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..kernels.jit import OPT_LEVEL, argument_kinds

WORKER_CMD = [sys.executable, "-m", "qllama.runtime.compile_pool"]  # (tests replace it to simulate failures)
JOB_TIMEOUT_S = 600.0  # a worker silent this long on one job is killed (its job falls back)
LOCK_NAME = "qllama-cache-save.lock"
STATS: list[dict] = []  # the last compile_jobs: one entry per compiled job (CPU and wall seconds, worker), for tools


@dataclass
class Job:
    """One specialisation to compile: the kernel `module.name` (or `module.name[key]`, a
    kernels/jit.py `Variants` member) for `argtypes` (Numba types)."""

    module: str
    name: str
    argtypes: tuple
    cost: float = 0.0  # expected compile seconds (`_cost`), for the order: larger first
    callees: frozenset = frozenset()  # ids of the kernels it calls (compiled along with it)
    done: bool = field(default=False, compare=False)
    key: object = None  # the variant's key, or None

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}" + ("" if self.key is None else f"[{self.key}]")


def default_workers() -> int:
    """Worker processes for a cold compile, besides this process: QLLAMA_COMPILE_WORKERS, else the
    CPUs this process may use, less one."""
    if os.name != "posix":  # (pipes in selectors, fcntl locks: POSIX only; elsewhere compile in-process)
        return 0
    env = os.environ.get("QLLAMA_COMPILE_WORKERS", "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            pass
    try:
        return len(os.sched_getaffinity(0)) - 1
    except AttributeError:  # not Linux
        return (os.cpu_count() or 1) - 1


# -- 1. record ----------------------------------------------------------------------------------


def _module_name(d) -> tuple[str, str, object] | None:
    """(module, attribute, variant key or None) under which a worker can import dispatcher `d`, or None."""
    variant = getattr(d, "_qllama_variant", None)  # (kernels/jit.py Variants)
    if variant is not None:
        return variant
    f = d.py_func
    mod = sys.modules.get(f.__module__)
    if mod is None or getattr(mod, f.__name__, None) is not d:
        return None
    return f.__module__, f.__name__, None


def _resolve(module: str, name: str, key):
    """The dispatcher that `_module_name` named."""
    d = getattr(importlib.import_module(module), name)
    return d if key is None else d[key]


def _in_disk_cache(d, argtypes: tuple) -> bool:
    """Whether Numba's disk cache holds `d` compiled for `argtypes` (False when unsure)."""
    try:
        cache = d._cache
        key = cache._index_key(argtypes, d.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # NullCache (cache=False), or Numba internals changed: let a worker find out
        return False


def _called(func) -> list:
    """The Numba kernels that `func`'s code names: `f(...)` and `module.f(...)`."""
    from types import ModuleType

    from numba.core.dispatcher import Dispatcher

    names = func.__code__.co_names
    found = [func.__globals__.get(n) for n in names]
    modules = [m for m in found if isinstance(m, ModuleType)]
    found += [getattr(m, n, None) for m in modules for n in names]
    return [d for d in found if isinstance(d, Dispatcher)]


# Measured compile CPU seconds of the kernels that cold warm-ups compile (tools/bench_compile.py
# prints them per job; 2-core AMD EPYC, LLVM level 1). Only their order matters: the pool hands
# out the longest first, so that no long job starts last while the other worker idles. Kernels
# not listed get `_reach`'s guess from their bytecode, which misses what intrinsics and
# overloads generate (ROWS_SERIAL, guessed among the cheapest, took ~1.5 s and often ran last).
MEASURED_S = {
    "layer_ops._attend_jobs": 4.6, "int8.GEMM_ROWS": 0.6, "int8.ROWS_INT8": 0.55, "int8._row_chunks": 0.9,
    "dequantize.ROWS_SERIAL": 1.3, "fused.ffn": 1.4, "fused._chunk3": 1.2, "layer_ops.glu": 1.0,
    "act_quant.q8_0_row": 0.9, "act_quant.q8_1_row": 0.9, "layer_ops._attention_chunks": 0.7,
    "layer_ops.rope_store": 0.75, "act_quant.q8_k_row": 0.55, "act_quant._each_token": 0.45, "fused.matvec3": 0.3,
    "layer_ops.rmsnorm": 0.25,
}
_GUESS_S_PER_BYTE = 1.0 / 4000  # `_reach`'s bytecode guess in seconds, roughly, next to MEASURED_S


def _cost(module: str, name: str, guess: float) -> float:
    """Compile seconds expected for kernel module.name: measured if listed, else guessed."""
    return MEASURED_S.get(f"{module.rsplit('.', 1)[-1]}.{name}", guess * _GUESS_S_PER_BYTE)


def _reach(d) -> tuple[float, frozenset]:
    """(compile-cost guess, ids of the kernels it calls, transitively) for dispatcher d.

    The guess is the bytecode size of d and of everything it calls (each once), doubled for a
    parallel=True kernel (parfor lowering compiles the loop body as a separate function)."""
    seen = {id(d)}
    todo = [d]
    size = 0
    while todo:
        k = todo.pop()
        size += len(k.py_func.__code__.co_code)
        for c in _called(k.py_func):
            if id(c) not in seen:
                seen.add(id(c))
                todo.append(c)
    return size * (2.0 if d.targetoptions.get("parallel") else 1.0), frozenset(seen - {id(d)})


@contextlib.contextmanager
def _recording(jobs: list[Job]):
    from numba.core.dispatcher import Dispatcher

    original = Dispatcher._compile_for_args
    seen: set = set()

    def record(self, *args, **kws):
        try:
            quick = (id(self), argument_kinds(args))  # (typing every argument of every call cost ~0.3 s per warm-up)
            if quick in seen:
                return _skip
            seen.add(quick)
            argtypes = tuple(self.typeof_pyval(a) for a in args)
            key = (id(self), argtypes)
            if key in seen:  # (also when it is cached: reading the cache index on every call cost ~1.5 s per warm-up)
                return _skip
            seen.add(key)
            where = _module_name(self)
            if where is not None and not kws and not _in_disk_cache(self, argtypes):
                guess, callees = _reach(self)
                jobs.append(Job(where[0], where[1], argtypes, _cost(where[0], where[1], guess), callees, key=where[2]))
        except Exception:  # an argument Numba cannot type: the real warm-up will say so
            pass
        return _skip

    Dispatcher._compile_for_args = record
    try:
        yield
    finally:
        Dispatcher._compile_for_args = original


def _skip(*args, **kws):
    return None


def record_jobs(steps: Iterable[Callable[[], object]]) -> list[Job]:
    """The specialisations that `steps` (e.g. the warm-up's forward passes) would compile (see the
    module docstring), most expensive first.

    The steps run with kernels that return None and leave their outputs untouched, so a step may
    fail on the garbage (e.g. the model's non-finite check): the next step still runs, and the
    jobs noted so far are kept."""
    import warnings

    import numpy as np

    jobs: list[Job] = []
    with _recording(jobs), warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the skipped kernels leave garbage: NumPy's complaints are noise
        for step in steps:
            try:
                step()
            except Exception:
                pass
    jobs.sort(key=lambda j: -j.cost)
    return jobs


# -- 2. compile in workers ----------------------------------------------------------------------


@dataclass
class _Worker:
    proc: subprocess.Popen | None  # None: this process
    job: Job | None = None
    since: float = 0.0
    buf: bytes = b""


def _encode(job: Job) -> bytes:
    return base64.b64encode(pickle.dumps((job.module, job.name, job.key, job.argtypes))) + b"\n"


def _stop(w: _Worker) -> None:
    with contextlib.suppress(OSError):
        w.proc.stdin.close()
    if w.proc.poll() is None:
        w.proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        w.proc.wait(timeout=5)
    with contextlib.suppress(OSError):
        w.proc.stdout.close()


_PRESTARTED: list[subprocess.Popen] = []  # workers started ahead of a cold warm-up (`prestart`)
IDLE_EXIT_S = 30.0  # a worker that gets no job this long after it started exits (a load with no warm-up)


def _worker_env() -> dict:
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "QLLAMA_POOL_PARENT": str(os.getpid())}
    if not env.get("NUMBA_OPT", "").strip():
        # A worker compiles only kernels: its whole process, machine-code generation included,
        # runs at their optimisation level, as kernels/jit.py sets it in the main process.
        env["NUMBA_OPT"] = str(OPT_LEVEL)
    return env


def _spawn() -> subprocess.Popen:
    return subprocess.Popen(WORKER_CMD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=_worker_env())


def prestart(n_workers: int | None = None) -> int:
    """Start the workers of a cold warm-up ahead of it, e.g. while the model loads: each imports
    Numba and the kernels and initialises its compiler meanwhile (~1 s that would otherwise
    delay its first job). The next `compile_jobs` takes them; `stop_prestarted` (also run at
    exit) stops unused ones, and each exits by itself after IDLE_EXIT_S without a job.
    Returns the number of workers waiting."""
    n = default_workers() if n_workers is None else n_workers
    while len(_PRESTARTED) < n:
        try:
            _PRESTARTED.append(_spawn())
        except OSError:
            break
    if _PRESTARTED:
        import atexit

        atexit.register(stop_prestarted)
    return len(_PRESTARTED)


def stop_prestarted() -> None:
    """Stop the prestarted workers that no compile took."""
    while _PRESTARTED:
        _stop(_Worker(_PRESTARTED.pop()))


def compile_jobs(jobs: list[Job], n_workers: int, job_timeout: float | None = None, here: bool = True) -> list[Job]:
    """Compile `jobs` into the disk cache in up to n_workers worker processes and, with `here`,
    in this process at the same time. Returns the jobs that failed or were not attempted (the
    caller's warm-up compiles them itself).

    This process takes jobs from the same queue (most expensive first) on its own thread while
    another thread hands jobs to the workers: it needs no start-up of its own, and the code it
    compiled is in memory already when the real warm-up runs. If every worker fails, it
    compiles what is left."""
    job_timeout = JOB_TIMEOUT_S if job_timeout is None else job_timeout
    todo = [j for j in jobs if not j.done]
    n = min(n_workers, len(todo) - 1 if here else len(todo))  # (this process takes one job at least)
    if n < 1:
        stop_prestarted()
        return todo
    workers: list[_Worker] = []
    sel = selectors.DefaultSelector()
    t_start = time.monotonic()
    STATS.clear()
    queue = list(todo)
    lock = threading.Lock()  # queue and here.job, shared by the two threads
    me = _Worker(None)  # this process, as a worker: its running job
    failed: list[BaseException] = []
    try:
        for _ in range(n):
            if _PRESTARTED and _PRESTARTED[0].poll() is None:
                p = _PRESTARTED.pop(0)
            else:
                try:
                    p = _spawn()
                except OSError:
                    break
            w = _Worker(p)
            workers.append(w)
            sel.register(p.stdout, selectors.EVENT_READ, w)
        alive = list(workers)

        def take(w: _Worker) -> Job | None:
            """The next job for w, most expensive first, preferring one that shares no callee with
            the jobs running elsewhere: a shared callee compiled once is then loaded by the other."""
            with lock:
                if not queue:
                    return None
                others = [o for o in alive + [me] if o is not w and o.job is not None]
                running = frozenset().union(*(o.job.callees for o in others))
                job = queue.pop(next((i for i, j in enumerate(queue) if not (j.callees & running)), 0))
                w.job, w.since = job, time.monotonic()
                return job

        def hand_out(w: _Worker) -> None:
            if take(w) is None:
                w.job = None
                return
            try:
                w.proc.stdin.write(_encode(w.job))
                w.proc.stdin.flush()
            except OSError:  # it died: the job goes to another worker or falls back
                retire(w, requeue=True)

        def retire(w: _Worker, requeue: bool) -> None:
            if w in alive:
                alive.remove(w)
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(w.proc.stdout)
            if requeue and w.job is not None:
                with lock:
                    queue.insert(0, w.job)  # one retry elsewhere (this process included)
            w.job = None
            _stop(w)

        def serve() -> None:
            try:
                _serve_workers(alive, sel, hand_out, retire, job_timeout, t_start)
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                failed.append(e)

        server = threading.Thread(target=serve, name="qllama-compile-pool", daemon=True)
        server.start()
        with _locked_cache_saves():
            while here and take(me) is not None:
                job, t0, c0 = me.job, time.perf_counter(), time.process_time()
                try:
                    _resolve(job.module, job.name, job.key).compile(job.argtypes)
                    job.done = True
                except Exception:  # noqa: BLE001 - the real warm-up compiles it again and reports
                    pass
                STATS.append(dict(job=job.label, worker=os.getpid(), cpu_s=time.process_time() - c0,
                                  wall_s=time.perf_counter() - t0, start_s=t0 - t_start))
                me.job = None
        server.join()
        if failed:
            raise failed[0]
    finally:
        for w in workers:
            _stop(w)
        sel.close()
        stop_prestarted()
    return [j for j in jobs if not j.done]


def _serve_workers(alive: list[_Worker], sel, hand_out, retire, job_timeout: float, t_start: float) -> None:
    """Hand jobs to the worker processes and collect their answers until none is busy and no
    job is left for them."""
    while alive:
        for w in list(alive):
            if w.job is None:
                hand_out(w)
        busy = [w for w in alive if w.job is not None]
        if not busy:
            break
        now = time.monotonic()
        for w in busy:
            if now - w.since > job_timeout:
                retire(w, requeue=False)
        busy = [w for w in alive if w.job is not None]
        if not busy:
            continue
        wait = max(0.05, min(job_timeout - (now - w.since) for w in busy))
        for key, _ in sel.select(timeout=wait):
            w = key.data
            if w not in alive:
                continue
            chunk = os.read(w.proc.stdout.fileno(), 4096)
            if not chunk:  # the worker exited (crashed, killed)
                retire(w, requeue=True)
                continue
            w.buf += chunk
            while b"\n" in w.buf and w.job is not None:
                line, w.buf = w.buf.split(b"\n", 1)
                if line.startswith(b"ok"):
                    w.job.done = True
                    with contextlib.suppress(ValueError):
                        cpu, wall = (float(v) for v in line.split()[1:3])
                        STATS.append(dict(job=w.job.label, worker=w.proc.pid, cpu_s=cpu, wall_s=wall,
                                          start_s=w.since - t_start))
                w.job = None
                hand_out(w)


def precompile(steps: Iterable[Callable[[], object]], n_workers: int | None = None) -> tuple[int, int]:
    """Record what `steps` compile and compile it in worker processes (module docstring).
    Returns (specialisations noted, compiled by the workers)."""
    n = default_workers() if n_workers is None else n_workers
    if n < 1:
        return 0, 0
    jobs = record_jobs(steps)
    if len(jobs) < 2:  # one job: compiling it here is as fast
        stop_prestarted()
        return len(jobs), 0
    try:
        left = compile_jobs(jobs, n)
    except Exception:  # the pool itself broke (e.g. no pipes or processes here): the warm-up compiles all
        stop_prestarted()
        return len(jobs), 0
    return len(jobs), len(jobs) - len(left)


# -- the worker -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked_cache_saves():
    """Serialise Numba's cache-index updates between processes (module docstring)."""
    import fcntl

    from numba.core import caching

    original = caching.IndexDataCacheFile.save

    def save(self, key, data):
        lock = os.path.join(os.path.dirname(self._index_path), LOCK_NAME)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return original(self, key, data)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return original(self, key, data)
        finally:
            os.close(fd)

    caching.IndexDataCacheFile.save = save
    try:
        yield
    finally:
        caching.IndexDataCacheFile.save = original


def _compile_one(line: bytes) -> str:
    module, name, key, argtypes = pickle.loads(base64.b64decode(line))
    d = _resolve(module, name, key)
    c0, t0 = time.process_time(), time.perf_counter()
    d.compile(argtypes)
    return f"ok {time.process_time() - c0:.3f} {time.perf_counter() - t0:.3f}"


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies (killed, crashed), instead of compiling on unasked.
    (Elsewhere a worker stops at its next read: its input closes with the parent.)"""
    import ctypes
    import signal

    parent = int(os.environ.get("QLLAMA_POOL_PARENT", "0"))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != parent:  # it died before prctl took effect
        sys.exit(1)


def _initialise() -> None:
    """What a worker's first compile would otherwise pay: import the kernel modules and compile
    (or load) one small kernel that attention needs anyway (Numba's typing and LLVM set-up)."""
    from numba import types

    for m in ("act_quant", "dequantize", "fused", "int8", "layer_ops"):
        importlib.import_module(f"qllama.kernels.{m}")
    importlib.import_module("qllama.kernels.layer_ops")._key_range.compile((types.int64, types.int64))


def worker_main() -> None:
    """Read jobs (one per line) from stdin, compile each, answer `ok` or `err <reason>` per job."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C at the terminal: die at once, quietly
    _die_with_parent()
    with contextlib.suppress(Exception):  # (only a head start: the first job imports what it needs)
        _initialise()
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    if not sel.select(IDLE_EXIT_S):
        return  # prestarted, and no warm-up came
    sel.close()
    out = sys.stdout
    with _locked_cache_saves():
        for line in sys.stdin.buffer:
            if not line.strip():
                break
            try:
                answer = _compile_one(line.strip())
            except Exception as e:  # noqa: BLE001 - reported to the parent, which compiles it itself
                answer = "err " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
            out.write(answer + "\n")
            out.flush()


if __name__ == "__main__":
    worker_main()
