"""Cold-start cost of qllama's Numba kernels (a developer tool, not a test).

    python tools/bench_compile.py                          # 1B Q4_K_M bench model and the demo, 1 round
    python tools/bench_compile.py --models demo --rounds 3 --modes serial pool
    python tools/bench_compile.py --kernels 15             # the 15 most expensive specialisations
    python tools/bench_compile.py --models demo --only act_quant.quantize_q8_k --src /tmp/variant /work/main --rounds 3

Each measurement is a fresh subprocess with its own empty NUMBA_CACHE_DIR (a temp dir), which
loads the model and runs `Model.warmup()` (what `qllama run` does before the prompt):

- cold: the cache is empty, every kernel compiles. `--modes serial` compiles in the process (one
  core, the old behaviour); `pool` lets the warm-up spread the compile over worker processes
  (qllama/compile_pool.py); rounds alternate the modes (A B A B) because the machine is shared.
- warm: a second fresh process on the filled cache (what every later run pays).

Reported per run: warm-up wall seconds, CPU seconds of the process and its children, the whole
subprocess's wall (imports and model load included), and the load average. For a serial cold
run, each specialisation's own compile seconds (Numba's "numba:compile" events, minus the time
of the nested compiles of the kernels it calls), sorted by cost, with its options.

`--only KERNEL --src DIR...` compares kernel definitions: for each source tree (e.g. a scratch
copy of the repository with one kernel edited, and the repository itself), a fresh process with
an empty cache compiles only the specialisations of KERNEL that the model's warm-up needs
(nested kernels included), alternating the trees each round; reported in CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "--child-only" not in sys.argv and "--child" not in sys.argv:  # (children import the tree on PYTHONPATH)
    sys.path.insert(0, str(REPO))

DEFAULT_MODELS = [str(REPO / "bench-models" / "llama-3.2-1b-q4_k_m.gguf"), "demo"]


# -- the child: one warm-up, measured ---------------------------------------------------------


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _install_compile_timer() -> list[dict]:
    """Record every Numba compile: dispatcher, signature, own seconds (nested compiles excluded)."""
    from numba.core import event

    records: list[dict] = []
    stack: list[list] = []  # [start wall, start CPU, wall and CPU seconds spent in nested compiles]

    class Timer(event.Listener):
        def on_start(self, ev):
            stack.append([time.perf_counter(), time.process_time(), 0.0, 0.0])

        def on_end(self, ev):
            t0, c0, nested, nested_cpu = stack.pop()
            total = time.perf_counter() - t0
            cpu = time.process_time() - c0
            if stack:
                stack[-1][2] += total
                stack[-1][3] += cpu
            d = ev.data["dispatcher"]
            f = d.py_func
            opts = {k: v for k, v in d.targetoptions.items() if k not in ("cache", "error_model", "nopython", "boundscheck")}
            records.append(dict(kernel=f"{f.__module__.removeprefix('qllama.kernels.')}.{f.__name__}",
                                sig=", ".join(str(a) for a in ev.data["args"]), own=total - nested, total=total,
                                own_cpu=cpu - nested_cpu,
                                options=", ".join(f"{k}={v}" for k, v in sorted(opts.items()) if v not in (False, None))))

    event.register("numba:compile", Timer())
    return records


def child(model: str, mode: str, threads: int) -> dict:
    t_start = time.perf_counter()
    if mode == "serial":
        os.environ["QLLAMA_COMPILE_WORKERS"] = "0"  # compile in this process only
    records = _install_compile_timer()
    import qllama

    llm = qllama.load(model, n_threads=threads, warmup_next=True)
    cold = not llm.kernels_cached()
    cpu0, t0 = _cpu_s(), time.perf_counter()
    llm.warmup()
    wall = time.perf_counter() - t0
    from qllama.runtime import compile_pool

    return dict(model=model, mode=mode, cold=cold, warmup_s=wall, cpu_s=_cpu_s() - cpu0, src=qllama.__file__,
                process_s=time.perf_counter() - t_start, types=llm.kernel_types(), kernels=records,
                pool=compile_pool.STATS)


def child_only(model: str, kernel: str, threads: int) -> dict:
    """Compile only `kernel`'s (comma-separated names) specialisations that the warm-up of `model` needs (empty cache)."""
    records = _install_compile_timer()
    import qllama
    from qllama.runtime import compile_pool
    from qllama.runtime.warmup import PREFILL_TOKENS, _forward_passes, _unchecked

    llm = qllama.load(model, n_threads=threads)
    with _unchecked(llm.forward_model):
        jobs = compile_pool.record_jobs(_forward_passes(llm.forward_model, PREFILL_TOKENS))
    jobs = [j for j in jobs if j.label.removeprefix("qllama.kernels.").split("[")[0] in kernel.split(",")]
    if not jobs:
        raise SystemExit(f"error: the warm-up of {model} does not call {kernel}")
    import importlib

    c0, t0 = time.process_time(), time.perf_counter()
    for j in jobs:
        d = getattr(importlib.import_module(j.module), j.name)
        d = d if getattr(j, "key", None) is None else d[j.key]  # (a kernels/jit.py Variants member)
        d.compile(j.argtypes)
    return dict(cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0, n=len(jobs), kernels=records,
                src=str(Path(qllama.__file__).parents[1]))


def compare_sources(args) -> None:
    print(f"== {args.only} for {Path(args.models[0]).name}: CPU seconds of its compile (nested kernels "
          f"included), empty cache, fresh process", flush=True)
    cpu: dict[str, list[float]] = {s: [] for s in args.src}
    for rnd in range(args.rounds):
        for src in args.src:
            cache = Path(tempfile.mkdtemp(prefix="qllama-numba-"))
            env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": src}
            try:
                r = subprocess.run([sys.executable, __file__, "--child-only", args.models[0], "--only", args.only,
                                    "--threads", str(args.threads)], env=env, capture_output=True, text=True,
                                   timeout=900, cwd=tempfile.gettempdir())
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            if r.returncode != 0:
                raise SystemExit(f"error: {src}: {r.stderr[-3000:]}")
            doc = json.loads(r.stdout.strip().splitlines()[-1])
            if Path(doc["src"]).resolve() != Path(src).resolve():
                raise SystemExit(f"error: {src}: imported qllama from {doc['src']}")
            cpu[src].append(doc["cpu_s"])
            own = ", ".join(f"{k['kernel']} {k['own_cpu']:.2f}" for k in sorted(doc["kernels"], key=lambda k: -k["own_cpu"])
                            if not k["kernel"].startswith("numba."))
            print(f"  round {rnd + 1} {src}: {doc['cpu_s']:.2f} s CPU ({doc['n']} specialisations; own: {own}) "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    for src in args.src:
        print(f"  median {statistics.median(cpu[src]):6.2f} s CPU  {src}")


# -- the parent: fresh processes, tables ---------------------------------------------------------


def run_child(model: str, mode: str, threads: int, cache: Path, src: str = str(REPO)) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": src}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--child", model, "--mode", mode,
                        "--threads", str(threads)], env=env, capture_output=True, text=True, timeout=1800,
                       cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise SystemExit(f"error: the measuring process failed:\n{r.stderr[-3000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    doc["subprocess_s"] = time.perf_counter() - t0
    doc["load"] = load
    return doc


def kernel_table(records: list[dict], top: int) -> list[str]:
    """Own CPU and wall seconds of each compiled specialisation (nested compiles excluded), by CPU."""
    rows = sorted(records, key=lambda r: -r["own_cpu"])
    total = sum(r["own_cpu"] for r in rows) or 1e-9
    lines = [f"  {'CPU s':>6} {'share':>6} {'wall s':>6}  kernel (signature) [options]"]
    for r in rows[:top]:
        sig = r["sig"] if len(r["sig"]) < 80 else r["sig"][:77] + "..."
        lines.append(f"  {r['own_cpu']:6.2f} {100 * r['own_cpu'] / total:5.1f}% {r['own']:6.2f}  "
                     f"{r['kernel']}({sig}) [{r['options']}]")
    if len(rows) > top:
        rest = sum(r["own_cpu"] for r in rows[top:])
        lines.append(f"  {rest:6.2f} {100 * rest / total:5.1f}%         ... {len(rows) - top} more specialisations")
    lines.append(f"  {total:6.2f}                in all: {len(rows)} specialisations of "
                 f"{len({r['kernel'] for r in rows})} functions")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="GGUF paths or `demo`")
    ap.add_argument("--modes", nargs="+", default=["serial", "pool"], choices=["serial", "pool"])
    ap.add_argument("--rounds", type=int, default=1, help="cold runs per mode, alternated (A B A B)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", type=int, default=25, help="rows of the per-kernel table")
    ap.add_argument("--json", help="also write every run to this file")
    ap.add_argument("--only", help="compare kernels (e.g. act_quant.quantize_q8_k, or layer_ops.glu,layer_ops.rmsnorm) across --src trees")
    ap.add_argument("--src", nargs="+", default=[str(REPO)],
                    help="source trees for --only; otherwise the tree to measure (default: this repo; a frozen copy "
                         "keeps others' edits from changing the sources between the cold and the warm run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-only", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="pool", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.models = [m if m == "demo" else str(Path(m).resolve()) for m in args.models]  # (children run elsewhere)
    if args.child:
        print(json.dumps(child(args.child, args.mode, args.threads)))
        return
    if args.child_only:
        print(json.dumps(child_only(args.child_only, args.only, args.threads)))
        return
    if args.only:
        compare_sources(args)
        return

    runs = []
    for model in args.models:
        name = Path(model).name
        print(f"== {name}: {args.threads} threads, {os.cpu_count()} CPUs", flush=True)
        for rnd in range(args.rounds):
            for mode in args.modes:
                cache = Path(tempfile.mkdtemp(prefix="qllama-numba-"))
                try:
                    cold = run_child(model, mode, args.threads, cache, args.src[0])
                    warm = run_child(model, mode, args.threads, cache, args.src[0])
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
                runs.append(dict(cold=cold, warm=warm))
                print(f"  round {rnd + 1} {mode:6s} cold: warm-up {cold['warmup_s']:6.2f} s wall, "
                      f"{cold['cpu_s']:6.2f} s CPU, process {cold['subprocess_s']:6.2f} s | warm: warm-up "
                      f"{warm['warmup_s']:5.2f} s ({warm['cpu_s']:.2f} s CPU), process {warm['subprocess_s']:5.2f} s | load {cold['load']:.2f}"
                      f"{'' if cold['cold'] and not warm['cold'] else '  (marker state unexpected!)'}", flush=True)
                here = [k for k in cold["kernels"] if not k["kernel"].startswith("numba.")]
                if mode == "pool":
                    print(f"      compiled in the main process after the pool: {len(here)} specialisations "
                          f"({sum(k['own_cpu'] for k in here):.2f} s CPU) "
                          + ", ".join(f"{k['kernel']} {k['own_cpu']:.2f}" for k in here), flush=True)
                    per_worker = []
                    for pid in sorted({p["worker"] for p in cold["pool"]}):
                        mine = [p for p in cold["pool"] if p["worker"] == pid]
                        per_worker.append(sum(p["cpu_s"] for p in mine))
                        print(f"      worker {pid}: {per_worker[-1]:6.2f} s CPU compiling: "
                              + ", ".join(f"{p['job'].removeprefix('qllama.kernels.')} {p['cpu_s']:.2f}" for p in mine),
                              flush=True)
                    if per_worker:
                        print(f"      critical path (the busiest worker) {max(per_worker):.2f} s CPU of "
                              f"{sum(per_worker):.2f} s compiled in {len(per_worker)} workers", flush=True)
                if warm["kernels"]:
                    print(f"      warm run compiled {len(warm['kernels'])} specialisations!", flush=True)
        for mode in args.modes:
            mine = [r for r in runs if r["cold"]["model"] == model and r["cold"]["mode"] == mode]
            med = statistics.median(r["cold"]["warmup_s"] for r in mine)
            medw = statistics.median(r["warm"]["warmup_s"] for r in mine)
            print(f"  median {mode}: cold warm-up {med:.2f} s, warm warm-up {medw:.2f} s ({len(mine)} rounds)")
        serial = [r for r in runs if r["cold"]["model"] == model and r["cold"]["mode"] == "serial"]
        if serial:
            print(f"  per specialisation, serial cold run 1 (types {', '.join(serial[0]['cold']['types'])}):")
            print("\n".join(kernel_table(serial[0]["cold"]["kernels"], args.kernels)))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
