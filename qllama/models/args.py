"""Hyper-parameters: `ModelArgs` and the reader of the keys every architecture shares.

`read_common_args` reads what llama.cpp's loader reads for every architecture (llama-model.cpp,
`load_hparams`) with its defaults; each architecture module then reads its own keys (window,
softcaps, scales) and replaces fields. Metadata comes from an untrusted file: every value is
checked before it sizes anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import QllamaError, UnsupportedError

DEFAULT_N_CTX_CAP = 4096  # n_ctx defaults to min(context_length, this)
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: per-layer tables are sized by block_count
_REQUIRED = object()


class Keys:
    """Typed access to the `<arch>.*` metadata keys of one file."""

    def __init__(self, md: Mapping[str, Any], arch: str):
        self.md = md
        self.arch = arch

    def has(self, name: str) -> bool:
        return f"{self.arch}.{name}" in self.md

    def raw(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self.md.get(f"{self.arch}.{name}")
        if value is None:
            if default is _REQUIRED:
                raise QllamaError(f"missing metadata key {self.arch}.{name}")
            return default
        return value

    def int(self, name: str, default: Any = _REQUIRED) -> int:
        value = self.raw(name, default)
        if value is None:
            return value
        if hasattr(value, "__len__"):  # a per-layer array: qllama runs uniform layers only
            vals = {int(v) for v in value}
            if len(vals) != 1:
                raise UnsupportedError(f"{self.arch}.{name} varies per layer; qllama runs uniform layers only")
            value = vals.pop()
        try:
            return int(value)
        except (TypeError, ValueError):
            raise QllamaError(f"metadata key {self.arch}.{name} should be an integer, got {value!r}") from None

    def float(self, name: str, default: Any = _REQUIRED) -> float:
        value = self.raw(name, default)
        if value is None:
            return value
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise QllamaError(f"metadata key {self.arch}.{name} should be a number, got {value!r}") from None
        rule, holds = FLOAT_RULES.get(name, ("finite", lambda v: True))
        if not (math.isfinite(out) and holds(out)):
            raise QllamaError(f"{self.arch}.{name} = {value!r}: must be {rule}")
        return out


# What a hyper-parameter must satisfy besides being finite (checked when it is read, for every
# family). A scaling factor of exactly 0 means "no scaling", as llama.cpp reads it.
FLOAT_RULES: dict[str, tuple[str, Any]] = {
    "attention.layer_norm_rms_epsilon": ("finite and >= 0", lambda v: v >= 0),
    "rope.freq_base": ("finite and > 0", lambda v: v > 0),
    "rope.freq_base_swa": ("finite and > 0", lambda v: v > 0),
    "rope.scaling.factor": ("finite and > 0 (or 0: no scaling)", lambda v: v >= 0),
    "rope.scale_linear": ("finite and > 0 (or 0: no scaling)", lambda v: v >= 0),
    "rope.scaling.attn_factor": ("finite and > 0", lambda v: v > 0),
    "attn_logit_softcapping": ("finite and >= 0", lambda v: v >= 0),
    "final_logit_softcapping": ("finite and >= 0", lambda v: v >= 0),
    "logit_scale": ("finite and > 0", lambda v: v > 0),
}


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters with llama.cpp's defaults for absent keys (shared fields, every family)."""

    arch: str
    n_ctx_train: int  # {arch}.context_length
    n_embd: int  # {arch}.embedding_length
    n_layer: int  # {arch}.block_count
    n_ff: int  # {arch}.feed_forward_length
    n_head: int  # {arch}.attention.head_count
    n_head_kv: int  # {arch}.attention.head_count_kv (default: n_head, i.e. MHA)
    head_dim: int  # {arch}.attention.key_length (default n_embd / n_head); value_length must equal it
    rms_eps: float  # {arch}.attention.layer_norm_rms_epsilon
    n_vocab: int  # {arch}.vocab_size, else the tokenizer's token count
    # RoPE
    rope_neox: bool  # NeoX halves (qwen, gemma, phi) instead of interleaved pairs (llama)
    rope_freq_base: float  # {arch}.rope.freq_base (default 10000)
    n_rot: int  # {arch}.rope.dimension_count (default: head_dim)
    rope_scale: float  # positions are divided by this (linear scaling factor; 1.0 = none)
    rope_attn_factor: float = 1.0  # {arch}.rope.scaling.attn_factor: cos and sin are multiplied by it
    n_ctx_orig: int = 0  # {arch}.rope.scaling.original_context_length (default: n_ctx_train)
    # attention
    attn_scale: float = 0.0  # multiplies q.k (default 1/sqrt(head_dim))
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap); 0 = off
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap); 0 = off
    # sliding-window attention
    n_swa: int = 0  # window (positions a query sees, itself included); 0 = no window layers
    swa_layers: tuple[bool, ...] = ()  # per layer: windowed or not
    rope_freq_base_swa: float = 10000.0  # RoPE of the window layers
    rope_scale_swa: float = 1.0
    # mixture of experts (models/moe.py reads these; 0 experts = a dense FFN)
    n_expert: int = 0  # {arch}.expert_count
    n_expert_used: int = 0  # {arch}.expert_used_count: experts run per token
    n_ff_exp: int = 0  # rows of each expert's gate/up (expert_feed_forward_length, or the family's rule)
    n_ff_shexp: int = 0  # rows of the shared expert's gate/up; 0 = no shared expert
    # Granite's scales (0 = none): embeddings and each block's two branches are multiplied, logits divided
    embd_scale: float = 0.0
    residual_scale: float = 0.0
    logit_scale: float = 0.0

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def is_swa(self, il: int) -> bool:
        return self.n_swa > 0 and bool(self.swa_layers) and self.swa_layers[il]

    def default_n_ctx(self) -> int:
        return min(self.n_ctx_train, DEFAULT_N_CTX_CAP)


def read_common_args(md: Mapping[str, Any], arch: str, *, neox: bool) -> ModelArgs:
    """The keys llama.cpp reads for every architecture, with its defaults."""
    key = Keys(md, arch)
    n_embd = key.int("embedding_length")
    n_head = key.int("attention.head_count")
    n_head_kv = key.int("attention.head_count_kv", n_head)
    n_layer = key.int("block_count")
    n_ff = key.int("feed_forward_length")
    if min(n_embd, n_head, n_head_kv, n_layer, n_ff) <= 0:
        raise QllamaError("model dimensions must be positive")
    if n_layer > MAX_LAYERS:
        raise QllamaError(f"block_count {n_layer} is more than {MAX_LAYERS} (llama.cpp's limit)")
    if n_head % n_head_kv:
        raise QllamaError(f"inconsistent heads: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if not key.has("attention.key_length") and n_embd % n_head:
        raise QllamaError(f"inconsistent heads: n_embd {n_embd}, head_count {n_head}, head_count_kv {n_head_kv}")
    head_dim = key.int("attention.key_length", n_embd // n_head)
    head_dim_v = key.int("attention.value_length", n_embd // n_head if not key.has("attention.key_length") else head_dim)
    if head_dim <= 0 or head_dim != head_dim_v:
        raise UnsupportedError(f"key_length {head_dim} and value_length {head_dim_v} must be equal and positive")
    n_rot = key.int("rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2 or n_rot <= 0:
        raise QllamaError(f"rope.dimension_count {n_rot} must be even, positive and <= head_dim {head_dim}")

    rope_scale = 1.0
    scaling_type = key.raw("rope.scaling.type", None)
    factor = key.float("rope.scaling.factor", None)
    if factor is None:  # older converters wrote only `rope.scale_linear`
        factor = key.float("rope.scale_linear", None)
    if scaling_type in (None, "linear"):
        rope_scale = factor if factor else 1.0
    elif scaling_type == "none":
        pass
    elif scaling_type == "llama3" or scaling_type == "longrope":
        pass  # the factors are tensors (rope_freqs.weight, rope_factors_long/short.weight)
    else:
        raise UnsupportedError(f"RoPE scaling type {scaling_type!r} is not supported (qllama runs: linear)")

    n_vocab = key.int("vocab_size", None)
    if n_vocab is None:
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise QllamaError(f"missing {arch}.vocab_size and tokenizer.ggml.tokens")
        n_vocab = len(tokens)
    n_ctx_train = key.int("context_length")
    return ModelArgs(
        arch=arch,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        rms_eps=key.float("attention.layer_norm_rms_epsilon", 1e-5),
        n_vocab=int(n_vocab),
        rope_neox=neox,
        rope_freq_base=key.float("rope.freq_base", 10000.0),
        n_rot=n_rot,
        rope_scale=rope_scale,
        rope_attn_factor=key.float("rope.scaling.attn_factor", 1.0),
        n_ctx_orig=key.int("rope.scaling.original_context_length", n_ctx_train),
        attn_scale=1.0 / math.sqrt(head_dim),
    )


def swa_pattern(md: Mapping[str, Any], arch: str, n_layer: int, default_period: int) -> tuple[bool, ...]:
    """Which layers are windowed, as llama.cpp's load_swa_pattern: a per-layer bool array, or a
    period n (`attention.sliding_window_pattern`, else the family's default): layer il is
    windowed when il % n < n - 1 (the last layer of each period is global)."""
    value = md.get(f"{arch}.attention.sliding_window_pattern")
    if value is not None and hasattr(value, "__len__") and not isinstance(value, str):
        flags = tuple(bool(v) for v in value)
        if len(flags) != n_layer:
            raise QllamaError(f"{arch}.attention.sliding_window_pattern has {len(flags)} entries for {n_layer} layers")
        return flags
    period = default_period if value is None else Keys(md, arch).int("attention.sliding_window_pattern")
    if period < 0:
        raise QllamaError(f"{arch}.attention.sliding_window_pattern must be >= 0, got {period}")
    return tuple(period == 0 or il % period < period - 1 for il in range(n_layer))
