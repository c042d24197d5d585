"""qllama against llama.cpp (through llama-cpp-python, the [oracle] extra) on the same GGUF, same cores.

Usage:
    python tools/bench_vs_llamacpp.py MODEL [-t 1,2] [-r 3] [-p 512] [-n 128] [-d 1024] [-b 512]
                                      [--cache-type f16] [--flash-attn on]
                                      [--no-start] [--no-cold] [--start-reps 3] [--json OUT.json]

For each thread count, one worker process per engine loads MODEL with the same n_threads,
n_batch and n_ctx and warms up; the parent then alternates them, A B A B, test by test and
repetition by repetition, so that the noise of a shared machine falls on both. Tests (as in
llama-bench): pp (N random prompt tokens from an empty cache), tg (N one-token decodes, no
sampling), tg at a depth (the cache already holds DEPTH tokens). The deep caches are filled
once per worker, untimed: the warm-up touches depths up to 2048 only and the timed tests run
pp, then tg at rising depths, so a 16384-token prefix is evaluated once, not once per test.

Both engines keep K and V in --cache-type (f16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl). llama.cpp
runs with flash attention on by default: its own default (`-fa auto`) turns it on for a CPU
model, while llama-cpp-python's `flash_attn=False` default turns it off (and a quantized V cache
needs it); `--flash-attn off` measures llama.cpp without it.

Then, each in a fresh process (tools/bench_memory.py): time to first token of a 64-token
prompt from process start (qllama with an empty Numba cache once; qllama with a warm cache and
llama.cpp alternating, --start-reps times each, medians), and peak RSS after generating 128 tokens.

Prints a markdown table: mean ± sd tokens/s of each engine and the ratio qllama / llama.cpp
(of the medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ENGINES = ("qllama", "llama.cpp")
# ggml type ids of the KV cache types both engines take (ggml.h's enum ggml_type)
LLAMA_CPP_CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20}
WARM_DEPTH_MAX = 2048  # the untimed first calls touch depths up to this; deeper prefixes fill once, in the timed run


# -- the llama.cpp runner (same interface as qllama.bench.runner.BenchRunner) ----------------------------


class LlamaCppRunner:
    """Times pp and tg on llama.cpp through llama-cpp-python; the cached prefix is reused as in BenchRunner."""

    def __init__(self, path: str, n_ctx: int, batch_size: int, n_threads: int, cache_type: str = "f16",
                 flash_attn: bool = True):
        import llama_cpp

        ggml_type = LLAMA_CPP_CACHE_TYPES[cache_type]
        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=batch_size, n_ubatch=batch_size, n_threads=n_threads,
                                   n_threads_batch=n_threads, logits_all=False, verbose=False, type_k=ggml_type,
                                   type_v=ggml_type, flash_attn=flash_attn)
        self.n_vocab = self.llm.n_vocab()
        self._prefix: list[int] = []

    def _ensure_prefix(self, depth: int) -> None:
        from qllama.bench.runner import random_tokens

        if depth > len(self._prefix):
            more = random_tokens(depth, self.n_vocab, seed=99)[len(self._prefix) :]
            self.llm.n_tokens = len(self._prefix)
            self.llm.eval(more)
            self._prefix.extend(more)
        del self._prefix[depth:]  # the run writes positions >= depth: only the first depth stay valid
        self.llm.n_tokens = depth  # eval() first drops cache entries at positions >= n_tokens

    def warmup(self) -> float:
        from qllama.bench.runner import random_tokens

        t0 = time.perf_counter()
        self.llm.n_tokens = 0
        self.llm.eval(random_tokens(2, self.n_vocab, seed=7))
        self.llm.eval(random_tokens(1, self.n_vocab, seed=8))
        self.llm.n_tokens = 0
        self._prefix = []
        return time.perf_counter() - t0

    def pp(self, n: int, depth: int = 0) -> float:
        from qllama.bench.runner import random_tokens

        self._ensure_prefix(depth)
        ids = random_tokens(n, self.n_vocab, seed=1234)
        t0 = time.perf_counter()
        self.llm.eval(ids)
        dt = time.perf_counter() - t0
        self.llm.n_tokens = depth
        return dt

    def tg(self, n: int, depth: int = 0) -> float:
        from qllama.bench.runner import random_tokens

        self._ensure_prefix(depth)
        ids = random_tokens(n, self.n_vocab, seed=4321)
        ev = self.llm.eval
        t0 = time.perf_counter()
        for t in ids:
            ev([t])
        dt = time.perf_counter() - t0
        self.llm.n_tokens = depth
        return dt

    def run(self, test) -> float:
        fn = self.pp if test.kind == "pp" else self.tg
        return test.n / fn(test.n, test.depth)


# -- worker processes --------------------------------------------------------------------------------


def _worker(engine: str, model: str, n_ctx: int, batch: int, threads: int, cache_type: str, flash_attn: bool) -> None:
    """Serve {"kind", "n", "depth"} requests on stdin with {"tps"} on stdout, one JSON per line."""
    from qllama.bench.runner import BenchRunner, BenchTest

    if engine == "qllama":
        runner = BenchRunner(model, n_ctx=n_ctx, batch_size=batch, n_threads=threads, type_k=cache_type,
                             type_v=cache_type)
    else:
        runner = LlamaCppRunner(model, n_ctx=n_ctx, batch_size=batch, n_threads=threads, cache_type=cache_type,
                                flash_attn=flash_attn)
    warm = runner.warmup()
    print(json.dumps({"ready": True, "warmup_s": warm}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        test = BenchTest(req["kind"], int(req["n"]), int(req["depth"]))
        tps = runner.run(test)
        with open("/proc/self/status") as f:
            hwm = next((int(l.split()[1]) for l in f if l.startswith("VmHWM:")), 0)
        print(json.dumps({"tps": tps, "rss_peak_mb": hwm / 1024}), flush=True)


class Worker:
    def __init__(self, engine: str, model: str, n_ctx: int, batch: int, threads: int, cache_type: str = "f16",
                 flash_attn: bool = True):
        self.engine = engine
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, model, "--n-ctx", str(n_ctx),
               "-b", str(batch), "-t", str(threads), "--cache-type", cache_type,
               "--flash-attn", "on" if flash_attn else "off"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.engine} worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, test) -> dict:
        self.proc.stdin.write(json.dumps({"kind": test.kind, "n": test.n, "depth": test.depth}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


# -- the comparison ----------------------------------------------------------------------------------


def compare_throughput(model: str, threads: list[int], reps: int, n_prompt: int, n_gen: int, depths: list[int],
                       batch: int, say, cache_type: str = "f16", flash_attn: bool = True) -> list[dict]:
    from qllama.bench.runner import bench_tests, needed_ctx

    n_ctx = needed_ctx(n_prompt, n_gen, depths)
    tests = bench_tests(n_prompt, n_gen, depths)
    rows = []
    for n_thr in threads:
        workers = {}
        for eng in ENGINES:  # one at a time, so that each loads on a quiet machine
            workers[eng] = Worker(eng, model, n_ctx, batch, n_thr, cache_type, flash_attn)
            say(f"{eng} worker ready ({n_thr} threads), warm-up {workers[eng].hello['warmup_s']:.2f} s")
        try:
            warm_depths = [d for d in depths if d <= WARM_DEPTH_MAX]
            for test in bench_tests(min(n_prompt, 64), min(n_gen, 4), warm_depths):  # untimed: first calls at each shape
                for eng in ENGINES:
                    workers[eng].run(test)
            for test in tests:
                samples = {eng: [] for eng in ENGINES}
                rss = {}
                for r in range(reps):
                    for eng in ENGINES:  # A B A B
                        out = workers[eng].run(test)
                        samples[eng].append(out["tps"])
                        rss[eng] = out["rss_peak_mb"]
                        say(f"{test.name} t={n_thr} rep {r + 1}/{reps} {eng}: {out['tps']:.2f} t/s")
                row = {"test": test.name, "threads": n_thr, "reps": reps}
                for eng in ENGINES:
                    s = samples[eng]
                    row[eng] = {"mean_tps": statistics.fmean(s), "sd_tps": statistics.stdev(s) if len(s) > 1 else 0.0,
                                "median_tps": statistics.median(s), "samples": s, "rss_peak_mb": rss[eng]}
                row["ratio"] = row["qllama"]["median_tps"] / row["llama.cpp"]["median_tps"]
                rows.append(row)
        finally:
            for w in workers.values():
                w.close()
    return rows


def compare_start(model: str, threads: int, cold: bool, reps: int, say) -> list[dict]:
    from tools.bench_memory import measure_starts

    return measure_starts(model, reps=reps, cold=cold, llamacpp=True, say=say, n_ctx=4096, threads=threads, n_gen=128,
                          prompt_tokens=64)


def format_throughput(rows: list[dict]) -> str:
    lines = ["| test | threads | qllama t/s | llama.cpp t/s | ratio (medians) |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        q, l = r["qllama"], r["llama.cpp"]
        lines.append(f"| {r['test']} | {r['threads']} | {q['mean_tps']:.2f} ± {q['sd_tps']:.2f} | "
                     f"{l['mean_tps']:.2f} ± {l['sd_tps']:.2f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", default="1,2", help="comma list (default 1,2)")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-d", "--depth", default="1024", help="comma list of tg depths besides 0 (default 1024)")
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("--cache-type", default="f16", choices=sorted(LLAMA_CPP_CACHE_TYPES),
                    help="K and V cache type of both engines (default f16)")
    ap.add_argument("--flash-attn", default="on", choices=("on", "off"),
                    help="llama.cpp's flash attention (default on: what its -fa auto picks on a CPU)")
    ap.add_argument("--no-start", action="store_true", help="skip the TTFT / RSS processes")
    ap.add_argument("--no-cold", action="store_true", help="skip the empty-Numba-cache start (slow)")
    ap.add_argument("--start-reps", type=int, default=3, help="warm TTFT runs per engine, alternating (medians)")
    ap.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.model, args.n_ctx, args.batch_size, int(args.threads), args.cache_type,
                args.flash_attn == "on")
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("error: llama-cpp-python is not installed (pip install -e '.[oracle]')")
    if not os.path.isfile(args.model):
        sys.exit(f"error: {args.model}: no such file")
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    depths = sorted({0, *(int(d) for d in args.depth.split(",") if d.strip())})
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.time()
    rows = compare_throughput(args.model, threads, args.reps, args.n_prompt, args.n_gen, depths, args.batch_size, say,
                              args.cache_type, args.flash_attn == "on")
    start = [] if args.no_start else compare_start(args.model, max(threads), not args.no_cold, args.start_reps, say)
    from tools.bench_memory import format_report

    size = os.path.getsize(args.model)
    print(f"model {os.path.basename(args.model)} ({size / 1e9:.3f} GB); reps {args.reps}, alternating A B A B; "
          f"n_batch {args.batch_size}; KV cache {args.cache_type}; llama.cpp flash attention {args.flash_attn}; "
          f"{os.cpu_count()} CPUs; {time.time() - t0:.0f} s")
    print()
    print(format_throughput(rows))
    if start:
        print()
        print(f"time to first token (64-token prompt, from process start) and memory, {max(threads)} threads, n_ctx 4096:")
        print(format_report(start))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "throughput": rows, "start": start}, f, indent=1)


if __name__ == "__main__":
    main()
