"""Decode speed on a busy machine: qllama (default, -t 1, -t 2) against llama.cpp (default, 1, 2).

Usage:
    python tools/bench_busy.py [MODEL] [-n 64] [-r 3] [--busy-cpu N | --busy-free] [--no-idle]
                               [--timeout 1200] [--json OUT.json]

MODEL defaults to SmolLM2-135M-Instruct Q4_1 (tools/fetch_smollm2.py). One worker process per
configuration loads MODEL and warms up; the parent then runs tg (N one-token decodes after an
8-token prompt, the prompt untimed) on each worker in turn, repetition by repetition (A B A B),
first with the machine as it is ("idle" phase: no busy loop of ours), then with a busy loop
(`while True: pass` in a child process) holding one CPU: pinned to the last CPU by default,
`--busy-free` leaves it to the scheduler.

qllama runs through its generation session (`qllama.generation.session.Session.decode`), so its default
(no thread count) is the adaptive mode of `qllama.runtime.threads`, and the worker reports the thread
count it settled on. llama.cpp runs through llama-cpp-python (tools/bench_vs_llamacpp.py's
runner); "default" there is llama-cpp-python's own default, n_threads = cpu_count // 2.

The busy loop stops by itself after --timeout seconds, and is killed when the benchmark ends or
fails. Prints a markdown table of median tokens/s per phase with the ratios the issue asks for,
and `uptime`'s load averages when each phase ended.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT_TOKENS = 8
# (label, engine, threads; None: the engine's default)
CONFIGS = [
    ("qllama default", "qllama", None),
    ("qllama -t 1", "qllama", 1),
    ("qllama -t 2", "qllama", 2),
    ("llama.cpp default", "llama.cpp", None),
    ("llama.cpp -t 1", "llama.cpp", 1),
    ("llama.cpp -t 2", "llama.cpp", 2),
]


# -- workers ---------------------------------------------------------------------------------------


class QllamaSessionRunner:
    """tg through the generation session (the path `qllama run` decodes on, thread adaptation included)."""

    def __init__(self, path: str, n_ctx: int, threads: int | None):
        from qllama import load

        self.llm = load(path, n_ctx=n_ctx, n_threads=threads)
        self.session = self.llm.session

    def warmup(self) -> float:
        return self.llm.warmup()

    def tg(self, n: int) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of n decode steps; the prompt is not counted."""
        from qllama.bench.runner import random_tokens

        s = self.session
        s.reset()
        s.prefill(random_tokens(PROMPT_TOKENS, self.llm.n_vocab, seed=99))
        ids = random_tokens(n, self.llm.n_vocab, seed=4321)
        c0, t0 = _cpu(), time.perf_counter()
        for t in ids:
            s.decode(t)
        return time.perf_counter() - t0, _cpu() - c0

    def state(self) -> dict:
        a = self.session.threads
        if a is None:
            return {"threads": self.llm.n_threads}
        return {"threads": a.current, "switches": a.switches, "probes": a.probes}


class LlamaCppTg:
    """tg on llama.cpp after the same 8-token prompt (tools/bench_vs_llamacpp.py's runner)."""

    def __init__(self, path: str, n_ctx: int, threads: int | None):
        from tools.bench_vs_llamacpp import LlamaCppRunner

        self.runner = LlamaCppRunner(path, n_ctx=n_ctx, batch_size=512, n_threads=threads)  # None: its defaults

    def warmup(self) -> float:
        return self.runner.warmup()

    def tg(self, n: int) -> tuple[float, float]:
        self.runner._ensure_prefix(PROMPT_TOKENS)  # the prompt, untimed (tg() then finds it in place)
        c0 = _cpu()
        dt = self.runner.tg(n, depth=PROMPT_TOKENS)
        return dt, _cpu() - c0

    def state(self) -> dict:
        return {"threads": self.runner.llm.n_threads}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def _worker(engine: str, model: str, n_ctx: int, threads: int | None) -> None:
    """Serve {"n"} requests on stdin with {"tps", "cpu_s", ...state} on stdout, one JSON per line."""
    runner = (QllamaSessionRunner if engine == "qllama" else LlamaCppTg)(model, n_ctx, threads)
    warm = runner.warmup()
    runner.tg(4)  # first calls at the decode shape
    print(json.dumps({"ready": True, "warmup_s": warm, **runner.state()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        dt, cpu = runner.tg(int(req["n"]))
        print(json.dumps({"tps": int(req["n"]) / dt, "cpu_per_wall": cpu / dt, **runner.state()}), flush=True)


class Worker:
    def __init__(self, label: str, engine: str, model: str, n_ctx: int, threads: int | None, timeout: float):
        self.label, self.timeout = label, timeout
        cmd = [sys.executable, str(Path(__file__).resolve()), model, "--worker", engine, "--n-ctx", str(n_ctx)]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def tg(self, n: int) -> dict:
        self.proc.stdin.write(json.dumps({"n": n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# -- the busy loop -------------------------------------------------------------------------------------


class BusyLoop:
    """A child process spinning on one CPU (pinned to `cpu`, or anywhere when None) for at most
    `seconds`: it exits by itself even if this process is killed first."""

    def __init__(self, cpu: int | None, seconds: float):
        code = f"import time\nend = time.monotonic() + {float(seconds)!r}\nwhile time.monotonic() < end:\n    pass\n"
        pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        self.proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=pin)
        time.sleep(0.5)  # let the scheduler settle it
        if self.proc.poll() is not None:
            raise RuntimeError(f"the busy loop exited at once (status {self.proc.returncode})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -- the benchmark ---------------------------------------------------------------------------------------


def run_phase(workers: list[Worker], n: int, reps: int, say) -> dict:
    samples = {w.label: [] for w in workers}
    cpu = {w.label: [] for w in workers}
    state = {}
    for r in range(reps):
        for w in workers:  # A B A B
            out = w.tg(n)
            samples[w.label].append(out["tps"])
            cpu[w.label].append(out["cpu_per_wall"])
            state[w.label] = {k: v for k, v in out.items() if k not in ("tps", "cpu_per_wall")}
            say(f"  rep {r + 1}/{reps} {w.label}: {out['tps']:.1f} t/s, cpu/wall {out['cpu_per_wall']:.2f}, {state[w.label]}")
    return {"median_tps": {k: statistics.median(v) for k, v in samples.items()}, "samples": samples,
            "cpu_per_wall": {k: statistics.median(v) for k, v in cpu.items()}, "state": state,
            "loadavg": os.getloadavg()}


def format_report(phases: dict) -> str:
    lines = ["| phase | config | threads used | t/s (median) | cpu/wall | vs own -t 1 | vs llama.cpp default |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, ph in phases.items():
        med = ph["median_tps"]
        own1 = med.get("qllama -t 1")
        lcd = med.get("llama.cpp default")
        for label, tps in med.items():
            st = ph["state"].get(label, {})
            used = str(st.get("threads", "?"))
            if "switches" in st:
                used += f" ({st['switches']} switches, {st['probes']} probes)"
            r1 = f"{tps / own1:.2f}" if own1 and label.startswith("qllama") else ""
            rl = f"{tps / lcd:.2f}" if lcd else ""
            lines.append(f"| {name} | {label} | {used} | {tps:.1f} | {ph['cpu_per_wall'][label]:.2f} | {r1} | {rl} |")
    for name, ph in phases.items():
        la = " ".join(f"{v:.2f}" for v in ph["loadavg"])
        lines.append("")
        lines.append(f"{name}: load average at the end {la}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF path (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="tokens decoded per repetition (default 64)")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--busy-cpu", type=int, help="CPU the busy loop is pinned to (default: the last one)")
    ap.add_argument("--busy-free", action="store_true", help="do not pin the busy loop")
    ap.add_argument("--no-idle", action="store_true", help="skip the phase without a busy loop")
    ap.add_argument("--only", help="comma list of configs by index into: " + ", ".join(c[0] for c in CONFIGS))
    ap.add_argument("--timeout", type=float, default=1200.0, help="the busy loop stops after this many seconds")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--worker", choices=("qllama", "llama.cpp"), help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.n_gen < 1 or args.reps < 1:
        print("error: -n and -r must be >= 1", file=sys.stderr)
        return 2
    if args.model is None:
        from tools.fetch_smollm2 import fetch

        args.model = str(fetch())
    if args.worker:
        _worker(args.worker, args.model, args.n_ctx, args.threads)
        return 0
    if not os.path.isfile(args.model):
        print(f"error: {args.model}: no such file", file=sys.stderr)
        return 1
    configs = CONFIGS
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("note: llama-cpp-python is not installed: qllama only", file=sys.stderr)
        configs = [c for c in configs if c[1] == "qllama"]
    if args.only:
        configs = [CONFIGS[int(i)] for i in args.only.split(",")]
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    n_ctx = PROMPT_TOKENS + args.n_gen + 8
    cpus = sorted(os.sched_getaffinity(0))
    busy_cpu = None if args.busy_free else (args.busy_cpu if args.busy_cpu is not None else cpus[-1])
    t_start = time.time()
    workers: list[Worker] = []
    phases = {}
    try:
        for label, engine, thr in configs:  # one at a time, so that each loads undisturbed
            workers.append(Worker(label, engine, args.model, n_ctx, thr, args.timeout))
            say(f"{label} ready: {workers[-1].hello}")
        if not args.no_idle:
            say("phase idle (no busy loop)")
            phases["idle"] = run_phase(workers, args.n_gen, args.reps, say)
        where = "unpinned" if busy_cpu is None else f"pinned to CPU {busy_cpu}"
        say(f"phase busy (a busy loop {where})")
        remaining = args.timeout - (time.time() - t_start)
        if remaining <= 5:
            raise RuntimeError("no time left for the busy phase (--timeout)")
        with BusyLoop(busy_cpu, remaining):
            phases[f"busy ({where})"] = run_phase(workers, args.n_gen, args.reps, say)
    finally:
        for w in workers:
            w.close()
    print(f"model {os.path.basename(args.model)}; tg{args.n_gen} after an {PROMPT_TOKENS}-token prompt; reps {args.reps}, "
          f"A B A B; {os.cpu_count()} CPUs; {time.time() - t_start:.0f} s")
    print()
    print(format_report(phases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "n_gen": args.n_gen, "phases": phases}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
