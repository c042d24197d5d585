"""The KV cache: keys and values of every layer, kept apart from the weights.

A full-attention layer holds n_ctx positions (position p in slot p). A sliding-window layer
holds only a ring of `window + batch` slots (position p in slot p % ring), as llama.cpp's SWA
cache holds n_swa + n_ubatch cells: a query sees the last `window` positions, and a batch of
up to `max_batch` new tokens can be stored before the oldest of them is read. A Gemma 3
(five window layers to one global) thus needs about a sixth of the memory at long contexts.

Keys and values are kept in f16 by default, as llama.cpp's cache (its `type_k` / `type_v`
default to GGML_TYPE_F16): half the memory of f32, and the same rounding, so that logits
follow llama.cpp's. An f16 cache array holds the IEEE half bits as uint16 (Numba has no
float16 type); a value is rounded to nearest even on the way in, as ggml's fp32 -> fp16.
"""

from __future__ import annotations

import mmap

import numpy as np

from ..errors import QllamaError

SWA_BATCH = 512  # ring slots beyond the window (llama.cpp: n_ubatch); the most tokens per forward chunk

# element types of the cache: name -> (storage dtype, bytes per element, ggml type id)
KV_TYPES = {"f16": (np.uint16, 2, 1), "f32": (np.float32, 4, 0)}
DEFAULT_KV_TYPE = "f16"  # llama.cpp's default for K and V


def kv_type(value) -> str:
    """A cache type name ("f16" or "f32") from a name or a ggml type id (GGML_TYPE_F16 = 1,
    GGML_TYPE_F32 = 0, as llama-cpp-python's type_k / type_v take); None gives the default."""
    if value is None:
        return DEFAULT_KV_TYPE
    if isinstance(value, str) and value.lower() in KV_TYPES:
        return value.lower()
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        for name, (_, _, ggml_id) in KV_TYPES.items():
            if value == ggml_id:
                return name
    raise QllamaError(f"KV cache type {value!r} is not supported: use 'f16' or 'f32' (ggml type 1 or 0)")


def kv_bytes_per_element(name: str) -> int:
    return KV_TYPES[kv_type(name)][1]


def to_f32(cache_array: np.ndarray) -> np.ndarray:
    """Cache contents (any shape) as float32 values: f16 bits are decoded, float32 is returned as is."""
    if cache_array.dtype == np.uint16:
        return cache_array.view(np.float16).astype(np.float32)
    return cache_array


def from_f32(values: np.ndarray, like: np.ndarray) -> np.ndarray:
    """float32 values encoded as the cache array `like` stores them (f16: round to nearest even;
    beyond 65504 they become inf, as the kernels' store does)."""
    if like.dtype == np.uint16:
        with np.errstate(over="ignore"):
            return np.asarray(values, np.float32).astype(np.float16).view(np.uint16)
    return np.asarray(values, np.float32)


def ring_slots(n_ctx: int, windows: list[int], batch: int = SWA_BATCH) -> list[int]:
    """Positions each layer's cache holds: n_ctx for full attention, window + batch for a window layer."""
    return [n_ctx if w <= 0 else min(n_ctx, w + batch) for w in windows]


class KVCache:
    """Per layer: keys (Hkv, ring, D) row-major and values (Hkv, D, ring) d-major, as f16 bits
    (uint16) or float32 (`type_k`, `type_v`: "f16" or "f32").

    Keys are stored row-major (a score is a dot with one key row); values d-major (`vt`), so
    that each output component is one long dot over the positions (see
    `kernels.layer_ops._attend_jobs`). `n_past`: positions [0, n_past) have been evaluated.
    """

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 windows: list[int] | None = None, batch: int = SWA_BATCH,
                 type_k: str = DEFAULT_KV_TYPE, type_v: str = DEFAULT_KV_TYPE):
        windows = windows or [0] * n_layer
        self.type_k, self.type_v = kv_type(type_k), kv_type(type_v)
        dk, dv = KV_TYPES[self.type_k][0], KV_TYPES[self.type_v][0]
        self.n_ctx = n_ctx
        self.n_past = 0
        self.window = list(windows)  # per layer: 0 = full attention
        self.ring = ring_slots(n_ctx, windows, batch)  # slots per layer
        self.k = [_lazy_zeros((n_head_kv, r, head_dim), dk) for r in self.ring]  # L x (Hkv, ring, D)
        self.vt = [_lazy_zeros((n_head_kv, head_dim, r), dv) for r in self.ring]  # L x (Hkv, D, ring)
        # the most tokens one forward may store: a window layer must keep the window of its first query
        limits = [r - w + 1 for r, w in zip(self.ring, windows) if w > 0 and r < n_ctx]
        self.max_batch = min(limits) if limits else n_ctx
        # for rewinding: which position each ring slot holds (-1: none); one ring size for all window layers
        rings = {r for r, w in zip(self.ring, windows) if w > 0 and r < n_ctx}
        self._ring = rings.pop() if len(rings) == 1 else None
        if rings:
            raise QllamaError("window layers of different sizes are not supported")
        self._win = max((w for w, r in zip(windows, self.ring) if w > 0 and r < n_ctx), default=0)
        self._slot_pos = np.full(self._ring, -1, np.int64) if self._ring else None

    @property
    def v(self) -> list[np.ndarray]:
        """Values as (Hkv, ring, D) views of the stored arrays (f16 bits or float32), per layer."""
        return [vt.transpose(0, 2, 1) for vt in self.vt]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + vt.nbytes for k, vt in zip(self.k, self.vt))

    def stored(self, start: int, n: int) -> None:
        """Record that positions [start, start + n) were written (called by the model)."""
        if self._slot_pos is not None:
            pos = np.arange(start, start + n, dtype=np.int64)
            self._slot_pos[pos % self._ring] = pos

    def rewind(self, n: int) -> int:
        """Keep positions [0, n) for reuse and return n; or 0 when a window layer has already
        overwritten what position n would need to see (everything is then evaluated again)."""
        n = max(0, min(n, self.n_past))
        if self._slot_pos is not None and n > 0:
            need = np.arange(max(0, n - self._win + 1), n, dtype=np.int64)
            if not np.array_equal(self._slot_pos[need % self._ring], need):
                n = 0
        self.n_past = n
        return n


def _lazy_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zero array (float32, or uint16 f16 bits: zero is 0.0 in both) whose memory is committed page by page as it is written.

    np.zeros would do that too, but NumPy asks for transparent huge pages on large arrays: the
    first token then commits a 2 MB page in every (layer, head) block, i.e. the whole cache
    (268 MB for a 1B model at n_ctx 4096). An anonymous mmap without huge pages grows with
    the positions actually used.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    try:
        flags = getattr(mmap, "MAP_PRIVATE", None)
        buf = mmap.mmap(-1, nbytes) if flags is None else mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_ANONYMOUS)
        if hasattr(buf, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
            buf.madvise(mmap.MADV_NOHUGEPAGE)
    except (OSError, ValueError, AttributeError):  # no anonymous mmap here: plain zeros
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
