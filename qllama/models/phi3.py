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

from .args import ModelArgs
from .base import Transformer, WeightReader
from .llama import Llama


class Phi3(Transformer):
    arch = "phi3"
    rope_neox = True  # and no sliding window: see the module docstring
    layer_tensors = {"fused_ffn": True}
    q_prescaled = True  # llama.cpp scales Q by 1/sqrt(head_dim) before attention (kq_scale 1)
    block = Llama.block  # `qkv` splits the one attn_qkv projection, `ffn` the one gate|up ffn_up

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        w = super().load_weights(gf, args)
        r = WeightReader(gf)
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
