"""Every path on a busy machine: qllama (default, -t 1, -t 2) against llama.cpp (default, 1, 2).

Usage:
    python tools/bench_busy.py [MODEL] [-n 64] [-r 3] [--paths pp,tg,server,bench] [-p 128]
                               [--requests 3] [--cap 10] [--busy-cpu N | --busy-free] [--no-idle]
                               [--spin 300000,passive] [--timeout 1200] [--json OUT.json]

Paths (each measured on every worker, A B A B, in the same process run):
- pp: a prompt of -p random tokens evaluated from an empty cache (qllama: `Session.prefill`, the
  path of `qllama run`; llama.cpp: one `eval` of the prompt, its default n_threads_batch);
- tg: -n one-token decodes after an 8-token prompt (below);
- server: --requests concurrent requests of a 12-token prompt and -n/2 greedy tokens each
  (ignore_eos) through qllama's `Scheduler` (the steps of `qllama serve` / `qllama batch`;
  one scheduler forward per worker, as a server keeps one), aggregate generated tokens/s from
  the first submit to the last token; llama.cpp: the same requests one after another (prompt
  eval, then one-token evals), as llama-cpp-python's server serves them;
- bench: `qllama bench`'s own code (`run_bench`, a fresh load each repetition, -p/2 prompt and
  -n/2 generated tokens, its untimed first calls included), pp and tg; llama.cpp: its pp and tg.
tg and server stop early after --cap seconds (tokens done / seconds), so that a collapsed
fixed count does not take minutes.

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

--spin adds one qllama -t 2 worker per value, with GOMP_SPINCOUNT set to it ('passive':
OMP_WAIT_POLICY=passive): qllama's own choice is `qllama.kernels.jit.GOMP_SPINCOUNT`, libgomp's
default is 300000.

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


def _server_prompts(n_req: int, n_vocab: int) -> list[list[int]]:
    from qllama.bench.runner import random_tokens

    return [random_tokens(12, n_vocab, seed=500 + i) for i in range(n_req)]


class QllamaSessionRunner:
    """tg through the generation session (the path `qllama run` decodes on, thread adaptation included)."""

    def __init__(self, path: str, n_ctx: int, threads: int | None):
        from qllama import load

        from qllama.server.engine import model_forward

        self.path, self.threads = path, threads
        self.llm = load(path, n_ctx=n_ctx, n_threads=threads)
        self.session = self.llm.session
        self.forward, self.new_cache, _ = model_forward(self.llm)  # one per server: its StepThreads persist

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
        done = 0
        for t in ids:
            s.decode(t)
            done += 1
            if time.perf_counter() - t0 > self.cap:
                break
        return time.perf_counter() - t0, _cpu() - c0, done

    def pp(self, n: int) -> tuple[float, float, int]:
        from qllama.bench.runner import random_tokens

        s = self.session
        s.reset()
        ids = random_tokens(n, self.llm.n_vocab, seed=1234)
        c0, t0 = _cpu(), time.perf_counter()
        s.prefill(ids)
        return time.perf_counter() - t0, _cpu() - c0, n

    def server(self, n_req: int, n_gen: int) -> tuple[float, float, int]:
        from dataclasses import replace

        from qllama.server.scheduler import Job, Scheduler
        from qllama.server.schemas import GenParams

        sched = Scheduler(self.forward, self.new_cache, self.llm.tokenizer, self.llm.n_ctx, n_parallel=n_req)
        greedy = GenParams(max_tokens=n_gen, sampling=replace(GenParams().sampling, temperature=0.0, ignore_eos=True))
        c0, t0 = _cpu(), time.perf_counter()
        for ids in _server_prompts(n_req, self.llm.n_vocab):
            sched.submit(Job(ids, greedy, lambda ev: None))
        while sched.step():
            if time.perf_counter() - t0 > self.cap:
                break
        dt = time.perf_counter() - t0
        done = sched.totals["predicted_tokens"] + sum(sl.run.n_gen for sl in sched.slots if sl.run is not None)
        return dt, _cpu() - c0, done

    def bench(self, n_prompt: int, n_gen: int) -> dict:
        from qllama.bench.runner import run_bench

        doc = run_bench(self.path, n_prompt=n_prompt, n_gen=n_gen, threads=[self.threads] if self.threads else (), reps=1)
        out = {}
        for r in doc["results"]:
            kind = "bench_pp" if r["test"].startswith("pp") else "bench_tg"
            out[kind] = r["mean_tps"]
            out[kind + "_threads"] = r["threads"]
        return out

    def state(self) -> dict:
        a = self.session.threads
        st = self.forward.threads
        out = {"threads": self.llm.n_threads} if a is None else {
            "threads": a.current, "prompt_threads": a.last_batch if a.long_batches else None, "switches": a.switches,
            "probes": a.probes}
        if st is not None:
            out["server_threads"] = {k: ad.current for k, ad in st.adapters.items()}
        return out


class LlamaCppTg:
    """tg on llama.cpp after the same 8-token prompt (tools/bench_vs_llamacpp.py's runner)."""

    def __init__(self, path: str, n_ctx: int, threads: int | None):
        from tools.bench_vs_llamacpp import LlamaCppRunner

        self.runner = LlamaCppRunner(path, n_ctx=n_ctx, batch_size=512, n_threads=threads)  # None: its defaults

    def warmup(self) -> float:
        return self.runner.warmup()

    def tg(self, n: int) -> tuple[float, float, int]:
        from qllama.bench.runner import random_tokens

        r = self.runner
        r._ensure_prefix(PROMPT_TOKENS)  # the prompt, untimed
        ids = random_tokens(n, r.n_vocab, seed=4321)
        c0, t0 = _cpu(), time.perf_counter()
        done = 0
        for t in ids:
            r.llm.eval([t])
            done += 1
            if time.perf_counter() - t0 > self.cap:
                break
        dt = time.perf_counter() - t0
        r.llm.n_tokens = PROMPT_TOKENS
        return dt, _cpu() - c0, done

    def pp(self, n: int) -> tuple[float, float, int]:
        c0 = _cpu()
        dt = self.runner.pp(n)
        return dt, _cpu() - c0, n

    def server(self, n_req: int, n_gen: int) -> tuple[float, float, int]:
        """The requests one after another: prompt, then greedy one-token steps (llama-cpp-python's server)."""
        import numpy as np

        r = self.runner
        c0, t0 = _cpu(), time.perf_counter()
        done = 0
        for ids in _server_prompts(n_req, r.n_vocab):
            r.llm.n_tokens = 0
            r.llm.eval(ids)
            for _ in range(n_gen):
                tok = int(np.argmax(r.llm.scores[r.llm.n_tokens - 1]))
                r.llm.eval([tok])
                done += 1
            if time.perf_counter() - t0 > self.cap:
                break
        r.llm.n_tokens = 0
        r._prefix = []
        return time.perf_counter() - t0, _cpu() - c0, done

    def bench(self, n_prompt: int, n_gen: int) -> dict:
        r = self.runner
        r.pp(min(n_prompt, 64))  # untimed first calls, as run_bench does
        pp = n_prompt / r.pp(n_prompt)
        tg = n_gen / r.tg(n_gen)
        return {"bench_pp": pp, "bench_tg": tg, "bench_pp_threads": r.llm.n_threads, "bench_tg_threads": r.llm.n_threads}

    def state(self) -> dict:
        return {"threads": self.runner.llm.n_threads}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def _worker(engine: str, model: str, n_ctx: int, threads: int | None, cap: float) -> None:
    """Serve {"path", "n", ...} requests on stdin with {"tps", "cpu_per_wall", ...state} on stdout,
    one JSON per line."""
    runner = (QllamaSessionRunner if engine == "qllama" else LlamaCppTg)(model, n_ctx, threads)
    runner.cap = float("inf")
    warm = runner.warmup()
    runner.tg(4)  # first calls at the decode shape
    runner.cap = cap
    print(json.dumps({"ready": True, "warmup_s": warm, **runner.state()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        path, n = req.get("path", "tg"), int(req["n"])
        if path == "bench":
            out = runner.bench(int(req["p"]), n)
        else:
            dt, cpu, done = (runner.pp(n) if path == "pp" else runner.server(int(req["requests"]), n)
                             if path == "server" else runner.tg(n))
            out = {"tps": done / dt, "cpu_per_wall": cpu / dt, "done": done}
        print(json.dumps({**out, **runner.state()}), flush=True)


class Worker:
    def __init__(self, label: str, engine: str, model: str, n_ctx: int, threads: int | None, timeout: float,
                 cap: float = 10.0, extra_env: dict | None = None):
        self.label, self.timeout = label, timeout
        cmd = [sys.executable, str(Path(__file__).resolve()), model, "--worker", engine, "--n-ctx", str(n_ctx),
               "--cap", str(cap)]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {})}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
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


def run_phase(workers: list[Worker], args, say) -> dict:
    """Each repetition runs every path on every worker in turn (A B A B, rotated); medians per (path, worker)."""
    samples: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    state: dict[str, dict] = {}
    used: dict[str, dict[str, object]] = {}

    def add(path, label, tps, cpw=None, thr=None):
        samples.setdefault(path, {}).setdefault(label, []).append(tps)
        if cpw is not None:
            cpu.setdefault(path, {}).setdefault(label, []).append(cpw)
        if thr is not None:
            used.setdefault(path, {})[label] = thr

    for r in range(args.reps):
        # A B A B, each repetition starting one worker later (A B C, B C A, ...), so that a load
        # that drifts during a repetition does not always favour the same worker
        order = workers[r % len(workers):] + workers[: r % len(workers)]
        for path in args.paths:
            for w in order:
                if path == "bench":
                    out = w.ask(path="bench", p=max(1, args.n_prompt // 2), n=max(1, args.n_gen // 2))
                    add("bench pp", w.label, out["bench_pp"], thr=out["bench_pp_threads"])
                    add("bench tg", w.label, out["bench_tg"], thr=out["bench_tg_threads"])
                    say(f"  rep {r + 1}/{args.reps} bench {w.label}: pp {out['bench_pp']:.1f} tg {out['bench_tg']:.1f} t/s")
                    continue
                n = args.n_prompt if path == "pp" else args.n_gen if path == "tg" else max(1, args.n_gen // 2)
                out = w.ask(path=path, n=n, requests=args.requests)
                st = {k: v for k, v in out.items() if k not in ("tps", "cpu_per_wall", "done")}
                state[w.label] = st
                thr = st.get("prompt_threads" if path == "pp" else "server_threads" if path == "server" else "threads",
                              st.get("threads"))
                add(path, w.label, out["tps"], out["cpu_per_wall"], thr)
                say(f"  rep {r + 1}/{args.reps} {path} {w.label}: {out['tps']:.1f} t/s ({out['done']} tokens), "
                    f"cpu/wall {out['cpu_per_wall']:.2f}, {st}")
    return {"median_tps": {p: {k: statistics.median(v) for k, v in d.items()} for p, d in samples.items()},
            "samples": samples, "cpu_per_wall": {p: {k: statistics.median(v) for k, v in d.items()} for p, d in cpu.items()},
            "threads_used": used, "state": state, "loadavg": os.getloadavg()}


def _threads_str(thr) -> str:
    if isinstance(thr, dict):  # the server's adapters: {requests per step: count}
        return ", ".join(f"{k} seq: {v}" for k, v in sorted(thr.items(), key=lambda kv: int(kv[0]))) or "?"
    return "?" if thr is None else str(thr)


def format_report(phases: dict) -> str:
    lines = ["| phase | path | config | threads (last) | t/s (median) | vs own -t 1 | vs llama.cpp default |",
             "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    for name, ph in phases.items():
        for path, med in ph["median_tps"].items():
            own1 = med.get("qllama -t 1")
            lcd = med.get("llama.cpp default")
            for label, tps in med.items():
                thr = _threads_str(ph["threads_used"].get(path, {}).get(label))
                r1 = f"{tps / own1:.2f}" if own1 and label.startswith("qllama") else ""
                rl = f"{tps / lcd:.2f}" if lcd else ""
                lines.append(f"| {name} | {path} | {label} | {thr} | {tps:.1f} | {r1} | {rl} |")
    for name, ph in phases.items():
        la = " ".join(f"{v:.2f}" for v in ph["loadavg"])
        lines.append("")
        lines.append(f"{name}: load average at the end {la} (1, 5, 15 min)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF path (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="tokens decoded per repetition (default 64)")
    ap.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens of the pp path (default 128)")
    ap.add_argument("--paths", default="pp,tg,server,bench", help="comma list of pp, tg, server, bench")
    ap.add_argument("--requests", type=int, default=3, help="concurrent requests of the server path (default 3)")
    ap.add_argument("--cap", type=float, default=10.0, help="seconds after which tg and server stop early")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--busy-cpu", type=int, help="CPU the busy loop is pinned to (default: the last one)")
    ap.add_argument("--busy-free", action="store_true", help="do not pin the busy loop")
    ap.add_argument("--no-idle", action="store_true", help="skip the phase without a busy loop")
    ap.add_argument("--only", help="comma list of configs by index into: " + ", ".join(c[0] for c in CONFIGS))
    ap.add_argument("--spin", help="comma list of GOMP_SPINCOUNT values: one more qllama -t 2 worker per value "
                    "(label 'qllama -t 2 spin X'; 'passive' sets OMP_WAIT_POLICY=passive instead)")
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
        _worker(args.worker, args.model, args.n_ctx, args.threads, args.cap)
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
    configs = [(*c, None) for c in configs]
    for v in (args.spin.split(",") if args.spin else []):  # the same -t 2 under another libgomp wait setting
        env = {"OMP_WAIT_POLICY": "passive"} if v.strip() == "passive" else {"GOMP_SPINCOUNT": v.strip()}
        configs.append((f"qllama -t 2 spin {v.strip()}", "qllama", 2, env))
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not set(args.paths) <= {"pp", "tg", "server", "bench"}:
        print(f"error: unknown path in --paths {','.join(args.paths)}", file=sys.stderr)
        return 2
    n_ctx = max(PROMPT_TOKENS + args.n_gen, args.n_prompt, 12 + args.n_gen) + 8
    cpus = sorted(os.sched_getaffinity(0))
    busy_cpu = None if args.busy_free else (args.busy_cpu if args.busy_cpu is not None else cpus[-1])
    t_start = time.time()
    load0 = os.getloadavg()
    workers: list[Worker] = []
    phases = {}
    try:
        for label, engine, thr, env in configs:  # one at a time, so that each loads undisturbed
            workers.append(Worker(label, engine, args.model, n_ctx, thr, args.timeout, args.cap, env))
            say(f"{label} ready: {workers[-1].hello}")
        if not args.no_idle:
            say("phase idle (no busy loop)")
            phases["idle"] = run_phase(workers, args, say)
        where = "unpinned" if busy_cpu is None else f"pinned to CPU {busy_cpu}"
        say(f"phase busy (a busy loop {where})")
        remaining = args.timeout - (time.time() - t_start)
        if remaining <= 5:
            raise RuntimeError("no time left for the busy phase (--timeout)")
        with BusyLoop(busy_cpu, remaining):
            phases[f"busy ({where})"] = run_phase(workers, args, say)
    finally:
        for w in workers:
            w.close()
    print(f"model {os.path.basename(args.model)}; paths {','.join(args.paths)}: pp{args.n_prompt}, tg{args.n_gen} after an "
          f"{PROMPT_TOKENS}-token prompt, server {args.requests} x {max(1, args.n_gen // 2)} tokens, bench "
          f"pp{max(1, args.n_prompt // 2)}/tg{max(1, args.n_gen // 2)}; reps {args.reps}, A B A B; "
          f"{os.cpu_count()} CPUs; load average at the start {' '.join(f'{v:.2f}' for v in load0)}; "
          f"{time.time() - t_start:.0f} s")
    print()
    print(format_report(phases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "n_gen": args.n_gen, "phases": phases}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
