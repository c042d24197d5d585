"""Mixture-of-experts speed, qllama against llama.cpp (llama-cpp-python), same run, A B A B.

Random-weight files with real shapes (tools/make_moe.py presets: Qwen3-30B-A3B, OLMoE-1B-7B,
gpt-oss-20b), only the first few layers (a layer's cost is what is measured; the embedding and output of the
tiny test vocabulary are negligible). For each thread count: prompt processing (pp tokens in one
batch) and decode (tg tokens one at a time), alternating engines `--rounds` times; the median of
each is reported with the weight bytes a decoded token reads (`qllama inspect`'s figure) and the
bandwidth that implies.

    python tools/bench_moe.py --preset qwen3-30b-a3b --n-layer 2 --threads 1,2 --pp 64 --tg 16 --rounds 2
    python tools/bench_moe.py --preset gpt-oss-20b ...   (q8_0, MXFP4 experts: the published files' types)
    python tools/bench_moe.py --model FILE.gguf ...

How many layers: 2 layers weigh the per-token costs (embedding, output, sampling-free logits,
Python per step) more than the 48 of the real model, and llama.cpp's prompt is cheaper per layer
in a 2-layer file than in longer ones: Qwen3-30B-A3B shape, pp64 at -t 1 in CPU ms, 2 / 4 / 6
layers, llama.cpp 210 / 593 / 767 against qllama 279 / 550 / 673 (one run each, load 3-4,
before the row kernels' prefetch). So also run --n-layer 6 before reading a 2-layer ratio as a
layer's cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# --cpu: rates per second of this process's CPU time (time.process_time) instead of wall time. On
# a machine other processes keep busy, wall time measures the scheduler; at one thread, CPU time
# still measures the engine (at two, it also counts time spent waiting in parallel regions).
CLOCK = time.perf_counter


def run_qllama(model, ids, pp: int, tg: int) -> tuple[float, float]:
    tr = model._model  # the Transformer
    cache = tr.new_cache()
    t0 = CLOCK()
    tr.forward(ids[:pp], cache, prompt=True)
    t_pp = CLOCK() - t0
    t0 = CLOCK()
    for tok in ids[pp : pp + tg]:
        tr.forward([tok], cache)
    return pp / t_pp, tg / (CLOCK() - t0)


def run_llamacpp(llm, ids, pp: int, tg: int) -> tuple[float, float]:
    llm.reset()
    t0 = CLOCK()
    llm.eval(ids[:pp])
    t_pp = CLOCK() - t0
    t0 = CLOCK()
    for tok in ids[pp : pp + tg]:
        llm.eval([tok])
    return pp / t_pp, tg / (CLOCK() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (else one is written from --preset)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--type", default=None, help="the matrices' type (default q4_K; gpt-oss: q8_0)")
    ap.add_argument("--down-type", default=None, help="ffn_down_exps' type (default q6_K)")
    ap.add_argument("--exps-type", default=None, help="every expert tensor's type (gpt-oss default: mxfp4)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="rates per CPU second of this process (busy machines, -t 1)")
    a = ap.parse_args()
    if a.cpu:
        global CLOCK
        CLOCK = time.process_time

    import llama_cpp

    import qllama
    from qllama.gguf.reader import GGUFFile
    from qllama.qtensor import set_threads
    from qllama.report.summary import summarize
    from tools.make_moe import PRESETS, moe_spec, write_moe

    tmp = None
    path = a.model
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = str(Path(tmp.name) / f"{a.preset}-{a.n_layer}l.gguf")
        kw = dict(PRESETS[a.preset])
        arch = kw.pop("arch")
        oss = arch == "gpt-oss"
        exps = a.exps_type or ("mxfp4" if oss else None)
        types = {k: exps for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")} if exps else {}
        types["ffn_down_exps"] = a.down_type or exps or "q6_K"
        write_moe(path, moe_spec(arch, n_layer=a.n_layer, weight_type=a.type or ("q8_0" if oss else "q4_K"),
                                 types=types, direct=True, **kw))
    s = summarize(GGUFFile(path))
    print(f"{path}: {s.architecture}, {s.block_count} layers, {s.expert_count} experts / {s.expert_used_count} used; "
          f"reads {s.bytes_per_token / 1e6:.1f} MB of {s.tensor_bytes / 1e6:.1f} MB per decoded token")
    n_ctx = a.pp + a.tg + 8
    ids = np.random.default_rng(0).integers(3, 300, size=a.pp + a.tg).tolist()
    for nt in [int(t) for t in a.threads.split(",")]:
        set_threads(nt)
        q = qllama.load(path, n_ctx=n_ctx, n_threads=nt)
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=nt, n_threads_batch=nt,
                              verbose=False, flash_attn=False)
        run_qllama(q, ids, a.pp, a.tg)  # warm-up: kernels compiled or loaded, the experts' pages mapped
        run_llamacpp(llm, ids, a.pp, a.tg)
        res = {"qllama": [], "llama.cpp": []}
        for _ in range(a.rounds):
            res["qllama"].append(run_qllama(q, ids, a.pp, a.tg))
            res["llama.cpp"].append(run_llamacpp(llm, ids, a.pp, a.tg))
        med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in res.items()}
        for k, (pp, tg) in med.items():
            print(f"  -t {nt} {k:9s}  pp{a.pp} {pp:8.1f} t/s   tg{a.tg} {tg:7.2f} t/s  "
                  f"({tg * s.bytes_per_token / 1e9:.1f} GB/s of weights)")
        print(f"  -t {nt} ratio qllama/llama.cpp: pp {med['qllama'][0] / med['llama.cpp'][0]:.2f}x, "
              f"tg {med['qllama'][1] / med['llama.cpp'][1]:.2f}x")
        del llm, q
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
