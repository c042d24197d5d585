"""The Llama forward pass (llama.cpp semantics), for batched prefill and one-token decode.

    tokens ──► embedding rows ──► n_layer x [ RMSNorm ─► Q,K,V ─► RoPE ─► cache ─► attention ─► O  (+ residual)
                                              RMSNorm ─► gate, up ─► SwiGLU ─► down               (+ residual) ]
           ──► RMSNorm ──► output (or tied token_embd) ──► logits

The KV cache is kept apart from the weights, so that `Model.logits` can evaluate on a
fresh cache without disturbing a generation in progress.
"""

from __future__ import annotations

import math
import mmap
import time
from dataclasses import dataclass, field

import numpy as np

from .config import ModelArgs
from .errors import QllamaError
from .kernels import llama_ops as ops
from .qtensor import get_threads, quantize_activation
from .weights import LlamaWeights


class KVCache:
    """Keys and values of every layer for up to n_ctx positions, one contiguous float32 array each.

    Keys are stored row-major (a score is a dot with one key row); values are stored d-major
    (`vt`), so that each output component is one long dot over the positions (see
    `llama_ops._attend`). `v` is a (L, Hkv, n_ctx, D) view of it.
    """

    def __init__(self, args: ModelArgs, n_ctx: int):
        self.k = _lazy_zeros((args.n_layer, args.n_head_kv, n_ctx, args.head_dim))  # (L, Hkv, n_ctx, D)
        self.vt = _lazy_zeros((args.n_layer, args.n_head_kv, args.head_dim, n_ctx))  # (L, Hkv, D, n_ctx)
        self.n_ctx = n_ctx
        self.n_past = 0  # positions [0, n_past) hold valid entries

    @property
    def v(self) -> np.ndarray:
        """Values as a (L, Hkv, n_ctx, D) view."""
        return self.vt.transpose(0, 1, 3, 2)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.vt.nbytes


def _lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 zero array whose memory is committed page by page as it is written.

    np.zeros would do that too, but NumPy asks for transparent huge pages on large arrays: the
    first token then commits a 2 MB page in every (layer, head) block, i.e. the whole cache
    (268 MB for a 1B model at n_ctx 4096). An anonymous mmap without huge pages grows with
    the positions actually used.
    """
    nbytes = int(np.prod(shape)) * 4
    try:
        flags = getattr(mmap, "MAP_PRIVATE", None)
        buf = mmap.mmap(-1, nbytes) if flags is None else mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_ANONYMOUS)
        if hasattr(buf, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
            buf.madvise(mmap.MADV_NOHUGEPAGE)
    except (OSError, ValueError, AttributeError):  # no anonymous mmap here: plain zeros
        return np.zeros(shape, dtype=np.float32)
    return np.frombuffer(buf, dtype=np.float32).reshape(shape)


def rope_tables(args: ModelArgs, rope_freqs: np.ndarray | None, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of pos * theta_i for every position and pair i: two (n_ctx, n_rot/2) float32 tables.

    theta_i = base^(-2i/n_rot) / factor_i (Llama 3.1 rope factors), positions divided by the
    linear scaling factor. Computed in float64, then rounded once.
    """
    half = args.n_rot // 2
    inv_freq = args.rope_freq_base ** (-np.arange(half, dtype=np.float64) * 2.0 / args.n_rot)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.astype(np.float64)
    pos = np.arange(n_ctx, dtype=np.float64) / args.rope_scale
    angles = np.outer(pos, inv_freq)  # (n_ctx, half)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@dataclass
class ForwardStats:
    """Accumulated wall time per operation (seconds), filled when profiling is on."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, dt: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + dt


class _Marker:
    """Adds the time since the previous mark to a ForwardStats entry (profiling only)."""

    __slots__ = ("stats", "last")

    def __init__(self, stats: ForwardStats):
        self.stats = stats
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.stats.add(name, now - self.last)
        self.last = now


class LlamaModel:
    """Forward pass over a KVCache. `forward` takes a batch of tokens at consecutive positions."""

    def __init__(self, args: ModelArgs, weights: LlamaWeights, n_ctx: int):
        self.args = args
        self.weights = weights
        self.n_ctx = n_ctx
        self.rope_cos, self.rope_sin = rope_tables(args, weights.rope_freqs, n_ctx)
        self.profile: ForwardStats | None = None  # set to a ForwardStats to time each op

    def new_cache(self) -> KVCache:
        return KVCache(self.args, self.n_ctx)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` at positions cache.n_past.. and append them to the cache.

        Returns logits float32: (T, n_vocab) if all_logits, else (1, n_vocab) for the last token.
        """
        a = self.args
        tokens = np.asarray(tokens, dtype=np.int64)
        n_tok = tokens.shape[0]
        start = cache.n_past
        if n_tok == 0:
            raise QllamaError("forward needs at least one token")
        if start + n_tok > cache.n_ctx:
            raise QllamaError(f"context overflow: {start} + {n_tok} tokens > n_ctx {cache.n_ctx}")
        if tokens.min() < 0 or tokens.max() >= a.n_vocab:
            raise QllamaError(f"token id out of range [0, {a.n_vocab})")
        mark = _Marker(self.profile) if self.profile is not None else None

        x = self.weights.token_embd.dequantize(tokens)  # (T, n_embd) residual stream
        x = np.ascontiguousarray(x, dtype=np.float32)
        h = np.empty_like(x)  # (T, n_embd) normed input of each sub-layer
        attn_out = np.empty((n_tok, a.n_head, a.head_dim), dtype=np.float32)  # (T, H, D)
        scale = np.float32(1.0 / math.sqrt(a.head_dim))
        # decode-sized work runs on this thread: waking the pool would cost more than it saves
        swiglu = ops.swiglu if n_tok > 1 else ops.swiglu_serial
        parallel = ops.attention_parallel_pays(n_tok, start, a.n_head, get_threads())
        attention = ops.attention if parallel else ops.attention_serial
        if mark:
            mark("embedding")

        for il, layer in enumerate(self.weights.layers):
            ops.rmsnorm(x, layer.attn_norm, a.rms_eps, h)
            if mark:
                mark("rmsnorm")
            hq = quantize_activation(h)  # quantized once (int8 path) for Q, K and V
            q = project(layer.attn_q, hq).reshape(n_tok, a.n_head, a.head_dim)  # (T, H, D)
            if mark:
                mark("matvec attn_q (+quantize x)")
            k = project(layer.attn_k, hq).reshape(n_tok, a.n_head_kv, a.head_dim)  # (T, Hkv, D)
            if mark:
                mark("matvec attn_k")
            v = project(layer.attn_v, hq).reshape(n_tok, a.n_head_kv, a.head_dim)  # (T, Hkv, D)
            if mark:
                mark("matvec attn_v")
            ops.rope_store(q, k, v, start, self.rope_cos, self.rope_sin, cache.k[il], cache.vt[il])
            if mark:
                mark("rope + kv store")
            attention(q, cache.k[il], cache.vt[il], start, a.n_rep, scale, attn_out)
            if mark:
                mark("attention")
            x += project(layer.attn_output, quantize_activation(attn_out.reshape(n_tok, a.n_embd)))
            if mark:
                mark("matvec attn_output (+quantize x, residual)")
            ops.rmsnorm(x, layer.ffn_norm, a.rms_eps, h)
            if mark:
                mark("rmsnorm")
            hq = quantize_activation(h)  # shared by gate and up
            gate = project(layer.ffn_gate, hq)  # (T, n_ff)
            if mark:
                mark("matvec ffn_gate (+quantize x)")
            up = project(layer.ffn_up, hq)  # (T, n_ff)
            if mark:
                mark("matvec ffn_up")
            swiglu(gate, up, gate)
            if mark:
                mark("swiglu")
            x += project(layer.ffn_down, quantize_activation(gate))
            if mark:
                mark("matvec ffn_down (+quantize x, residual)")

        cache.n_past = start + n_tok
        rows = x if all_logits else x[-1:]
        hn = np.empty_like(rows)
        ops.rmsnorm(np.ascontiguousarray(rows), self.weights.output_norm, a.rms_eps, hn)
        if mark:
            mark("rmsnorm")
        logits = project(self.weights.output, quantize_activation(hn))
        if mark:
            mark("matvec output (+quantize x)")
        return logits


def project(w, act) -> np.ndarray:
    """(T, in) activations (an Activation, quantized once when shared) -> (T, out) float32.
    One token takes the mat-vec (decode) kernel, a batch the mat-mat (prefill) kernel."""
    if act.n_tok == 1:
        return w.matvec(act).reshape(1, -1)
    return w.matmul(act)
