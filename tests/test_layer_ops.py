"""The layer kernels of qllama/kernels/layer_ops.py against float64 NumPy references:
the vectorised exp, RoPE + cache store, attention (serial and parallel, GQA, causal), SwiGLU."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.kernels import layer_ops as ops


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
    kc = np.zeros((Hkv, n_ctx, D), np.float32)
    vt = np.zeros((Hkv, D, n_ctx), np.float32)
    ops.rope_store(q, k, v, start, cos, sin, kc, vt, False)
    np.testing.assert_allclose(q, q_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kc[:, start : start + T, :], k_ref.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(vt[:, :, start : start + T], v.transpose(1, 2, 0))
    assert not kc[:, :start].any() and not vt[:, :, start + T :].any()  # other positions untouched


def _attention_ref(q, k, v, start, n_rep):
    """q (T, H, D); k, v (Hkv, n, D) float64; causal over the cache."""
    T, H, D = q.shape
    out = np.empty((T, H, D))
    for t in range(T):
        for h in range(H):
            n = start + t + 1
            s = k[h // n_rep, :n] @ q[t, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[h // n_rep, :n]
    return out


@pytest.mark.parametrize("kernel", ["attention", "attention_serial"])
@pytest.mark.parametrize("T,start", [(1, 0), (1, 37), (4, 0), (3, 20)])
@pytest.mark.parametrize("H,Hkv", [(8, 2), (6, 1), (3, 3)])  # n_rep 4, 6 (4 + a remainder of 2), 1
def test_attention_matches_float64(kernel, T, start, H, Hkv):
    rng = np.random.default_rng(T * 100 + start)
    D, n_ctx = 16, 64
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (3 * rng.standard_normal((Hkv, n_ctx, D))).astype(np.float32)  # peaked softmax
    v = rng.standard_normal((Hkv, n_ctx, D)).astype(np.float32)
    vt = np.ascontiguousarray(v.transpose(0, 2, 1))
    # garbage past the valid positions must not be read
    k[:, start + T :] = np.nan
    vt[:, :, start + T :] = np.nan
    out = np.empty_like(q)
    getattr(ops, kernel)(q, k, vt, start, H // Hkv, np.float32(1 / np.sqrt(D)), 0, np.float32(0), out)
    ref = _attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), start, H // Hkv)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_parallel_threshold():
    assert not ops.attention_parallel_pays(1, 10, 32, 2)  # a short decode step stays serial
    assert ops.attention_parallel_pays(1, 4096, 32, 2)
    assert ops.attention_parallel_pays(512, 0, 32, 2)
    assert not ops.attention_parallel_pays(512, 0, 32, 1)  # one thread: never


@pytest.mark.parametrize("kernel", ["glu", "glu_serial"])
def test_swiglu_matches_float64_in_place(kernel):
    rng = np.random.default_rng(1)
    gate = (8 * rng.standard_normal((3, 600))).astype(np.float32)  # not a multiple of the exp block
    gate[0, :4] = [-200.0, 200.0, 0.0, -90.0]
    up = rng.standard_normal((3, 600)).astype(np.float32)
    g64 = gate.astype(np.float64)
    ref = g64 / (1.0 + np.exp(-g64)) * up
    getattr(ops, kernel)(gate, up, gate, ops.ACT_SILU)  # in place, as the model calls it
    np.testing.assert_allclose(gate, ref, rtol=2e-6, atol=1e-30)
