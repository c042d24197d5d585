"""Prompt gemm speed per matrix: decode's rounding (vec_dot's) against llama.cpp's prompt arithmetic.

    python tools/bench_gemm.py MODEL [--tensor blk.0.ffn_gate.weight] [-n 512] [-t 1] [-r 5]

One weight matrix of MODEL times n random tokens (q8_K activations made once), through
`QTensor.matmul(prompt=False)` (decode's rounding: the type's gemm or row kernel, every row bit for
bit the one-token kernel's) and `prompt=True` (`int8.gemm(SUMS | type)`, llama.cpp's
ggml-cpu/tiled arithmetic, what a prompt's rows take), alternated r times; prints
the medians in ms and in G products/s (ne0 * ne1 * n / time), and their ratio. A developer tool:
run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> None:
    from qllama.gguf.reader import GGUFFile
    from qllama.gguf.types import type_name
    from qllama.kernels import int8
    from qllama.qtensor import TYPES, QTensor, quantize_activation

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tensor", default="blk.0.ffn_gate.weight")
    ap.add_argument("-n", "--tokens", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-r", "--reps", type=int, default=5)
    a = ap.parse_args(argv)

    g = GGUFFile(a.model)
    info = g._info(a.tensor)
    ne0, ne1 = info.shape
    tid = info.type_id
    if tid not in int8.PROMPT_TYPES:
        sys.exit(f"error: {a.tensor} is {type_name(tid)}, which has no prompt kernel of its own "
                 f"(those: {', '.join(sorted(type_name(t) for t in int8.PROMPT_TYPES))})")
    raw = np.ascontiguousarray(g.tensor_bytes(a.tensor).reshape(ne1, -1))
    w = QTensor.from_bytes(tid, raw, (ne0, ne1), name=a.tensor)
    act = quantize_activation(np.random.default_rng(0).standard_normal((a.tokens, ne0)).astype(np.float32))
    act.quantized(TYPES[tid].int8_form)  # (made once, as a forward pass shares it between matrices)
    roundings = {"decode's rounding": False, "llama.cpp's prompt arithmetic": True}
    times: dict[str, list[float]] = {k: [] for k in roundings}
    out = np.empty((a.tokens, ne1), np.float32)
    for prompt in roundings.values():  # compile or load, untimed
        w.matmul(act, out, a.threads, prompt=prompt)
    for _ in range(a.reps):
        for name, prompt in roundings.items():
            t0 = time.perf_counter()
            w.matmul(act, out, a.threads, prompt=prompt)
            times[name].append(time.perf_counter() - t0)
    print(f"{Path(a.model).name} {a.tensor} ({type_name(tid)}, {ne1} x {ne0}), {a.tokens} tokens, {a.threads} thread(s):")
    med = {k: float(np.median(v)) for k, v in times.items()}
    for name, m in med.items():
        print(f"  {name:31s} {m * 1e3:8.2f} ms  {ne0 * ne1 * a.tokens / m / 1e9:6.1f} G products/s")
    first, second = med.values()
    print(f"  ratio {first / second:.2f}")


if __name__ == "__main__":
    main()
