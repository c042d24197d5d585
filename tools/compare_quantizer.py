"""Compare qllama's quantizer with llama.cpp's on the same f32 model, tensor by tensor.

    python tools/compare_quantizer.py F32.gguf PRESET [--reference REF.gguf] [--ppl TEXT] [--chunks 8]
                                      [--repeat N] [--imatrix FILE] [--threads T]

The reference is either a file llama.cpp quantized (--reference) or, when llama-cpp-python is
installed, made here with llama_cpp.llama_model_quantize. For each tensor it prints both types,
the share of byte-identical blocks and the ratio of round-trip RMSEs (ours / llama.cpp's, both
decoded with gguf-py's dequantizer); with --ppl it also has llama.cpp load both files and
compute perplexity on TEXT (chunks of 128 tokens, the second half of each chunk scored).
--repeat N times both quantizers N more times, alternately (A B A B), and prints the medians;
--imatrix FILE quantizes ours with llama.cpp's importance matrix (the reference then has to be
given with --reference: llama-cpp-python cannot pass a matrix); --threads: llama.cpp's nthread.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import gguf  # the oracle dequantizer (tools only)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from qllama.gguf.types import F32, GGML_TYPES, type_name  # noqa: E402
from qllama.gguf.reader import GGUFFile  # noqa: E402
from qllama.quantize import get_preset, quantize_gguf  # noqa: E402


def llama_quantize(src: Path, dst: Path, ftype: int, nthread: int = 2) -> None:
    """Quantize with llama.cpp itself (no imatrix)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = nthread
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise SystemExit("llama_model_quantize failed")


def perplexity(path: Path, text: str, n_ctx: int = 128, n_chunks: int = 8) -> float:
    """llama.cpp's perplexity of a file: BOS-led chunks of n_ctx tokens, second half scored."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, n_threads=2)
    toks = llm.tokenize(text.encode(), add_bos=True)
    nll, count = 0.0, 0
    for c in range(min(n_chunks, len(toks) // n_ctx)):
        chunk = toks[c * n_ctx : (c + 1) * n_ctx]
        chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:n_ctx], np.float64)  # (n_ctx, n_vocab)
        for i in range(n_ctx // 2, n_ctx - 1):
            m = logits[i].max()
            nll += m + math.log(np.exp(logits[i] - m).sum()) - logits[i, chunk[i + 1]]
            count += 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("f32", type=Path)
    ap.add_argument("preset")
    ap.add_argument("--reference", type=Path, help="llama.cpp's quantization of F32 (default: make one with llama-cpp-python)")
    ap.add_argument("--ppl", type=Path, help="text file: also compare llama.cpp perplexities of both files")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=0, help="time both quantizers N more times, A B A B")
    ap.add_argument("--imatrix", type=Path, help="llama.cpp's importance matrix for our quantization")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's nthread")
    args = ap.parse_args()
    preset = get_preset(args.preset)
    if args.imatrix and args.reference is None:
        raise SystemExit("--imatrix needs --reference (llama-cpp-python cannot give llama.cpp a matrix)")

    with tempfile.TemporaryDirectory() as tmp:
        ours = Path(tmp) / "ours.gguf"

        def run_ours() -> float:
            t0 = time.perf_counter()
            quantize_gguf(args.f32, ours, preset.name, force=True, imatrix=args.imatrix)
            return time.perf_counter() - t0

        def run_theirs() -> float:
            t0 = time.perf_counter()
            llama_quantize(args.f32, Path(tmp) / "llama_cpp.gguf", preset.ftype, args.threads)
            return time.perf_counter() - t0

        t_ours = run_ours()  # (the first run compiles the kernels on a cold cache)
        ref = args.reference
        if ref is None:
            ref = Path(tmp) / "llama_cpp.gguf"
            print(f"llama.cpp quantized in {run_theirs():.2f} s", file=sys.stderr)
        print(f"qllama quantized in {t_ours:.2f} s", file=sys.stderr)
        if args.repeat:
            times = [(run_ours(), run_theirs()) for _ in range(args.repeat)]
            mo, mt = (float(np.median([t[k] for t in times])) for k in (0, 1))
            print(f"A B A B x{args.repeat}: qllama median {mo:.2f} s, llama.cpp ({args.threads} threads) median "
                  f"{mt:.2f} s, ratio {mo / mt:.2f}", file=sys.stderr)

        f, a, b = GGUFFile(args.f32), GGUFFile(ours), GGUFFile(ref)
        print(f"{'tensor':32s} {'ours':>6s} {'llama':>6s} {'same blocks':>11s} {'rmse ours/llama':>15s}")
        ratios, n_same_type = [], 0
        se_a = se_b = 0.0
        for name, tb in b.tensors.items():
            ta = a.tensors[name]
            n_same_type += ta.type_id == tb.type_id
            if tb.type_id == F32 and ta.type_id == F32:
                continue
            x = f.tensor_array(name).astype(np.float64)
            ya = gguf.quants.dequantize(a.tensor_bytes(name), gguf.GGMLQuantizationType(ta.type_id)).reshape(x.shape)
            yb = gguf.quants.dequantize(b.tensor_bytes(name), gguf.GGMLQuantizationType(tb.type_id)).reshape(x.shape)
            ea, eb = float(((ya - x) ** 2).sum()), float(((yb - x) ** 2).sum())
            se_a, se_b = se_a + ea, se_b + eb
            same = "-"
            if ta.type_id == tb.type_id:
                bs = GGML_TYPES[tb.type_id].type_size
                same = f"{(a.tensor_bytes(name).reshape(-1, bs) == b.tensor_bytes(name).reshape(-1, bs)).all(axis=1).mean():.2%}"
            ratio = math.sqrt(ea / eb) if eb > 0 else (1.0 if ea == 0 else math.inf)
            ratios.append(ratio)
            print(f"{name:32s} {type_name(ta.type_id):>6s} {type_name(tb.type_id):>6s} {same:>11s} {ratio:15.6f}")
        print(f"types equal: {n_same_type}/{len(b.tensors)}; RMSE ratio max {max(ratios):.6f}, "
              f"whole model {math.sqrt(se_a / se_b) if se_b else 1.0:.6f}")
        if args.ppl:
            text = args.ppl.read_text(encoding="utf-8")
            pa, pb = perplexity(ours, text, n_chunks=args.chunks), perplexity(ref, text, n_chunks=args.chunks)
            print(f"llama.cpp perplexity: ours {pa:.4f}, llama.cpp's {pb:.4f}, ratio {pa / pb:.6f}")


if __name__ == "__main__":
    main()
