"""`qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): llama.cpp's src/models/qwen3moe.cpp.

Attention as qwen3 (per-head Q/K RMSNorm before NeoX RoPE, no biases, head_dim from
`attention.key_length`); every FFN is a mixture of experts (models/moe.py): softmax router over
`expert_count` experts, the top `expert_used_count` weights renormalised to sum 1, no shared
expert. Each expert's width is `expert_feed_forward_length` (else feed_forward_length /
expert_used_count, as llama.cpp).
"""

from __future__ import annotations

from .args import ModelArgs
from .base import Transformer
from .moe import load_moe_weights, read_moe_args
from .qwen3 import Qwen3


class Qwen3Moe(Transformer):
    arch = "qwen3moe"
    rope_neox = True
    layer_tensors = {"qk_norm": True}
    block = Qwen3.block  # its `ffn` runs the layer's MoeFFN

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        return read_moe_args(md, super().read_args(md), required=True, n_ff_exp="key")

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        return load_moe_weights(cls, gf, args, norm_w=True)
