"""`llama` (Llama 2/3, Mistral, TinyLlama, SmolLM2): llama.cpp's src/models/llama.cpp.

- RoPE on interleaved pairs (llama.cpp "norm" mode): the HF->GGUF converter permuted Q/K rows.
- Llama 3.1+ stores per-frequency divisors in `rope_freqs.weight`; rope scaling "linear"
  divides positions by its factor.
- SwiGLU FFN; output tied to the embedding when the file has no `output.weight`.
- `expert_count` > 0 (Mixtral): every FFN is a mixture of experts (models/moe.py): softmax
  router, top-k weights renormalised, experts as wide as feed_forward_length, `ffn_gate_exps`
  optional (llama.cpp: act(up) alone without it).

    x += attn_output(attention(RoPE(q, k), v))   on RMSNorm(x, attn_norm)
    x += ffn_down(silu(ffn_gate h) * ffn_up h)   on h = RMSNorm(x, ffn_norm)
"""

from __future__ import annotations

from .args import ModelArgs
from .base import ACT_SILU, Transformer, WeightReader
from .moe import load_moe_weights, read_moe_args


class Llama(Transformer):
    arch = "llama"

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        return read_moe_args(md, super().read_args(md), required=False)

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        if args.n_expert:  # Mixtral
            w = load_moe_weights(cls, gf, args, norm_w=True, gate_optional=True)
        else:
            w = super().load_weights(gf, args)
        w.rope_freqs = WeightReader(gf).optional_vector("rope_freqs.weight", args.n_rot // 2)
        return w

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)
        x += self.out_proj(layer, self.attend(il, q, k, v, batch))
        h = self.norm(x, layer.ffn_norm)
        x += self.ffn(layer, h, ACT_SILU)
        return x
