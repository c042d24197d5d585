"""Run by test_isa.py in a fresh process (its own QLLAMA_ISA and Numba cache).

`python tests/isa_probe.py OUT.npz WORKDIR`: every int8 kernel shape on fixed random data, and a
small Q4_K_M model's prompt and decode logits, saved to one .npz for the test to compare
between ISAs bit for bit.

`python tests/isa_probe.py --compile-only OUT.json WORKDIR`: with NUMBA_CPU_NAME and
NUMBA_CPU_FEATURES naming a CPU this host may not be, compile (never run) every kernel the same
work would use, and write {kernel: [the vpdp*/zmm instructions in its machine code]}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as GQ  # noqa: E402
from gguf import quants as gq  # noqa: E402

from qllama.gguf import types as gt
from qllama.kernels import _x86  # noqa: E402
from qllama.qtensor import QTensor, int8_activations, quantize_activation, set_threads  # noqa: E402

# byte offsets of the fp16 scale fields of one K-quant block (as test_kernels.FP16_FIELDS)
K_SCALES = {gt.Q2_K: (80, 82), gt.Q3_K: (108,), gt.Q4_K: (0, 2), gt.Q5_K: (0, 2), gt.Q6_K: (208,), gt.IQ4_NL: (0,), gt.IQ4_XS: (0,),
            gt.IQ3_S: (0,), gt.IQ3_XXS: (0,), gt.IQ2_XXS: (0,), gt.IQ2_XS: (0,), gt.IQ2_S: (0,), gt.IQ1_S: (0,),
            gt.IQ1_M: (), gt.TQ1_0: (52,), gt.TQ2_0: (64,)}  # (iq1_m: its fp16 d is spread over the scales: random, NaN included)
NE0, N_ROWS = 512, 48  # (48: 3 gemm passes of 16 rows on a 512-bit ISA, 6 of 8 on AVX2)


def matrix(tid: int, rng: np.random.Generator) -> np.ndarray:
    """(N_ROWS, row bytes): random blocks, with the extremes that bound the int16 pair sums."""
    t = gt.GGML_TYPES[tid]
    if tid in K_SCALES:  # random bytes are valid K-quant (and iq4) blocks (quants 0..max included)
        raw = rng.integers(0, 256, (N_ROWS, NE0 // t.block_size, t.type_size), dtype=np.uint8)
        for f in K_SCALES[tid]:
            raw[:, :, f:f + 2] = rng.uniform(-0.02, 0.02, (N_ROWS, raw.shape[1], 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(N_ROWS, -1)
    w = rng.standard_normal((N_ROWS, NE0)).astype(np.float32)
    raw = np.ascontiguousarray(gq.quantize(w, GQ(tid))).reshape(N_ROWS, -1).view(np.uint8).copy()
    if tid == gt.Q8_0:  # row 0: every quant -128, |w| = 128 read unsigned
        raw.reshape(N_ROWS, -1, 34)[0, :, 2:] = 0x80
    return raw


def activations(n_tok: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((n_tok, NE0)).astype(np.float32)
    x[0, :64] = -3.0  # constant blocks: every activation quantizes to -127
    x[0, 64:96] = 5.0
    return x


def probe_model(workdir: str):
    from qllama.gguf.reader import GGUFFile
    from qllama.models import build_model, read_args
    from tools.make_model import ModelSpec, write_model

    path = Path(workdir) / "probe-q4_k_m.gguf"
    if not path.exists():
        write_model(path, ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, preset="Q4_K_M", seed=7))
    gf = GGUFFile(path)
    return build_model(gf, read_args(gf.metadata), n_ctx=64)


def compile_only(out: str, workdir: str) -> None:
    import json
    import re

    from qllama.runtime.compile_pool import _resolve, record_jobs

    assert int8_activations(), "the probe needs the int8 kernels"
    jobs = record_jobs([lambda: main(None, workdir)])  # every kernel call is noted, none runs
    found = {"isa": _x86.ISA}
    for job in jobs:
        d = _resolve(job.module, job.name, job.key)
        d.compile(job.argtypes)
        asm = d.inspect_asm(job.argtypes)
        found[job.label + repr(job.argtypes)] = sorted(set(re.findall(r"\bvpdp\w+|%zmm", asm)))
    Path(out).write_text(json.dumps(found, indent=1))


def main(out: str | None, workdir: str) -> None:
    assert int8_activations(), "the probe needs the int8 kernels"
    set_threads(2)
    res: dict[str, np.ndarray] = {"isa": np.array(_x86.ISA)}
    rng = np.random.default_rng(1234)
    for tid in sorted(int8_activations()):
        q = QTensor.from_bytes(tid, matrix(tid, rng), (NE0, N_ROWS))
        for n_tok in (1, 2, 3, 4, 5, 9, 33):  # one token, the 4-token tiles and tails, the gemm (q4_K), odd ends
            x = activations(n_tok, rng)
            res[f"{gt.type_name(tid)}/{n_tok}"] = q.matvec(x[0]) if n_tok == 1 else q.matmul(x)
            if n_tok >= 9:  # a prompt's rows (iq4_xs, iq3_s, iq2_xxs: llama.cpp's prompt arithmetic)
                res[f"{gt.type_name(tid)}/{n_tok}/prompt"] = q.matmul(x, prompt=True)
        res[f"{gt.type_name(tid)}/act"] = q.matvec(quantize_activation(activations(1, rng)[0]))
    model = probe_model(workdir)
    model.n_threads = 2
    if out is None:  # (compile-only runs leave garbage: no non-finite check)
        from qllama.models.step import Plain

        model.execution = Plain(checks=False)
    cache = model.new_cache()
    tokens = rng.integers(0, model.args.n_vocab, size=11).tolist()
    res["model/prompt"] = model.forward(tokens, cache, all_logits=True)  # batched: gemm and tiles
    res["model/decode"] = model.forward([tokens[3]], cache)  # one token: the fused decode kernels
    if out is not None:
        np.savez(out, **res)


if __name__ == "__main__":
    if sys.argv[1] == "--compile-only":
        compile_only(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
