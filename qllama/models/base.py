"""Building blocks shared by every architecture: named weights, RoPE tables, and `Transformer`,
whose methods (norm, qkv, attend, out_proj, ffn) each family's `block` composes in its order.

    tokens ──► embedding rows ──► n_layer x block(...) ──► RMSNorm ──► output ──► logits

A forward pass takes one or more *segments*: token runs, each continuing its own KVCache at
its n_past. The projections run as one mat-mat over all segments' tokens (one pass over the
weights); RoPE, the cache store and attention run per segment. `forward(tokens, cache)` is
the one-segment case.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import QllamaError, UnsupportedError
from ..gguf.reader import GGUFFile
from ..qtensor import QTensor, int8_enabled, quantize_activation, resolve_threads, set_threads
from .args import ModelArgs, read_common_args
from .decode import MAX_ROWS
from .kvcache import SWA_BATCH, KVCache
from .nonfinite import locate as locate_nonfinite
from .points import attention_numpy
from .step import PLAIN, Execution, Step

if TYPE_CHECKING:
    from .moe import MoeFFN

ATTENTION = "rope + kv store + attention"  # the kind a Timed step gives an attention call
ACT_SILU = 0  # gated FFN activations, as kernels.layer_ops numbers them
ACT_GELU = 1


class _Kernels:
    """`ops`: kernels.layer_ops, imported on first use. Importing it imports Numba (~1.5 s), which
    `qllama inspect` (it reads ModelArgs through this package) never needs. The first access
    replaces this placeholder by the module itself, so the forward pass pays nothing."""

    def __getattr__(self, name: str):
        from ..kernels import layer_ops

        globals()["ops"] = layer_ops
        return getattr(layer_ops, name)


ops = _Kernels()


# -- weights --------------------------------------------------------------------------------


@dataclass
class LayerWeights:
    """One block's tensors, named after the GGUF tensors (`blk.N.attn_q.weight` -> `attn_q`).

    Matrices are QTensors in GGUF order (ne0 = input dim); vectors are float32 arrays. A
    family fills what it has; None means absent.
    """

    attn_norm: np.ndarray  # (n_embd,)
    attn_output: QTensor  # [q_dim, n_embd]
    ffn_norm: np.ndarray  # (n_embd,)
    ffn_up: QTensor | None  # [n_embd, n_ff], or [n_embd, 2 n_ff] gate|up fused (phi3); None in an MoE layer
    ffn_down: QTensor | None  # [n_ff, n_embd]; None in an MoE layer
    ffn_gate: QTensor | None = None  # [n_embd, n_ff]; None when fused into ffn_up
    attn_q: QTensor | None = None  # [n_embd, q_dim]
    attn_k: QTensor | None = None  # [n_embd, kv_dim]
    attn_v: QTensor | None = None  # [n_embd, kv_dim]
    attn_qkv: QTensor | None = None  # [n_embd, q_dim + 2 kv_dim] fused Q|K|V (phi3), instead of the three
    attn_q_b: np.ndarray | None = None  # (q_dim,) biases (qwen2)
    attn_k_b: np.ndarray | None = None  # (kv_dim,)
    attn_v_b: np.ndarray | None = None  # (kv_dim,)
    attn_q_norm: np.ndarray | None = None  # (head_dim,) per-head RMSNorm before RoPE (qwen3, gemma3)
    attn_k_norm: np.ndarray | None = None  # (head_dim,)
    post_attention_norm: np.ndarray | None = None  # (n_embd,) (gemma2/3)
    post_ffw_norm: np.ndarray | None = None  # (n_embd,) (gemma2/3)
    moe: "MoeFFN | None" = None  # a mixture of experts instead of ffn_gate/up/down (models/moe.py; those are None)


@dataclass
class Weights:
    token_embd: QTensor  # [n_embd, n_vocab]: rows are dequantized on demand
    output_norm: np.ndarray  # (n_embd,) float32
    output: QTensor  # [n_embd, n_vocab]; is token_embd when the file ties them
    tied_output: bool
    layers: list[LayerWeights]
    rope_freqs: np.ndarray | None = None  # (n_rot/2,) frequency divisors (Llama 3.1+)
    rope_factors_long: np.ndarray | None = None  # (n_rot/2,) LongRoPE divisors (phi3), chosen by context
    rope_factors_short: np.ndarray | None = None


class WeightReader:
    """Reads named tensors from a GGUF file, checking type and shape."""

    def __init__(self, gf: GGUFFile):
        self.gf = gf

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def vector(self, name: str, length: int) -> np.ndarray:
        info = self.gf.tensors.get(name)
        if info is None:
            raise QllamaError(f"missing tensor {name!r}")
        if info.type_name not in ("f32", "f16", "bf16") or info.n_elements != length:
            raise UnsupportedError(f"tensor {name!r} should be a float vector of {length}, got {info.type_name} {list(info.shape)}")
        arr = self.gf.tensor_array(name).reshape(length)
        if info.type_name == "bf16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return np.ascontiguousarray(arr, dtype=np.float32)

    def matrix(self, name: str, ne0: int, ne1: int) -> QTensor:
        if name not in self.gf.tensors:
            raise QllamaError(f"missing tensor {name!r}")
        shape = self.gf.tensors[name].shape
        if tuple(shape) != (ne0, ne1):
            raise QllamaError(f"tensor {name!r} has shape {list(shape)}, expected {[ne0, ne1]}")
        return QTensor.from_gguf(self.gf, name)

    def optional_vector(self, name: str, length: int) -> np.ndarray | None:
        return self.vector(name, length) if self.has(name) else None

    def layer(self, i: int, a: ModelArgs, *, fused_ffn: bool = False, qk_norm: bool = False,
              post_norms: bool = False, dense_ffn: bool = True) -> LayerWeights:
        """The tensors of block i, as llama.cpp's create_tensor_qkv and the family loaders read
        them: a fused attn_qkv or attn_q/k/v, each with an optional bias. dense_ffn False: no
        ffn_gate/up/down (a mixture-of-experts layer; models/moe.py reads its tensors)."""
        p = f"blk.{i}."
        d, qd, kv, ff = a.n_embd, a.q_dim, a.kv_dim, a.n_ff
        lw = LayerWeights(
            attn_norm=self.vector(p + "attn_norm.weight", d),
            attn_output=self.matrix(p + "attn_output.weight", qd, d),
            ffn_norm=self.vector(p + "ffn_norm.weight", d),
            ffn_up=self.matrix(p + "ffn_up.weight", d, 2 * ff if fused_ffn else ff) if dense_ffn else None,
            ffn_down=self.matrix(p + "ffn_down.weight", ff, d) if dense_ffn else None,
        )
        if not fused_ffn and dense_ffn:
            lw.ffn_gate = self.matrix(p + "ffn_gate.weight", d, ff)
        if self.has(p + "attn_qkv.weight"):
            lw.attn_qkv = self.matrix(p + "attn_qkv.weight", d, qd + 2 * kv)
            if self.has(p + "attn_qkv.bias"):
                b = self.vector(p + "attn_qkv.bias", qd + 2 * kv)
                lw.attn_q_b, lw.attn_k_b, lw.attn_v_b = b[:qd], b[qd : qd + kv], b[qd + kv :]
        else:
            lw.attn_q = self.matrix(p + "attn_q.weight", d, qd)
            lw.attn_k = self.matrix(p + "attn_k.weight", d, kv)
            lw.attn_v = self.matrix(p + "attn_v.weight", d, kv)
        if lw.attn_q_b is None:
            lw.attn_q_b = self.optional_vector(p + "attn_q.bias", qd)
            lw.attn_k_b = self.optional_vector(p + "attn_k.bias", kv)
            lw.attn_v_b = self.optional_vector(p + "attn_v.bias", kv)
        if qk_norm:
            lw.attn_q_norm = self.vector(p + "attn_q_norm.weight", a.head_dim)
            lw.attn_k_norm = self.vector(p + "attn_k_norm.weight", a.head_dim)
        if post_norms:
            lw.post_attention_norm = self.vector(p + "post_attention_norm.weight", d)
            lw.post_ffw_norm = self.vector(p + "post_ffw_norm.weight", d)
        return lw

    def model(self, a: ModelArgs, layers: list[LayerWeights], *, own_output: bool = True) -> Weights:
        """Embedding, final norm and output: `output.weight`, or the embedding when the file has
        none (tied), or always the embedding when own_output is False (gemma2, as llama.cpp)."""
        token_embd = self.matrix("token_embd.weight", a.n_embd, a.n_vocab)
        tied = not (own_output and self.has("output.weight"))
        output = token_embd if tied else self.matrix("output.weight", a.n_embd, a.n_vocab)
        return Weights(token_embd=token_embd, output_norm=self.vector("output_norm.weight", a.n_embd),
                       output=output, tied_output=tied, layers=layers)


# -- RoPE -----------------------------------------------------------------------------------


def rope_tables(n_rot: int, base: float, scale: float, factors: np.ndarray | None, attn_factor: float,
                n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of pos * theta_i for every position and pair i: two (n_ctx, n_rot/2) float32 tables.

    theta_i = base^(-2i/n_rot) / factor_i (Llama 3.1 / LongRoPE factors), positions divided by
    the linear scaling factor, both multiplied by attn_factor (llama.cpp's mscale). Computed in
    float64, then rounded once.
    """
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    if factors is not None:
        inv_freq = inv_freq / factors.astype(np.float64)
    pos = np.arange(n_ctx, dtype=np.float64) / scale
    angles = np.outer(pos, inv_freq)  # (n_ctx, half)
    cos, sin = np.cos(angles), np.sin(angles)
    if attn_factor != 1.0:
        cos, sin = cos * attn_factor, sin * attn_factor
    return cos.astype(np.float32), sin.astype(np.float32)


# -- the forward pass -----------------------------------------------------------------------


@dataclass
class Segment:
    """One token run of a forward pass: rows [lo, hi) of the batch, at positions start.. of cache."""

    cache: KVCache
    start: int
    lo: int
    hi: int


class Transformer:
    """A decoder-only transformer over KV caches. Subclasses (one per architecture) define
    `read_args`, `load_weights` and `block`, and may override `embed` and `final_logits`."""

    arch = ""

    def __init__(self, args: ModelArgs, weights: Weights, n_ctx: int, batch: int = SWA_BATCH):
        self.args = args
        self.weights = weights
        self.n_ctx = n_ctx
        self.batch = batch  # ring slots of window layers beyond the window
        # how forward rounds run (models/step.py): plain, timed, probed (hooks, traces), unchecked;
        # set through `executing` or by the hooks' registry (points.Probe)
        self.execution: Execution = PLAIN
        self.step: Step | None = None  # the running round's Step (None between rounds)
        self.n_threads = resolve_threads(None)  # a round's threads when its caller names none (qllama.load sets it)
        self._plan = None  # decode.DecodePlan, built on the first fused step (False: the model has none)
        self._scale = np.float32(args.attn_scale)  # kernel arguments, converted once
        self._softcap = np.float32(args.attn_softcap)
        self._window = [args.n_swa if args.is_swa(il) else 0 for il in range(args.n_layer)]
        tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        factors = self.rope_factors(n_ctx)
        self.rope: list[tuple[np.ndarray, np.ndarray]] = []  # per layer: (cos, sin) (n_ctx, n_rot/2)
        for il in range(args.n_layer):
            base, scale = (args.rope_freq_base_swa, args.rope_scale_swa) if args.is_swa(il) else (args.rope_freq_base, args.rope_scale)
            if (base, scale) not in tables:
                tables[base, scale] = rope_tables(args.n_rot, base, scale, factors, args.rope_attn_factor, n_ctx)
            self.rope.append(tables[base, scale])

    # -- families fill these in --

    # A family's traits; the defaults below read and load a llama-shaped model with them.
    rope_neox = False  # RoPE on NeoX halves (x[i], x[i + n_rot/2]) instead of interleaved pairs
    layer_tensors: dict = {}  # options of WeightReader.layer: qk_norm, post_norms, fused_ffn
    own_output = True  # False: the output is always the embedding, even if the file has output.weight

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        """The keys every architecture shares (`args.read_common_args`); families add their own."""
        return read_common_args(md, cls.arch, neox=cls.rope_neox)

    @classmethod
    def load_weights(cls, gf: GGUFFile, args: ModelArgs) -> Weights:
        """Every block's tensors (with the family's `layer_tensors`), embedding, final norm, output."""
        r = WeightReader(gf)
        layers = [r.layer(i, args, **cls.layer_tensors) for i in range(args.n_layer)]
        return r.model(args, layers, own_output=cls.own_output)

    def block(self, il: int, layer: LayerWeights, x: np.ndarray, batch: list[Segment]) -> np.ndarray:
        """One layer: x (T, n_embd) residual stream in, residual stream out (may be updated in place)."""
        raise NotImplementedError

    def rope_factors(self, n_ctx: int) -> np.ndarray | None:
        """Per-frequency RoPE divisors (n_rot/2,) or None: `rope_freqs.weight` when the file has it."""
        return self.weights.rope_freqs

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(T,) token ids -> (T, n_embd) float32 rows of the embedding."""
        return np.ascontiguousarray(self.weights.token_embd.dequantize(tokens), dtype=np.float32)

    def final_logits(self, logits: np.ndarray) -> np.ndarray:
        """Post-processing of the output projection (Gemma's final softcap)."""
        return logits

    # -- caches and entry points --

    kv_types = ("f16", "f16")  # (type_k, type_v) of new caches: llama.cpp's default; `qllama.load` sets it
    q_prescaled = False  # llama.cpp's graph scales Q before attention (Gemma, Phi-3): with f16 keys, rounded after

    def new_cache(self) -> KVCache:
        a = self.args
        windows = [a.n_swa if a.is_swa(il) else 0 for il in range(a.n_layer)]
        return KVCache(a.n_layer, a.n_head_kv, a.head_dim, self.n_ctx, windows, self.batch, *self.kv_types)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False, n_threads: int | None = None,
                prompt: bool = False) -> np.ndarray:
        """Run `tokens` at positions cache.n_past.. and append them to the cache, on `n_threads`
        threads (None: `self.n_threads`). prompt: the tokens are (part of) a prompt of
        qtensor.PROMPT_MIN_TOKENS or more, whose rows take llama.cpp's prompt arithmetic where it
        differs from its decode (`step.project`); else (generated tokens, drafts to verify, short
        prompts) each row equals a one-token step's bit for bit.

        Returns logits float32: (T, n_vocab) if all_logits, else (1, n_vocab) for the last token.
        """
        tokens = self._check(tokens, cache)
        if tokens.shape[0] <= cache.max_batch:  # the common case, without forward_many's bookkeeping
            return self._forward_round([(tokens, cache)], [True], all_logits, n_threads, prompt)[0]
        return self.forward_many([(tokens, cache)], all_logits, n_threads, prompt)[0]

    def _check(self, tokens, cache: KVCache) -> np.ndarray:
        """Token ids as an int64 array, checked against the vocabulary and the cache's room."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.shape[0] == 0:
            raise QllamaError("forward needs at least one token")
        if cache.n_past + tokens.shape[0] > cache.n_ctx:
            raise QllamaError(f"context overflow: {cache.n_past} + {tokens.shape[0]} tokens > n_ctx {cache.n_ctx}")
        if tokens.min() < 0 or tokens.max() >= self.args.n_vocab:
            raise QllamaError(f"token id out of range [0, {self.args.n_vocab})")
        return tokens

    def forward_many(self, segments: Sequence[tuple[Sequence[int], KVCache]], all_logits: bool = False,
                     n_threads: int | None = None, prompt: "bool | Sequence[bool]" = False) -> list[np.ndarray]:
        """Run several token runs, each at its own cache's n_past, in one pass over the weights.
        prompt: whether the runs are prompts' (all, or one flag per segment; see `forward`).

        Returns one logits array per segment: (T_i, n_vocab) if all_logits, else (1, n_vocab).
        Runs longer than a cache's max_batch are evaluated in rounds.

        A server step (one token of each of k streams) is one k-row batch: every projection reads
        its weights once for all rows (up to decode.MAX_ROWS rows through the fused calls of
        models/decode.py, which run each type's n-token row kernel; more rows the gemm, where the
        type has one), attention runs per segment over its own cache, and each row equals that
        stream's one-token step bit for bit (tests/test_multi_sequence.py).
        """
        runs = [(self._check(tokens, cache), cache) for tokens, cache in segments]
        prompts = [bool(prompt)] * len(runs) if isinstance(prompt, bool) else [bool(p) for p in prompt]
        if len(prompts) != len(runs):
            raise QllamaError(f"{len(prompts)} prompt flags for {len(runs)} segments")
        if len({id(c) for _, c in runs}) != len(runs):
            raise QllamaError("each segment of a forward pass needs its own cache")

        outs: list[list[np.ndarray]] = [[] for _ in runs]
        done = [0] * len(runs)
        while True:
            part = [(i, r[0][done[i] : done[i] + r[1].max_batch], r[1]) for i, r in enumerate(runs) if done[i] < len(r[0])]
            if not part:
                break
            want = [all_logits or done[i] + len(t) == len(runs[i][0]) for i, t, _ in part]
            flags = [prompts[i] for i, _, _ in part]
            logits = self._forward_round([(t, c) for _, t, c in part], want, all_logits, n_threads,
                                         flags[0] if len(set(flags)) == 1 else flags)
            for (i, t, _), lg in zip(part, logits):
                done[i] += len(t)
                if lg is not None:
                    outs[i].append(lg)
        return [o[0] if len(o) == 1 else np.concatenate(o) for o in outs]

    def _forward_round(self, runs, want: list[bool], all_logits: bool, n_threads: int | None,
                       prompt: "bool | list[bool]" = False) -> list[np.ndarray | None]:
        n_rows = sum(t.shape[0] for t, _ in runs)
        if not self.prompt_kernels:  # (no matrix rounds a prompt differently: the round as any other)
            prompt = False
        elif not isinstance(prompt, bool):  # one flag per run -> one per row
            prompt = np.repeat(np.array(prompt, bool), [t.shape[0] for t, _ in runs])
        n_threads = n_threads or self.n_threads
        set_threads(n_threads)  # Numba's count for this calling thread; kernels also receive it explicitly
        step = self.execution.step(self, n_threads, n_rows, prompt)  # the way this round runs
        self.step = step
        try:
            return self._round(runs, want, all_logits, step)
        finally:
            self.step = None
            step.end()

    @contextlib.contextmanager
    def executing(self, execution: Execution):
        """Run the forward rounds inside the block with `execution` (models/step.py)."""
        before = self.execution
        self.execution = execution
        try:
            yield self
        finally:
            self.execution = before

    @functools.cached_property
    def prompt_kernels(self) -> bool:
        """Whether a matrix of the model takes llama.cpp's prompt arithmetic for a prompt's rows
        (`QTensor.matmul(prompt=...)`): q4_K, q6_K, iq4_xs, iq3_s or iq2_xxs."""
        from ..kernels.int8 import PROMPT_TYPES

        w = self.weights
        mats = [w.output] + [v for layer in w.layers for v in vars(layer).values() if isinstance(v, QTensor)]
        return any(m.type_id in PROMPT_TYPES for m in mats)

    def fused_state(self, n_rows: int = 1, max_rows: int | None = None):
        """A decode.DecodeState for a round of n_rows tokens on the fused kernels, or None (more
        than max_rows rows (None: decode.MAX_ROWS), the float path, or a matrix type without
        fused kernels)."""
        if n_rows > (max_rows or MAX_ROWS) or not int8_enabled():
            return None
        plan = self._plan if self._plan is not None else self._build_plan()
        return plan.acquire(n_rows) if plan else None

    def release_fused(self, state) -> None:
        self._plan.release(state)

    def _build_plan(self):
        from .decode import DecodePlan

        a = self.args
        self._plan = DecodePlan.build(self.weights, a.n_embd, a.q_dim, a.kv_dim, a.n_ff) or False
        return self._plan

    def _round(self, runs, want: list[bool], all_logits: bool, step: Step) -> list[np.ndarray | None]:
        batch, off = [], 0
        for tokens, cache in runs:
            batch.append(Segment(cache, cache.n_past, off, off + len(tokens)))
            off += len(tokens)
        tokens = runs[0][0] if len(runs) == 1 else np.concatenate([t for t, _ in runs])
        x = step.point("embed", step.op("embedding", self.embed, tokens))  # (T, n_embd)
        for il, layer in enumerate(self.weights.layers):
            step.il = il
            x = step.point("resid", self.block(il, layer, x, batch))
        step.il = None
        for seg in batch:
            seg.cache.stored(seg.start, seg.hi - seg.lo)
            seg.cache.n_past = seg.start + seg.hi - seg.lo

        # rows whose logits are wanted: every row, or the last of each segment
        if len(batch) == 1:
            picked = slice(None) if all_logits else slice(-1, None)
        else:
            pick = [np.arange(s.lo, s.hi) if all_logits else np.array([s.hi - 1]) for s, w in zip(batch, want) if w]
            picked = np.concatenate(pick) if pick else slice(0, 0)
        rows = x[picked]
        result: list[np.ndarray | None] = [None] * len(batch)
        if rows.shape[0] == 0:
            return result
        hn = step.point("result_norm", self.norm(np.ascontiguousarray(rows), self.weights.output_norm))
        logits = step.fused.logits(hn, step.n_threads, step.clock) if step.fused is not None else None
        if logits is None:
            # Only the last row of each segment: decode's rounding, as llama.cpp's output mat-mul of
            # one row per sequence takes its vec_dot (and packing the whole output matrix for its
            # prompt kernel cost 50 ms a prompt, q6_K 128256 x 2048). Every row (perplexity): a
            # prompt's rows take its prompt arithmetic, as llama.cpp's mat-mul of 8+ rows does.
            logits = step.project("output (logits)", self.weights.output, quantize_activation(hn), picked,
                                  as_decode=not all_logits)
        logits = step.point("logits", self.final_logits(logits))
        if step.checks and not np.isfinite(logits).all():  # one pass over the returned rows
            seg = next((s for s in batch if not np.isfinite(x[s.lo : s.hi]).all()), batch[0])
            raise locate_nonfinite(self, tokens[seg.lo : seg.hi], seg.cache, seg.start)
        r = 0
        for i, (seg, w) in enumerate(zip(batch, want)):
            if w:
                n = seg.hi - seg.lo if all_logits else 1
                result[i] = logits[r : r + n]
                r += n
        return result

    # -- building blocks for `block` --

    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """RMSNorm of each row: (T, d) -> new (T, d)."""
        out = np.empty_like(x)
        self.step.op("rmsnorm", ops.rmsnorm, x, weight, self.args.rms_eps, out)
        return out

    def qkv(self, layer: LayerWeights, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q (T, H, D), K and V (T, Hkv, D) from the normed input h (T, n_embd): separate or
        fused projections, plus biases when the file has them."""
        a, step = self.args, self.step
        n_tok = h.shape[0]
        h = step.point("attn_norm", h)
        if step.fused is not None:  # one fused call (per activation form): buffers of the step
            q, k, v = step.fused.qkv(step.il, h, step.n_threads, step.clock)
        elif layer.attn_qkv is not None:
            qkv = step.project("attn_qkv", layer.attn_qkv, quantize_activation(h))  # (T, q_dim + 2 kv_dim)
            q = qkv[:, : a.q_dim]
            k = qkv[:, a.q_dim : a.q_dim + a.kv_dim]
            v = qkv[:, a.q_dim + a.kv_dim :]
        else:
            hq = quantize_activation(h)  # quantized once (int8 path) for Q, K and V
            q = step.project("attn_q", layer.attn_q, hq)  # (T, q_dim)
            k = step.project("attn_k", layer.attn_k, hq)  # (T, kv_dim)
            v = step.project("attn_v", layer.attn_v, hq)  # (T, kv_dim)
        if layer.attn_q_b is not None:
            q = q + layer.attn_q_b
            k = k + layer.attn_k_b
            v = v + layer.attn_v_b
        shape_q, shape_kv = (n_tok, a.n_head, a.head_dim), (n_tok, a.n_head_kv, a.head_dim)
        return (np.ascontiguousarray(q).reshape(shape_q), np.ascontiguousarray(k).reshape(shape_kv),
                np.ascontiguousarray(v).reshape(shape_kv))

    def head_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """RMSNorm over each head's D values, in place: x (T, heads, D), weight (D,)."""
        flat = x.reshape(-1, x.shape[2])
        self.step.op("rmsnorm (q/k heads)", ops.rmsnorm, flat, weight, self.args.rms_eps, flat)
        return x

    def attend(self, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: list[Segment]) -> np.ndarray:
        """RoPE on q and k, k and v into each segment's cache, attention: -> (T, H * D)."""
        return self.step.op(ATTENTION, self._attend, il, q, k, v, batch)

    def _attend(self, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: list[Segment]) -> np.ndarray:
        a, step = self.args, self.step
        n_tok = q.shape[0]
        cos, sin = self.rope[il]
        window, softcap, scale, n_threads = self._window[il], self._softcap, self._scale, step.n_threads
        out = np.empty((n_tok, a.n_head, a.head_dim), dtype=np.float32)  # (T, H, D)
        one = len(batch) == 1
        for seg in batch:
            c = seg.cache
            qs = q if one else q[seg.lo : seg.hi]
            ks = k if one else k[seg.lo : seg.hi]
            vs = v if one else v[seg.lo : seg.hi]
            os_ = out if one else out[seg.lo : seg.hi]
            if c.blocks:  # a quantized KV cache: rows stored as blocks (kernels/attention_quant.py)
                from ..kernels import attention_quant as aq

                aq.rope_store_quant(qs, ks, vs, seg.start, cos, sin, c.kb[il], c.vb[il], a.rope_neox, *c.type_ids)
            else:
                ops.rope_store(qs, ks, vs, seg.start, cos, sin, c.kt[il], c.vt[il], a.rope_neox)
            qs = step.attention_inputs(qs, c.k[il], c.vt[il], seg.start)  # the points attn_q/k/v (after RoPE)
            if step.wants("attn_scores") or step.wants("attn_probs"):  # they need the NumPy path
                os_[...] = attention_numpy(step.probe, il, qs, c.k[il], c.vt[il], seg.start, a.n_rep, scale, window,
                                           softcap, self.q_prescaled)
                continue
            # decode-sized work runs on this thread: waking the pool would cost more than it saves
            parallel = ops.attention_parallel_pays(seg.hi - seg.lo, seg.start, a.n_head, n_threads)
            if c.blocks:  # attention reads the blocks directly, as llama.cpp's flash attention
                attention = aq.attention_quant if parallel else aq.attention_quant_serial
                attention(qs, c.kb[il], c.vb[il], *c.type_ids, seg.start, a.n_rep, scale, window, softcap, self.q_prescaled, os_)
                continue
            attention = ops.attention if parallel else ops.attention_serial
            attention(qs, c.kt[il], c.vt[il], seg.start, a.n_rep, scale, window, softcap, self.q_prescaled, os_)
        return out.reshape(n_tok, a.q_dim)

    def out_proj(self, layer: LayerWeights, attn: np.ndarray) -> np.ndarray:
        """The attention output projection: (T, q_dim) -> (T, n_embd)."""
        a, step = self.args, self.step
        attn = step.point("attn_z", attn.reshape(-1, a.n_head, a.head_dim)).reshape(-1, a.q_dim)
        if step.fused is not None:
            y = step.fused.out_proj(step.il, attn, step.n_threads, step.clock)
        else:
            y = step.project("attn_output", layer.attn_output, quantize_activation(attn))
        return step.point("attn_out", y)

    def ffn(self, layer: LayerWeights, h: np.ndarray, act: int) -> np.ndarray:
        """Gated FFN: down(act(gate h) * up h), (T, n_embd) -> (T, n_embd). act: ACT_SILU or ACT_GELU.
        A fused ffn_up holds gate|up (gate first, as llama.cpp's swiglu splits it)."""
        step, n_ff = self.step, self.args.n_ff
        h = step.point("ffn_in", h)
        if layer.moe is not None:  # a mixture of experts (models/moe.py)
            return layer.moe.forward(self, h, act)
        if step.fused is not None:  # gate|up, GLU and down in one fused call
            return step.fused.ffn(step.il, h, act, step.n_threads, step.clock)
        hq = quantize_activation(h)  # shared by gate and up
        if layer.ffn_gate is None:
            gu = step.project("ffn_gate|up", layer.ffn_up, hq)  # (T, 2 n_ff)
            gate, up = np.ascontiguousarray(gu[:, :n_ff]), np.ascontiguousarray(gu[:, n_ff:])
        else:
            gate = step.project("ffn_gate", layer.ffn_gate, hq)  # (T, n_ff)
            up = step.project("ffn_up", layer.ffn_up, hq)  # (T, n_ff)
        step.op("glu", ops.glu, gate, up, gate, act)
        gate = step.point("ffn_act", gate)
        y = step.project("ffn_down", layer.ffn_down, quantize_activation(gate))
        return step.point("ffn_out", y)
