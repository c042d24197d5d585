"""`qwen2` (Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen): llama.cpp's src/models/qwen2.cpp.

What differs from llama:
- biases on Q, K and V (`attn_q.bias`, `attn_k.bias`, `attn_v.bias`), added after the projections;
- RoPE on NeoX halves (x[i], x[i + n_rot/2]);
- output tied to the embedding when the file has no `output.weight` (the 0.5B-3B models).

    x += attn_output(attention(RoPE(q + bq, k + bk), v + bv))   on RMSNorm(x, attn_norm)
    x += ffn_down(silu(ffn_gate h) * ffn_up h)                  on h = RMSNorm(x, ffn_norm)
"""

from __future__ import annotations

from .base import Transformer
from .llama import Llama


class Qwen2(Transformer):
    arch = "qwen2"
    rope_neox = True
    block = Llama.block  # the same order of operations; `qkv` adds the biases the file has
