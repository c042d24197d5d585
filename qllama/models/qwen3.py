"""`qwen3` (Qwen3 dense models): llama.cpp's src/models/qwen3.cpp.

What differs from qwen2:
- a per-head RMSNorm on Q and on K (`attn_q_norm`, `attn_k_norm`, head_dim weights each),
  applied before RoPE;
- no biases;
- head_dim from `qwen3.attention.key_length` (128 for every size): n_head * head_dim may differ
  from n_embd, so attn_q is [n_embd, n_head * head_dim] and attn_output its transpose shape.

    q, k = RMSNorm_head(q, attn_q_norm), RMSNorm_head(k, attn_k_norm)   then NeoX RoPE
"""

from __future__ import annotations

from .base import ACT_SILU, Transformer


class Qwen3(Transformer):
    arch = "qwen3"
    rope_neox = True
    layer_tensors = {"qk_norm": True}

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)
        q = self.head_norm(q, layer.attn_q_norm)
        k = self.head_norm(k, layer.attn_k_norm)
        x += self.out_proj(layer, self.attend(il, q, k, v, batch))
        h = self.norm(x, layer.ffn_norm)
        x += self.ffn(layer, h, ACT_SILU)
        return x
