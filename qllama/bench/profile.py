"""`qllama bench --profile`: where a decode token's time goes.

Each Numba kernel call of `steps` one-token steps is timed by kind (`models.decode.KernelClock`,
set on the model): activation quantization, each projection (or each fused group of them),
RMSNorm, the GLU, RoPE + KV store + attention, the embedding, the output projection (logits).
Sampling (llama.cpp's default chain) is timed too. "python overhead" is the rest: the step's
wall time minus every timed call, i.e. the interpreter's work between kernels (and the calls'
own dispatch cost, which the clock sees only partly).

The forward pass runs as generation runs it: fused one-token steps on the int8 path, unless
`fused=False` (the unfused building blocks, one call per matrix: the "before" of issue 15).
The named points of `models/points.py` are not used here: a probe on the model makes every
step take the unfused blocks, which is not what is being measured.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from ..models.base import ATTENTION  # noqa: F401  (the kind attention calls are timed as; a profile key)
from .runner import BenchRunner, random_tokens

SAMPLING = "sampling"
OVERHEAD = "python overhead (wall - timed calls)"


@dataclass
class DecodeProfile:
    """Mean milliseconds per decode step, per kind of call (`ms`, which ends with sampling and the
    Python overhead, and adds up to `total_ms`, the measured wall time per step) and per block
    (`layer_ms`: the timed calls of each layer); `calls` is kernel calls per step by kind."""

    ms: dict[str, float] = field(default_factory=dict)
    layer_ms: dict[int, float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    total_ms: float = 0.0
    steps: int = 0
    depth: int = 0
    threads: int = 0
    weight_bytes: int = 0
    fused: bool = True
    clock_resolution_ms: float = 0.0  # perf_counter's resolution: each timed call may be off by it

    @property
    def calls_per_token(self) -> float:
        return sum(self.calls.values())

    def as_dict(self) -> dict:
        return {"ms_per_token": self.ms, "layer_ms_per_token": {str(k): v for k, v in self.layer_ms.items()},
                "calls_per_token": self.calls, "total_ms": self.total_ms, "steps": self.steps, "depth": self.depth,
                "threads": self.threads, "weight_bytes": self.weight_bytes, "fused": self.fused}


def profile_decode(path: str | os.PathLike, *, steps: int = 32, depth: int = 128, n_threads: int | None = None,
                   batch_size: int = 512, runner: BenchRunner | None = None, type_k: str = "f16",
                   type_v: str = "f16", fused: bool = True) -> DecodeProfile:
    """Time every kernel call of `steps` decode steps (each followed by sampling) after `depth`
    cached tokens; see the module docstring."""
    from ..models.decode import KernelClock
    from ..models.step import Plain, Timed
    from ..generation.sampling import Sampler, SamplingParams

    own = runner is None
    if own:
        runner = BenchRunner(path, n_ctx=depth + steps + 8, batch_size=batch_size, n_threads=n_threads,
                             type_k=type_k, type_v=type_v)
        runner.warmup()
    threads = runner.set_threads(n_threads) if n_threads else runner.set_threads(runner.llm.n_threads)
    runner._ensure_prefix(depth)
    sampler = Sampler(SamplingParams(seed=1))  # llama.cpp's default chain: top-k 40, top-p, min-p, temp 0.8
    model = runner.model
    token = random_tokens(1, runner.n_vocab, seed=3)[0]
    with model.executing(Plain(fused=fused)):
        model.forward([token], runner.cache)  # one untimed step at this depth: nothing below is a first call
    runner.cache.n_past = depth
    clock = KernelClock()
    sample_s = 0.0
    now = time.perf_counter
    try:
        with model.executing(Timed(clock, fused=fused)):  # every kernel call timed (models/step.py)
            t0 = now()
            for _ in range(steps):
                logits = model.forward([token], runner.cache)
                ts = now()
                token = sampler.sample(logits[-1])
                sample_s += now() - ts
            wall = now() - t0
    finally:
        runner.cache.n_past = depth
    per = 1000.0 / steps
    ms = {kind: s * per for kind, s in sorted(clock.seconds.items(), key=lambda kv: -kv[1])}
    calls = {kind: n / steps for kind, n in clock.calls.items()}
    layer_ms: dict[int, float] = {}
    for (il, _), s in clock.per_layer.items():
        if il is not None:
            layer_ms[il] = layer_ms.get(il, 0.0) + s * per
    ms[SAMPLING] = sample_s * per
    total_ms = wall * per
    ms[OVERHEAD] = total_ms - sum(ms.values())  # may be a hair below 0 only through the clock's resolution
    prof = DecodeProfile(ms=ms, layer_ms=dict(sorted(layer_ms.items())), calls=calls, total_ms=total_ms, steps=steps,
                         depth=depth, threads=threads, weight_bytes=_weight_bytes(runner.llm.weights), fused=fused,
                         clock_resolution_ms=1000.0 * time.get_clock_info("perf_counter").resolution)
    if own:
        runner.close()
    return prof


def _weight_bytes(weights) -> int:
    """Bytes of weights one decode step reads (every matrix once, the output projection included)."""
    total = weights.output.nbytes
    for layer in weights.layers:
        for name in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            w = getattr(layer, name, None)  # fused families (phi3) have attn_qkv and no ffn_gate
            total += w.nbytes if w is not None else 0
        moe = getattr(layer, "moe", None)
        if moe is not None:  # a mixture of experts: the router, k of the n experts' slices, the shared expert
            total += moe.router.nbytes + sum(w.nbytes for w in (moe.shared or ()))
            total += sum(t.nbytes for t in (moe.gate, moe.up, moe.down) if t is not None) * moe.n_used // len(moe.up)
    return total


def format_profile(p: DecodeProfile) -> str:
    """Markdown tables: ms per token, share of the step and calls per token, per kind; then per block."""
    tps = 1000.0 / p.total_ms if p.total_ms else 0.0
    gbs = p.weight_bytes / 1e6 / p.total_ms if p.total_ms else 0.0
    lines = [
        f"decode profile ({'fused' if p.fused else 'unfused'} one-token steps): {p.steps} steps after {p.depth} "
        f"cached tokens, {p.threads} threads, {p.total_ms:.2f} ms/token ({tps:.2f} tokens/s), "
        f"{p.calls_per_token:.0f} timed kernel calls/token; weights read per token {p.weight_bytes / 1e9:.3f} GB "
        f"-> {gbs:.1f} GB/s",
        "",
        "| operation | ms/token | share | calls/token |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, v in p.ms.items():
        share = 100.0 * v / p.total_ms if p.total_ms else math.nan
        n = p.calls.get(name)
        lines.append(f"| {name} | {v:.3f} | {share:.1f}% | {'' if n is None else f'{n:.0f}'} |")
    if p.layer_ms:
        lines += ["", "| block | ms/token (timed calls) | share |", "| ---: | ---: | ---: |"]
        for il, v in p.layer_ms.items():
            share = 100.0 * v / p.total_ms if p.total_ms else math.nan
            lines.append(f"| {il} | {v:.3f} | {share:.1f}% |")
    return "\n".join(lines)
