"""How much one weight pass serving k sequences costs llama.cpp on this host (a developer tool).

    python tools/bench_lcpp_batch.py MODEL [-t 2] [--ks 1,2,4,8] [--depth 64] [--steps 8] [--reps 3]

Issue 14 asks qllama's server for 4 streams >= 2.5x one stream, on the premise that decode is
bandwidth-bound. This measures the premise on llama.cpp itself (llama-cpp-python, the oracle
extra): k sequences, each with `depth` tokens in its cache, then `steps` decode steps where
one llama_decode takes one new token of every sequence, logits for all of them (what a
server step needs). Reported per k: the median step time, its cost in one-token steps c(k),
and the throughput ratio k / c(k). Alternate repetitions (1, 2, 4, 8, 1, 2, ...) share the
machine's noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("error: llama-cpp-python is not installed (pip install 'qllama[oracle]')", file=sys.stderr)
        return 2
    ks = [int(k) for k in a.ks.split(",")]
    n_seq = max(ks)
    n_ctx = n_seq * (a.depth + a.steps + 8)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        print(f"error: llama.cpp could not load {a.model}", file=sys.stderr)
        return 1
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, max(512, n_seq * a.depth), 512, n_seq
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(max(512, a.depth), 0, n_seq)

    def fill(entries):  # entries: (token, pos, seq, want logits)
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = out

    def decode(entries) -> float:
        fill(entries)
        t0 = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - t0

    mem = llama_cpp.llama_get_memory(ctx)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(a.reps):
        for k in ks:
            llama_cpp.llama_memory_clear(mem, True)
            for s in range(k):  # each sequence's prompt
                decode([(100 + (7 * j + s) % 1000, j, s, j == a.depth - 1) for j in range(a.depth)])
            steps = [decode([(200 + (step * k + s) % 1000, a.depth + step, s, True) for s in range(k)])
                     for step in range(a.steps)]
            times[k].append(statistics.median(steps))
    one = statistics.median(times[ks[0]]) if ks[0] == 1 else None
    print(f"llama.cpp {llama_cpp.__version__}, {a.threads} threads, depth {a.depth}, {a.steps} steps x {a.reps} reps")
    for k in ks:
        m = statistics.median(times[k])
        line = f"  k={k}: step {1000 * m:.1f} ms"
        if one:
            line += f", c(k) = {m / one:.2f}, throughput {k * one / m:.2f}x one sequence"
        print(line)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
