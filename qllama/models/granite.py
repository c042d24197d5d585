"""`granite` (Granite 3.x dense) and `granitemoe` (Granite 3.x MoE): llama.cpp's src/models/granite.cpp,
one graph for both.

What differs from llama (interleaved RoPE, SwiGLU, as llama):
- `embedding_scale`: the embedding rows are multiplied by it (0 or absent: not);
- `residual_scale`: the attention and FFN outputs are multiplied by it before each residual add;
- `attention.scale`: the query scale instead of 1/sqrt(head_dim) (0 or absent: the default);
- `logit_scale` (required): logits are divided by it (multiplied by 1/scale in float32);
- with `expert_count` > 0 (granitemoe; llama.cpp's loader takes experts in `granite` too), the
  FFN is a mixture of experts (models/moe.py): softmax router, top-k weights renormalised, and
  an optional shared expert (`expert_shared_feed_forward_length` > 0) added without a gate.
- `rope.scaling.finetuned` false would switch RoPE off in llama.cpp; qllama refuses such a file.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import UnsupportedError
from .args import Keys, ModelArgs
from .base import ACT_SILU, Transformer, WeightReader
from .moe import load_moe_weights, read_moe_args


class Granite(Transformer):
    arch = "granite"

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        a = super().read_args(md)
        key = Keys(md, cls.arch)
        if not md.get(f"{cls.arch}.rope.scaling.finetuned", True):
            raise UnsupportedError(f"{cls.arch}.rope.scaling.finetuned is false (no RoPE): not supported")
        attn = key.float("attention.scale", 0.0)
        a = replace(a, logit_scale=key.float("logit_scale"), residual_scale=key.float("residual_scale", 0.0),
                    embd_scale=key.float("embedding_scale", 0.0), attn_scale=attn if attn else a.attn_scale)
        return read_moe_args(md, a, required=False, shared="key")

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        w = load_moe_weights(cls, gf, args, norm_w=True) if args.n_expert else super().load_weights(gf, args)
        w.rope_freqs = WeightReader(gf).optional_vector("rope_freqs.weight", args.n_rot // 2)
        return w

    def embed(self, tokens):
        x = super().embed(tokens)
        if self.args.embd_scale:
            x *= np.float32(self.args.embd_scale)
        return x

    def block(self, il, layer, x, batch):
        rs = np.float32(self.args.residual_scale)
        h = self.norm(x, layer.attn_norm)
        q, k, v = self.qkv(layer, h)
        a = self.out_proj(layer, self.attend(il, q, k, v, batch))
        x += a * rs if rs else a
        h = self.norm(x, layer.ffn_norm)
        f = self.ffn(layer, h, ACT_SILU)
        x += f * rs if rs else f
        return x

    def final_logits(self, logits):
        logits *= np.float32(1.0) / np.float32(self.args.logit_scale)
        return logits


class GraniteMoe(Granite):
    arch = "granitemoe"
