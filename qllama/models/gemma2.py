"""`gemma2` (Gemma 2): llama.cpp's src/models/gemma2.cpp and llama_model_gemma2::load_arch_hparams.

What differs from llama:
- embeddings scaled by sqrt(n_embd);
- RMSNorm before *and after* attention and the FFN (`post_attention_norm`, `post_ffw_norm`);
  the converter stored Gemma's norms as 1 + w, so the file's weights multiply as they are;
- GELU (tanh) gated FFN;
- attention scores capped: s -> cap * tanh(s / cap) (`attn_logit_softcapping`, default 50),
  and so are the logits (`final_logit_softcapping`, default 30);
- a sliding window (`attention.sliding_window`, default 4096) on every other layer (period 2:
  even layers local, odd layers global); window layers keep the same RoPE base and scaling;
- the query scale: 1/sqrt(key_length), except the 27B (46 layers), which uses
  1/sqrt(n_embd / n_head) as llama.cpp does;
- the output is always the embedding (llama.cpp ignores any output.weight).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .args import Keys, ModelArgs, swa_pattern
from .base import ACT_GELU, Transformer


class Gemma2(Transformer):
    arch = "gemma2"
    rope_neox = True
    layer_tensors = {"post_norms": True}
    own_output = False
    q_prescaled = True  # llama.cpp scales Q by the query scale before attention (kq_scale 1)
    n_layer_27b = 46  # llama.cpp's LLM_TYPE_27B, whose query scale differs

    @classmethod
    def query_scale(cls, a: ModelArgs) -> float:
        """1/sqrt(head_dim), but 1/sqrt(n_embd / n_head) on the 27B, as llama.cpp decides by model type."""
        return 1.0 / math.sqrt(a.n_embd // a.n_head if a.n_layer == cls.n_layer_27b else a.head_dim)

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        a = super().read_args(md)
        key = Keys(md, cls.arch)
        return replace(
            a,
            n_swa=key.int("attention.sliding_window", 4096),
            swa_layers=swa_pattern(md, "gemma2", a.n_layer, 2),
            rope_freq_base_swa=key.float("rope.freq_base_swa", a.rope_freq_base),
            rope_scale_swa=a.rope_scale,
            attn_softcap=key.float("attn_logit_softcapping", 50.0),
            final_softcap=key.float("final_logit_softcapping", 30.0),
            attn_scale=cls.query_scale(a),
        )

    def embed(self, tokens):
        x = super().embed(tokens)
        x *= np.float32(math.sqrt(self.args.n_embd))
        return x

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)
        a = self.out_proj(layer, self.attend(il, q, k, v, batch))  # window and softcap: from args
        x += self.norm(a, layer.post_attention_norm)
        h = self.norm(x, layer.ffn_norm)
        f = self.ffn(layer, h, ACT_GELU)
        x += self.norm(f, layer.post_ffw_norm)
        return x

    def final_logits(self, logits):
        return softcap(logits, self.args.final_softcap)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap), in float32 as llama.cpp's scale-tanh-scale (cap 0: unchanged)."""
    if not cap:
        return x
    y = np.tanh(x * np.float32(1.0 / cap))
    y *= np.float32(cap)
    return y
