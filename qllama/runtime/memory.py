"""Memory checks done before a model allocates anything large (the KV cache above all).

A context size comes from the user; a huge one must be one clear error, not NumPy's
"Unable to allocate 238. GiB" or the kernel's OOM killer halfway through a prompt.
"""

from __future__ import annotations

import os
import warnings

from ..errors import ContextSizeError, QllamaWarning

def kv_cache_bytes(args, n_ctx: int, batch: int, kv_types: tuple[str, str] = ("f16", "f16")) -> int:
    """Bytes of a model's KV cache: keys and values, of types kv_types ("f16": 2 bytes, "f32": 4,
    a quantized type its block bytes per 32: q8_0 34, q4_0 18, ...), for every layer's slots (a
    window layer keeps only a ring, see `models.kvcache`), KV head and head dimension."""
    from ..models.kvcache import kv_row_bytes, ring_slots

    windows = [args.n_swa if args.is_swa(il) else 0 for il in range(args.n_layer)]
    per_slot = args.n_head_kv * sum(kv_row_bytes(t, args.head_dim) for t in kv_types)
    return sum(ring_slots(n_ctx, windows, batch)) * per_slot


def available_memory() -> int | None:
    """Bytes the system can give this process now: MemAvailable (Linux), else total RAM; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_context(args, n_ctx: int, batch: int, *, available: int | None = None,
                  kv_types: tuple[str, str] = ("f16", "f16")) -> None:
    """Refuse a context whose KV cache cannot fit in memory; warn when it exceeds the training length.

    `args` is the model's ModelArgs; `batch` the tokens per forward (window layers keep
    window + batch positions); kv_types the cache's (type_k, type_v). Raises
    ContextSizeError naming both sizes; warns (QllamaWarning) when n_ctx > n_ctx_train.
    """
    need = kv_cache_bytes(args, n_ctx, batch, kv_types)
    have = available_memory() if available is None else available
    if have is not None and need > have:
        raise ContextSizeError(
            f"a context of {n_ctx} tokens needs {_gib(need)} for its KV cache, "
            f"but only {_gib(have)} of memory is available"
        )
    if args.n_ctx_train and n_ctx > args.n_ctx_train:
        warnings.warn(
            QllamaWarning(f"a context of {n_ctx} tokens is beyond the {args.n_ctx_train} the model was trained on: "
                          "expect its output to degrade past that"),
            stacklevel=3,
        )
