"""What a grammar costs per token: llguidance's mask (compute + apply to the logits) against a
decode step.

    python tools/bench_constrained.py [--steps 64] [--model demo] [--vocab /work/shared/vocab/ggml-vocab-llama-bpe.gguf]

1. The demo model (32,000 tokens), greedy under a JSON schema: per-token time of the mask
   (ConstrainedSampler.distribution's extra work, timed inside) against the whole decode step.
2. A large vocabulary without its model (default: Llama 3's 128,256 tokens from a vocab-only
   GGUF): the matcher walks a JSON-schema output chosen by random logits, timing mask + advance
   per token; compare with a decode step of a model of that vocabulary (1B Llama 3.2: ~32 ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "city": {"type": "string", "enum": ["Verona", "Mantua", "Padua"]},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}


def med_us(xs):
    return 1e6 * statistics.median(xs) if xs else float("nan")


def bench_model(steps: int, model: str = "demo") -> None:
    import qllama
    from qllama.generation import constrained as C

    m = qllama.load(model, n_threads=1)
    m.warmup()
    times: list[float] = []
    orig = C.Constraint.mask

    def timed(self, logits):
        t0 = time.perf_counter()
        out = orig(self, logits)
        times.append(time.perf_counter() - t0)
        return out

    C.Constraint.mask = timed
    try:
        for _ in range(3):
            times.clear()
            text = m.complete("ROMEO:", max_tokens=steps, temperature=0, json_schema=SCHEMA)
            t = m.last_timings
        plain = m.complete("ROMEO:", max_tokens=steps, temperature=0)
        tp = m.last_timings
    finally:
        C.Constraint.mask = orig
    step = t.gen_s / max(t.gen_tokens, 1)
    print(f"{os.path.basename(m.path)} (n_vocab {m.n_vocab}), 1 thread, {t.gen_tokens} tokens: {text[:60]!r}...")
    print(f"  mask (compute + apply) median {med_us(times):.0f} us, mean {1e6 * np.mean(times):.0f} us per token")
    print(f"  constrained step {1e3 * step:.2f} ms per token; plain greedy {1e3 * tp.gen_s / max(tp.gen_tokens, 1):.2f} ms "
          f"-> the mask is {100 * statistics.median(times) / step:.1f}% of a constrained step")
    del plain


def bench_vocab(path: str, steps: int) -> None:
    from qllama.generation.constrained import Constraint, llg_tokenizer
    from qllama.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    t0 = time.perf_counter()
    llg_tokenizer(tok)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    c = Constraint.from_spec(tok, "json_schema", SCHEMA)
    t_compile = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    mask_t, adv_t = [], []
    out = []
    for _ in range(steps):
        logits = rng.standard_normal(tok.n_vocab).astype(np.float32)
        t0 = time.perf_counter()
        c.mask(logits)
        t1 = time.perf_counter()
        token = int(np.argmax(logits))
        if token in tok.eog_ids:
            break
        c.advance(token)
        t2 = time.perf_counter()
        mask_t.append(t1 - t0)
        adv_t.append(t2 - t1)
        out.append(token)
    print(f"{os.path.basename(path)} (n_vocab {tok.n_vocab}): llguidance tokenizer built in {t_tok:.2f} s "
          f"(once per model), schema compiled in {1e3 * t_compile:.1f} ms")
    print(f"  {len(mask_t)} tokens: mask median {med_us(mask_t):.0f} us (max {1e6 * max(mask_t):.0f}), "
          f"advance median {med_us(adv_t):.0f} us; output {tok.decode(out)[:70]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", default="demo", help="a model reference (default: demo), e.g. the SmolLM2 file")
    ap.add_argument("--vocab", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "vocab",
                                                    "ggml-vocab-llama-bpe.gguf"))
    a = ap.parse_args()
    bench_model(a.steps, a.model)
    if os.path.exists(a.vocab):
        bench_vocab(a.vocab, a.steps)


if __name__ == "__main__":
    main()
