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

Quantized caches (`type_k` / `type_v` q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, as llama.cpp's
-ctk/-ctv): keys and values are kept as ggml blocks of 32 elements, both row-major, one
(Hkv, ring, D/32) array of blocks per layer (a NumPy record dtype named after the type, so that
`to_f32` / `from_f32` know how to read and write it; an f16 or f32 partner of a quantized type
is kept in the same layout). New rows are quantized as ggml's reference quantizers do, and
attention reads the blocks directly (`kernels.attention_quant`), as llama.cpp's flash attention.
"""

from __future__ import annotations

import mmap

import numpy as np

from ..errors import QllamaError

SWA_BATCH = 512  # ring slots beyond the window (llama.cpp: n_ubatch); the most tokens per forward chunk

# element types of the cache: name -> (storage dtype, bytes per element, ggml type id)
KV_TYPES = {"f16": (np.uint16, 2, 1), "f32": (np.float32, 4, 0)}
# quantized types (blocks of 32, as llama.cpp's cache allows them): name -> (ggml type id, bytes per block)
QUANT_KV_TYPES = {"q8_0": (8, 34), "q4_0": (2, 18), "q4_1": (3, 20), "q5_0": (6, 22), "q5_1": (7, 24),
                  "iq4_nl": (20, 18)}
KV_BLOCK = 32  # elements per block of a quantized cache
DEFAULT_KV_TYPE = "f16"  # llama.cpp's default for K and V
ALL_KV_TYPES = tuple(KV_TYPES) + tuple(QUANT_KV_TYPES)


def kv_type(value) -> str:
    """A cache type name ("f16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl") from a
    name or a ggml type id (GGML_TYPE_F16 = 1, F32 = 0, Q8_0 = 8, ..., as llama-cpp-python's
    type_k / type_v take); None gives the default."""
    if value is None:
        return DEFAULT_KV_TYPE
    if isinstance(value, str) and value.lower() in ALL_KV_TYPES:
        return value.lower()
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        for name in ALL_KV_TYPES:
            if value == kv_type_id(name):
                return name
    raise QllamaError(f"KV cache type {value!r} is not supported: use one of {', '.join(ALL_KV_TYPES)} "
                      "(or its ggml type id)")


def kv_type_id(name: str) -> int:
    """The ggml type id of a cache type name."""
    return KV_TYPES[name][2] if name in KV_TYPES else QUANT_KV_TYPES[name][0]


def kv_bytes_per_element(name: str) -> float:
    """Bytes per cached element: 2 (f16), 4 (f32), or a quantized type's block bytes / 32 (q8_0: 1.0625)."""
    name = kv_type(name)
    if name in QUANT_KV_TYPES:
        return QUANT_KV_TYPES[name][1] / KV_BLOCK
    return KV_TYPES[name][1]


def is_quantized(name: str) -> bool:
    return kv_type(name) in QUANT_KV_TYPES


def kv_row_bytes(name: str, n: int) -> int:
    """Bytes of n cached elements of type `name` (n a multiple of 32 for a quantized type)."""
    name = kv_type(name)
    if name in QUANT_KV_TYPES:
        return n // KV_BLOCK * QUANT_KV_TYPES[name][1]
    return n * KV_TYPES[name][1]


def block_dtype(name: str) -> np.dtype:
    """The record dtype of one 32-element block of a block cache (an f16/f32 block: 64/128 bytes)."""
    name = kv_type(name)
    nbytes = QUANT_KV_TYPES[name][1] if name in QUANT_KV_TYPES else KV_BLOCK * KV_TYPES[name][1]
    return np.dtype([(name, np.uint8, (nbytes,))])


def is_blocks(cache_array: np.ndarray) -> bool:
    """Whether a cache array holds blocks (a quantized cache's layout), not f16 bits or float32."""
    return cache_array.dtype.names is not None


def _block_type(cache_array: np.ndarray) -> str:
    return cache_array.dtype.names[0]


def to_f32(cache_array: np.ndarray) -> np.ndarray:
    """Cache contents (any shape) as float32 values: f16 bits are decoded, float32 is returned as is,
    blocks (..., D/32) are dequantized as ggml's to_float does, to (..., D)."""
    if cache_array.dtype == np.uint16:
        return cache_array.view(np.float16).astype(np.float32)
    if is_blocks(cache_array):
        return dequantize_blocks(cache_array)
    return cache_array


def from_f32(values: np.ndarray, like: np.ndarray) -> np.ndarray:
    """float32 values encoded as the cache array `like` stores them (f16: round to nearest even;
    beyond 65504 they become inf, as the kernels' store does; blocks: (..., D) values quantized
    as ggml's reference quantizer, to (..., D/32) blocks)."""
    if like.dtype == np.uint16:
        with np.errstate(over="ignore"):
            return np.asarray(values, np.float32).astype(np.float16).view(np.uint16)
    if is_blocks(like):
        from ..quantize.blocks import quantize_array

        name = _block_type(like)
        values = np.asarray(values, np.float32)
        raw = quantize_array(values.reshape(-1, values.shape[-1]), kv_type_id(name))
        return raw.view(like.dtype).reshape(values.shape[:-1] + (values.shape[-1] // KV_BLOCK,))
    return np.asarray(values, np.float32)


_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def dequantize_blocks(blocks: np.ndarray) -> np.ndarray:
    """Blocks of a block cache (..., nb) -> float32 (..., nb * 32), as ggml's dequantize_row_* (NumPy)."""
    name = _block_type(blocks)
    shape = blocks.shape
    raw = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, blocks.dtype.itemsize)  # (n, bytes)
    n = raw.shape[0]
    if name == "f32":
        return raw.view(np.float32).reshape(shape[:-1] + (shape[-1] * KV_BLOCK,)).copy()
    if name == "f16":
        return raw.view(np.float16).astype(np.float32).reshape(shape[:-1] + (shape[-1] * KV_BLOCK,))
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    if name == "q8_0":
        out = raw[:, 2:34].view(np.int8).astype(np.float32) * d
    else:
        m = raw[:, 2:4].copy().view(np.float16).astype(np.float32) if name in ("q4_1", "q5_1") else None
        qs_at = {"q4_0": 2, "iq4_nl": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[name]
        qs = raw[:, qs_at : qs_at + 16].astype(np.int32)
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # (n, 32)
        if name in ("q5_0", "q5_1"):
            qh = raw[:, qs_at - 4 : qs_at].copy().view("<u4").astype(np.int64)  # (n, 1)
            q = q | (((qh >> np.arange(32)) & 1) << 4).astype(np.int32)
        if name == "iq4_nl":
            out = _IQ4NL[q] * d
        elif name in ("q4_0", "q5_0"):
            out = (q - (8 if name == "q4_0" else 16)).astype(np.float32) * d
        else:
            out = q.astype(np.float32) * d + m
    return out.astype(np.float32).reshape(shape[:-1] + (shape[-1] * KV_BLOCK,))


def query_as_keys(q: np.ndarray, k_cache: np.ndarray) -> np.ndarray:
    """Queries (..., D) float32 as attention over a block cache multiplies them with the keys:
    quantized keys take q8_0 (q8_1 for q4_1/q5_1: the same values) as ggml's x86
    quantize_row_q8_0 (d = amax/127 kept as fp16, q = round-half-even(x * 127/amax)), f16 keys
    the f16-rounded queries, f32 keys the queries as they are."""
    name = _block_type(k_cache)
    q = np.asarray(q, np.float32)
    if name == "f32":
        return q
    if name == "f16":
        return q.astype(np.float16).astype(np.float32)
    b = q.reshape(-1, KV_BLOCK)
    amax = np.abs(b).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    qi = np.clip(np.rint(b * iscale), -127, 127)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    return (qi * d).astype(np.float32).reshape(q.shape)


def ring_slots(n_ctx: int, windows: list[int], batch: int = SWA_BATCH) -> list[int]:
    """Positions each layer's cache holds: n_ctx for full attention, window + batch for a window layer."""
    return [n_ctx if w <= 0 else min(n_ctx, w + batch) for w in windows]


class KVCache:
    """Per layer: keys `kt` and values `vt`, both (Hkv, D, ring) d-major, as f16 bits (uint16) or
    float32 (`type_k`, `type_v`: "f16" or "f32"); `k` and `v` are their (Hkv, ring, D) views.

    Both d-major: the scores of 16 consecutive positions are one vector of multiply-adds, and
    each output component is one long dot over the positions (see
    `kernels.layer_ops._attend_jobs`). `n_past`: positions [0, n_past) have been evaluated.

    With a quantized type_k or type_v (`blocks` True), `k` and `vt` are both (Hkv, ring, D/32)
    arrays of blocks, row-major (`vt` too), and `kb` / `vb` their uint8 (Hkv, ring, row bytes)
    views for the kernels; `type_ids` are the ggml type ids of K and V.
    """

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 windows: list[int] | None = None, batch: int = SWA_BATCH,
                 type_k: str = DEFAULT_KV_TYPE, type_v: str = DEFAULT_KV_TYPE):
        windows = windows or [0] * n_layer
        self.type_k, self.type_v = kv_type(type_k), kv_type(type_v)
        self.type_ids = (kv_type_id(self.type_k), kv_type_id(self.type_v))
        self.blocks = self.type_k in QUANT_KV_TYPES or self.type_v in QUANT_KV_TYPES
        self.n_ctx = n_ctx
        self.n_past = 0
        self.window = list(windows)  # per layer: 0 = full attention
        self.ring = ring_slots(n_ctx, windows, batch)  # slots per layer
        if self.blocks:
            if head_dim % KV_BLOCK:
                quant = self.type_k if self.type_k in QUANT_KV_TYPES else self.type_v
                raise QllamaError(f"a {quant} KV cache needs a head size that is a multiple of {KV_BLOCK}; "
                                  f"this model's is {head_dim}")
            nb = head_dim // KV_BLOCK
            bk, bv = block_dtype(self.type_k), block_dtype(self.type_v)
            self.k = [_lazy_zeros((n_head_kv, r, nb), bk) for r in self.ring]  # L x (Hkv, ring, D/32) blocks
            self.vt = [_lazy_zeros((n_head_kv, r, nb), bv) for r in self.ring]  # L x (Hkv, ring, D/32), row-major
            self.kb = [k.view(np.uint8) for k in self.k]  # L x (Hkv, ring, row bytes)
            self.kt = None  # (the float caches' d-major keys)
            self.vb = [v.view(np.uint8) for v in self.vt]
        else:
            dk, dv = KV_TYPES[self.type_k][0], KV_TYPES[self.type_v][0]
            self.kt = [_lazy_zeros((n_head_kv, head_dim, r), dk) for r in self.ring]  # L x (Hkv, D, ring)
            self.vt = [_lazy_zeros((n_head_kv, head_dim, r), dv) for r in self.ring]  # L x (Hkv, D, ring)
            self.k = [kt.transpose(0, 2, 1) for kt in self.kt]  # L x (Hkv, ring, D) views, for NumPy readers
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
        """Values as (Hkv, ring, D) views of the stored arrays (f16 bits or float32), per layer
        (a block cache: its (Hkv, ring, D/32) block arrays)."""
        if self.blocks:
            return list(self.vt)
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
