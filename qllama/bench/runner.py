"""Speed measurement in the manner of llama-bench: prompt processing (pp) and text generation (tg).

- **pp N**: N random tokens evaluated from an empty cache in batches of `batch_size`
  (logits of the last token only); tokens/s = N / wall time.
- **tg N**: N tokens decoded one at a time (no sampling, as llama-bench); with a depth D, the
  cache already holds D tokens when the timed decode starts ("tg128@d1024").
- Each figure is the mean ± sd over `reps` repetitions. A warm-up (the first call of every
  kernel: Numba compile or cache load) runs before and is reported apart as `compile_s`.

`run_bench` returns the `qllama bench --json` document:
`{"model", "n_threads": [...], "results": [{"test", "threads", "mean_tps", "sd_tps", "reps"}], "compile_s"}`.
`profile_decode` (qllama/bench_profile.py) times every kernel call of decode steps by kind and
layer, and the Python overhead around them (the `--profile` tables).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import QllamaError

__all__ = [
    "BenchRunner",
    "BenchTest",
    "bench_tests",
    "run_bench",
    "format_table",
    "mean_sd",
    "random_tokens",
]


def random_tokens(n: int, n_vocab: int, seed: int = 1234) -> list[int]:
    """n token ids drawn uniformly from [0, n_vocab) by a seeded generator (the same for every engine)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, n_vocab, size=n)]


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    vals = list(values)
    if not vals:
        return 0.0, 0.0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


@dataclass(frozen=True)
class BenchTest:
    """One benchmark test: `kind` "pp" or "tg", `n` tokens, at `depth` tokens already cached."""

    kind: str
    n: int
    depth: int = 0

    @property
    def name(self) -> str:
        base = f"{self.kind}{self.n}"
        return f"{base}@d{self.depth}" if self.depth else base


def bench_tests(n_prompt: int, n_gen: int, depths: Sequence[int] = (0,)) -> list[BenchTest]:
    """pp at depth 0 (if n_prompt > 0), then tg at each depth (if n_gen > 0), like llama-bench's defaults."""
    tests = []
    if n_prompt > 0:
        tests.append(BenchTest("pp", n_prompt, 0))
    if n_gen > 0:
        for d in sorted(set(int(d) for d in depths) or {0}):
            tests.append(BenchTest("tg", n_gen, d))
    return tests


class BenchRunner:
    """Times pp and tg on one loaded qllama model; the same interface as the llama.cpp runner in tools/.

    Every method starts from a cache whose first `depth` positions hold the prefix tokens:
    the prefix is evaluated once and reused (its K/V entries are unchanged by later tokens).
    """

    def __init__(self, path: str | os.PathLike, n_ctx: int, batch_size: int = 512, n_threads: int | None = None,
                 type_k: str = "f16", type_v: str = "f16"):
        from ..api import load

        self.llm = load(path, n_ctx=n_ctx, n_threads=n_threads, batch_size=batch_size, type_k=type_k, type_v=type_v,
                        warmup_next=True)
        self.model = self.llm.forward_model
        self.cache = self.model.new_cache()
        self.batch_size = batch_size
        self.n_vocab = self.llm.n_vocab
        self._prefix: list[int] = []  # tokens at positions [0, len) of self.cache
        self.path = os.fspath(path)
        # the default thread count: a ThreadAdapter picks each round's (as `qllama run`); None: fixed
        self.threads = None

    # -- threads -------------------------------------------------------------------------

    def set_threads(self, n: int) -> int:
        """Run the model's rounds on n threads; returns the count actually used (capped by Numba's pool size)."""
        from ..qtensor import resolve_threads

        self.model.n_threads = resolve_threads(n)
        return self.model.n_threads

    # -- primitives ------------------------------------------------------------------------

    def _eval(self, ids: Sequence[int]) -> None:
        from ..qtensor import PROMPT_MIN_TOKENS

        a, prompt = self.threads, len(ids) >= PROMPT_MIN_TOKENS  # (a prompt, as `Session.prefill` runs it)
        for start in range(0, len(ids), self.batch_size):
            batch = ids[start : start + self.batch_size]
            if a is None:
                self.model.forward(batch, self.cache, prompt=prompt)
            else:
                a.run_batch(len(batch), lambda n: self.model.forward(batch, self.cache, n_threads=n, prompt=prompt))

    def _ensure_prefix(self, depth: int) -> None:
        """Make the cache hold `depth` prefix tokens (evaluating only the missing ones)."""
        if depth > len(self._prefix):
            more = random_tokens(depth, self.n_vocab, seed=99)[len(self._prefix) :]
            self.cache.n_past = len(self._prefix)
            self._eval(more)
            self._prefix.extend(more)
        del self._prefix[depth:]  # the run writes positions >= depth: only the first depth stay valid
        self.cache.n_past = depth

    def warmup(self) -> float:
        """Compile or load every kernel as `qllama run` does (`Model.warmup`: the compile pool on a
        cold cache), then run a 2-token batch and one decode step twice; returns the warm-up's
        seconds plus what the first of those runs took beyond the second: the Numba compile /
        cache-load time."""

        def once() -> float:
            t0 = time.perf_counter()
            self.cache.n_past = 0
            self.model.forward(random_tokens(2, self.n_vocab, seed=7), self.cache)
            self.model.forward(random_tokens(1, self.n_vocab, seed=8), self.cache)
            return time.perf_counter() - t0

        warm = self.llm.warmup()
        first = once()
        second = once()
        self._prefix = []
        self.cache.n_past = 0
        return warm + max(0.0, first - second)

    def pp(self, n: int, depth: int = 0) -> float:
        """Seconds to evaluate n random prompt tokens after `depth` cached tokens."""
        self._ensure_prefix(depth)
        ids = random_tokens(n, self.n_vocab, seed=1234)
        t0 = time.perf_counter()
        self._eval(ids)
        dt = time.perf_counter() - t0
        self.cache.n_past = depth
        return dt

    def tg(self, n: int, depth: int = 0) -> float:
        """Seconds to decode n tokens one at a time after `depth` cached tokens."""
        self._ensure_prefix(depth)
        ids = random_tokens(n, self.n_vocab, seed=4321)
        forward, cache, a = self.model.forward, self.cache, self.threads
        t0 = time.perf_counter()
        if a is None:
            for t in ids:
                forward([t], cache)
        else:
            for t in ids:
                a.run(lambda n: forward([t], cache, n_threads=n))
        dt = time.perf_counter() - t0
        self.cache.n_past = depth
        return dt

    def run(self, test: BenchTest) -> float:
        """Tokens/s of one repetition of `test`."""
        fn = self.pp if test.kind == "pp" else self.tg
        return test.n / fn(test.n, test.depth)

    def close(self) -> None:
        """Drop the model and cache (the mmap closes when nothing refers to it)."""
        self.cache = None
        self.model = None
        self.llm = None


def needed_ctx(n_prompt: int, n_gen: int, depths: Sequence[int]) -> int:
    """Cache positions the tests need (as llama-bench: prompt + depth + generated)."""
    return max(n_prompt, max(depths or [0]) + n_gen, 8)


def run_bench(
    path: str | os.PathLike,
    *,
    n_prompt: int = 512,
    n_gen: int = 128,
    threads: Sequence[int] = (),
    reps: int = 5,
    depths: Sequence[int] = (0,),
    batch_size: int = 512,
    progress: Callable[[str], None] | None = None,
    type_k: str = "f16",
    type_v: str = "f16",
    fused: bool = True,
) -> dict:
    """Run the tests at each thread count; returns the `qllama bench --json` document.
    fused=False: one-token steps run the unfused building blocks (for a before/after comparison)."""
    if reps < 1:
        raise QllamaError(f"repetitions must be >= 1, got {reps}")
    if n_prompt < 0 or n_gen < 0 or any(d < 0 for d in depths):
        raise QllamaError("token counts and depths must be >= 0")
    if n_prompt == 0 and n_gen == 0:
        raise QllamaError("nothing to measure: both -p and -n are 0")
    from ..models.step import Plain
    from ..qtensor import physical_cores
    from ..runtime.threads import IdleMeter, adapter_for

    adaptive = not threads  # the default: the thread count adapts to the machine, as `qllama run`'s
    threads = list(threads) or [physical_cores()]
    if any(t < 1 for t in threads):
        raise QllamaError("thread counts must be >= 1")
    runner = BenchRunner(path, n_ctx=needed_ctx(n_prompt, n_gen, depths), batch_size=batch_size, n_threads=threads[0],
                         type_k=type_k, type_v=type_v)
    if max(depths or [0]) + n_gen > runner.model.n_ctx or n_prompt > runner.model.n_ctx:
        raise QllamaError("the tests do not fit in the context")
    runner.model.execution = Plain(fused=fused)  # the fused one-token kernels, or the plain blocks
    say = progress or (lambda msg: None)
    compile_s = runner.warmup()
    if adaptive:
        runner.threads = adapter_for(runner.model.n_threads)  # None on one core: nothing to choose
    say(f"warm-up (Numba compile / cache load): {compile_s:.2f} s")
    results = []
    for n_thr in threads:
        used = runner.set_threads(n_thr)
        if used != n_thr:
            say(f"note: {n_thr} threads requested, Numba's pool allows {used}")
        for test in bench_tests(n_prompt, n_gen, depths):
            # untimed: first calls at this shape (64 prompt tokens reach the parallel attention kernel)
            runner.run(BenchTest(test.kind, min(test.n, 64 if test.kind == "pp" else 4), test.depth))
            meter = IdleMeter() if runner.threads is None and used > 1 else None  # a fixed count on a busy machine
            samples = []
            for r in range(reps):
                samples.append(runner.run(test))
                say(f"{test.name} t={used} rep {r + 1}/{reps}: {samples[-1]:.2f} tokens/s")
            others = meter.others_cpus(min_seconds=0.0) if meter is not None else None
            if others is not None and used > meter.n_cpu - others + 0.25:
                say(f"note: other processes held {others:.1f} of {meter.n_cpu} CPUs during {test.name}: {used} fixed "
                    f"threads shared cores with them, so these figures depend on their load (without -t the count adapts)")
            m, sd = mean_sd(samples)
            res = {"test": test.name, "threads": used, "mean_tps": m, "sd_tps": sd, "reps": reps}
            a = runner.threads
            if a is not None:  # the count the adapter ran the last repetition at, and its state
                res["threads"] = a.last_batch if test.kind == "pp" else a.current
                res["adaptive"] = a.describe()
            results.append(res)
    doc = {
        "model": os.path.basename(os.fspath(path)),
        "n_threads": [r for r in dict.fromkeys(res["threads"] for res in results)],
        "results": results,
        "compile_s": compile_s,
        "type_k": runner.llm.kv_types[0],  # the KV cache types (llama-bench's type_k / type_v)
        "type_v": runner.llm.kv_types[1],
    }
    runner.close()
    return doc


def format_table(doc: dict, extra: dict | None = None) -> str:
    """The results as a markdown table (mean ± sd tokens/s), like llama-bench's."""
    lines = [
        "| model | threads | test | t/s |",
        "| --- | ---: | --- | ---: |",
    ]
    for r in doc["results"]:
        thr = f"auto ({r['threads']})" if r.get("adaptive") else str(r["threads"])
        lines.append(f"| {doc['model']} | {thr} | {r['test']} | {r['mean_tps']:.2f} ± {r['sd_tps']:.2f} |")
    lines.append("")
    lines.append(f"Numba compile / cache load (warm-up, not timed above): {doc['compile_s']:.2f} s")
    return "\n".join(lines)


# -- the per-operation profile of decode: qllama/bench_profile.py (re-exported here) ------------
