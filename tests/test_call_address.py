"""Kernels that call another compiled kernel by its address (kernels/jit.py `call_address`):
the parallel attention, the activation quantizers and the fused decode's row chunks. Each must
compute exactly what the called kernel computes when run directly, for any split of the work."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.kernels import act_quant
from qllama.kernels import layer_ops as ops
from qllama.kernels.jit import compiled_address


def _cache(x, kind):
    return np.ascontiguousarray(x.astype(np.float16).view(np.uint16) if kind == "f16" else x)


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("T,start,window", [(1, 700, 0), (37, 0, 0), (19, 40, 16)])
def test_parallel_attention_equals_serial_bit_for_bit(kind, T, start, window):
    """37 tokens x 3 KV heads = 111 jobs in 16 interleaved chunks; 1 token: 3 chunks of one job."""
    rng = np.random.default_rng(T + start)
    H, Hkv, D, n_ctx = 9, 3, 32, 1024
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kc = _cache(2 * rng.standard_normal((Hkv, D, n_ctx)).astype(np.float32), kind)  # keys d-major
    vt = _cache(rng.standard_normal((Hkv, D, n_ctx)).astype(np.float32), kind)
    args = (q, kc, vt, start, H // Hkv, np.float32(0.17), window, np.float32(0), False)
    serial, parallel = np.full_like(q, np.nan), np.full_like(q, np.nan)
    ops.attention_serial(*args, serial)
    ops.attention(*args, parallel)
    assert np.isfinite(serial).all()
    assert np.array_equal(serial, parallel)


def test_attention_on_a_non_contiguous_query_runs_on_this_thread_and_agrees():
    """The address is only for C-contiguous arrays: anything else takes the serial kernel."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((8, 4, 2 * 16)).astype(np.float32)[:, :, ::2]  # strided
    kc = rng.standard_normal((2, 16, 64)).astype(np.float32)  # keys d-major
    vt = rng.standard_normal((2, 16, 64)).astype(np.float32)
    args = (q, kc, vt, 0, 2, np.float32(0.25), 0, np.float32(0), False)
    a, b = np.empty((8, 4, 16), np.float32), np.empty((8, 4, 16), np.float32)
    ops.attention(*args, a)
    ops.attention_serial(np.ascontiguousarray(q), *args[1:], b)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("form", ["q8_k", "q8_0", "q8_1"])
def test_each_token_in_parallel_equals_the_row_function(form):
    rng = np.random.default_rng(5)
    n_tok, n = 13, 512
    x = (rng.standard_normal((n_tok, n)) * np.exp2(rng.integers(-8, 8, (n_tok, 1)))).astype(np.float32)
    x[4, 7] = np.inf  # a non-finite block: d NaN there, quants 0
    per_d, per_s, s_dtype = {"q8_k": (256, 16, np.int32), "q8_0": (32, 32, np.int32), "q8_1": (32, 32, np.float32)}[form]

    def buffers():
        return np.empty((n_tok, n), np.int8), np.empty((n_tok, n // per_d), np.float32), np.empty((n_tok, n // per_s), s_dtype)

    whole, rows = buffers(), buffers()
    getattr(act_quant, f"quantize_{form}")(x, *whole)
    row = getattr(act_quant, f"{form}_row")
    for t in range(n_tok):
        row(x, t, *rows)
    for a, b in zip(whole, rows):
        assert np.array_equal(a, b, equal_nan=True)
    assert np.isnan(whole[1][4, 0])
    one = buffers()
    getattr(act_quant, f"quantize_{form}")(x[:1].copy(), *(a[:1] for a in one))  # one token: the calling thread
    for a, b in zip(one, whole):
        assert np.array_equal(a[:1], b[:1])


def test_compiled_address_is_zero_until_compiled_for_those_types():
    from qllama.kernels.jit import kernel

    @kernel
    def twice(x, out):
        for i in range(x.shape[0]):
            out[i] = 2 * x[i]

    x = np.arange(4, dtype=np.int16)
    out = np.empty(4, np.int16)
    assert compiled_address(twice, (x, out)) == 0
    twice(x, out)
    assert compiled_address(twice, (x, out)) > 0
    assert compiled_address(twice, (x.astype(np.int32), out.astype(np.int32))) == 0  # other types: not compiled
