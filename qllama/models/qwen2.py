"""`qwen2` (Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen): llama.cpp's src/models/qwen2.cpp.

What differs from llama:
- biases on Q, K and V (`attn_q.bias`, `attn_k.bias`, `attn_v.bias`), added after the projections;
- RoPE on NeoX halves (x[i], x[i + n_rot/2]);
- output tied to the embedding when the file has no `output.weight` (the 0.5B-3B models).

    x += attn_output(attention(RoPE(q + bq, k + bk), v + bv))   on RMSNorm(x, attn_norm)
    x += ffn_down(silu(ffn_gate h) * ffn_up h)                  on h = RMSNorm(x, ffn_norm)
"""

from __future__ import annotations

from .args import ModelArgs, read_common_args
from .base import ACT_SILU, Transformer, WeightReader


class Qwen2(Transformer):
    arch = "qwen2"

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        return read_common_args(md, "qwen2", neox=True)

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        r = WeightReader(gf)
        return r.model(args, [r.layer(i, args) for i in range(args.n_layer)])  # biases: read when present

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)  # + attn_q/k/v.bias
        x += self.out_proj(layer, self.attend(il, q, k, v, batch))
        h = self.norm(x, layer.ffn_norm)
        x += self.ffn(layer, h, ACT_SILU)
        return x
