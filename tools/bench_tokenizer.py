"""Tokenizer benchmark: build time of the Llama 3 tokenizer, and encoding speed on ~1 MiB of English.

    python tools/bench_tokenizer.py [--shared ../shared] [--reps 5] [--corpus shakespeare|docs]

Reports medians of `--reps` repetitions (the machines are shared and noisy). Every encode
repetition starts from empty word caches (a fresh cache is what a new text sees). Each encode
line ends with a digest of the ids, to check that a change kept them identical. With
llama-cpp-python installed, llama.cpp's tokenizer runs on the same text in the same run,
alternating with ours (A B A B), and the ratio of the medians is printed.

Corpora: `shakespeare` repeats ../shared/models/shakespeare-val.txt up to 1 MiB (deterministic);
`docs` concatenates the .rst/.md/.txt files of the installed Python packages (more varied words,
so the word caches help less).
"""

from __future__ import annotations

import argparse
import gc
import glob
import hashlib
import os
import site
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qllama.gguf.reader import GGUFFile  # noqa: E402
from qllama.tokenizer import Tokenizer  # noqa: E402

MIB = 1 << 20


def corpus(kind: str, shared: Path) -> str:
    """About 1 MiB of English text (UTF-8 bytes), cut at a character boundary."""
    if kind == "shakespeare":
        base = (shared / "models" / "shakespeare-val.txt").read_text(encoding="utf-8")
        text = base * (MIB // len(base.encode()) + 1)
    else:
        parts, size = [], 0
        files = sorted(p for sp in site.getsitepackages() for ext in ("rst", "md", "txt")
                       for p in glob.glob(os.path.join(sp, f"**/*.{ext}"), recursive=True))
        for p in files:
            try:
                s = Path(p).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            parts.append(s)
            size += len(s.encode())
            if size > MIB:
                break
        text = "\n".join(parts)
    return text.encode()[:MIB].decode("utf-8", "ignore")


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ids_digest(ids: list[int]) -> str:
    """A short fingerprint of a token sequence (compare runs before and after a change)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def bench_build(path: Path, reps: int) -> None:
    opens, builds, totals, cpu_open, cpu_build = [], [], [], [], []
    for _ in range(reps):
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        gf = GGUFFile(path)
        md = gf.metadata
        t1, c1 = time.perf_counter(), time.process_time()
        tok = Tokenizer.from_metadata(md)
        t2, c2 = time.perf_counter(), time.process_time()
        opens.append(t1 - t0)
        builds.append(t2 - t1)
        totals.append(t2 - t0)
        cpu_open.append(c1 - c0)
        cpu_build.append(c2 - c1)
        del tok, gf, md
    med = statistics.median
    print(f"build {path.name}: GGUF open {med(opens):.3f} s + tokenizer {med(builds):.3f} s = "
          f"{med(totals):.3f} s wall; CPU time {med(cpu_open):.3f} + {med(cpu_build):.3f} s (medians of {reps})")


def bench_encode(path: Path, text: str, reps: int) -> None:
    tok = Tokenizer.from_gguf(GGUFFile(path))
    n_bytes = len(text.encode())

    def ours():
        tok.clear_caches()
        return tok.encode(text)

    ids = ours()
    digest = ids_digest(ids)
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if llama_cpp is None:
        t = median_time(ours, reps)
        print(f"encode {path.name}: {n_bytes / MIB:.2f} MiB -> {len(ids)} tokens in {t:.3f} s "
              f"({n_bytes / MIB / t:.2f} MiB/s), ids sha256 {digest}; llama-cpp-python not installed, no ratio")
        return
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    data = text.encode()
    buf = (llama_cpp.llama_token * (len(data) + 8))()

    def theirs():
        # the C API with a buffer that fits: Llama.tokenize() would tokenize twice on a vocab-only
        # file (its first buffer is n_ctx_train = 0 tokens long)
        n = llama_cpp.llama_tokenize(ref._model.vocab, data, len(data), buf, len(buf), False, False)
        return buf[:n]

    same = theirs() == ids
    a, b = [], []
    for _ in range(reps):  # alternate A B A B
        a.append(median_time(ours, 1))
        b.append(median_time(theirs, 1))
    ta, tb = statistics.median(a), statistics.median(b)
    print(f"encode {path.name}: {n_bytes / MIB:.2f} MiB -> {len(ids)} tokens: qllama {ta:.3f} s, "
          f"llama.cpp {tb:.3f} s, ratio {ta / tb:.2f}x (ids identical: {same}; ids sha256 {digest})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--corpus", choices=("shakespeare", "docs"), default="shakespeare")
    args = ap.parse_args()
    vocab = args.shared / "vocab"
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    bench_build(vocab / "ggml-vocab-llama-bpe.gguf", args.reps)
    text = corpus(args.corpus, args.shared)
    for name in ("llama-bpe", "llama-spm", "gpt-2"):
        bench_encode(vocab / f"ggml-vocab-{name}.gguf", text, args.reps)


if __name__ == "__main__":
    main()
