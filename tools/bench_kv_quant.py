"""Decode speed at a given depth with a quantized KV cache against f16 (issue 32, item 3).

    python tools/bench_kv_quant.py bench-models/llama-3.2-1b-q4_k_m.gguf --depth 4096 -t 1 --types f16,q8_0
    python tools/bench_kv_quant.py --kernel --depth 4096 --types f16,q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl

For each cache type the model gets a cache whose first `depth` positions hold random keys and
values (stored through the cache's own encoding: f16 bits or quantized blocks; the values do not
change the work), then `--steps` one-token decode steps are timed at that depth. The types
alternate (A B A B, `--rounds` times) so that a noisy machine hits them alike; the table gives
the median step, and the attention kernel alone per layer (one token, serial) for the same cache.
With --kernel, no model: the attention kernel alone per type on the 1B shape's heads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qllama  # noqa: E402
from qllama.models.kvcache import from_f32  # noqa: E402
from qllama.qtensor import set_threads  # noqa: E402


def filled_cache(fm, depth: int, seed: int = 0):
    """A new cache of the model with positions [0, depth) holding random keys and values."""
    c = fm.new_cache()
    rng = np.random.default_rng(seed)
    for il in range(len(c.k)):
        hkv, ring = c.k[il].shape[:2]
        n = min(depth, ring)
        d = fm.args.head_dim
        k = rng.standard_normal((hkv, n, d), dtype=np.float32)
        v = rng.standard_normal((hkv, n, d), dtype=np.float32)
        if c.blocks:
            c.k[il][:, :n] = from_f32(k, c.k[il])
            c.vt[il][:, :n] = from_f32(v, c.vt[il])
        else:
            c.k[il][:, :n] = from_f32(k, c.k[il])
            c.vt[il][:, :, :n] = from_f32(v, c.vt[il]).transpose(0, 2, 1)
    c.n_past = depth
    c.stored(0, depth)
    return c


def attention_ms(fm, cache, il: int, reps: int = 20) -> float:
    """The attention kernel alone for one token at the cache's depth (serial), best of reps, in ms."""
    from qllama.kernels import attention_quant as aq
    from qllama.kernels import layer_ops as ops

    a = fm.args
    q = np.random.default_rng(1).standard_normal((1, a.n_head, a.head_dim), dtype=np.float32)
    out = np.empty_like(q)
    args = (cache.n_past - 1, a.n_rep, np.float32(a.attn_scale), 0, np.float32(0.0), False, out)
    if cache.blocks:
        def run():
            aq.attention_quant_serial(q, cache.kb[il], cache.vb[il], *cache.type_ids, *args)
    else:
        def run():
            ops.attention_serial(q, cache.kt[il], cache.vt[il], *args)
    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def kernel_table(types: list[str], depth: int, n_kv: int, n_rep: int, head_dim: int, reps: int, rounds: int) -> None:
    """The attention kernel alone (one token at `depth`, serial, one layer), per cache type,
    types alternating over `rounds`; the best of reps x rounds."""
    from qllama.kernels import attention_quant as aq
    from qllama.kernels import layer_ops as ops
    from qllama.models.kvcache import block_dtype, kv_type_id

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n_kv * n_rep, head_dim), dtype=np.float32)
    k = rng.standard_normal((n_kv, depth, head_dim), dtype=np.float32)
    v = rng.standard_normal((n_kv, depth, head_dim), dtype=np.float32)
    out = np.empty_like(q)
    args = (depth - 1, n_rep, np.float32(head_dim ** -0.5), 0, np.float32(0.0), False, out)
    runs = {}
    for t in types:
        if t in ("f16", "f32"):
            like = np.zeros(1, np.uint16 if t == "f16" else np.float32)
            kc, vt = (np.ascontiguousarray(from_f32(x, like).transpose(0, 2, 1)) for x in (k, v))  # both d-major
            runs[t] = (lambda kc=kc, vt=vt: ops.attention_serial(q, kc, vt, *args))
        else:
            kb = from_f32(k, np.zeros(1, block_dtype(t))).view(np.uint8)
            vb = from_f32(v, np.zeros(1, block_dtype(t))).view(np.uint8)
            tid = kv_type_id(t)
            runs[t] = (lambda kb=kb, vb=vb, tid=tid: aq.attention_quant_serial(q, kb, vb, tid, tid, *args))
        runs[t]()
    best = {t: float("inf") for t in types}
    for _ in range(rounds):
        for t in types:
            for _ in range(reps):
                t0 = time.perf_counter()
                runs[t]()
                best[t] = min(best[t], time.perf_counter() - t0)
    print(f"attention kernel, 1 token at depth {depth}, {n_kv} KV heads x {n_rep} query heads, head_dim {head_dim}, "
          f"serial, best of {reps} x {rounds} (types alternating):")
    print("| cache (K = V) | ms per layer | vs " + types[0] + " |")
    print("| --- | --- | --- |")
    for t in types:
        print(f"| {t} | {best[t] * 1e3:.2f} | {best[t] / best[types[0]]:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF (not needed with --kernel)")
    ap.add_argument("--kernel", action="store_true",
                    help="time the attention kernel alone per type (1B shape: 8 KV heads x 4, head_dim 64), no model")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--types", default="f16,q8_0", help="cache types (K and V the same), comma-separated")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    opt = ap.parse_args()

    types = opt.types.split(",")
    if opt.kernel:
        kernel_table(types, opt.depth, 8, 4, 64, reps=10, rounds=opt.rounds)
        return
    if not opt.model:
        ap.error("give a model, or --kernel")
    n_ctx = opt.depth + opt.steps * opt.rounds + 16
    models = {t: qllama.load(opt.model, n_ctx=n_ctx, n_threads=opt.threads, type_k=t, type_v=t) for t in types}
    set_threads(opt.threads)
    steps: dict[str, list[float]] = {t: [] for t in types}
    caches = {}
    for t, m in models.items():
        fm = m.forward_model
        caches[t] = filled_cache(fm, opt.depth)
        fm.forward([1], caches[t])  # compiles (or loads) the kernels, first step not timed
    for _ in range(opt.rounds):
        for t, m in models.items():
            fm, c = m.forward_model, caches[t]
            for _ in range(opt.steps):
                t0 = time.perf_counter()
                fm.forward([1], c)
                steps[t].append(time.perf_counter() - t0)
    a = models[types[0]].args
    print(f"{Path(opt.model).name}: {a.n_layer} layers, {a.n_head}/{a.n_head_kv} heads, head_dim {a.head_dim}; "
          f"depth {opt.depth}, {opt.threads} thread(s), {opt.rounds} x {opt.steps} steps per type (alternating)")
    print(f"{'cache':8s} {'KV MiB':>8s} {'ms/token':>9s} {'tok/s':>7s} {'vs ' + types[0]:>8s} {'attn ms/layer':>14s}")
    base = statistics.median(steps[types[0]])
    for t in types:
        med = statistics.median(steps[t])
        kv = models[t].kv_cache_bytes / 2**20
        att = attention_ms(models[t].forward_model, caches[t], 0)
        print(f"{t:8s} {kv:8.1f} {med * 1e3:9.1f} {1 / med:7.1f} {base / med:7.2f}x {att:14.3f}")


if __name__ == "__main__":
    main()
