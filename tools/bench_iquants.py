"""i-quant speed against llama.cpp (issue 30): the Llama-3.2-1B shape in i-quant files,
A B A B in the same run (tools/bench_vs_llamacpp.py).

Usage:
    python tools/bench_iquants.py [--type iq4_xs,iq4_nl,iq3_m,iq2_xxs] [-t 1,2] [-r 2] [-p 128] [-n 32]
                                  [--made-by llama.cpp|random] [--dir /tmp/qllama-bench]

--made-by llama.cpp (the default): the shape is written once in f16 with random weights
(tools/make_model.py, ~2.5 GB) and llama.cpp's own quantizer (`llama_model_quantize`, the library
behind llama-quantize) makes each file from it with the preset of that name (IQ4_XS, IQ4_NL, IQ3_M,
IQ2_XXS, IQ3_S), so its per-tensor types are whatever llama.cpp picks. IQ2_XXS (and the other
presets that llama.cpp refuses without an importance matrix: IQ3_XXS, IQ2_XS, IQ1_S, ...) gets one
of ones (the weights are random; a matrix only steers which grid points the quantizer picks, not the
types or the speed).
--made-by random: random blocks with calibrated fp16 scales written directly in llama.cpp's mixes
for this shape (`llama_tensor_get_type`: n_gqa 4, 16 layers, tied embeddings; see MIXES), no f16
file and no quantizer. The files are kept in --dir. Prints bench_vs_llamacpp's table (tokens/s,
mean ± sd, ratio of the medians) per type.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# name -> (the weight type, per tensor kind or tensor the types llama.cpp's mix gives instead): IQ3_M
# keeps attn_v, attn_output and the first n_layer/8 ffn_down in q4_K, the tied embedding in q6_K;
# IQ2_XXS: attn_v q4_K (n_gqa >= 4), the first n_layer/8 ffn_down q2_K, the tied embedding q5_K
MIXES = {
    "iq3_m": ("iq3_s", {"token_embd": "q6_K", "attn_v": "q4_K", "attn_output": "q4_K", "blk.0.ffn_down": "q4_K",
                        "blk.1.ffn_down": "q4_K"}),
    "iq2_xxs": ("iq2_xxs", {"token_embd": "q5_K", "attn_v": "q4_K", "blk.0.ffn_down": "q2_K", "blk.1.ffn_down": "q2_K"}),
}


def model_file(wtype: str, folder: Path) -> Path:
    from tools.make_model import PRESETS, ModelSpec, write_model

    path = folder / f"llama-3.2-1b-{wtype}.gguf"
    if not path.exists():
        kw = dict(PRESETS["llama-3.2-1b"])
        kw["vocab"] = str(REPO.parent / "shared" / "vocab" / kw["vocab"])
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        weight_type, types = MIXES.get(wtype, (wtype, {}))
        write_model(tmp, ModelSpec(weight_type=weight_type, types=types, direct_blocks=True, seed=1, **kw))
        tmp.rename(path)
    return path


def llama_cpp_file(wtype: str, folder: Path) -> Path:
    """The 1B shape quantized by llama.cpp to preset wtype.upper() from the f16 file (module docstring)."""
    import numpy as np

    from tools.llama_quantize import FTYPES, quantize
    from tools.make_model import PRESETS, ModelSpec, write_model

    path = folder / f"llama-3.2-1b-{wtype}-by-llama.cpp.gguf"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "llama-3.2-1b-f16.gguf"
    if not src.exists():
        kw = dict(PRESETS["llama-3.2-1b"])
        kw["vocab"] = str(REPO.parent / "shared" / "vocab" / kw["vocab"])
        tmp = src.with_suffix(".tmp")
        write_model(tmp, ModelSpec(weight_type="f16", seed=1, **kw))
        tmp.rename(src)
    preset = wtype.upper()
    imatrix = None
    if preset in ("IQ3_XXS", "IQ3_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "Q2_K_S"):
        # (llama.cpp refuses these without a matrix)
        spec = PRESETS["llama-3.2-1b"]
        sizes = {"ffn_down": spec["n_ff"]}
        imatrix = {f"blk.{i}.{w}.weight": np.ones(sizes.get(w, spec["n_embd"]), np.float32)
                   for i in range(spec["n_layer"])
                   for w in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    tmp = path.with_suffix(".tmp")
    quantize(src, tmp, FTYPES[preset], imatrix=imatrix)
    tmp.rename(path)
    return path


def main() -> None:
    from tools.bench_vs_llamacpp import compare_throughput, format_throughput

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="iq4_xs,iq4_nl", help="comma list of weight types")
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--made-by", choices=("llama.cpp", "random"), default="llama.cpp",
                    help="who quantizes the files (module docstring)")
    ap.add_argument("--dir", default="/tmp/qllama-bench")
    a = ap.parse_args()
    make = llama_cpp_file if a.made_by == "llama.cpp" else model_file
    for wtype in a.type.split(","):
        path = make(wtype, Path(a.dir))
        rows = compare_throughput(str(path), [int(t) for t in a.threads.split(",")], a.reps, a.n_prompt, a.n_gen, [],
                                  a.n_prompt, lambda s: print(s, file=sys.stderr, flush=True))
        print(f"\n{wtype} ({path.name})\n{format_throughput(rows)}", flush=True)


if __name__ == "__main__":
    main()
