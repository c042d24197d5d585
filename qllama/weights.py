"""Named model tensors: the only place GGUF tensor names are spelled.

Attributes are named after the GGUF tensors (`blk.N.attn_q.weight` -> `layers[N].attn_q`), so
loading needs no renaming table. Matrices are `QTensor`s (packed, zero-copy views into the
mmap); 1-D tensors (norm weights, rope factors) are small float32 arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelArgs
from .errors import QllamaError, UnsupportedError
from .gguf import GGUFFile
from .qtensor import QTensor


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (n_embd,) float32
    attn_q: QTensor  # [n_embd, n_embd]            (GGUF order: ne0 = input dim)
    attn_k: QTensor  # [n_embd, n_head_kv*head_dim]
    attn_v: QTensor  # [n_embd, n_head_kv*head_dim]
    attn_output: QTensor  # [n_embd, n_embd]
    ffn_norm: np.ndarray  # (n_embd,) float32
    ffn_gate: QTensor  # [n_embd, n_ff]
    ffn_up: QTensor  # [n_embd, n_ff]
    ffn_down: QTensor  # [n_ff, n_embd]


@dataclass
class LlamaWeights:
    token_embd: QTensor  # [n_embd, n_vocab]: rows are dequantized on demand
    output_norm: np.ndarray  # (n_embd,) float32
    output: QTensor  # [n_embd, n_vocab]; is token_embd when the file ties them
    tied_output: bool
    rope_freqs: np.ndarray | None  # (n_rot/2,) float32 frequency divisors (Llama 3.1+), or None
    layers: list[LayerWeights]

    @classmethod
    def from_gguf(cls, gf: GGUFFile, args: ModelArgs) -> "LlamaWeights":
        def vector(name: str, length: int) -> np.ndarray:
            info = gf.tensors.get(name)
            if info is None:
                raise QllamaError(f"missing tensor {name!r}")
            if info.type_name not in ("f32", "f16", "bf16") or info.n_elements != length:
                raise UnsupportedError(f"tensor {name!r} should be a float vector of {length}, got {info.type_name} {list(info.shape)}")
            arr = gf.tensor_array(name).reshape(length)
            if info.type_name == "bf16":
                return (arr.astype(np.uint32) << 16).view(np.float32)
            return np.ascontiguousarray(arr, dtype=np.float32)

        def matrix(name: str, ne0: int, ne1: int) -> QTensor:
            if name not in gf.tensors:
                raise QllamaError(f"missing tensor {name!r}")
            shape = gf.tensors[name].shape
            if tuple(shape) != (ne0, ne1):
                raise QllamaError(f"tensor {name!r} has shape {list(shape)}, expected {[ne0, ne1]}")
            return QTensor.from_gguf(gf, name)

        d, kv, ff = args.n_embd, args.kv_dim, args.n_ff
        layers = []
        for i in range(args.n_layer):
            p = f"blk.{i}."
            layers.append(
                LayerWeights(
                    attn_norm=vector(p + "attn_norm.weight", d),
                    attn_q=matrix(p + "attn_q.weight", d, d),
                    attn_k=matrix(p + "attn_k.weight", d, kv),
                    attn_v=matrix(p + "attn_v.weight", d, kv),
                    attn_output=matrix(p + "attn_output.weight", d, d),
                    ffn_norm=vector(p + "ffn_norm.weight", d),
                    ffn_gate=matrix(p + "ffn_gate.weight", d, ff),
                    ffn_up=matrix(p + "ffn_up.weight", d, ff),
                    ffn_down=matrix(p + "ffn_down.weight", ff, d),
                )
            )
        token_embd = matrix("token_embd.weight", d, args.n_vocab)
        tied = "output.weight" not in gf.tensors
        output = token_embd if tied else matrix("output.weight", d, args.n_vocab)
        rope_freqs = vector("rope_freqs.weight", args.n_rot // 2) if "rope_freqs.weight" in gf.tensors else None
        return cls(
            token_embd=token_embd,
            output_norm=vector("output_norm.weight", d),
            output=output,
            tied_output=tied,
            rope_freqs=rope_freqs,
            layers=layers,
        )
