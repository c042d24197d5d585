"""Perplexity with each KV cache type, qllama against llama.cpp with the same cache (issue 32, item 3).

    python tools/kv_quant_ppl.py ../shared/models/shakespeare-spm-f32.gguf ../shared/models/shakespeare-val.txt

llama.cpp (llama-cpp-python) runs with flash attention on, which its quantized V cache needs;
both follow llama-perplexity's protocol (chunks of -c tokens, BOS first, the second half of each
chunk scored). Prints one markdown table: perplexity per type on both sides, their difference,
and each side's change against its own f16 cache.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qllama  # noqa: E402
from qllama.generation.perplexity import perplexity  # noqa: E402
from qllama.models.kvcache import kv_type_id  # noqa: E402

TYPES = ("f16", "f32", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")


def llama_cpp_perplexity(path: str, text: str, kv: str, n_ctx: int, chunks: int, threads: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, logits_all=True, verbose=False,
                          seed=0, type_k=kv_type_id(kv), type_v=kv_type_id(kv), flash_attn=True)
    toks = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    nll, count = 0.0, 0
    for c in range(min(chunks, len(toks) // n_ctx)):
        chunk = toks[c * n_ctx : (c + 1) * n_ctx]
        chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        lg = np.array(llm.scores[:n_ctx], np.float64)[n_ctx // 2 : n_ctx - 1]
        lg -= lg.max(axis=1, keepdims=True)
        logp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        tgt = np.asarray(chunk[n_ctx // 2 + 1 :])
        nll -= float(logp[np.arange(tgt.size), tgt].sum())
        count += tgt.size
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("-c", "--ctx-size", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(TYPES))
    opt = ap.parse_args()
    text = Path(opt.text).read_text(encoding="utf-8")
    rows = []
    for kv in opt.types.split(","):
        t0 = time.perf_counter()
        want = llama_cpp_perplexity(opt.model, text, kv, opt.ctx_size, opt.chunks, opt.threads)
        model = qllama.load(opt.model, n_ctx=opt.ctx_size, batch_size=opt.ctx_size, n_threads=opt.threads,
                            type_k=kv, type_v=kv)
        got = perplexity(model, text, n_ctx=opt.ctx_size, chunks=opt.chunks).ppl
        rows.append((kv, got, want))
        print(f"  {kv}: qllama {got:.4f} llama.cpp {want:.4f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    base = {side: dict((kv, v) for kv, *vals in rows for v in [vals[side]]) for side in (0, 1)}
    print(f"{Path(opt.model).name}, -c {opt.ctx_size}, {opt.chunks} chunks:\n")
    print("| cache (K = V) | qllama | llama.cpp (flash attn) | qllama vs llama.cpp | vs own f16 cache (qllama / llama.cpp) |")
    print("| --- | --- | --- | --- | --- |")
    for kv, got, want in rows:
        own = ""
        if "f16" in base[0]:
            own = f"{(got / base[0]['f16'] - 1) * 100:+.2f}% / {(want / base[1]['f16'] - 1) * 100:+.2f}%"
        print(f"| {kv} | {got:.4f} | {want:.4f} | {(got / want - 1) * 100:+.3f}% | {own} |")


if __name__ == "__main__":
    main()
