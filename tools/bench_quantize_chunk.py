"""Time qllama's block quantizers against ggml's own `ggml_quantize_chunk`, A B A B, one thread.

    python tools/bench_quantize_chunk.py [TYPE ...] [--rows 64] [--ne0 4096] [--repeat 3]

Both quantize the same gaussian rows (rows, ne0) with the same importance weights (for the types
that take them; iq1_s, iq2_xxs, iq2_xs need them); qllama runs its kernel in one thread, as
`ggml_quantize_chunk` does (llama-quantize splits rows over threads around both). Each side is
run once first (qllama's compile, ggml's grid tables), then timed alternately; the medians and
their ratio (ggml / qllama: above 1 is qllama faster) are printed, and the bytes are checked equal.
ggml comes from llama-cpp-python's libggml-base (tests/test_quantize_ggml.py's ctypes loader).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from qllama.gguf.types import GGML_TYPES  # noqa: E402
from qllama.quantize import blocks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", default=["iq1_s", "iq1_m", "tq1_0", "tq2_0"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ne0", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from test_quantize_ggml import ggml_quantize_chunk  # (pytest's skip if llama-cpp-python is missing)

    by_name = {t.name: tid for tid, t in GGML_TYPES.items()}
    blocks._MIN_BLOCKS_PER_THREAD = 1 << 60  # one thread, as ggml_quantize_chunk
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.ne0)).astype(np.float32)
    qw = rng.lognormal(0, 1.5, args.ne0).astype(np.float32)
    for name in args.types:
        if name.lower() not in by_name:
            sys.exit(f"error: unknown type {name}")
        tid = by_name[name.lower()]
        w = qw if tid in blocks.WEIGHTED_TYPES else None
        same = np.array_equal(blocks.quantize_chunk(x, tid, w), ggml_quantize_chunk(tid, x, w))
        ours, theirs = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            blocks.quantize_chunk(x, tid, w)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ggml_quantize_chunk(tid, x, w)
            theirs.append(time.perf_counter() - t0)
        a, b = np.median(ours), np.median(theirs)
        print(f"{name}: qllama {a * 1e3:.1f} ms, ggml {b * 1e3:.1f} ms, ggml / qllama {b / a:.2f}, "
              f"bytes {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
