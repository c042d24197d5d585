"""Model hyper-parameters: the only reader of the `{arch}.*` metadata keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import QllamaError, UnsupportedError

SUPPORTED_ARCHITECTURES = ("llama",)
DEFAULT_N_CTX_CAP = 4096  # n_ctx defaults to min(context_length, this)


@dataclass(frozen=True)
class ModelArgs:
    """Llama hyper-parameters with llama.cpp's defaults for absent keys."""

    arch: str
    n_ctx_train: int  # {arch}.context_length
    n_embd: int  # {arch}.embedding_length
    n_layer: int  # {arch}.block_count
    n_ff: int  # {arch}.feed_forward_length
    n_head: int  # {arch}.attention.head_count
    n_head_kv: int  # {arch}.attention.head_count_kv (default: n_head, i.e. MHA)
    rms_eps: float  # {arch}.attention.layer_norm_rms_epsilon
    rope_freq_base: float  # {arch}.rope.freq_base (default 10000)
    n_rot: int  # {arch}.rope.dimension_count (default: head_dim)
    rope_scale: float  # positions are divided by this (linear scaling factor; 1.0 = none)
    n_vocab: int  # {arch}.vocab_size, else the tokenizer's token count

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_head // self.n_head_kv

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "ModelArgs":
        arch = md.get("general.architecture")
        if arch is None:
            raise QllamaError("the file has no general.architecture: not a model GGUF")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedError(
                f"architecture {arch!r} is not supported (qllama runs: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def key(name: str, default: Any = None, required: bool = True) -> Any:
            value = md.get(f"{arch}.{name}", default)
            if value is None and required:
                raise QllamaError(f"missing metadata key {arch}.{name}")
            return value

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        n_head_kv = int(key("attention.head_count_kv", n_head))
        n_layer = int(key("block_count"))
        n_ff = int(key("feed_forward_length"))
        if min(n_embd, n_head, n_head_kv, n_layer, n_ff) <= 0:
            raise QllamaError("model dimensions must be positive")
        if n_embd % n_head or n_head % n_head_kv:
            raise QllamaError(
                f"inconsistent heads: n_embd {n_embd}, head_count {n_head}, head_count_kv {n_head_kv}"
            )
        head_dim = n_embd // n_head
        n_rot = int(key("rope.dimension_count", head_dim))
        if n_rot > head_dim or n_rot % 2:
            raise QllamaError(f"rope.dimension_count {n_rot} must be even and <= head_dim {head_dim}")

        rope_scale = 1.0
        scaling_type = key("rope.scaling.type", None, required=False)
        factor = key("rope.scaling.factor", None, required=False)
        if scaling_type in (None, "none"):
            pass
        elif scaling_type == "linear":
            rope_scale = float(factor) if factor else 1.0
        elif scaling_type == "llama3":
            pass  # the Llama 3.1 factors live in rope_freqs.weight (weights.py)
        else:
            raise UnsupportedError(f"RoPE scaling type {scaling_type!r} is not supported (qllama runs: linear)")
        # Older converters wrote only `rope.scale_linear`.
        if scaling_type is None and key("rope.scale_linear", None, required=False):
            rope_scale = float(key("rope.scale_linear", required=False))

        n_vocab = key("vocab_size", None, required=False)
        if n_vocab is None:
            tokens = md.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise QllamaError(f"missing {arch}.vocab_size and tokenizer.ggml.tokens")
            n_vocab = len(tokens)

        return cls(
            arch=arch,
            n_ctx_train=int(key("context_length")),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=n_ff,
            n_head=n_head,
            n_head_kv=n_head_kv,
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_freq_base=float(key("rope.freq_base", 10000.0)),
            n_rot=n_rot,
            rope_scale=rope_scale,
            n_vocab=int(n_vocab),
        )

    def default_n_ctx(self) -> int:
        return min(self.n_ctx_train, DEFAULT_N_CTX_CAP)
