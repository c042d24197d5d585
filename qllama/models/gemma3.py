"""`gemma3` (Gemma 3 text models): llama.cpp's src/models/gemma3.cpp and load_arch_hparams.

Like gemma2 (sqrt(n_embd) embedding scale, post-attention and post-FFN norms, GELU-tanh FFN,
the 27B's query scale), plus:
- a per-head RMSNorm on Q and K (`attn_q_norm`, `attn_k_norm`) before RoPE;
- no attention softcapping; the final softcap only when the file sets one;
- sliding-window layers in llama.cpp's pattern of period 6 (five local, then one global),
  when `gemma3.attention.sliding_window` is set; the local layers use their own RoPE base
  (`rope.freq_base_swa`, default 10000) and no RoPE scaling, while the global layers use
  `rope.freq_base` and the file's linear scaling (factor 8 on the 4B+ models);
- head_dim from `attention.key_length` (n_head * head_dim != n_embd);
- its own output matrix when the file has one.
"""

from __future__ import annotations

from dataclasses import replace

from .args import Keys, ModelArgs, swa_pattern
from .base import ACT_GELU
from .gemma2 import Gemma2


class Gemma3(Gemma2):
    arch = "gemma3"
    layer_tensors = {"qk_norm": True, "post_norms": True}
    own_output = True
    n_layer_27b = 62

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        a = super(Gemma2, cls).read_args(md)  # the shared keys; none of gemma2's window/softcap defaults
        key = Keys(md, cls.arch)
        a = replace(a, final_softcap=key.float("final_logit_softcapping", 0.0), attn_scale=cls.query_scale(a))
        n_swa = key.int("attention.sliding_window", 0)
        if n_swa > 0:
            a = replace(a, n_swa=n_swa, swa_layers=swa_pattern(md, cls.arch, a.n_layer, 6),
                        rope_freq_base_swa=key.float("rope.freq_base_swa", 10000.0), rope_scale_swa=1.0)
        return a

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)
        q = self.head_norm(q, layer.attn_q_norm)
        k = self.head_norm(k, layer.attn_k_norm)
        a = self.out_proj(layer, self.attend(il, q, k, v, batch))  # window and RoPE base per layer
        x += self.norm(a, layer.post_attention_norm)
        h = self.norm(x, layer.ffn_norm)
        f = self.ffn(layer, h, ACT_GELU)
        x += self.norm(f, layer.post_ffw_norm)
        return x
