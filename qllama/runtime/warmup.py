"""Kernel warm-up: call every kernel of a model's forward pass once, before anything is timed.

The first call of a Numba kernel in a process either compiles it (seconds to tens of seconds:
the first run after install, or after a source change) or loads it from Numba's disk cache (a
fraction of a second). Either way that time is not the model's speed, so `warm_up` pays it on a
scratch KV cache before a generation (llama.cpp also runs a warm-up decode at load), and the
caller reports it on its own line. What is not compiled yet is first compiled by worker
processes, one per CPU (qllama/compile_pool.py): on 2 cores that about halves a first run.

Whether a warm-up will compile (so that a front end can say "compiling kernels..." before it
starts) is known from a marker file written into the kernel cache (`kernels.jit.kernel_cache_dir`,
one directory per digest of the kernel sources) after a warm-up succeeded. Its name is a hash of
what decides which compiled code is needed: the Numba version, the model's tensor types, the
int8-activation path, the ISA and whether kernels ran on several threads. An empty or deleted
cache holds no marker, so it reads as cold.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path

from ..qtensor import PROMPT_MIN_TOKENS

# the prompt pass: more tokens than a fused step takes (models/decode.MAX_ROWS), so the unfused
# batch kernels (the gemm) compile; >= 4: the int8 row kernels work on groups of 4 tokens plus a remainder;
# >= qtensor.PROMPT_MIN_TOKENS: the prompt kernels (llama.cpp's prompt arithmetic) compile too
PREFILL_TOKENS = 10
# a step of this many tokens runs the fused calls with each type's n-token row kernel (a server
# step of 2 streams, prompt lookup's verify batch, a short prompt such as the demo's)
SHORT_TOKENS = 2
# depth of the third pass: attention runs in parallel there for any model with >= 2 heads
# (layer_ops.attention_parallel_pays), and costs little (at n_ctx 4096 it took ~0.2 s of a 1B warm-up)
FAR_DEPTH = 2048


def kernel_types(gguf) -> list[str]:
    """Type names of a model's matrices (tensors of 2 or more dimensions), sorted: ["q4_K", "q6_K"]."""
    return sorted({t.type_name for t in gguf.tensors.values() if len(t.shape) >= 2})


def warm_up(model, tokens: int = PREFILL_TOKENS, workers: int | None = None) -> float:
    """Run the forward pass of `model` (a LlamaModel-like object with `new_cache()` and
    `forward(ids, cache)`) on a scratch cache so that every kernel it uses is compiled or
    loaded: a prompt batch, one decode step, a step of SHORT_TOKENS, and a batch FAR_DEPTH tokens
    into the context (where attention is long enough to run in parallel). Returns the seconds it took.

    Kernels that neither this process nor Numba's disk cache holds are first compiled by
    `workers` processes in parallel (default: one per CPU; 0: all in this process), see
    qllama/compile_pool.py; the forward pass then only loads them."""
    t0 = time.perf_counter()
    if workers is None:
        from .compile_pool import default_workers

        workers = default_workers()
    if workers > 0:
        from .compile_pool import precompile

        with _unchecked(model):
            precompile(_forward_passes(model, tokens), workers)
    for step in _forward_passes(model, tokens):
        step()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _unchecked(model):
    """No non-finite check in the forward pass: while compile_pool records, the skipped kernels
    leave garbage, and locating it would re-run each step on the slow NumPy path (a minute on 1B)."""
    if not hasattr(model, "executing"):  # (a stand-in model)
        yield
        return
    from ..models.step import Plain

    with model.executing(Plain(checks=False)):
        yield


def _forward_passes(model, tokens: int) -> list:
    """The warm-up's four forward passes on one scratch cache, as steps to call in order."""
    cache = model.new_cache()  # (positions are zero-filled: their values do not matter here)
    n_ctx = cache.n_ctx
    first = min(tokens, max(n_ctx - 1, 1))

    def prompt():
        model.forward([0] * first, cache, prompt=first >= PROMPT_MIN_TOKENS)  # token 0 exists in every vocabulary

    def decode():
        cache.n_past = first
        if cache.n_past < n_ctx:
            model.forward([0], cache)

    def short():
        cache.n_past = first + 1
        if cache.n_past + SHORT_TOKENS <= n_ctx:
            model.forward([0] * SHORT_TOKENS, cache)

    def far():  # a batch deep enough into the context for attention to run in parallel (not a prompt's:
        # the kernels of long verify batches and many-stream steps)
        depth = min(n_ctx - tokens, FAR_DEPTH)
        if depth > first + 1:
            cache.n_past = depth
            model.forward([0] * tokens, cache)

    return [prompt, decode, short, far]


# -- is Numba's cache warm for this model? -----------------------------------------------------


def _marker(types: list[str], parallel: bool) -> Path:
    import numba

    from ..kernels._x86 import ISA
    from ..kernels.jit import kernel_cache_dir
    from ..qtensor import int8_activations

    key = repr((numba.__version__, sorted(types), sorted(int8_activations()), parallel, ISA))
    return kernel_cache_dir() / f"qllama-warm-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def is_warm(types: list[str], n_threads: int) -> bool:
    """Whether a warm-up for these tensor types succeeded with the current kernel sources (then
    warming up only loads compiled code). A warm-up on several threads also compiled every kernel
    a single thread runs, so it counts for `-t 1` too."""
    return _marker(types, True).exists() or (n_threads <= 1 and _marker(types, False).exists())


def mark_warm(types: list[str], n_threads: int) -> None:
    """Record that the kernel cache now holds every kernel these types and threads need."""
    try:
        _marker(types, n_threads > 1).write_text("qllama kernels compiled for " + ", ".join(types) + "\n")
    except OSError:  # a read-only cache: we will just say "compiling" again next time
        pass
