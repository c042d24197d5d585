"""`olmoe` (OLMoE-1B-7B): llama.cpp's src/models/olmoe.cpp.

What differs from llama:
- Q/K RMSNorm over the whole projection (`attn_q_norm`, `attn_k_norm` of n_embd, not per head),
  before NeoX RoPE;
- every FFN is a mixture of experts (models/moe.py): softmax router, top-k weights used as they
  are (no renormalisation), experts as wide as feed_forward_length, no shared expert;
- output.weight is required (llama.cpp does not tie it).
"""

from __future__ import annotations

from ..errors import QllamaError
from .args import ModelArgs
from .base import ACT_SILU, Transformer, WeightReader
from .moe import load_moe_weights, read_moe_args


class Olmoe(Transformer):
    arch = "olmoe"
    rope_neox = True

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        return read_moe_args(md, super().read_args(md), required=True)

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        r = WeightReader(gf)
        if not r.has("output.weight"):
            raise QllamaError("missing tensor 'output.weight'")
        w = load_moe_weights(cls, gf, args, norm_w=False)
        for i, lw in enumerate(w.layers):
            lw.attn_q_norm = r.vector(f"blk.{i}.attn_q_norm.weight", args.q_dim)  # full width
            lw.attn_k_norm = r.vector(f"blk.{i}.attn_k_norm.weight", args.kv_dim)
        return w

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)  # (T, H, D), (T, Hkv, D)
        n_tok = q.shape[0]
        q = self.norm(q.reshape(n_tok, -1), layer.attn_q_norm).reshape(q.shape)  # RMSNorm over q_dim
        k = self.norm(k.reshape(n_tok, -1), layer.attn_k_norm).reshape(k.shape)
        x += self.out_proj(layer, self.attend(il, q, k, v, batch))
        h = self.norm(x, layer.ffn_norm)
        x += self.ffn(layer, h, ACT_SILU)
        return x
