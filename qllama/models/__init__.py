"""Model architectures: one module per `general.architecture`, over the shared blocks in `base`.

    read_args(metadata) -> ModelArgs          the file's hyper-parameters (its family's keys and defaults)
    build_model(gguf, args, n_ctx) -> model   named weights + forward pass over a KVCache

Any other architecture is one error naming the supported ones.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import QllamaError, UnsupportedError
from .args import DEFAULT_N_CTX_CAP, ModelArgs
from .base import Transformer
from .kvcache import SWA_BATCH, KVCache
from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .gptoss import GptOss
from .granite import Granite, GraniteMoe
from .llama import Llama
from .olmoe import Olmoe
from .phi3 import Phi3
from .qwen2 import Qwen2
from .qwen2moe import Qwen2Moe
from .qwen3 import Qwen3
from .qwen3moe import Qwen3Moe

ARCHITECTURES: dict[str, type[Transformer]] = {cls.arch: cls for cls in (
    Llama, Qwen2, Qwen3, Gemma2, Gemma3, Phi3,
    Qwen3Moe, Olmoe, Qwen2Moe, Granite, GraniteMoe, GptOss,  # mixtures of experts (models/moe.py; granite also dense)
)}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture(md: Mapping[str, Any]) -> type[Transformer]:
    """The model class for a file's `general.architecture`."""
    arch = md.get("general.architecture")
    if arch is None:
        raise QllamaError("the file has no general.architecture: not a model GGUF")
    cls = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if cls is None:
        raise UnsupportedError(f"architecture {arch!r} is not supported (qllama runs: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return cls


def read_args(md: Mapping[str, Any]) -> ModelArgs:
    """Hyper-parameters of a model file, with llama.cpp's defaults for absent keys."""
    return architecture(md).read_args(md)


def build_model(gf, args: ModelArgs, n_ctx: int, batch: int = SWA_BATCH) -> Transformer:
    """Load the named weights of an open GGUFFile and return its forward-pass object.

    batch: the most tokens one forward pass stores at once; sliding-window layers keep
    window + batch positions (llama.cpp: n_swa + n_ubatch). Longer runs go in rounds.
    """
    cls = ARCHITECTURES[args.arch]
    return cls(args, cls.load_weights(gf, args), n_ctx, batch)


__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "DEFAULT_N_CTX_CAP", "ModelArgs", "KVCache",
           "Transformer", "architecture", "read_args", "build_model"]
