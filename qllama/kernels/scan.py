"""Scans of packed tensor data for non-finite floats (`qllama inspect --check`).

A float is non-finite when all its exponent bits are set (Inf or NaN), whatever its type:
fp16 0x7C00, bf16 0x7F80, f32 0x7F800000. The kernels test those bits on integer views of the
mmap, so they never convert, never allocate per item, and stream at memory speed.

`count_nonfinite` runs serially; `count_nonfinite_parallel` splits the items over threads and
is worth waking the thread pool only for large tensors (see `qllama.report.check`).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .jit import kernel

SCAN_CHUNK = 1 << 16  # items per parallel work unit


@kernel(boundscheck=False)
def count_nonfinite(words, stride, offsets, mask, lo, hi):
    """Items in [lo, hi) holding at least one non-finite field, and the first such item (or -1).

    words: uint16 or uint32 view of the tensor; item i owns words[i*stride : (i+1)*stride] and
    its float fields sit at words[i*stride + offsets[j]]. A field is non-finite when
    (field & mask) == mask.
    """
    n_bad = 0
    if stride == 1:  # plain float tensors: a branch-free count that vectorises
        for i in range(lo, hi):
            n_bad += (words[i] & mask) == mask
    else:
        for i in range(lo, hi):
            bad = False
            for j in range(offsets.shape[0]):
                bad |= (words[i * stride + offsets[j]] & mask) == mask
            n_bad += bad
    first = -1
    if n_bad:  # rare: a second pass finds where
        for i in range(lo, hi):
            for j in range(offsets.shape[0]):
                if first < 0 and (words[i * stride + offsets[j]] & mask) == mask:
                    first = i
            if first >= 0:
                break
    return n_bad, first


@kernel(parallel=True, boundscheck=False)
def count_nonfinite_parallel(words, stride, offsets, mask, n_items):
    """count_nonfinite over all n_items, in chunks of SCAN_CHUNK items spread over threads."""
    n_chunks = (n_items + SCAN_CHUNK - 1) // SCAN_CHUNK
    counts = np.zeros(n_chunks, np.int64)  # per chunk, so the threads share no state
    firsts = np.full(n_chunks, -1, np.int64)
    for c in prange(n_chunks):
        lo = c * SCAN_CHUNK
        counts[c], firsts[c] = count_nonfinite(words, stride, offsets, mask, lo, min(lo + SCAN_CHUNK, n_items))
    first = -1
    for c in range(n_chunks):
        if firsts[c] >= 0:
            first = firsts[c]
            break
    return counts.sum(), first
