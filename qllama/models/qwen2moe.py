"""`qwen2moe` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): llama.cpp's src/models/qwen2moe.cpp.

Attention as qwen2 (Q/K/V biases, NeoX RoPE); every FFN is a mixture of experts (models/moe.py):
softmax router, top-k weights not renormalised, experts of `expert_feed_forward_length` (else
feed_forward_length / expert_used_count), plus a shared expert of
`expert_shared_feed_forward_length` (else feed_forward_length) whose output is multiplied by
sigmoid(h . ffn_gate_inp_shexp) and added. output.weight is required.
"""

from __future__ import annotations

from ..errors import QllamaError
from .args import ModelArgs
from .base import Transformer, WeightReader
from .llama import Llama
from .moe import load_moe_weights, read_moe_args


class Qwen2Moe(Transformer):
    arch = "qwen2moe"
    rope_neox = True
    block = Llama.block  # (qkv adds the biases; ffn runs the MoeFFN with its shared expert)

    @classmethod
    def read_args(cls, md) -> ModelArgs:
        return read_moe_args(md, super().read_args(md), required=True, n_ff_exp="key", shared="always")

    @classmethod
    def load_weights(cls, gf, args: ModelArgs):
        if not WeightReader(gf).has("output.weight"):
            raise QllamaError("missing tensor 'output.weight'")
        return load_moe_weights(cls, gf, args, norm_w=False, shared_gate=True)
