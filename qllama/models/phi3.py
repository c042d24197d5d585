"""`phi3` (Phi-3, Phi-3.5-mini, Phi-4-mini): llama.cpp's src/models/phi3.cpp and load_arch_hparams.

What differs from llama:
- fused projections: `attn_qkv` holds Q|K|V rows, `ffn_up` holds gate|up (gate first);
- RoPE on NeoX halves, possibly on part of head_dim only (`rope.dimension_count`, Phi-4-mini: 3/4);
- LongRoPE: per-frequency divisors `rope_factors_long` when the context (n_ctx) exceeds
  `rope.scaling.original_context_length`, else `rope_factors_short`, as llama.cpp's
  get_rope_factors chooses; cos and sin are multiplied by `rope.scaling.attn_factor`;
- `attention.sliding_window` is ignored: llama.cpp disables Phi's sliding window (a warning in
  its loader), and we compute what it computes.
"""

from __future__ import annotations

from .args import ModelArgs, read_common_args
from .base import ACT_SILU, Transformer, WeightReader


class Phi3(Transformer):
    arch = "phi3"

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        return read_common_args(md, "phi3", neox=True)  # no window: see the module docstring

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        r = WeightReader(gf)
        w = r.model(args, [r.layer(i, args, fused_ffn=True) for i in range(args.n_layer)])
        half = args.n_rot // 2
        w.rope_freqs = r.optional_vector("rope_freqs.weight", half)
        w.rope_factors_long = r.optional_vector("rope_factors_long.weight", half)
        w.rope_factors_short = r.optional_vector("rope_factors_short.weight", half)
        return w

    def rope_factors(self, n_ctx):
        w = self.weights
        if w.rope_freqs is not None:
            return w.rope_freqs
        return w.rope_factors_long if n_ctx > self.args.n_ctx_orig else w.rope_factors_short

    def block(self, il, layer, x, batch):
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)  # one attn_qkv projection, split
        x += self.out_proj(layer, self.attend(il, q, k, v, batch))
        h = self.norm(x, layer.ffn_norm)
        x += self.ffn(layer, h, ACT_SILU)  # one ffn_up projection: gate|up
        return x
