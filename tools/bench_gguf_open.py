"""Time opening a GGUF file and reading all its metadata: qllama's reader vs gguf-py's GGUFReader.

    python tools/bench_gguf_open.py                       # ../shared/vocab/ggml-vocab-llama-bpe.gguf
    python tools/bench_gguf_open.py FILE... --runs 21 --oracle-runs 3 [--no-oracle] [--contents]

qllama: `GGUFFile(path)` parses everything eagerly (every string decoded to str, numeric
arrays as zero-copy views), so its constructor time *is* "open + read all metadata".
gguf-py: `GGUFReader(path)` (it builds numpy views of every field but decodes nothing);
with `--contents` also `field.contents()` for every key, i.e. the values as Python objects.
Runs alternate (ours, theirs, ours, ...) so that load changes on a shared machine hit both;
medians are reported, with qllama's CPU time beside its wall time (the machines are shared:
the wall time of a 0.1 s job doubles when another process holds the other core). A fresh-process time (`python -c "open"`, including interpreter start
and the numpy import) is given too, as `qllama inspect` pays it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from qllama.gguf.reader import GGUFFile  # noqa: E402

DEFAULT_FILE = REPO.parent / "shared" / "vocab" / "ggml-vocab-llama-bpe.gguf"


def time_ours(path: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one open + full metadata read."""
    c0, t0 = time.process_time(), time.perf_counter()
    f = GGUFFile(path)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    f.close()
    return dt, dc


def time_oracle(path: str, contents: bool) -> float:
    from gguf import GGUFReader  # the oracle: benchmark/tests only

    t0 = time.perf_counter()
    r = GGUFReader(path)
    if contents:
        for field in r.fields.values():
            try:
                field.contents()
            except UnicodeDecodeError:
                pass  # gguf-py cannot decode invalid UTF-8 values
    return time.perf_counter() - t0


def time_fresh_process(path: str, runs: int) -> list[float]:
    code = f"from qllama.gguf.reader import GGUFFile; GGUFFile({path!r})"
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
        out.append(time.perf_counter() - t0)
    return out


def fmt(ts: list[float]) -> str:
    return f"median {statistics.median(ts):7.3f} s  (min {min(ts):.3f}, max {max(ts):.3f}, n={len(ts)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", default=[str(DEFAULT_FILE)])
    ap.add_argument("--runs", type=int, default=21, help="runs of qllama's reader per file")
    ap.add_argument("--oracle-runs", type=int, default=3, help="runs of gguf-py's reader per file (slow)")
    ap.add_argument("--no-oracle", action="store_true", help="skip gguf-py")
    ap.add_argument("--contents", action="store_true", help="gguf-py: also decode every field's contents()")
    ap.add_argument("--process-runs", type=int, default=5, help="fresh-process runs (0 to skip)")
    args = ap.parse_args()

    for path in args.files:
        f = GGUFFile(path)
        n_str = sum(len(v) for v in f.metadata.values() if isinstance(v, list))
        print(f"{path}: {f.file_size / 2**20:.2f} MiB, {len(f.metadata)} keys, {len(f.tensors)} tensors, "
              f"{n_str} strings in string arrays")
        f.close()
        time_ours(path)  # warm the page cache
        ours: list[float] = []
        ours_cpu: list[float] = []
        theirs: list[float] = []
        n_oracle = 0 if args.no_oracle else args.oracle_runs
        every = max(1, args.runs // max(n_oracle, 1))
        for i in range(args.runs):
            wall, cpu = time_ours(path)
            ours.append(wall)
            ours_cpu.append(cpu)
            if n_oracle and i % every == every // 2 and len(theirs) < n_oracle:
                theirs.append(time_oracle(path, args.contents))
        while len(theirs) < n_oracle:
            theirs.append(time_oracle(path, args.contents))
        print(f"  qllama GGUFFile            {fmt(ours)}")
        print(f"  qllama GGUFFile, CPU time  {fmt(ours_cpu)}  (what a quiet machine's wall time approaches)")
        if theirs:
            label = "gguf-py GGUFReader+contents" if args.contents else "gguf-py GGUFReader        "
            print(f"  {label} {fmt(theirs)}")
            print(f"  ratio (gguf-py / qllama, medians): {statistics.median(theirs) / statistics.median(ours):.0f}x")
        if args.process_runs:
            print(f"  fresh process (python -c: start + import numpy + open) {fmt(time_fresh_process(path, args.process_runs))}")


if __name__ == "__main__":
    main()
