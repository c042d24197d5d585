"""Benchmark the mat-vec / mat-mat kernels (a developer tool, not a test).

    python tools/bench_kernels.py                 # GB/s, GFLOP/s, vectorisation report
    python tools/bench_kernels.py --cold-compile  # compile time of every kernel, empty cache
    python tools/bench_kernels.py --types q4_K q8_0 --threads 1 --reps 10 --no-asm  # a quick subset
    python tools/bench_kernels.py --compare HEAD~1 --rounds 4   # A B A B: that commit's kernels vs these

Reports, at 1 and 2 threads (--threads) (medians of repetitions; the machine is shared and noisy):
- machine read bandwidth: numpy.sum over a 1 GiB float32 array split across the threads;
- mat-vec GB/s of packed weights for q4_K, q6_K, q8_0 and f16 on Llama 3.2 1B shapes
  (ne0 x ne1 = 2048x2048, 2048x512, 8192x2048, 2048x8192). Each repetition uses the next of
  several copies of the matrix (>= 96 MiB in all), so weights stream from DRAM, not the 32 MiB L3;
  the default path (int8 activations where available) and the float path;
- mat-mat GFLOP/s (2 * ne0 * ne1 * batch / time) at a batch of 64 tokens;
- which packed-SIMD instructions the inner loops use (from `kernel.inspect_asm(sig)`).

--compare REV runs two worker processes, one importing qllama as of git revision REV (extracted
into a temporary directory, its own Numba cache) and one this tree, and alternates them pass by
pass (A B A B): per type, on the matrix shapes of the small models whose mixes use the 32-element
types (Qwen2.5-0.5B: 896x4864 and 4864x896; SmolLM2-135M: 576x1536), the time of one int8-path
mat-vec (weights rotated through copies, so they stream from DRAM) and of a mat-mat of 4, 9
(a prompt-lookup batch) and 64 tokens with activations already quantized (k-quant rows rounded
up to whole 256-element super-blocks). Prints, per call,
medians over passes of the median wall time and of the least CPU time (`time.process_time`, all
threads; the least is the call least disturbed by other processes), and new / old.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(2048, 2048), (2048, 512), (8192, 2048), (2048, 8192)]  # (ne0, ne1)
TYPES = ["q4_K", "q6_K", "q8_0", "f16"]
STREAM_BYTES = 96 << 20  # total size of the rotated copies: 3x the L3


def times(fn, reps: int) -> tuple[float, float]:
    """(median, best) wall time of fn over reps calls."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), float(np.min(ts))


def read_bandwidth(n_threads: int, reps: int = 7) -> float:
    """GB/s of numpy.sum over 1 GiB of float32 split in n_threads parts (numpy releases the GIL)."""
    a = np.ones(1 << 28, np.float32)  # 1 GiB
    parts = np.array_split(a, n_threads)
    with ThreadPoolExecutor(n_threads) as pool:
        med, best = times(lambda: list(pool.map(np.sum, parts)), reps)
    return a.nbytes / med / 1e9, a.nbytes / best / 1e9


def make_matrix(tname: str, ne0: int, ne1: int, rng: np.random.Generator):
    from gguf import GGMLQuantizationType as GQ
    from gguf import quants as gq

    from qllama.gguf.types import GGML_TYPES_BY_NAME
    from qllama.qtensor import QTensor

    t = GGML_TYPES_BY_NAME[tname]
    if tname == "f16":
        raw = rng.standard_normal((ne1, ne0)).astype(np.float16).view(np.uint8)
    elif tname == "q8_0":
        raw = gq.quantize(rng.standard_normal((ne1, ne0)).astype(np.float32), GQ.Q8_0)
    else:  # k-quants: random bytes are valid blocks; small finite fp16 scales
        nb = ne0 // 256
        raw = rng.integers(0, 256, (ne1, nb, t.type_size), dtype=np.uint8)
        for f in {"q4_K": (0, 2), "q6_K": (208,)}[tname]:
            raw[:, :, f : f + 2] = rng.uniform(0.001, 0.01, (ne1, nb, 1)).astype(np.float16).view(np.uint8)
    return QTensor.from_bytes(t.id, np.ascontiguousarray(raw), (ne0, ne1))


def bench(args) -> None:
    from qllama.qtensor import QTensor, int8_activations, set_int8_activations, set_threads

    from qllama.gguf.types import type_name

    rng = np.random.default_rng(0)
    print(f"# int8-activation types on this host: {sorted(type_name(t) for t in int8_activations())}")
    print(f"# reps={args.reps}; medians (best in brackets); load average at start: {os.getloadavg()[0]:.1f}")
    bw = {}
    threads = args.threads
    for nt in threads:
        med, best = read_bandwidth(nt)
        bw[nt] = med
        print(f"numpy.sum 1 GiB, {nt} thread(s): {med:.1f} GB/s ({best:.1f})")

    print("\n## mat-vec, GB/s of packed weights streamed (copies rotated, >= 96 MiB)")
    heads = " ".join(f"{f'{nt} thread(s)':>12}" for nt in threads)
    print(f"{'type':6} {'ne0xne1':>10} {'path':6} {heads} {f'%bw({threads[-1]})':>7}")
    for tname in args.types:
        for ne0, ne1 in SHAPES:
            q0 = make_matrix(tname, ne0, ne1, rng)
            n_copy = max(2, STREAM_BYTES // q0.nbytes)
            copies = [QTensor.from_bytes(q0.type_id, q0.raw.copy(), q0.shape) for _ in range(n_copy)]
            x = rng.standard_normal(ne0).astype(np.float32)
            out = np.empty(ne1, np.float32)
            paths = ["int8", "float"] if q0.type_id in int8_activations() else ["float"]
            for path in paths:
                set_int8_activations(path == "int8")
                res = []
                for nt in threads:
                    set_threads(nt)
                    copies[0].matvec(x, out)  # compile / warm
                    i = [0]

                    def step():
                        copies[i[0] % n_copy].matvec(x, out)
                        i[0] += 1

                    med, best = times(step, max(args.reps, n_copy))
                    res.append((q0.nbytes / med / 1e9, q0.nbytes / best / 1e9))
                cols = " ".join(f"{m:5.1f} ({b:4.1f})" for m, b in res)
                print(f"{tname:6} {ne0:>5}x{ne1:<5} {path:6} {cols} {100 * res[-1][0] / bw[threads[-1]]:6.0f}%")
            set_int8_activations(True)

    print("\n## mat-mat, batch 64, GFLOP/s (2*ne0*ne1*64 / time)")
    print(f"{'type':6} {'ne0xne1':>10} {'path':6} {heads}")
    for tname in args.types:
        for ne0, ne1 in SHAPES:
            q = make_matrix(tname, ne0, ne1, rng)
            xs = rng.standard_normal((64, ne0)).astype(np.float32)
            out = np.empty((64, ne1), np.float32)
            paths = ["int8", "float"] if q.type_id in int8_activations() else ["float"]
            for path in paths:
                set_int8_activations(path == "int8")
                res = []
                for nt in threads:
                    set_threads(nt)
                    q.matmul(xs, out)
                    med, best = times(lambda: q.matmul(xs, out), max(3, args.reps // 4))
                    res.append((2 * ne0 * ne1 * 64 / med / 1e9, 2 * ne0 * ne1 * 64 / best / 1e9))
                cols = " ".join(f"{m:5.1f} ({b:4.1f})" for m, b in res)
                print(f"{tname:6} {ne0:>5}x{ne1:<5} {path:6} {cols}")
            set_int8_activations(True)
    set_threads(None)
    if args.no_asm:
        return
    print("\n## inner-loop instructions (counts of ymm-register instructions in each compiled kernel)")
    _run_fresh(["--asm"])


PACKED = ["vpmaddubsw", "vpmaddwd", "vfmadd231ps", "vfmadd213ps", "vcvtdq2ps", "vcvtph2ps",
          "vpmovzxbw", "vpmovzxbd", "vpmovzxbq", "vcvtqq2ps", "vpgatherdd", "vgatherdps"]


def vector_report() -> None:
    """Count packed-SIMD instructions (on ymm registers) in each compiled kernel."""
    from qllama.kernels import floats, int8

    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        exec(COLD)  # compile every kernel (inspect_asm needs freshly compiled, not cached, code)
    from qllama.kernels import dequantize, kquants, legacy

    kernels = {f"int8.GEMM_ROWS[{t}]": k for t, k in int8.GEMM_ROWS.items()}
    kernels.update({f"int8.ROWS_INT8[{t}]": k for t, k in int8.ROWS_INT8.items()})
    kernels.update({f"kquants.{k}": getattr(kquants, k) for k in dir(kquants) if k.startswith("matvec_")})
    kernels.update({f"legacy.{k}": getattr(legacy, k) for k in dir(legacy) if k.startswith("matvec_")})
    kernels.update({f"floats.{k}": getattr(floats, k) for k in ("matvec_f16", "matmul_f32", "matmul_half")})
    kernels["dequantize.dequantize_rows"] = dequantize.dequantize_rows
    for name, k in kernels.items():
        if not k.signatures:
            continue
        asm = k.inspect_asm(k.signatures[0])
        ymm = Counter(m.group(1) for m in re.finditer(r"^\s+(v\w+)\s[^\n]*ymm", asm, re.M))
        shown = {op: ymm[op] for op in PACKED if ymm[op]}
        print(f"{name:32} {shown}")


COLD = r"""
import time, numpy as np
t0 = time.perf_counter()
from qllama import ggml_types as gt
from qllama.qtensor import QTensor, set_int8_activations, Activation
rng = np.random.default_rng(0)
for tid in sorted(__import__('qllama.qtensor', fromlist=['x']).SUPPORTED_TYPES):
    t = gt.GGML_TYPES[tid]
    q = QTensor.from_bytes(tid, np.zeros(t.row_bytes(256) * 2, np.uint8), (256, 2))
    for int8 in (True, False):
        set_int8_activations(int8)
        q.matvec(np.ones(256, np.float32)); q.matmul(np.ones((3, 256), np.float32))
    q.dequantize([0])
print(f"{time.perf_counter() - t0:.1f}", end="")
"""


def _run_fresh(argv: list[str], runs: int = 1) -> list[str]:
    """Run this script (or COLD) in subprocesses sharing a new, empty Numba cache directory."""
    root = Path(__file__).resolve().parents[1]
    outs = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=str(root))
        for _ in range(runs):
            cmd = [sys.executable, "-c", COLD] if argv == ["cold"] else [sys.executable, __file__, *argv]
            r = subprocess.run(cmd, env=env, capture_output=argv == ["cold"], text=True, check=True)
            outs.append((r.stdout or "").strip())
    return outs


def cold_compile() -> None:
    cold, warm = _run_fresh(["cold"], runs=2)
    print(f"first call of every kernel (13 types, int8 + float paths), empty cache: {cold} s")
    print(f"the same with the cache filled: {warm} s")


CMP_SHAPES = [(896, 4864), (4864, 896), (576, 1536)]  # (ne0, ne1)
CMP_TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q6_K"]
CMP_TOKENS = [1, 4, 9, 64]
CMP_STREAM = 64 << 20  # rotated copies for the mat-vec: 2x the L3


def cmp_matrix(tname: str, ne0: int, ne1: int):
    """A deterministic random matrix of type tname (legacy types via gguf-py's quantizer)."""
    from gguf import GGMLQuantizationType as GQ
    from gguf import quants as gq

    from qllama.gguf.types import GGML_TYPES_BY_NAME
    from qllama.qtensor import QTensor

    rng = np.random.default_rng(ne0 * 7 + ne1)
    t = GGML_TYPES_BY_NAME[tname]
    if tname.endswith("_K"):
        return make_matrix(tname, ne0, ne1, rng)
    raw = gq.quantize(rng.standard_normal((ne1, ne0)).astype(np.float32), GQ(t.id))
    return QTensor.from_bytes(t.id, np.ascontiguousarray(raw), (ne0, ne1))


def cmp_worker(args) -> None:
    """Serve passes: on each input line, time every (type, shape, tokens) once; print one JSON line."""
    import json

    sys.path.insert(0, args.tree)  # before any qllama import: that tree's package
    import qllama
    from qllama.qtensor import QTensor, quantize_activation, set_threads

    assert Path(qllama.__file__).resolve().is_relative_to(Path(args.tree).resolve()), qllama.__file__
    set_threads(args.threads[0])
    rng = np.random.default_rng(1)
    items = []
    from qllama.gguf.types import GGML_TYPES_BY_NAME

    for tname in args.types:
        bs = GGML_TYPES_BY_NAME[tname].block_size
        for ne0, ne1 in args.shapes:
            ne0 = -(-ne0 // bs) * bs  # k-quants: the row length rounded up to whole super-blocks
            q = cmp_matrix(tname, ne0, ne1)
            for n_tok in args.tokens:
                act = quantize_activation(rng.standard_normal((n_tok, ne0)).astype(np.float32))
                out = np.empty((n_tok, ne1), np.float32)
                q.matmul(act, out)  # compile, quantize the activation once
                items.append((f"{tname} {ne0}x{ne1} n={n_tok}", q, act, out))
    print("ready", flush=True)
    for _ in sys.stdin:
        res = {}
        for key, q, act, out in items:
            mats = [q]
            if act.n_tok == 1:
                n_copy = max(2, CMP_STREAM // q.nbytes)
                mats = [QTensor.from_bytes(q.type_id, q.raw.copy(), q.shape) for _ in range(n_copy)]
            calls = max(len(mats), int(2e8 // (q.n_cols * q.n_rows * act.n_tok)) + 1)
            walls, cpus = [], []
            for i in range(calls):
                t, c = time.perf_counter(), time.process_time()
                mats[i % len(mats)].matmul(act, out)
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
            res[key] = (float(np.median(walls)), float(np.min(cpus)))
            del mats
        print(json.dumps(res), flush=True)


def compare(args) -> None:
    """A B A B: the kernels of git revision args.compare vs this tree (see the module docstring)."""
    import json

    root = Path(__file__).resolve().parents[1]
    argv = ["--cmp-worker", "--threads", str(args.threads[0]), "--types", *args.types,
            "--shapes", *(f"{a}x{b}" for a, b in args.shapes), "--tokens", *map(str, args.tokens)]
    with tempfile.TemporaryDirectory() as old:
        arc = subprocess.run(["git", "-C", str(root), "archive", args.compare, "qllama"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", old], input=arc.stdout, check=True)
        procs = {}
        for name, tree in (("old", old), ("new", str(root))):
            procs[name] = subprocess.Popen([sys.executable, __file__, *argv, "--tree", tree], cwd=tree, text=True,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for p in procs.values():
            assert p.stdout.readline().strip() == "ready"
        runs = {"old": [], "new": []}
        loads = []
        for _ in range(args.rounds):
            for name, p in procs.items():
                loads.append(os.getloadavg()[0])
                p.stdin.write("go\n")
                p.stdin.flush()
                runs[name].append(json.loads(p.stdout.readline()))
        for p in procs.values():
            p.stdin.close()
            p.wait()
    print(f"# {args.compare} (old) vs this tree (new), {args.threads[0]} thread(s), {args.rounds} passes each, "
          f"A B A B; load average during the run {min(loads):.1f}..{max(loads):.1f}")
    print("# per call: median wall, least CPU time, medians over passes; n=1 streams weights from DRAM")
    print(f"{'matrix':28} {'old us':>9} {'new us':>9} {'new/old':>7} {'old cpu':>9} {'new cpu':>9} {'new/old':>7}")
    for key in runs["old"][0]:
        ow, oc = (float(np.median([r[key][i] for r in runs["old"]])) * 1e6 for i in (0, 1))
        nw, nc = (float(np.median([r[key][i] for r in runs["new"]])) * 1e6 for i in (0, 1))
        print(f"{key:28} {ow:9.1f} {nw:9.1f} {nw / ow:7.2f} {oc:9.1f} {nc:9.1f} {nc / oc:7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--types", nargs="*", default=TYPES)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="thread counts to measure (default: 1 2)")
    ap.add_argument("--no-asm", action="store_true", help="skip the vectorisation report (it recompiles every kernel)")
    ap.add_argument("--cold-compile", action="store_true", help="measure kernel compile time with an empty cache")
    ap.add_argument("--compare", metavar="REV", help="A B A B: the kernels of git revision REV vs this tree")
    ap.add_argument("--rounds", type=int, default=4, help="passes per side with --compare (default 4)")
    ap.add_argument("--shapes", nargs="+", type=lambda v: tuple(map(int, v.split("x"))), default=CMP_SHAPES,
                    help="with --compare: matrix shapes ne0xne1 (default: 896x4864 4864x896 576x1536)")
    ap.add_argument("--tokens", nargs="+", type=int, default=CMP_TOKENS, help="with --compare: batch sizes (default: 1 4 9 64)")
    ap.add_argument("--asm", action="store_true", help=argparse.SUPPRESS)  # internal: vectorisation report
    ap.add_argument("--cmp-worker", action="store_true", help=argparse.SUPPRESS)  # internal: one side of --compare
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # internal: the worker's source tree
    args = ap.parse_args()
    if args.compare and args.types == TYPES:
        args.types = CMP_TYPES
    if args.cmp_worker:
        cmp_worker(args)
    elif args.compare:
        compare(args)
    elif args.asm:
        vector_report()
    elif args.cold_compile:
        cold_compile()
    else:
        bench(args)


if __name__ == "__main__":
    main()
