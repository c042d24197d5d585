"""Speed of `qllama inspect --check` (the NaN/Inf tensor scan), from the page cache.

    python tools/bench_check.py MODEL.gguf [MODEL2.gguf ...] [--reps 7]

The file is read once untimed (so its pages are cached and the scan kernels are loaded), then
scanned --reps times; prints the median and best rate in GB/s of tensor bytes, beside
numpy.sum's read rate over the same mmap (what the memory system gives one pass over it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from qllama.report.check import check_tensors  # noqa: E402
from qllama.gguf.reader import GGUFFile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    for path in args.models:
        gf = GGUFFile(path)
        report = check_tensors(gf)  # untimed: page cache + kernel load
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            check_tensors(gf)
            ts.append(time.perf_counter() - t0)
        raw = np.frombuffer(gf._mm, dtype=np.uint8)  # the whole mapped file
        words = raw[: raw.size // 8 * 8].view(np.uint64)
        sums = []
        for _ in range(3):
            t0 = time.perf_counter()
            words.sum()
            sums.append(time.perf_counter() - t0)
        gb = report.n_bytes / 1e9
        print(f"{os.path.basename(path)}: {gb:.2f} GB of tensors, {report.n_tensors} tensors, ok={report.ok}: "
              f"median {gb / statistics.median(ts):.1f} GB/s, best {gb / min(ts):.1f} GB/s "
              f"(numpy.sum over the file: {raw.size / 1e9 / min(sums):.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
