"""i-quant speed against llama.cpp (issue 30): the Llama-3.2-1B shape with random iq4_xs / iq4_nl
weights (the tied token_embd/output matrix too), A B A B in the same run (tools/bench_vs_llamacpp.py).

Usage:
    python tools/bench_iquants.py [--type iq4_xs,iq4_nl] [-t 1,2] [-r 2] [-p 128] [-n 32] [--dir /tmp/qllama-bench]

The model files are written once (tools/make_model.py, random blocks: ~0.7-0.8 GB each) and kept
in --dir. Prints bench_vs_llamacpp's table (tokens/s, mean ± sd, ratio of the medians) per type.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def model_file(wtype: str, folder: Path) -> Path:
    from tools.make_model import PRESETS, ModelSpec, write_model

    path = folder / f"llama-3.2-1b-{wtype}.gguf"
    if not path.exists():
        kw = dict(PRESETS["llama-3.2-1b"])
        kw["vocab"] = str(REPO.parent / "shared" / "vocab" / kw["vocab"])
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_model(tmp, ModelSpec(weight_type=wtype, direct_blocks=True, seed=1, **kw))
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
