"""i-quant speed against llama.cpp (issue 30): the Llama-3.2-1B shape with random i-quant weights,
A B A B in the same run (tools/bench_vs_llamacpp.py).

Usage:
    python tools/bench_iquants.py [--type iq4_xs,iq4_nl,iq3_m,iq2_xxs] [-t 1,2] [-r 2] [-p 128] [-n 32] [--dir /tmp/qllama-bench]

Types: iq4_xs / iq4_nl: every matrix of that type (the tied token_embd/output too); iq3_m and
iq2_xxs: llama.cpp's IQ3_M / IQ2_XXS mixes for this shape (`llama_tensor_get_type`: n_gqa 4,
16 layers, tied embeddings), see MIXES. The model files are written once (tools/make_model.py,
random blocks with calibrated fp16 scales, not llama.cpp's quantizer: ~0.5-0.8 GB each) and kept
in --dir. Prints bench_vs_llamacpp's table (tokens/s, mean ± sd, ratio of the medians) per type.
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


def main() -> None:
    from tools.bench_vs_llamacpp import compare_throughput, format_throughput

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="iq4_xs,iq4_nl", help="comma list of weight types")
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--dir", default="/tmp/qllama-bench")
    a = ap.parse_args()
    for wtype in a.type.split(","):
        path = model_file(wtype, Path(a.dir))
        rows = compare_throughput(str(path), [int(t) for t in a.threads.split(",")], a.reps, a.n_prompt, a.n_gen, [],
                                  a.n_prompt, lambda s: print(s, file=sys.stderr, flush=True))
        print(f"\n{wtype} ({path.name})\n{format_throughput(rows)}", flush=True)


if __name__ == "__main__":
    main()
