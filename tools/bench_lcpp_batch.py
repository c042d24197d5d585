"""How much one weight pass serving k sequences costs, llama.cpp and qllama, in one run (a developer tool).

    python tools/bench_lcpp_batch.py MODEL [-t 2] [--ks 1,2,4,8] [--depth 64] [--steps 8] [--reps 3]
                                           [--engines llama.cpp,qllama,qllama-unfused] [--profile]

Issue 32 asks qllama's server for 4 streams >= 2.5x one stream and >= llama.cpp's batched
ratio at every stream count. Per engine: k sequences, each with `depth` tokens in its cache,
then `steps` decode steps where one call takes one new token of every sequence and returns
logits for all of them (what a server step needs): llama.cpp's llama_decode on one batch,
qllama's Transformer.forward_many (the server's step, without HTTP or sampling). Reported per
k: the median step time, its cost in one-token steps c(k) and the throughput ratio k / c(k),
by wall clock and by the process's CPU time (user + system; steadier when other processes
share the machine, but it counts the threads' spin-waits). The engines alternate (llama.cpp
rep 0, qllama rep 0, llama.cpp rep 1, ...) and so do the ks within a repetition, so that a
drifting machine load favours neither. --profile: then qllama's steps once more with every
kernel call timed by kind (where a k-sequence step's time goes, against k = 1). The engine
`qllama-unfused` is qllama with k-sequence steps through the unfused blocks (one-token steps
still fused; models/step.Execution's fused_rows=1): the fused n-token steps' before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def step_tokens(k: int, step: int) -> list[int]:
    """The new token of each of k sequences at a decode step (the same ids for both engines)."""
    return [200 + (step * k + s) % 1000 for s in range(k)]


def prompt_tokens(s: int, depth: int) -> list[int]:
    return [100 + (7 * j + s) % 1000 for j in range(depth)]


class LlamaCpp:
    """llama.cpp through llama-cpp-python: one context holding every sequence."""

    name = "llama.cpp"

    def __init__(self, path: str, threads: int, n_seq: int, depth: int, steps: int):
        import llama_cpp

        self.lc, self.depth = llama_cpp, depth
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_seq * (depth + steps + 8), max(512, n_seq * depth), 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        self.batch = llama_cpp.llama_batch_init(max(512, depth, n_seq), 0, n_seq)
        self.mem = llama_cpp.llama_get_memory(self.ctx)

    def _decode(self, entries) -> None:  # entries: (token, pos, seq, want logits)
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def prepare(self, k: int) -> None:
        self.lc.llama_memory_clear(self.mem, True)
        for s in range(k):
            ids = prompt_tokens(s, self.depth)
            self._decode([(t, j, s, j == self.depth - 1) for j, t in enumerate(ids)])

    def step(self, k: int, step: int) -> None:
        self._decode([(t, self.depth + step, s, True) for s, t in enumerate(step_tokens(k, step))])

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class Qllama:
    """qllama's multi-sequence step: Transformer.forward_many, one cache per sequence."""

    name = "qllama"

    def __init__(self, path: str, threads: int, n_seq: int, depth: int, steps: int):
        import qllama

        self.llm = qllama.load(path, n_ctx=depth + steps + 8, n_threads=threads)
        self.llm.warmup()
        self.model, self.depth, self.threads = self.llm._model, depth, threads
        self.caches = [self.model.new_cache() for _ in range(n_seq)]
        for s, c in enumerate(self.caches):  # each prompt once; every repetition rewinds to it
            self.model.forward(prompt_tokens(s, depth), c, n_threads=threads, prompt=True)

    def prepare(self, k: int) -> None:
        for c in self.caches[:k]:
            c.rewind(self.depth)

    def step(self, k: int, step: int, execution=None) -> None:
        segs = [([t], c) for t, c in zip(step_tokens(k, step), self.caches)]
        with self.model.executing(execution or self.execution()):
            self.model.forward_many(segs, n_threads=self.threads)

    def execution(self):
        from qllama.models.step import PLAIN

        return PLAIN

    def profile(self, ks: list[int], steps: int) -> str:
        """Where a k-sequence step's time goes: every kernel call timed by kind (models/step.Timed)."""
        from qllama.models.decode import KernelClock
        from qllama.models.step import Timed

        lines = []
        for k in ks:
            self.prepare(k)
            clock = KernelClock()
            t0 = time.perf_counter()
            for step in range(steps):
                self.step(k, step, Timed(clock))
            wall = time.perf_counter() - t0
            lines.append(f"qllama k={k}: {1000 * wall / steps:.1f} ms per step, "
                         f"{1000 * sum(clock.seconds.values()) / steps:.1f} ms in timed calls")
            for kind, sec in sorted(clock.seconds.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {kind:48s} {1000 * sec / steps:8.2f} ms  {clock.calls[kind] / steps:4.0f} calls")
        return "\n".join(lines)

    def close(self) -> None:
        pass


class QllamaUnfused(Qllama):
    """qllama with k-sequence steps through the unfused blocks (the fused kernels for one token only)."""

    name = "qllama-unfused"

    def execution(self):
        from qllama.models.step import Plain

        return Plain(fused_rows=1)


ENGINES = {"llama.cpp": LlamaCpp, "qllama": Qllama, "qllama-unfused": QllamaUnfused}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default="llama.cpp,qllama", help="comma-separated: llama.cpp, qllama, qllama-unfused")
    ap.add_argument("--profile", action="store_true", help="then qllama's steps once more, each kernel call timed by kind")
    a = ap.parse_args()
    names = a.engines.split(",")
    if any(n not in ENGINES for n in names):
        print(f"error: --engines takes {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    if "llama.cpp" in names:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("error: llama-cpp-python is not installed (pip install 'qllama[oracle]')", file=sys.stderr)
            return 2
    ks = [int(k) for k in a.ks.split(",")]
    if a.profile and "qllama" not in names:
        print("error: --profile needs the qllama engine", file=sys.stderr)
        return 2
    engines = [ENGINES[n](a.model, a.threads, max(ks), a.depth, a.steps) for n in names]
    # (engine, k) -> per repetition: median step wall seconds, median step CPU seconds
    wall: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    loads = []
    try:
        for _ in range(a.reps):
            for e in engines:
                for k in ks:
                    e.prepare(k)
                    w, c = [], []
                    for step in range(a.steps):
                        t0, c0 = time.perf_counter(), time.process_time()
                        e.step(k, step)
                        w.append(time.perf_counter() - t0)
                        c.append(time.process_time() - c0)
                    wall.setdefault((e.name, k), []).append(statistics.median(w))
                    cpu.setdefault((e.name, k), []).append(sum(c) / len(c))  # (CPU time ticks: a mean, not a median)
                    loads.append(os.getloadavg()[0])
    finally:
        for e in engines:
            if not (a.profile and e.name == "qllama"):  # (closed after its profile: nothing to close)
                e.close()
    version = f"llama.cpp {sys.modules['llama_cpp'].__version__}, " if "llama.cpp" in names else ""
    print(f"{version}{a.threads} threads, depth {a.depth}, {a.steps} steps x {a.reps} reps, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print("| engine | k | step ms | c(k) | throughput x one sequence | CPU ms per step | CPU c(k) | CPU throughput x one |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for e in engines:
        one = statistics.median(wall[e.name, ks[0]]) if ks[0] == 1 else None
        one_cpu = statistics.median(cpu[e.name, ks[0]]) if ks[0] == 1 else None
        for k in ks:
            m, mc = statistics.median(wall[e.name, k]), statistics.median(cpu[e.name, k])
            rel = f"{m / one:.2f} | {k * one / m:.2f}" if one else "| "
            rel_cpu = f"{mc / one_cpu:.2f} | {k * one_cpu / mc:.2f}" if one_cpu else "| "
            print(f"| {e.name} | {k} | {1000 * m:.1f} | {rel} | {1000 * mc:.1f} | {rel_cpu} |")
    if a.profile:
        print(next(e for e in engines if e.name == "qllama").profile(ks, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
