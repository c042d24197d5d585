"""The layer kernels of qllama/kernels/layer_ops.py against float64 NumPy references:
the vectorised exp, RoPE + cache store, attention (serial and parallel, GQA, causal) over f32
and f16 caches, the f32 -> f16 rounding, SwiGLU."""

from __future__ import annotations

import numpy as np
import pytest

from numba import njit

from qllama.kernels import layer_ops as ops
from qllama.kernels._softmax import exp_sum16, row_max16


def test_exp_matches_float64_within_a_few_ulp():
    x = np.concatenate([np.linspace(-87.0, 88.3, 20001), [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5]]).astype(np.float32)
    out = np.empty_like(x)
    ops.exp_f32(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out / ref - 1.0)) < 5e-7  # float32 eps is 1.2e-7
    assert out[x == 0].tolist() == [1.0, 1.0]


def test_exp_clamps_instead_of_overflowing():
    x = np.array([-1000.0, -100.0, 100.0, 1000.0, np.float32(3.4e38)], np.float32)
    out = np.empty_like(x)
    ops.exp_f32(x, out)
    assert np.all(np.isfinite(out))
    assert out[0] < 1e-37 and out[1] < 1e-37 and out[2] > 1e38 and out[3] > 1e38


def _rope_ref(x, pos, cos, sin, n_rot):
    out = x.astype(np.float64).copy()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # (T, 1, n_rot/2)
    x0, x1 = x[..., 0:n_rot:2].astype(np.float64), x[..., 1:n_rot:2].astype(np.float64)
    out[..., 0:n_rot:2] = x0 * c - x1 * s
    out[..., 1:n_rot:2] = x0 * s + x1 * c
    return out


@pytest.mark.parametrize("n_rot", [8, 4])  # n_rot < head_dim leaves the tail dims alone
def test_rope_store_rotates_and_stores(n_rot):
    rng = np.random.default_rng(0)
    T, H, Hkv, D, n_ctx, start = 3, 4, 2, 8, 16, 5
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    ang = np.outer(np.arange(n_ctx), 10000.0 ** (-np.arange(n_rot // 2) * 2.0 / n_rot))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = np.arange(start, start + T)
    q_ref, k_ref = _rope_ref(q, pos, cos, sin, n_rot), _rope_ref(k, pos, cos, sin, n_rot)
    kt = np.zeros((Hkv, D, n_ctx), np.float32)  # keys d-major, as values
    vt = np.zeros((Hkv, D, n_ctx), np.float32)
    ops.rope_store(q, k, v, start, cos, sin, kt, vt, False)
    kc = kt.transpose(0, 2, 1)
    np.testing.assert_allclose(q, q_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kc[:, start : start + T, :], k_ref.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(vt[:, :, start : start + T], v.transpose(1, 2, 0))
    assert not kc[:, :start].any() and not vt[:, :, start + T :].any()  # other positions untouched


def _f16(x):
    """x rounded to fp16 by NumPy (nearest even), as float64."""
    return np.asarray(x).astype(np.float16).astype(np.float64)


def _attention_ref(q, k, v, start, n_rep, round_q=False, round_p=False):
    """q (T, H, D); k, v (Hkv, n, D) float64; causal over the cache. round_q / round_p: q and the
    probabilities rounded to fp16 for the products, as ggml's mul_mat with an f16 K / V matrix."""
    T, H, D = q.shape
    out = np.empty((T, H, D))
    for t in range(T):
        for h in range(H):
            n = start + t + 1
            s = k[h // n_rep, :n] @ (_f16(q[t, h]) if round_q else q[t, h]) / np.sqrt(D)
            p = np.exp(s - s.max())
            p = p / p.sum()
            out[t, h] = (_f16(p) if round_p else p) @ v[h // n_rep, :n]
    return out


def _as_cache(x, kind):
    """A float32 array as a cache array of type kind: float32, or its f16 bits (uint16)."""
    return np.ascontiguousarray(x.astype(np.float16).view(np.uint16) if kind == "f16" else x)


@pytest.mark.parametrize("kernel", ["attention", "attention_serial"])
@pytest.mark.parametrize("T,start", [(1, 0), (1, 37), (4, 0), (3, 20)])
@pytest.mark.parametrize("H,Hkv", [(8, 2), (6, 1), (3, 3)])  # n_rep 4, 6 (4 + a remainder of 2), 1
@pytest.mark.parametrize("type_k,type_v", [("f32", "f32"), ("f16", "f16"), ("f16", "f32"), ("f32", "f16")])
def test_attention_matches_float64(kernel, T, start, H, Hkv, type_k, type_v):
    rng = np.random.default_rng(T * 100 + start)
    D, n_ctx = 16, 64
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (3 * rng.standard_normal((Hkv, n_ctx, D))).astype(np.float32)  # peaked softmax
    v = rng.standard_normal((Hkv, n_ctx, D)).astype(np.float32)
    # garbage past the valid positions must not be read
    k[:, start + T :] = np.nan
    v[:, start + T :] = np.nan
    kc, vt = _as_cache(k, type_k), _as_cache(v.transpose(0, 2, 1), type_v)
    out = np.empty_like(q)
    kt = np.ascontiguousarray(kc.transpose(0, 2, 1))  # keys d-major
    getattr(ops, kernel)(q, kt, vt, start, H // Hkv, np.float32(1 / np.sqrt(D)), 0, np.float32(0), False, out)
    # the reference reads what the cache holds (the f16-rounded values) in float64
    k64 = _f16(k) if type_k == "f16" else k.astype(np.float64)
    v64 = _f16(v) if type_v == "f16" else v.astype(np.float64)
    ref = _attention_ref(q.astype(np.float64), k64, v64, start, H // Hkv, type_k == "f16", type_v == "f16")
    # measured: at most 4.2e-6 over these cases (f32/f32: 8.1e-7)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    if "f16" in (type_k, type_v) and start + T > 1:  # the q / probability rounding is really done:
        plain = _attention_ref(q.astype(np.float64), k64, v64, start, H // Hkv)  # without it, 1e-4 .. 2e-3 away
        assert np.abs(out - plain).max() > 5e-5


@pytest.mark.parametrize("q_scaled", [False, True])
def test_f16_attention_over_a_wrapped_ring_with_window_and_softcap(q_scaled):
    """Keys at positions 0..29 in a ring of 12 slots (each slot written twice), window 8,
    softcap 2: against float64 on the rounded cache. q_scaled: q * scale is rounded (Gemma, Phi-3)."""
    rng = np.random.default_rng(9)
    T, start, H, Hkv, D, ring, window, cap = 5, 25, 4, 2, 16, 12, 8, 2.0
    n_pos = start + T
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (2 * rng.standard_normal((Hkv, n_pos, D))).astype(np.float32)
    v = rng.standard_normal((Hkv, n_pos, D)).astype(np.float32)
    kc = np.full((Hkv, ring, D), np.nan, np.float16)
    vt = np.full((Hkv, D, ring), np.nan, np.float16)
    for p in range(n_pos):
        kc[:, p % ring], vt[:, :, p % ring] = k[:, p], v[:, p]
    scale = np.float32(0.3)
    out = np.empty_like(q)
    kt = np.ascontiguousarray(kc.transpose(0, 2, 1))  # keys d-major
    ops.attention(q, kt.view(np.uint16), vt.view(np.uint16), start, H // Hkv, scale, window, np.float32(cap), q_scaled, out)
    k64, v64 = _f16(k), _f16(v)
    ref = np.empty((T, H, D))
    for t in range(T):
        p1 = start + t
        keys = np.arange(p1 - window + 1, p1 + 1)
        for h in range(H):
            qh = q[t, h].astype(np.float64)
            s = (k64[h // 2, keys] @ _f16(qh * scale)) if q_scaled else (k64[h // 2, keys] @ _f16(qh)) * scale
            s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            ref[t, h] = _f16(p / p.sum()) @ v64[h // 2, keys]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,Hkv", [(14, 2), (3, 1), (8, 2)])  # n_rep 7 (4 + 3), 3, 4
@pytest.mark.parametrize("type_v", ["f16", "f32"])
def test_long_attention_batch_rows_equal_single_tokens(H, Hkv, type_v):
    """Depths past several 64-key value blocks (plus a last partial one): each row of a batch
    equals the same token attended alone, bit for bit, and both match float64."""
    rng = np.random.default_rng(H * 10 + Hkv)
    T, start, D = 5, 190, 64
    n_ctx = start + T
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (0.5 * rng.standard_normal((Hkv, n_ctx, D))).astype(np.float32)
    v = rng.standard_normal((Hkv, n_ctx, D)).astype(np.float32)
    kt = _as_cache(k.transpose(0, 2, 1), "f16")
    vt = _as_cache(v.transpose(0, 2, 1), type_v)
    scale = np.float32(1 / np.sqrt(D))
    out = np.empty_like(q)
    ops.attention(q, kt, vt, start, H // Hkv, scale, 0, np.float32(0), False, out)
    for t in range(T):
        one = np.empty_like(q[:1])
        ops.attention_serial(q[t : t + 1].copy(), kt, vt, start + t, H // Hkv, scale, 0, np.float32(0), False, one)
        np.testing.assert_array_equal(one[0], out[t])
    v64 = _f16(v) if type_v == "f16" else v.astype(np.float64)
    ref = _attention_ref(q.astype(np.float64), _f16(k), v64, start, H // Hkv, True, type_v == "f16")
    # with f16 values a float32 probability next to an f16 rounding boundary may round the other
    # way than float64's (one f16 step, ~1e-3 of it): measured up to 2.7e-5 here
    tol = 1e-4 if type_v == "f16" else 1e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


def test_window_ring_rows_do_not_depend_on_where_the_ring_wraps():
    """A window layer's ring (window + batch slots) wraps at a place that depends on the batch:
    a token's row is the same from a ring of 160 + 5 slots filled by a batch of 5 and from a ring
    of 160 + 1 filled one token at a time, with more than one 64-key value block in the window."""
    rng = np.random.default_rng(3)
    T, start, H, Hkv, D, window = 5, 400, 8, 2, 32, 160
    n_pos = start + T
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, n_pos, D)).astype(np.float32)
    v = rng.standard_normal((Hkv, n_pos, D)).astype(np.float32)

    def ring_cache(ring, upto):
        kt = np.full((Hkv, D, ring), np.nan, np.float16)
        vt = np.full((Hkv, D, ring), np.nan, np.float16)
        for p in range(max(0, upto - ring), upto):
            kt[:, :, p % ring], vt[:, :, p % ring] = k[:, p], v[:, p]
        return kt.view(np.uint16), vt.view(np.uint16)

    scale = np.float32(0.2)
    kt, vt = ring_cache(window + T, n_pos)
    out = np.empty_like(q)
    ops.attention_serial(q, kt, vt, start, H // Hkv, scale, window, np.float32(0), False, out)
    for t in range(T):
        kt1, vt1 = ring_cache(window + 1, start + t + 1)
        one = np.empty_like(q[:1])
        ops.attention_serial(q[t : t + 1].copy(), kt1, vt1, start + t, H // Hkv, scale, window, np.float32(0), False, one)
        np.testing.assert_array_equal(one[0], out[t])


def test_f16_cache_rounds_probabilities_as_ggml():
    """q = 0: every score is 0 and each probability is 1/n in float32; an f16 V cache multiplies
    by fp16(1/n) (ggml converts the probabilities to f16 for the V product), an f32 one by 1/n."""
    n, D = 3, 8
    v = np.random.default_rng(4).standard_normal((1, n, D)).astype(np.float32)
    k = np.ones((1, n, D), np.float32)
    q = np.zeros((1, 1, D), np.float32)
    for type_v, p in (("f16", np.float64(np.float16(np.float32(1 / 3)))), ("f32", 1 / 3)):
        out = np.empty_like(q)
        ops.attention_serial(q, k.transpose(0, 2, 1).copy(), _as_cache(v.transpose(0, 2, 1), type_v), n - 1, 1, np.float32(1), 0,
                             np.float32(0), False,
                             out)
        want = p * _f16(v[0]).sum(axis=0) if type_v == "f16" else p * v[0].astype(np.float64).sum(axis=0)
        np.testing.assert_allclose(out[0, 0], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("portable", [False, True])  # F16C (where the host has it) and the integer fallback
def test_f16_rounding_equals_numpy(portable):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(100_000) * np.exp2(rng.uniform(-30, 18, 100_000))).astype(np.float32)
    ties = np.array([1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-24 * 1.5, 65504, 65519.99, 65520, 7e4,
                     2**-14, 2**-14 - 2**-25, 0.0, -0.0, np.inf, -np.inf, 1e-45], np.float32)  # halfway cases, ranges
    x = np.concatenate([x, ties, -ties])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    out = np.empty(x.size, np.uint16)
    ops.round_f16(x, out, portable)
    np.testing.assert_array_equal(out, want)
    nan = np.array([np.nan, -np.nan], np.float32)
    ops.round_f16(nan, out[:2], portable)
    assert np.isnan(out[:2].view(np.float16)).all()


@pytest.mark.parametrize("n_rot", [8, 4])
def test_rope_store_into_an_f16_cache_rounds_as_numpy(n_rot):
    """The f16 cache holds exactly NumPy's float16 rounding of what an f32 cache holds; q is
    rotated the same way (its rounding happens inside the attention)."""
    rng = np.random.default_rng(1)
    T, H, Hkv, D, n_ctx, start = 4, 4, 2, 8, 12, 3
    q = (100 * rng.standard_normal((T, H, D))).astype(np.float32)
    k = (100 * rng.standard_normal((T, Hkv, D))).astype(np.float32)
    v = (1e-3 * rng.standard_normal((T, Hkv, D))).astype(np.float32)  # small values: subnormal f16s too
    ang = np.outer(np.arange(n_ctx), 10000.0 ** (-np.arange(n_rot // 2) * 2.0 / n_rot))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    caches = {}
    for kind, dtype in (("f32", np.float32), ("f16", np.uint16)):
        kt, vt = np.zeros((Hkv, D, n_ctx), dtype), np.zeros((Hkv, D, n_ctx), dtype)
        qq = q.copy()
        ops.rope_store(qq, k.copy(), v, start, cos, sin, kt, vt, True)
        caches[kind] = (qq, kt, vt)
    q32, k32, v32 = caches["f32"]
    q16, k16, v16 = caches["f16"]
    np.testing.assert_array_equal(q16, q32)
    np.testing.assert_array_equal(k16, k32.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(v16, v32.astype(np.float16).view(np.uint16))
    assert (k16 != 0).any() and not np.array_equal(k16.view(np.float16).astype(np.float32), k32)  # it did round


def test_attention_parallel_threshold():
    assert not ops.attention_parallel_pays(1, 10, 32, 2)  # a short decode step stays serial
    assert ops.attention_parallel_pays(1, 4096, 32, 2)
    assert ops.attention_parallel_pays(512, 0, 32, 2)
    assert not ops.attention_parallel_pays(512, 0, 32, 1)  # one thread: never


def test_swiglu_matches_float64_in_place():
    rng = np.random.default_rng(1)
    gate = (8 * rng.standard_normal((3, 600))).astype(np.float32)  # not a multiple of the exp block
    gate[0, :4] = [-200.0, 200.0, 0.0, -90.0]
    up = rng.standard_normal((3, 600)).astype(np.float32)
    g64 = gate.astype(np.float64)
    ref = g64 / (1.0 + np.exp(-g64)) * up
    ops.glu(gate, up, gate, ops.ACT_SILU)  # in place, as the model calls it
    np.testing.assert_allclose(gate, ref, rtol=2e-6, atol=1e-30)


def _ggml_swiglu():
    """ggml_vec_swiglu_f32 from llama-cpp-python's own libggml-cpu (None without it)."""
    import ctypes
    import os

    try:
        import llama_cpp
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so")
    if not os.path.exists(path):
        return None
    fn = getattr(ctypes.CDLL(path), "ggml_vec_swiglu_f32", None)
    if fn is not None:
        p = ctypes.POINTER(ctypes.c_float)
        fn.argtypes = [ctypes.c_int, p, p, p]
    return fn


@pytest.mark.oracle
def test_swiglu_equals_ggml_bit_for_bit():
    """SiLU(gate) * up against ggml's own ggml_vec_swiglu_f32 (called in llama.cpp's library):
    the same bits where llama.cpp runs its AVX-512 code; one rounding of the last step apart
    (<= 1 ulp) where it was built for AVX2 (k + k j instead of (1 + j) 2^n)."""
    import ctypes

    from qllama.kernels._x86 import _target_features

    fn = _ggml_swiglu()
    if fn is None:
        pytest.skip("llama-cpp-python's libggml-cpu (the [oracle] extra) is not installed")
    rng = np.random.default_rng(4)
    n = 1 << 18
    x = (rng.standard_normal(n) * rng.choice([0.01, 1.0, 6.0, 40.0], n)).astype(np.float32)
    x[:10] = [0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 150.0, -150.0, 1e-30, -1e-30]
    g = rng.standard_normal(n).astype(np.float32)
    want = np.empty_like(x)
    p = ctypes.POINTER(ctypes.c_float)
    fn(n, want.ctypes.data_as(p), x.ctypes.data_as(p), g.ctypes.data_as(p))
    got = np.empty((1, n), np.float32)
    ops.glu(x[None].copy(), g[None].copy(), got, ops.ACT_SILU)
    if {"+avx512f", "+avx512dq"} <= _target_features():
        np.testing.assert_array_equal(got[0].view(np.int32), want.view(np.int32))
    else:
        np.testing.assert_array_max_ulp(got[0], want, maxulp=1)

@pytest.mark.parametrize("act", [0, 1])
def test_glu_element_bits_do_not_depend_on_position(act):
    """An element's result is the same bits in a row's tail (n_ff % 16) as in a whole vector, in
    any row of any batch: decode and a prompt batch must agree. NaN stays NaN."""
    rng = np.random.default_rng(3)
    vals = (6 * rng.standard_normal(37)).astype(np.float32)
    vals[5] = np.nan
    up = rng.standard_normal(37).astype(np.float32)
    short = np.stack([vals, vals[::-1]])  # (2, 37): 2 vectors and a tail of 5
    out_short = np.empty_like(short)
    ops.glu(short, np.stack([up, up[::-1]]), out_short, act)
    wide = np.zeros((3, 64), np.float32)  # the same values at other offsets of longer rows
    wide_up = np.zeros((3, 64), np.float32)
    wide[2, 27:64], wide_up[2, 27:64] = vals, up
    out_wide = np.empty_like(wide)
    ops.glu(wide, wide_up, out_wide, act)
    np.testing.assert_array_equal(out_short[0].view(np.int32), out_wide[2, 27:].view(np.int32))
    np.testing.assert_array_equal(out_short[1][::-1].view(np.int32), out_wide[2, 27:].view(np.int32))
    assert np.isnan(out_short[0, 5]) and np.isfinite(np.delete(out_short[0], 5)).all()


@njit
def _exp_sum_row(x, r, n, shift):
    m = row_max16(x, r, n)
    return exp_sum16(x, r, n, shift), m


@pytest.mark.parametrize("n", [1, 15, 16, 37, 300])
def test_softmax_numerators_in_one_pass(n):
    """exp_sum16: x[r, :n] = exp(x - shift) in place and their sum, lanes past n left out of the sum
    and the rows around untouched; row_max16: the row's max, whatever lies past n."""
    rng = np.random.default_rng(n)
    x = (4 * rng.standard_normal((3, n + 16))).astype(np.float32)
    x[1, n:] = 1e30  # past n: must not count
    x[1, 0] = -200.0  # clamped: exp of less than -87.3 is ~1e-38, not 0 or a NaN
    before = x.copy()
    row = x[1, :n].astype(np.float64)
    shift = np.float32(row.max())
    total, biggest = _exp_sum_row(x, 1, n, shift)
    assert biggest == shift
    want = np.exp(np.maximum(row - shift, np.float64(np.float32(-87.3))))
    np.testing.assert_allclose(x[1, :n], want, rtol=2e-6, atol=0)  # (x - shift is rounded to float32 first)
    assert total == pytest.approx(want.sum(), rel=1e-6)
    np.testing.assert_array_equal(x[0], before[0])
    np.testing.assert_array_equal(x[2], before[2])
