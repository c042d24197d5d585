"""Where a prompt batch's time goes: one batch of N random tokens after DEPTH cached positions, every
kernel call timed by kind (the model's `Timed` execution, as `qllama bench --profile` times decode),
at each thread count, the thread counts alternated round by round; the median round per count.

Usage:
    python tools/profile_prompt.py MODEL [-n 512] [--depth 0] [-t 1,2] [-r 3]

The cache positions before DEPTH hold whatever the cache was allocated with (zeros): the timing of
attention over them is that of real keys, the values are not. "untimed" is the Python between
the calls. Times are per batch, in ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # (this tree's qllama, not whichever one is installed)
    sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", "--n-tokens", type=int, default=512)
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="kinds shown per thread count")
    a = ap.parse_args()

    from qllama.bench.runner import BenchRunner, random_tokens
    from qllama.models.decode import KernelClock
    from qllama.models.step import Timed

    threads = [int(t) for t in a.threads.split(",")]
    from qllama.qtensor import PROMPT_MIN_TOKENS

    runner = BenchRunner(a.model, n_ctx=a.depth + a.n_tokens + 8, batch_size=a.n_tokens, n_threads=max(threads))
    runner.warmup()
    model = runner.model
    tokens = random_tokens(a.n_tokens, runner.n_vocab, seed=5)
    rounds: dict[int, list] = {t: [] for t in threads}
    for _ in range(a.rounds):
        for t in threads:
            runner.set_threads(t)
            clock = KernelClock()
            runner.cache.n_past = a.depth
            with model.executing(Timed(clock)):
                t0 = time.perf_counter()
                model.forward(tokens, runner.cache, prompt=len(tokens) >= PROMPT_MIN_TOKENS)  # (a prompt's rounding, as a run)
                wall = time.perf_counter() - t0
            runner.cache.n_past = a.depth
            rounds[t].append((wall, dict(clock.seconds)))
    for t in threads:
        walls = [w for w, _ in rounds[t]]
        wall, seconds = rounds[t][int(np.argsort(walls)[len(walls) // 2])]
        print(f"{a.n_tokens} tokens after {a.depth}, {t} thread(s): {wall * 1e3:.0f} ms ({a.n_tokens / wall:.1f} t/s); "
              f"rounds {[round(w * 1e3) for w in walls]} ms")
        for kind, s in sorted(seconds.items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"  {kind:45s} {s * 1e3:9.1f}")
        print(f"  {'untimed (Python between the calls)':45s} {(wall - sum(seconds.values())) * 1e3:9.1f}")
    runner.close()


if __name__ == "__main__":
    main()
