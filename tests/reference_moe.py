"""A plain float64 NumPy forward pass for the mixture-of-experts families, written from llama.cpp.

The independent side of tests/test_moe.py, beside reference_forward.py (whose GGUF reader,
gguf-py dequantization, RMSNorm, RoPE and attention it reuses; nothing from qllama). Graphs:
llama.cpp's src/models/{qwen3moe,llama,olmoe,qwen2moe,granite}.cpp and build_moe_ffn in
src/llama-graph.cpp:

- router: logits = h @ ffn_gate_inp^T; probs = softmax over all experts; the k largest probs
  (ties to the lower id); their weights renormalised to sum 1 (qwen3moe, llama/Mixtral,
  granitemoe: norm_w true; olmoe, qwen2moe: as they are); no expert_weights_scale is read by
  these families;
- each chosen expert: down_e @ (silu(gate_e @ h) * (up_e @ h)); the output is the weighted sum;
- qwen2moe adds a shared expert times sigmoid(h . ffn_gate_inp_shexp); granitemoe adds its
  optional shared expert as it is;
- qwen3moe: per-head Q/K RMSNorm before NeoX RoPE; olmoe: Q/K RMSNorm over the whole projection
  before NeoX RoPE; qwen2moe: Q/K/V biases, NeoX RoPE; llama, granite: interleaved RoPE;
- granite(moe): embeddings x embedding_scale, each branch x residual_scale, query scale
  attention.scale (if set), logits / logit_scale.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from reference_forward import attention, hparams, read_gguf, rmsnorm, rope, silu, tensor_f64

NEOX = {"qwen3moe", "olmoe", "qwen2moe"}
NORM_W = {"qwen3moe": True, "llama": True, "granitemoe": True, "granite": True, "olmoe": False, "qwen2moe": False}


class MoeReference:
    def __init__(self, path: str | Path):
        g = read_gguf(path)
        self.md = md = g.metadata
        self.h = hparams(md)
        self.arch = arch = md["general.architecture"]
        self.w = {name: tensor_f64(g, name) for name in g.tensors}
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]
        key = lambda k, d=0.0: float(md.get(f"{arch}.{k}", d))  # noqa: E731
        self.n_used = int(md.get(f"{arch}.expert_used_count", 0))
        self.granite = arch in ("granite", "granitemoe")
        if self.granite:
            self.embd_scale, self.res_scale = key("embedding_scale"), key("residual_scale")
            self.logit_scale = key("logit_scale")
            if key("attention.scale"):
                self.h.kq_scale = key("attention.scale")
        self.min_gap = np.inf  # smallest gap between the k-th and (k+1)-th router probability seen

    def moe(self, p: str, cur: np.ndarray, tap) -> np.ndarray:
        w, k = self.w, self.n_used
        logits = tap("ffn_moe_logits", cur @ w[p + "ffn_gate_inp.weight"].T)  # (T, n_expert)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
        order = np.argsort(-probs, axis=1, kind="stable")
        if probs.shape[1] > k:
            srt = np.take_along_axis(probs, order, axis=1)
            self.min_gap = min(self.min_gap, float((srt[:, k - 1] - srt[:, k]).min()))
        sel = np.asarray(tap("ffn_moe_experts", order[:, :k].astype(np.float64)), dtype=np.int64)  # (T, k)
        wt = np.take_along_axis(probs, sel, axis=1)
        if NORM_W[self.arch]:
            wt = wt / np.maximum(wt.sum(axis=1, keepdims=True), 6.103515625e-5)
        wt = tap("ffn_moe_weights", wt)
        gate, up, down = w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"]
        out = np.zeros_like(cur)
        for t in range(cur.shape[0]):
            for j in range(k):
                ex = sel[t, j]
                a = silu(gate[ex] @ cur[t]) * (up[ex] @ cur[t])
                out[t] += wt[t, j] * (down[ex] @ a)
        if p + "ffn_up_shexp.weight" in w:
            sh = (silu(cur @ w[p + "ffn_gate_shexp.weight"].T) * (cur @ w[p + "ffn_up_shexp.weight"].T)) \
                @ w[p + "ffn_down_shexp.weight"].T
            if p + "ffn_gate_inp_shexp.weight" in w:
                z = cur @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1)
                sh = sh * (1.0 / (1.0 + np.exp(-z)))[:, None]
            out = out + sh
        return out

    def logits(self, ids, hook=None) -> np.ndarray:
        """float64 (T, n_vocab); hook(name, array, layer) at qllama's named points may replace arrays."""
        h, w = self.h, self.w
        ids = np.asarray(ids, dtype=np.int64)
        T, d = len(ids), h.head_dim
        pos = np.arange(T, dtype=np.float64)

        def tap(name, a, il=None):
            if hook is None:
                return a
            r = hook(name if il is None else f"blk.{il}.{name}", a, il)
            return a if r is None else np.asarray(r, dtype=np.float64)

        x = w["token_embd.weight"][ids]
        if self.granite and self.embd_scale:
            x = x * self.embd_scale
        x = tap("embed", x)
        neox = self.arch in NEOX
        rs = self.res_scale if self.granite and self.res_scale else 1.0
        for il in range(h.n_layer):
            p = f"blk.{il}."
            cur = tap("attn_norm", rmsnorm(x, w[p + "attn_norm.weight"], h.rms_eps), il)
            q, k, v = (cur @ w[p + f"attn_{n}.weight"].T for n in "qkv")
            if p + "attn_q.bias" in w:
                q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
            if self.arch == "olmoe":  # over the whole projection
                q = rmsnorm(q, w[p + "attn_q_norm.weight"], h.rms_eps)
                k = rmsnorm(k, w[p + "attn_k_norm.weight"], h.rms_eps)
            q, k, v = q.reshape(T, h.n_head, d), k.reshape(T, h.n_head_kv, d), v.reshape(T, h.n_head_kv, d)
            if self.arch == "qwen3moe":  # per head
                q = rmsnorm(q, w[p + "attn_q_norm.weight"], h.rms_eps)
                k = rmsnorm(k, w[p + "attn_k_norm.weight"], h.rms_eps)
            q = rope(q, pos, h.n_rot, h.rope_base, h.freq_scale, None, h.attn_factor, neox)
            k = rope(k, pos, h.n_rot, h.rope_base, h.freq_scale, None, h.attn_factor, neox)
            q, k, v = tap("attn_q", q, il), tap("attn_k", k, il), tap("attn_v", v, il)
            att = attention(q, k, v, pos, h, False, lambda name, a: tap(name, a, il)) @ w[p + "attn_output.weight"].T
            x = x + tap("attn_out", att, il) * rs
            cur = tap("ffn_in", rmsnorm(x, w[p + "ffn_norm.weight"], h.rms_eps), il)
            if p + "ffn_gate_inp.weight" in w:
                ffn = self.moe(p, cur, lambda name, a: tap(name, a, il))
            else:  # dense granite
                act = tap("ffn_act", silu(cur @ w[p + "ffn_gate.weight"].T) * (cur @ w[p + "ffn_up.weight"].T), il)
                ffn = act @ w[p + "ffn_down.weight"].T
            x = tap("resid", x + tap("ffn_out", ffn, il) * rs, il)
        x = tap("result_norm", rmsnorm(x, w["output_norm.weight"], h.rms_eps))
        out = x @ w["output.weight"].T
        if self.granite:
            out = out / self.logit_scale
        return tap("logits", out)


# -- gpt-oss (llama.cpp's src/models/openai-moe-iswa.cpp) ----------------------------------------


def yarn_rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, factor: float, n_ctx_orig: int,
              beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """NeoX RoPE with ggml's rope_yarn (ext_factor 1), element by element as ggml_rope_cache_init:
    theta_extrap = p base^(-2i/n_rot), theta_interp = theta_extrap / factor, mixed by the ramp
    between the correction dims; cos and sin scaled by 1 + 0.1 ln(factor). x (T, heads, D)."""
    half = n_rot // 2

    def corr_dim(n):
        return n_rot * np.log(n_ctx_orig / (n * 2 * np.pi)) / (2 * np.log(base))

    lo, hi = max(0.0, np.floor(corr_dim(beta_fast))), min(n_rot - 1.0, np.ceil(corr_dim(beta_slow)))
    cos = np.empty((len(pos), half))
    sin = np.empty((len(pos), half))
    mscale = 1.0 + 0.1 * np.log(factor)
    for t, p in enumerate(pos):
        for i in range(half):
            extrap = p * base ** (-2.0 * i / n_rot)
            interp = extrap / factor
            ramp = (1 - min(1.0, max(0.0, (i - lo) / max(0.001, hi - lo))))
            theta = interp * (1 - ramp) + extrap * ramp
            cos[t, i], sin[t, i] = np.cos(theta) * mscale, np.sin(theta) * mscale
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    a, b = x[..., :half], x[..., half:n_rot]
    out[..., :half] = a * cos - b * sin
    out[..., half:n_rot] = a * sin + b * cos
    return out


class GptOssReference:
    """gpt-oss in float64: Q/K/V/O biases, YaRN NeoX RoPE, attention sinks (a per-head logit in
    the softmax denominator), a window on even layers, post_attention_norm before the MoE; the
    router biased, top-k on its logits, softmax over the k; experts biased, swiglu_oai."""

    def __init__(self, path: str | Path):
        g = read_gguf(path)
        md = g.metadata
        a = lambda k, d=None: md.get(f"gpt-oss.{k}", d)  # noqa: E731
        self.n_layer, self.n_head = int(a("block_count")), int(a("attention.head_count"))
        self.n_head_kv, self.d = int(a("attention.head_count_kv")), int(a("attention.key_length"))
        self.eps, self.base = float(a("attention.layer_norm_rms_epsilon")), float(a("rope.freq_base"))
        self.k, self.n_swa = int(a("expert_used_count")), int(a("attention.sliding_window"))
        self.yarn = a("rope.scaling.type") == "yarn"
        self.factor = float(a("rope.scaling.factor", 1.0))
        self.n_orig = int(a("rope.scaling.original_context_length", a("context_length")))
        self.w = {name: tensor_f64(g, name) for name in g.tensors}

    def rope(self, x, pos):
        if self.yarn:
            return yarn_rope(x, pos, self.d, self.base, self.factor, self.n_orig)
        return rope(x, pos, self.d, self.base, 1.0, None, 1.0, True)

    def moe(self, p: str, cur: np.ndarray, tap) -> np.ndarray:
        w, k = self.w, self.k
        logits = tap("ffn_moe_logits", cur @ w[p + "ffn_gate_inp.weight"].T + w[p + "ffn_gate_inp.bias"])
        sel = np.asarray(tap("ffn_moe_experts", np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(np.float64)),
                         dtype=np.int64)
        z = np.take_along_axis(logits, sel, axis=1)
        wt = np.exp(z - z.max(axis=1, keepdims=True))
        wt = tap("ffn_moe_weights", wt / wt.sum(axis=1, keepdims=True))
        out = np.zeros_like(cur)
        for t in range(cur.shape[0]):
            for j in range(k):
                e = sel[t, j]
                g = w[p + "ffn_gate_exps.weight"][e] @ cur[t] + w[p + "ffn_gate_exps.bias"][e]
                u = w[p + "ffn_up_exps.weight"][e] @ cur[t] + w[p + "ffn_up_exps.bias"][e]
                x = np.minimum(g, 7.0)
                act = x / (1.0 + np.exp(-1.702 * x)) * (np.clip(u, -7.0, 7.0) + 1.0)
                out[t] += wt[t, j] * (w[p + "ffn_down_exps.weight"][e] @ act + w[p + "ffn_down_exps.bias"][e])
        return out

    def logits(self, ids, hook=None) -> np.ndarray:
        w = self.w
        ids = np.asarray(ids, dtype=np.int64)
        T, d, H, Hkv = len(ids), self.d, self.n_head, self.n_head_kv
        pos = np.arange(T, dtype=np.float64)

        def tap(name, arr, il=None):
            if hook is None:
                return arr
            r = hook(name if il is None else f"blk.{il}.{name}", arr, il)
            return arr if r is None else np.asarray(r, dtype=np.float64)

        x = w["token_embd.weight"][ids]
        for il in range(self.n_layer):
            p = f"blk.{il}."
            cur = rmsnorm(x, w[p + "attn_norm.weight"], self.eps)
            q, k, v = (cur @ w[p + f"attn_{n}.weight"].T + w[p + f"attn_{n}.bias"] for n in "qkv")
            q = self.rope(q.reshape(T, H, d), pos)
            k = self.rope(k.reshape(T, Hkv, d), pos)
            v = v.reshape(T, Hkv, d)
            rep = H // Hkv
            kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->ths", q, kk) / np.sqrt(d)  # (T, H, T)
            diff = pos[:, None] - pos[None, :]
            masked = diff < 0
            if il % 2 == 0 and self.n_swa:  # window on even layers
                masked = masked | (diff >= self.n_swa)
            s = np.where(masked[:, None, :], -np.inf, s)
            sink = w[p + "attn_sinks.weight"][None, :, None]  # (1, H, 1)
            m = np.maximum(s.max(axis=2, keepdims=True), sink)
            e = np.exp(s - m)
            prob = e / (e.sum(axis=2, keepdims=True) + np.exp(sink - m))
            att = np.einsum("ths,shd->thd", prob, vv).reshape(T, H * d)
            x = x + att @ w[p + "attn_output.weight"].T + w[p + "attn_output.bias"]
            cur = rmsnorm(x, w[p + "post_attention_norm.weight"], self.eps)
            x = tap("resid", x + self.moe(p, cur, lambda name, a: tap(name, a, il)), il)
        x = rmsnorm(x, w["output_norm.weight"], self.eps)
        return tap("logits", x @ w["output.weight"].T)


def greedy_departure(llm, tr, prompt: list[int], n: int) -> tuple[int | None, list[float]]:
    """Greedy continuations of `prompt` by llama.cpp (a llama_cpp.Llama) and by a qllama
    Transformer, n tokens each: (the first position where they differ, or None; llama.cpp's
    top-2 margin at every position)."""
    llm.reset()
    llm.eval(prompt)
    theirs, margins = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.sort(row)[-2:]
        margins.append(float(top[1] - top[0]))
        theirs.append(int(np.argmax(row)))
        llm.eval([theirs[-1]])
    cache = tr.new_cache()
    row = tr.forward(prompt, cache)[0]
    ours = []
    for _ in range(n):
        ours.append(int(np.argmax(row)))
        row = tr.forward([ours[-1]], cache)[0]
    return next((i for i in range(n) if ours[i] != theirs[i]), None), margins


def moe_files(root: Path, cases: dict):
    """name -> path of the file `tools.make_moe` writes for cases[name], written once on first use."""
    import functools

    from tools.make_moe import write_moe

    @functools.cache
    def get(name: str) -> str:
        path = root / f"{name}.gguf"
        write_moe(path, cases[name])
        return str(path)

    return get


def rel_err(got, ref) -> float:
    """Largest absolute difference over the largest magnitude of the reference."""
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))

