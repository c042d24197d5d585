"""A plain float64 NumPy forward pass for every family qllama runs, written from llama.cpp.

This is the independent side of the family tests: it shares no code with qllama. It reads the
GGUF with its own small parser below, dequantizes with gguf-py's NumPy reference
(`gguf.quants.dequantize`) and computes logits for a whole sequence at once (full causal
attention with masks), following llama.cpp's graphs (src/models/{llama,qwen2,qwen3,gemma2,
gemma3,phi3}.cpp) and hyper-parameter rules (src/llama-model.cpp, the per-arch
load_arch_hparams, llama-hparams.cpp):

- RMSNorm: x / sqrt(mean(x^2) + eps) * w (Gemma's converter already stored 1 + w).
- RoPE: "norm" (llama: pairs 2i, 2i+1) or NeoX (qwen, gemma, phi3: pairs i, i + n_rot/2), on the
  first n_rot dims; angle = pos * base^(-2i/n_rot) * freq_scale / factor_i, cos and sin times
  rope.scaling.attn_factor (llama.cpp's mscale with ext_factor 0).
- Sliding window (llama.cpp's is_masked_swa, standard type): a query at p1 does not see a key
  at p0 when p1 - p0 >= n_swa. Layer il is local when il % pattern < pattern - 1.
- Phi-3: attn_qkv rows are Q|K|V; ffn_up rows are gate|up (silu(gate) * up); LongRoPE uses
  rope_factors_long when the context (n_ctx) exceeds rope.scaling.original_context_length,
  else rope_factors_short. llama.cpp disables Phi's sliding window (the key is ignored).
- Gemma: embeddings times sqrt(n_embd); post-attention and post-FFN norms; GELU (tanh) gate;
  gemma2 attention-logit softcapping (default 50) and final softcapping (default 30); gemma3
  Q/K norms, final softcapping only when the key is present, local layers with their own
  RoPE base (rope.freq_base_swa, default 10000) and no RoPE scaling.

llama.cpp evaluates GELU through an fp16 lookup table; `gelu_fp16=True` mimics it (only to
check this reference against llama.cpp itself; qllama is compared with the exact GELU).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------------
# A minimal GGUF reader (gguf-py's GGUFReader takes ~20 s on a 50K-token vocabulary)
# ---------------------------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, n = self.take("<I"), self.take("<Q")
            if itype == 8:
                return [self.string() for _ in range(n)]
            if itype in _NP:
                arr = np.frombuffer(self.buf, dtype=_NP[itype], count=n, offset=self.pos).copy()
                self.pos += arr.nbytes
                return arr
            return [self.value(itype) for _ in range(n)]
        return self.take(_SCALARS[vtype])


@dataclass
class GGUFData:
    metadata: dict
    tensors: dict  # name -> (ggml type id, shape ne0-first, raw bytes view)


def read_gguf(path: str | Path) -> GGUFData:
    f = open(path, "rb")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    c.pos = 4
    c.take("<I")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    md = {}
    for _ in range(n_kv):
        key = c.string()
        md[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        nd = c.take("<I")
        shape = tuple(c.take("<Q") for _ in range(nd))
        infos.append((name, shape, c.take("<I"), c.take("<Q")))
    align = int(md.get("general.alignment", 32))
    start = (c.pos + align - 1) // align * align
    tensors = {name: (t, shape, memoryview(buf)[start + off :]) for name, shape, t, off in infos}
    return GGUFData(md, tensors)


def tensor_f64(g: GGUFData, name: str) -> np.ndarray:
    """Dequantized values, float64, numpy shape (reversed ne: rows last-dim first)."""
    import gguf  # gguf-py's NumPy dequantizers: independent of qllama's kernels

    t, shape, raw = g.tensors[name]
    qt = gguf.GGMLQuantizationType(t)
    block, tsize = gguf.GGML_QUANT_SIZES[qt]
    n = int(np.prod(shape))
    nbytes = n // block * tsize
    data = np.frombuffer(raw[:nbytes], dtype=np.uint8)
    if qt == gguf.GGMLQuantizationType.F32:
        vals = data.view(np.float32)
    elif qt == gguf.GGMLQuantizationType.F16:
        vals = data.view(np.float16)
    else:
        vals = gguf.quants.dequantize(data.reshape(1, -1), qt)
    return np.asarray(vals, dtype=np.float64).reshape(tuple(reversed(shape)))


# ---------------------------------------------------------------------------------------------
# Hyper-parameters, as llama.cpp derives them
# ---------------------------------------------------------------------------------------------

NEOX = {"qwen2", "qwen3", "gemma2", "gemma3", "phi3"}


@dataclass
class HParams:
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rms_eps: float
    rope_base: float
    freq_scale: float
    attn_factor: float
    kq_scale: float
    embd_scale: float = 1.0
    n_swa: int = 0
    is_swa: list = field(default_factory=list)
    rope_base_swa: float = 10000.0
    freq_scale_swa: float = 1.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    n_ctx_orig: int = 0


def hparams(md: dict) -> HParams:
    arch = md["general.architecture"]
    a = lambda k, d=None: md.get(f"{arch}.{k}", d)  # noqa: E731
    n_embd, n_layer, n_head = int(a("embedding_length")), int(a("block_count")), int(a("attention.head_count"))
    n_head_kv = int(a("attention.head_count_kv", n_head))
    head_dim = int(a("attention.key_length", n_embd // n_head))
    if int(a("attention.value_length", head_dim)) != head_dim:
        raise NotImplementedError("key_length != value_length")
    n_rot = int(a("rope.dimension_count", head_dim))
    scaling = a("rope.scaling.type", "linear")
    if scaling not in ("linear", "none"):
        raise NotImplementedError(f"rope scaling {scaling!r}")
    factor = float(a("rope.scaling.factor", 0.0) or a("rope.scale_linear", 0.0) or 0.0)
    freq_scale = 1.0 if (scaling == "none" or factor == 0.0) else 1.0 / factor
    base = float(a("rope.freq_base", 10000.0))
    n_ctx_train = int(a("context_length"))
    h = HParams(arch=arch, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                n_rot=n_rot, rms_eps=float(a("attention.layer_norm_rms_epsilon")), rope_base=base,
                freq_scale=freq_scale, attn_factor=float(a("rope.scaling.attn_factor", 1.0)),
                kq_scale=1.0 / np.sqrt(head_dim), is_swa=[False] * n_layer,
                n_ctx_orig=int(a("rope.scaling.original_context_length", n_ctx_train)))

    def pattern(default: int) -> None:
        p = int(a("attention.sliding_window_pattern", default))
        h.is_swa = [p == 0 or (il % p < p - 1) for il in range(n_layer)]

    if arch == "gemma2":
        h.n_swa = int(a("attention.sliding_window", 4096))
        pattern(2)
        h.rope_base_swa = float(a("rope.freq_base_swa", base))
        h.freq_scale_swa = freq_scale
        h.attn_softcap = float(a("attn_logit_softcapping", 50.0))
        h.final_softcap = float(a("final_logit_softcapping", 30.0))
    elif arch == "gemma3":
        n_swa = int(a("attention.sliding_window", 0))
        if n_swa > 0:
            h.n_swa = n_swa
            pattern(6)
            h.rope_base_swa = float(a("rope.freq_base_swa", 10000.0))
            h.freq_scale_swa = 1.0
        h.final_softcap = float(a("final_logit_softcapping", 0.0))
    if arch in ("gemma2", "gemma3"):
        h.embd_scale = float(np.sqrt(np.float32(n_embd)))
        big = n_layer == (46 if arch == "gemma2" else 62)  # the 27B models: scale by n_embd / n_head
        h.kq_scale = 1.0 / np.sqrt(n_embd // n_head if big else head_dim)
    return h


# ---------------------------------------------------------------------------------------------
# The forward pass
# ---------------------------------------------------------------------------------------------

def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def gelu_tanh(x: np.ndarray, fp16: bool = False) -> np.ndarray:
    def g(v):
        return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * v * (1.0 + 0.044715 * v * v)))

    if not fp16:
        return g(x)
    x32 = x.astype(np.float32)
    table = g(x32.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x32 <= -10.0, 0.0, np.where(x32 >= 10.0, x, table))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, freq_scale: float, factors, mscale: float,
         neox: bool) -> np.ndarray:
    """x (T, n_heads, head_dim); rotates the first n_rot dims of each head."""
    half = n_rot // 2
    inv = base ** (-np.arange(half) * 2.0 / n_rot)
    if factors is not None:
        inv = inv / factors
    theta = pos[:, None] * inv[None, :] * freq_scale  # (T, half)
    cos, sin = (np.cos(theta) * mscale)[:, None, :], (np.sin(theta) * mscale)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


Q_PRESCALED = ("gemma2", "gemma3", "phi3")  # graphs that scale Q before attention (kq_scale 1)


def f16(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16 (nearest even), back in float64."""
    return np.asarray(x).astype(np.float16).astype(np.float64)


def attention(q, k, v, pos, h: HParams, swa: bool, tap=None, kv_f16: bool = False) -> np.ndarray:
    """q (T, n_head, d), k/v (T, n_head_kv, d) -> (T, n_head * d); causal (+ window) mask.
    tap(point, array): optional, sees (and may replace) attn_scores, attn_probs (T, n_head, T)
    and attn_z (T, n_head, d). kv_f16: as llama.cpp's f16 cache multiplies (k and v are already
    rounded by the caller): q and the probabilities are rounded to fp16 for the products."""
    T = q.shape[0]
    rep = h.n_head // h.n_head_kv
    diff = pos[:, None] - pos[None, :]  # p1 - p0
    masked = diff < 0
    if swa:
        masked = masked | (diff >= h.n_swa)
    tap = tap or (lambda name, a: a)
    kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # query head hh reads KV head hh // rep
    if kv_f16 and h.arch in Q_PRESCALED:  # llama.cpp scales Q itself, then multiplies by f16 keys
        s = np.einsum("thd,shd->ths", f16(q * h.kq_scale), kk)
    else:
        s = np.einsum("thd,shd->ths", f16(q) if kv_f16 else q, kk) * h.kq_scale
    if h.attn_softcap:
        s = h.attn_softcap * np.tanh(s / h.attn_softcap)
    s = tap("attn_scores", np.where(masked[:, None, :], -np.inf, s))
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p = tap("attn_probs", p / p.sum(axis=2, keepdims=True))
    return tap("attn_z", np.einsum("ths,shd->thd", f16(p) if kv_f16 else p, vv)).reshape(T, -1)


class Reference:
    """Weights of one GGUF in float64; `logits(ids)` for the whole sequence (positions 0..T-1).
    kv_f16: keys and values rounded to fp16 as an f16 KV cache stores them (see `attention`)."""

    def __init__(self, path: str | Path, n_ctx: int | None = None, gelu_fp16: bool = False, kv_f16: bool = False):
        g = read_gguf(path)
        self.md = g.metadata
        self.h = hparams(g.metadata)
        self.gelu_fp16 = gelu_fp16
        self.kv_f16 = kv_f16
        self.w = {name: tensor_f64(g, name) for name in g.tensors}
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]
        # LongRoPE: llama.cpp picks the factors by the context size it was given
        self.factors = self.w.get("rope_freqs.weight")
        if self.factors is None and "rope_factors_long.weight" in self.w:
            n_ctx = n_ctx or int(self.md[f"{self.h.arch}.context_length"])
            key = "long" if n_ctx > self.h.n_ctx_orig else "short"
            self.factors = self.w[f"rope_factors_{key}.weight"]

    def logits(self, ids, hook=None) -> np.ndarray:
        """hook(name, array, layer): optional, called at qllama's named points (qllama.models.points)
        with the float64 intermediate; it may return a replacement (ablation, steering)."""
        h, w = self.h, self.w
        ids = np.asarray(ids, dtype=np.int64)
        T, d = len(ids), h.head_dim
        pos = np.arange(T, dtype=np.float64)

        def tap(name, a, il=None):
            if hook is None:
                return a
            r = hook(name if il is None else f"blk.{il}.{name}", a, il)
            return a if r is None else np.asarray(r, dtype=np.float64)

        x = tap("embed", w["token_embd.weight"][ids] * h.embd_scale)
        neox = h.arch in NEOX
        for il in range(h.n_layer):
            p = f"blk.{il}."
            swa = h.is_swa[il]
            cur = tap("attn_norm", rmsnorm(x, w[p + "attn_norm.weight"], h.rms_eps), il)
            if p + "attn_qkv.weight" in w:
                qkv = cur @ w[p + "attn_qkv.weight"].T
                nq, nk = h.n_head * d, h.n_head_kv * d
                q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
            else:
                q, k, v = (cur @ w[p + f"attn_{n}.weight"].T for n in "qkv")
            if p + "attn_q.bias" in w:
                q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
            q, k, v = q.reshape(T, h.n_head, d), k.reshape(T, h.n_head_kv, d), v.reshape(T, h.n_head_kv, d)
            if p + "attn_q_norm.weight" in w:
                q = rmsnorm(q, w[p + "attn_q_norm.weight"], h.rms_eps)
                k = rmsnorm(k, w[p + "attn_k_norm.weight"], h.rms_eps)
            base, scale = (h.rope_base_swa, h.freq_scale_swa) if swa else (h.rope_base, h.freq_scale)
            q = rope(q, pos, h.n_rot, base, scale, self.factors, h.attn_factor, neox)
            k = rope(k, pos, h.n_rot, base, scale, self.factors, h.attn_factor, neox)
            if self.kv_f16:  # the points show k and v as the cache stores them
                k, v = f16(k), f16(v)
            q, k, v = tap("attn_q", q, il), tap("attn_k", k, il), tap("attn_v", v, il)
            att = attention(q, k, v, pos, h, swa, lambda name, a: tap(name, a, il), self.kv_f16) @ w[p + "attn_output.weight"].T
            att = tap("attn_out", att, il)
            if p + "post_attention_norm.weight" in w:
                att = rmsnorm(att, w[p + "post_attention_norm.weight"], h.rms_eps)
            x = x + att
            cur = tap("ffn_in", rmsnorm(x, w[p + "ffn_norm.weight"], h.rms_eps), il)
            if p + "ffn_gate.weight" in w:
                gate, up = cur @ w[p + "ffn_gate.weight"].T, cur @ w[p + "ffn_up.weight"].T
            else:  # phi3: fused gate|up
                gu = cur @ w[p + "ffn_up.weight"].T
                gate, up = gu[:, : gu.shape[1] // 2], gu[:, gu.shape[1] // 2 :]
            act = gelu_tanh(gate, self.gelu_fp16) if h.arch in ("gemma2", "gemma3") else silu(gate)
            ffn = tap("ffn_out", tap("ffn_act", act * up, il) @ w[p + "ffn_down.weight"].T, il)
            if p + "post_ffw_norm.weight" in w:
                ffn = rmsnorm(ffn, w[p + "post_ffw_norm.weight"], h.rms_eps)
            x = tap("resid", x + ffn, il)
        x = tap("result_norm", rmsnorm(x, w["output_norm.weight"], h.rms_eps))
        out = x @ w["output.weight"].T
        if "output.bias" in w:
            out = out + w["output.bias"]
        if h.final_softcap:
            out = h.final_softcap * np.tanh(out / h.final_softcap)
        return tap("logits", out)


def reference_logits(path: str | Path, ids, n_ctx: int | None = None, gelu_fp16: bool = False,
                     kv_f16: bool = False) -> np.ndarray:
    """float64 (len(ids), n_vocab) logits of the GGUF at `path` for the token ids."""
    return Reference(path, n_ctx=n_ctx, gelu_fp16=gelu_fp16, kv_f16=kv_f16).logits(ids)
