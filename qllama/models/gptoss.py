"""`gpt-oss` (gpt-oss-20b, gpt-oss-120b): llama.cpp's src/models/openai-moe-iswa.cpp.

    h    = RMSNorm(x) attn_norm
    q, k, v = h W_{q,k,v} + b_{q,k,v}; NeoX RoPE with YaRN scaling (below) on q and k
    attn = softmax over [q.k / sqrt(head_dim) ..., sink_h] (attention sinks: one learnt logit per
           head in the max and the denominator, with no value), windowed on even layers
           (`attention.sliding_window`, pattern 2: layer il is windowed when il % 2 == 0)
    x    = x + attn W_o + b_o
    h    = RMSNorm(x) post_attention_norm                   (the file has no ffn_norm)
    x    = x + MoE(h)

The MoE (llama.cpp's build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT and
LLM_FFN_SWIGLU_OAI_MOE): router logits = h W_r + b_r; the top k *logits* (ties to the lower
id); their weights = softmax over those k logits; each chosen expert
    g = h G_e + bg_e, u = h U_e + bu_e
    a = min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)      (ggml_swiglu_oai)
    y = a D_e + bd_e
and the output is the weighted sum of the k experts' y. Expert biases are 2-D tensors
`ffn_{gate,up}_exps.bias` [n_ff_exp, n_expert], `ffn_down_exps.bias` [n_embd, n_expert]; the
router's `ffn_gate_inp.bias` [n_expert]. The experts are MXFP4 in the published files.

YaRN RoPE (ggml's rope_yarn, `rope.scaling.type` "yarn"): freq_scale = 1 / rope.scaling.factor,
ext_factor 1, beta_fast 32, beta_slow 1 (llama.cpp's defaults), n_ctx_orig =
rope.scaling.original_context_length; pair i's angle mixes the interpolated and extrapolated
frequencies with the ramp between the correction dimensions, and cos/sin are scaled by
attn_factor * (1 + 0.1 ln(1 / freq_scale)).

Attention runs in the Numba attention kernels with the sinks (`kernels.layer_ops.attention`,
`sinks=`); with a quantized KV cache, and when hooks read the attention scores, in NumPy (one
query at a time, or `points.attention_numpy` with `sinks`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..errors import UnsupportedError
from .args import Keys, ModelArgs, read_common_args, swa_pattern
from .base import ACT_SILU, LayerWeights, Transformer, WeightReader, ops
from .moe import ExpertTensor, MoeFFN, read_moe_args
from .kvcache import from_f32, is_blocks, query_as_keys, to_f32
from .points import attention_numpy

YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's cparams defaults


def yarn_rope_tables(n_rot: int, base: float, freq_scale: float, n_ctx_orig: int, attn_factor: float,
                     n_ctx: int, ext_factor: float = 1.0, beta_fast: float = YARN_BETA_FAST,
                     beta_slow: float = YARN_BETA_SLOW) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n_ctx, n_rot/2) float32 of ggml's rope_yarn at every position, in float64,
    rounded once."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    extrap = base ** (-2.0 * i / n_rot)  # theta_extrap / pos
    mscale = attn_factor
    inv = extrap * freq_scale  # theta_interp / pos
    if ext_factor != 0.0:
        def corr_dim(n_rot_turns: float) -> float:
            return n_rot * math.log(n_ctx_orig / (n_rot_turns * 2 * math.pi)) / (2 * math.log(base))

        low = max(0.0, math.floor(corr_dim(beta_fast)))
        high = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
        y = (i - low) / max(0.001, high - low)
        mix = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        inv = inv * (1.0 - mix) + extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    angles = np.outer(np.arange(n_ctx, dtype=np.float64), inv)
    return (np.cos(angles) * mscale).astype(np.float32), (np.sin(angles) * mscale).astype(np.float32)


def swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """ggml_swiglu_oai in float32 of two float32 arrays of one shape (kernels.experts.swiglu_oai,
    the experts' own kernel): x = min(g, 7); x / (1 + e^(-1.702 x)) * (clamp(u, -7, 7) + 1)."""
    from ..kernels.experts import swiglu_oai as kernel

    g2 = np.ascontiguousarray(g, np.float32).reshape(-1, g.shape[-1])  # (T, n)
    out = np.empty_like(g2)
    kernel(g2, np.ascontiguousarray(u, np.float32).reshape(g2.shape), out, 0)
    return out.reshape(g.shape)


class GptOssMoe(MoeFFN):
    """build_moe_ffn for gpt-oss: biased router, top-k on logits then softmax over the k, biased
    experts with swiglu_oai, every chosen expert in one call (kernels/experts.py) when the
    experts' types have int8 row kernels (MXFP4 has)."""

    def __init__(self, *args, router_b, gate_b, up_b, down_b, **kw):
        super().__init__(*args, **kw)
        self.router_b, self.gate_b, self.up_b, self.down_b = router_b, gate_b, up_b, down_b
        self.top_k_first = True  # top k on the router's logits, then the softmax over those k
        self._fusable = False  # (kernels/fused.py has no biases nor swiglu_oai)

    def biases(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.gate_b, self.up_b, self.down_b

    def act_kernel(self):
        from ..kernels.experts import swiglu_oai as kernel

        return kernel

    @classmethod
    def load(cls, r: WeightReader, a: ModelArgs, i: int, **_) -> "GptOssMoe":
        p = f"blk.{i}."
        d, ff, n = a.n_embd, a.n_ff_exp, a.n_expert
        router = r.matrix(p + "ffn_gate_inp.weight", d, n)
        gate = ExpertTensor(r.gf, p + "ffn_gate_exps.weight", d, ff, n)
        up = ExpertTensor(r.gf, p + "ffn_up_exps.weight", d, ff, n)
        down = ExpertTensor(r.gf, p + "ffn_down_exps.weight", ff, d, n)

        def biases(name: str, width: int) -> np.ndarray:
            return np.ascontiguousarray(r.vector(p + name, width * n).reshape(n, width))  # (n_expert, width): expert e's row e

        return cls(router, gate, up, down, a.n_expert_used, False, router_b=r.vector(p + "ffn_gate_inp.bias", n),
                   gate_b=biases("ffn_gate_exps.bias", ff), up_b=biases("ffn_up_exps.bias", ff),
                   down_b=biases("ffn_down_exps.bias", d))

    def _expert(self, step, e: int, xa, act: int, glu) -> np.ndarray:
        from ..qtensor import quantize_activation

        up = step.project("ffn_moe_up", self.up[e], xa, as_decode=True) + self.up_b[e]  # (n, n_ff_exp)
        g = step.project("ffn_moe_gate", self.gate[e], xa, as_decode=True) + self.gate_b[e]
        a = step.op("swiglu_oai", swiglu_oai, g, up)
        return step.project("ffn_moe_down", self.down[e], quantize_activation(a), as_decode=True) + self.down_b[e]


def attend_one(q: np.ndarray, k_cache: np.ndarray, vt_cache: np.ndarray, pos: int, n_rep: int, scale, window: int,
               q_scaled: bool, sinks: np.ndarray) -> np.ndarray:
    """One query q (H, D) at position pos over exactly the positions it sees (pos - window + 1 .. pos,
    or 0 .. pos), with the layer's sinks: the same work whatever the batch, so the same bits.
    Caches and roundings as `points.attention_numpy` (f16 caches: q and the probabilities rounded
    to f16 for the products; quantized caches: keys and values decoded). -> (H, D) float32."""
    ring = k_cache.shape[1]
    lo = max(0, pos - window + 1) if window > 0 else 0
    slots = np.arange(lo, pos + 1) % ring
    k = np.repeat(to_f32(k_cache[:, slots, :]), n_rep, axis=0)  # (H, P, D)
    blocks = is_blocks(k_cache)
    v_rows = to_f32(vt_cache[:, slots, :]) if blocks else to_f32(vt_cache[:, :, slots]).transpose(0, 2, 1)
    v = np.repeat(v_rows, n_rep, axis=0)  # (H, P, D)
    q = q[None]  # (1, H, D)
    if blocks or k_cache.dtype == np.uint16:
        if q_scaled:
            q, scale = q * np.float32(scale), 1.0
        q = query_as_keys(q, k_cache) if blocks else to_f32(from_f32(q, k_cache))
    s = np.einsum("hpd,hd->hp", k, q[0]) * np.float32(scale)  # (H, P)
    sk = sinks.astype(np.float32)[:, None]  # (H, 1)
    best = np.maximum(s.max(axis=1, keepdims=True), sk)
    e = np.exp(s - best)
    probs = (e * (1.0 / (e.sum(axis=1, keepdims=True, dtype=np.float64) + np.exp(sk - best)))).astype(np.float32)
    if vt_cache.dtype == np.uint16:
        probs = to_f32(from_f32(probs, vt_cache))
    return np.einsum("hp,hpd->hd", probs, v).astype(np.float32)


class _NoProbe:
    def fire(self, point, il, arr):
        return arr


class GptOss(Transformer):
    arch = "gpt-oss"
    rope_neox = True

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        arch = cls.arch
        scaling = md.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none", "yarn"):
            raise UnsupportedError(f"RoPE scaling type {scaling!r} is not supported for gpt-oss (qllama runs: yarn)")
        plain = {k: v for k, v in md.items() if k != f"{arch}.rope.scaling.type"}  # factor read as a scale
        a = read_common_args(plain, arch, neox=True)
        if scaling != "yarn":
            a = replace(a, rope_scale=1.0)
        key = Keys(md, arch)
        a = replace(a, n_swa=key.int("attention.sliding_window", 0), swa_layers=swa_pattern(md, arch, a.n_layer, 2),
                    rope_freq_base_swa=a.rope_freq_base, rope_scale_swa=a.rope_scale)
        return read_moe_args(md, a, required=True, n_ff_exp="key")

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        r = WeightReader(gf)
        a = args
        layers = []
        for i in range(a.n_layer):
            p = f"blk.{i}."
            lw = LayerWeights(
                attn_norm=r.vector(p + "attn_norm.weight", a.n_embd),
                attn_output=r.matrix(p + "attn_output.weight", a.q_dim, a.n_embd),
                ffn_norm=r.vector(p + "post_attention_norm.weight", a.n_embd),  # the FFN's input norm
                ffn_up=None, ffn_down=None,
                attn_q=r.matrix(p + "attn_q.weight", a.n_embd, a.q_dim),
                attn_k=r.matrix(p + "attn_k.weight", a.n_embd, a.kv_dim),
                attn_v=r.matrix(p + "attn_v.weight", a.n_embd, a.kv_dim),
                attn_q_b=r.vector(p + "attn_q.bias", a.q_dim),
                attn_k_b=r.vector(p + "attn_k.bias", a.kv_dim),
                attn_v_b=r.vector(p + "attn_v.bias", a.kv_dim),
            )
            lw.attn_output_b = r.vector(p + "attn_output.bias", a.n_embd)
            lw.attn_sinks = r.vector(p + "attn_sinks.weight", a.n_head)
            lw.moe = GptOssMoe.load(r, a, i)
            layers.append(lw)
        return r.model(args, layers)

    def __init__(self, args: ModelArgs, weights, n_ctx: int, *rest):
        super().__init__(args, weights, n_ctx, *rest)
        a = args
        if a.rope_scale != 1.0:  # YaRN tables instead of the linear ones (every layer has the same base)
            n_orig = a.n_ctx_orig or a.n_ctx_train
            t = yarn_rope_tables(a.n_rot, a.rope_freq_base, 1.0 / a.rope_scale, n_orig, a.rope_attn_factor, n_ctx)
            self.rope = [t] * a.n_layer

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)  # with the Q/K/V biases
        x += self.out_proj(layer, self.attend(il, q, k, v, batch)) + layer.attn_output_b
        h = self.norm(x, layer.ffn_norm)  # post_attention_norm
        x += self.ffn(layer, h, ACT_SILU)
        return x

    def _attend(self, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch) -> np.ndarray:
        """RoPE, the cache store, then attention with the layer's sinks (NumPy path)."""
        a, step = self.args, self.step
        n_tok = q.shape[0]
        cos, sin = self.rope[il]
        sinks = self.weights.layers[il].attn_sinks
        probe = step.probe if step.probe is not None else _NoProbe()
        out = np.empty((n_tok, a.n_head, a.head_dim), dtype=np.float32)
        for seg in batch:
            c = seg.cache
            sl = slice(seg.lo, seg.hi)
            qs, ks, vs = q[sl], k[sl], v[sl]
            if c.blocks:  # a quantized KV cache
                from ..kernels import attention_quant as aq

                aq.rope_store_quant(qs, ks, vs, seg.start, cos, sin, c.kb[il], c.vb[il], a.rope_neox, *c.type_ids)
            else:
                ops.rope_store(qs, ks, vs, seg.start, cos, sin, c.kt[il], c.vt[il], a.rope_neox)
            qs = step.attention_inputs(qs, c.k[il], c.vt[il], seg.start)
            args = (a.n_rep, self._scale, self._window[il], self._softcap, self.q_prescaled)
            if step.wants("attn_scores") or step.wants("attn_probs"):  # the hooks see the segment at once
                out[sl] = attention_numpy(probe, il, qs, c.k[il], c.vt[il], seg.start, *args, sinks=sinks)
                continue
            os_ = out[sl]
            if not c.blocks:  # the Numba attention kernels with the sinks (a prompt's rows == decode's)
                parallel = ops.attention_parallel_pays(seg.hi - seg.lo, seg.start, a.n_head, step.n_threads)
                attention = ops.attention if parallel else ops.attention_serial
                attention(np.ascontiguousarray(qs), c.kt[il], c.vt[il], seg.start, *args, os_, sinks=sinks)
                continue
            for t in range(qs.shape[0]):  # a quantized cache: query by query in NumPy
                os_[t] = attend_one(qs[t], c.k[il], c.vt[il], seg.start + t, *args[:3], self.q_prescaled, sinks)
        return out.reshape(n_tok, a.q_dim)


__all__ = ["GptOss", "GptOssMoe", "swiglu_oai", "yarn_rope_tables"]
