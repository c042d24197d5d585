"""A long prompt in batches of 512, qllama then llama.cpp (the [oracle] extra) in one process, same
threads and KV cache type: tokens/s of the whole prompt, and qllama's rate on its last batch (where
attention over the longest prefix dominates); with --tg N, then N one-token steps at that depth.

Usage:
    python tools/bench_fill.py MODEL [-n 8192] [-t 1] [--cache-type f16] [-r 1] [--tg 0]

llama.cpp runs with flash attention on (what its `-fa auto` picks on a CPU). One figure per
repetition and engine; quote the ratios of runs made alone.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

GGML_CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", "--n-prompt", type=int, default=8192)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--cache-type", default="f16", choices=sorted(GGML_CACHE_TYPES))
    ap.add_argument("-r", "--reps", type=int, default=1)
    ap.add_argument("--tg", type=int, default=0, help="one-token steps after the prompt (decode at its depth)")
    a = ap.parse_args()

    import llama_cpp

    import qllama

    n, kv = a.n_prompt, a.cache_type
    ids = np.random.default_rng(0).integers(3, 3000, size=n + a.tg).tolist()
    for rep in range(a.reps):
        model = qllama.load(a.model, n_ctx=n + a.tg + 64, n_threads=a.threads, type_k=kv, type_v=kv)._model
        model.forward(ids[:8], model.new_cache(), prompt=True)  # (compiles or loads the kernels, untimed)
        cache = model.new_cache()
        t0 = time.perf_counter()
        marks = []
        for i in range(0, n, 512):
            model.forward(ids[i:i + 512], cache, prompt=True)
            marks.append(time.perf_counter() - t0)
        ours = n / marks[-1]
        last = min(512, n) / (marks[-1] - (marks[-2] if len(marks) > 1 else 0.0))
        t0 = time.perf_counter()
        for tok in ids[n:]:
            model.forward([tok], cache)
        our_tg = a.tg / (time.perf_counter() - t0) if a.tg else 0.0
        del model, cache
        llm = llama_cpp.Llama(a.model, n_ctx=n + a.tg + 64, n_batch=512, n_ubatch=512, n_threads=a.threads,
                              n_threads_batch=a.threads, verbose=False, flash_attn=True,
                              type_k=GGML_CACHE_TYPES[kv], type_v=GGML_CACHE_TYPES[kv])
        t0 = time.perf_counter()
        llm.eval(ids[:n])
        theirs = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for tok in ids[n:]:
            llm.eval([tok])
        their_tg = a.tg / (time.perf_counter() - t0) if a.tg else 0.0
        del llm
        print(f"rep {rep}: prompt of {n}, {a.threads} thread(s), {kv} cache: qllama {ours:.1f} t/s "
              f"(last batch {last:.1f}), llama.cpp {theirs:.1f} t/s, ratio {ours / theirs:.2f}", flush=True)
        if a.tg:
            print(f"rep {rep}: tg{a.tg} at depth {n}: qllama {our_tg:.2f} t/s, llama.cpp {their_tg:.2f} t/s, "
                  f"ratio {our_tg / their_tg:.2f}", flush=True)


if __name__ == "__main__":
    main()
