"""Presets and llama.cpp's per-tensor type mix (`llama_tensor_get_type` in src/llama-quant.cpp).

`choose_tensor_type` picks the ggml type of one tensor for a preset in `PRESETS`.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple

from ..errors import QllamaError, UnsupportedError
from ..gguf.types import (BF16, F16, F32, GGML_TYPES, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, MXFP4,
                          Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TQ1_0, TQ2_0)
from .blocks import FLOAT_TYPES


class Preset(NamedTuple):
    """A `llama-quantize` file type: its llama_ftype value and its default tensor type."""

    name: str
    ftype: int  # enum llama_ftype, written to general.file_type
    default_type: int


# (name, llama_ftype, default type); `get_preset` lists them in this order when a name is unknown
PRESETS: dict[str, Preset] = {name: Preset(name, ftype, t) for name, ftype, t in (
    ("Q4_K_M", 15, Q4_K), ("Q5_K_M", 17, Q5_K), ("Q6_K", 18, Q6_K), ("Q8_0", 7, Q8_0), ("Q4_0", 2, Q4_0),
    ("Q4_K_S", 14, Q4_K), ("Q5_K_S", 16, Q5_K), ("Q4_1", 3, Q4_1), ("Q5_0", 8, Q5_0), ("Q5_1", 9, Q5_1),
    ("F16", 1, F16), ("BF16", 32, BF16), ("F32", 0, F32),
    ("MXFP4_MOE", 38, MXFP4),  # experts (3-D tensors) MXFP4, every other quantized tensor q8_0
    ("Q2_K", 10, Q2_K), ("Q3_K_S", 11, Q3_K), ("Q3_K_M", 12, Q3_K), ("Q3_K_L", 13, Q3_K),
    ("IQ4_NL", 25, IQ4_NL), ("IQ4_XS", 30, IQ4_XS),
    ("Q2_K_S", 21, Q2_K),  # needs an importance matrix
    ("IQ3_S", 26, IQ3_S), ("IQ3_M", 27, IQ3_S),
    ("TQ1_0", 36, TQ1_0), ("TQ2_0", 37, TQ2_0),
    # these need an importance matrix (their grid types do, in llama.cpp)
    ("IQ3_XXS", 23, IQ3_XXS), ("IQ3_XS", 22, IQ3_S), ("IQ2_XXS", 19, IQ2_XXS), ("IQ2_XS", 20, IQ2_XS),
    ("IQ2_S", 28, IQ2_XS), ("IQ2_M", 29, IQ2_S), ("IQ1_S", 24, IQ1_S), ("IQ1_M", 31, IQ1_M),
)}
NEEDS_IMATRIX = ("Q2_K_S", "IQ3_XXS", "IQ3_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")
# llama-quantize's presets qllama cannot write yet (none left of its i-quant and k-quant mixes)
NOT_YET: tuple[str, ...] = ()


def needs_imatrix_message(name: str) -> str:
    from .imatrix import IMATRIX_HOWTO

    return f"{name} needs an importance matrix: give one with --imatrix FILE ({IMATRIX_HOWTO})"


def get_preset(name: str) -> Preset:
    """Look up a preset by name, case-insensitively (`q4_k_m` works)."""
    for key, preset in PRESETS.items():
        if key.lower() == str(name).lower():
            return preset
    if str(name).upper() in NOT_YET:
        raise UnsupportedError(f"qllama cannot write {str(name).upper()} files yet (llama.cpp's llama-quantize can); "
                               f"choose one of: {', '.join(PRESETS)}")
    raise QllamaError(f"unknown quantization type {name!r}; choose one of: {', '.join(PRESETS)}")


# When ne0 is not a multiple of a k-quant's 256, llama.cpp falls back to a 32-block type.
_FALLBACK = {Q2_K: Q4_0, Q3_K: Q4_0, TQ1_0: Q4_0, TQ2_0: Q4_0, IQ3_S: IQ4_NL, IQ3_XXS: IQ4_NL, IQ2_XXS: IQ4_NL, IQ2_XS: IQ4_NL, IQ2_S: IQ4_NL, IQ1_S: IQ4_NL, IQ1_M: IQ4_NL, IQ4_XS: IQ4_NL, Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}  # (the pinned llama.cpp)

# the presets of llama.cpp's very-low-bit i-quant mix (one branch of llama_tensor_get_type)
_LOW_BIT_IQ = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")


def tensor_requires_imatrix(name: str, dst_type: int, preset: str) -> bool:
    """llama.cpp's tensor_requires_imatrix: the grid i-quants (and q2_K in a Q2_K_S file) need
    importance weights, except in token_embd / output."""
    if name in ("token_embd.weight", "output.weight"):
        return False
    return dst_type in (IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M, IQ1_S) or (dst_type == Q2_K and preset == "Q2_K_S")


# Substrings of weight names llama.cpp never quantizes (besides 1-D tensors and *_norm.weight).
_NEVER_QUANTIZED = (
    "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d",
    "shortconv.conv.weight", "attn_rel_b.weight", "time_mix_", "position_embd", "token_types",
    ".rel_pos", ".patch_embd", ".patch_merger",
)
_LAYER_RE = re.compile(r"blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_is_quantized(name: str, shape: Iterable[int]) -> bool:
    """Whether llama.cpp quantizes this tensor at all (weights of >= 2 dims, not norms/gates...)."""
    dims = [d for d in shape]
    if len(dims) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return False
    return not any(s in name for s in _NEVER_QUANTIZED)


def _layer_index(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def choose_tensor_type(
    name: str,
    shape,
    preset: str,
    n_layers: int,
    *,
    current_type: int = F32,
    n_attn_v: int | None = None,
    tied_embeddings: bool = False,
    n_expert: int = 0,
    is_70b: bool = False,
    n_gqa: int = 1,
    has_imatrix: bool = False,
) -> int:
    """The ggml type llama.cpp's `llama_tensor_get_type` picks for one tensor.

    shape is in GGUF order (ne0 first). n_layers is `{arch}.block_count`; n_attn_v the number
    of attn_v tensors (default n_layers); tied_embeddings when the file has no output.weight
    (token_embd then gets the output's type); n_gqa = head_count / head_count_kv; has_imatrix
    when an importance matrix is given (it changes a few choices). Tensors llama.cpp does not
    quantize (1-D, norms...) keep `current_type`. E.g. for the `_M` presets: output (and tied
    token_embd) -> q6_K; attn_v and ffn_down of the use_more_bits() layers -> q6_K. A type whose
    block does not divide ne0 falls back as `_FALLBACK` says (then to f16).
    """
    p = get_preset(preset)
    shape = tuple(int(d) for d in shape)
    if not tensor_is_quantized(name, shape):
        return current_type
    new = p.default_type
    ft = p.name
    if p.default_type in FLOAT_TYPES:
        return new  # F16/BF16/F32 presets: no mix, no fallback
    ne0 = shape[0]
    i = _layer_index(name) or 0
    if ft == "MXFP4_MOE":  # llama.cpp: output (and a tied embedding) q8_0; MoE tensors MXFP4, the rest q8_0
        is_output = name == "output.weight" or (tied_embeddings and name == "token_embd.weight")
        new = MXFP4 if not is_output and len(shape) > 2 and shape[2] > 1 else Q8_0
    elif name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        if ne0 % GGML_TYPES[new].block_size:
            new = Q8_0
        elif ft in _LOW_BIT_IQ or ft == "IQ3_XXS":
            new = Q5_K
        elif new != Q8_0:
            new = Q6_K
    elif name == "token_embd.weight":
        if ft in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            new = Q2_K
        elif ft in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            new = IQ3_S
        elif ft in ("TQ1_0", "TQ2_0"):
            new = Q4_K
    elif ft in _LOW_BIT_IQ:
        iq2_sm = ft in ("IQ2_S", "IQ2_M")
        if any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")):
            new = Q4_K if n_gqa >= 4 or n_expert >= 4 else (IQ3_S if iq2_sm else Q2_K)
        elif n_expert == 8 and "attn_k.weight" in name:
            new = Q4_K
        elif "ffn_down" in name:
            if i < n_layers // 8:
                new = IQ3_S if iq2_sm else Q2_K
        elif "attn_output.weight" in name:
            if n_expert == 8:
                new = Q5_K
            elif ft in ("IQ1_S", "IQ1_M"):
                new = IQ2_XXS
            elif iq2_sm:
                new = IQ3_S
    elif any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")):
        n = n_attn_v if n_attn_v is not None else n_layers
        if ft == "Q2_K":
            new = Q4_K if n_gqa >= 4 else Q3_K
        elif ft == "Q2_K_S" and n_gqa >= 4:
            new = Q4_K
        elif ft == "IQ3_XXS":
            new = Q4_K if n_gqa >= 4 else IQ3_XXS if has_imatrix else IQ3_S
        elif (ft in ("IQ3_S", "IQ3_XS") and n_gqa >= 4) or ft == "IQ3_M":
            new = Q4_K
        elif ft == "Q3_K_M":
            new = Q5_K if i < 2 else Q4_K
        elif ft == "Q3_K_L":
            new = Q5_K
        elif ft in ("IQ4_NL", "IQ4_XS") and n_gqa >= 4:
            new = Q5_K
        elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            new = Q6_K
        elif ft == "Q4_K_S" and i < 4:
            new = Q5_K
        if is_70b and new in (Q3_K, Q4_K):  # 8 heads share attn_v: more bits are nearly free
            new = Q5_K
        if n_expert == 8:
            new = Q8_0
    elif "attn_k.weight" in name or "attn_q.weight" in name:
        if n_expert == 8 and "attn_k.weight" in name:
            new = Q8_0
        elif ft in ("IQ3_XS", "IQ3_XXS"):  # q and k a step below the preset's type
            new = IQ3_XXS if ft == "IQ3_XS" else IQ2_S
    elif "ffn_down" in name:
        if ft == "Q2_K":
            new = Q3_K
        elif ft == "Q2_K_S":
            new = Q4_K if i < n_layers // 8 else new
        elif ft == "IQ3_XXS" and not has_imatrix:
            new = Q4_K if i < n_layers // 8 else Q3_K
        elif ft == "Q3_K_M":
            new = Q5_K if i < n_layers // 16 else Q4_K
        elif ft == "IQ3_M" and (i < n_layers // 8 or (n_expert == 8 and use_more_bits(i, n_layers))):
            new = Q4_K
        elif ft == "Q3_K_L":
            new = Q5_K
        elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n_layers):
            new = Q6_K
        elif ft in ("IQ4_NL", "IQ4_XS") and i < n_layers // 8 and not has_imatrix:
            new = Q5_K
        elif ft == "Q4_K_S" and i < n_layers // 8:
            new = Q5_K
        elif ft in ("Q4_0", "Q5_0") and has_imatrix and i < n_layers // 8:
            new = Q4_1 if ft == "Q4_0" else Q5_1  # llama.cpp's guard for the first ffn_down layers
    elif "attn_output.weight" in name:
        if n_expert == 8:
            if ft in ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M",
                      "IQ4_XS"):
                new = Q5_K
        else:
            new = {"Q2_K": Q3_K, "IQ3_XXS": IQ3_S, "Q3_K_M": Q4_K, "Q3_K_L": Q5_K, "IQ3_M": Q4_K}.get(ft, new)
    elif ("ffn_gate" in name or "ffn_up" in name) and ft == "IQ3_XS":
        if n_layers // 8 <= i < 7 * n_layers // 8:
            new = IQ3_XXS
    # shapes a type cannot hold
    if ne0 % GGML_TYPES[new].block_size:
        new = _FALLBACK.get(new, F16)
        if ne0 % GGML_TYPES[new].block_size:
            new = F16
    return new
