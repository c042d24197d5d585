"""The family parameters of the layer kernels (qllama/kernels/layer_ops.py) against float64
NumPy: NeoX RoPE (with partial rotary), the ring-buffer cache store, sliding-window attention
over a ring, attention-logit softcapping, and the GELU-tanh gated FFN."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.kernels import layer_ops as ops


def _tables(n_ctx: int, n_rot: int, base: float = 10000.0):
    ang = np.outer(np.arange(n_ctx), base ** (-np.arange(n_rot // 2) * 2.0 / n_rot))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rope_neox_ref(x, pos, cos, sin, n_rot):
    """Rotate (x[i], x[i + n_rot/2]) for i < n_rot/2; dims past n_rot unchanged."""
    out = x.astype(np.float64).copy()
    half = n_rot // 2
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    x0, x1 = x[..., :half].astype(np.float64), x[..., half:n_rot].astype(np.float64)
    out[..., :half] = x0 * c - x1 * s
    out[..., half:n_rot] = x0 * s + x1 * c
    return out


@pytest.mark.parametrize("n_rot", [8, 6])  # 6: partial rotary (Phi-4-mini), dims 6..7 untouched
def test_rope_neox_and_ring_store(n_rot):
    rng = np.random.default_rng(0)
    T, H, Hkv, D, n_ctx, start, ring = 3, 4, 2, 8, 32, 11, 5
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    cos, sin = _tables(n_ctx, n_rot)
    pos = np.arange(start, start + T)
    q_ref, k_ref = _rope_neox_ref(q, pos, cos, sin, n_rot), _rope_neox_ref(k, pos, cos, sin, n_rot)
    kt = np.zeros((Hkv, D, ring), np.float32)  # keys d-major, as values
    vt = np.zeros((Hkv, D, ring), np.float32)
    ops.rope_store(q, k, v, start, cos, sin, kt, vt, True)
    kc = kt.transpose(0, 2, 1)
    np.testing.assert_allclose(q, q_ref, rtol=1e-6, atol=1e-6)
    slots = pos % ring  # 1, 2, 3
    np.testing.assert_allclose(kc[:, slots, :], k_ref.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(vt[:, :, slots], v.transpose(1, 2, 0))
    assert not kc[:, [0, 4]].any() and not vt[:, :, [0, 4]].any()


def test_rope_layouts_differ():
    """NeoX halves and interleaved pairs are different rotations (the flag is not ignored)."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 8)).astype(np.float32)
    cos, sin = _tables(8, 8)
    outs = []
    for neox in (False, True):
        qq = q.copy()
        ops.rope_store(qq, np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32), 3, cos, sin,
                       np.zeros((1, 8, 8), np.float32), np.zeros((1, 8, 8), np.float32), neox)
        outs.append(qq)
    assert np.abs(outs[0] - outs[1]).max() > 0.1


def _attention_ref(q, k, v, positions, n_rep, scale, window, softcap):
    """q (T, H, D); k, v (Hkv, P, D) float64 for positions 0..P-1; causal, windowed (llama.cpp's
    is_masked_swa: masked when p1 - p0 >= window), softcapped."""
    T, H, D = q.shape
    out = np.empty((T, H, D))
    for t, p1 in enumerate(positions):
        p0 = np.arange(p1 + 1)
        keep = (p1 - p0 < window) if window else np.ones(p1 + 1, bool)
        for h in range(H):
            s = k[h // n_rep, : p1 + 1] @ q[t, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = np.where(keep, s, -np.inf)
            pr = np.exp(s - s.max())
            out[t, h] = (pr / pr.sum()) @ v[h // n_rep, : p1 + 1]
    return out


@pytest.mark.parametrize("kernel", ["attention", "attention_serial"])
@pytest.mark.parametrize("window,T,start,softcap", [
    (8, 1, 30, 0.0),   # decode far past the window (more than 3x)
    (8, 5, 20, 0.0),   # a batch whose first query still needs keys the batch overwrites in a full ring
    (8, 4, 0, 0.0),    # inside the first window
    (6, 3, 17, 2.0),   # window + softcap together
    (0, 4, 9, 1.5),    # softcap alone, full cache
])
def test_windowed_softcapped_attention_over_a_ring(kernel, window, T, start, softcap):
    rng = np.random.default_rng(window * 100 + start)
    H, Hkv, D = 4, 2, 16
    n_pos = start + T
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (2 * rng.standard_normal((Hkv, n_pos, D))).astype(np.float32)
    v = rng.standard_normal((Hkv, n_pos, D)).astype(np.float32)
    ring = window + T - 1 if window else n_pos  # the smallest ring that holds what the batch needs
    kc = np.full((Hkv, ring, D), np.nan, np.float32)  # slots never written must not be read
    vt = np.full((Hkv, D, ring), np.nan, np.float32)
    for p in range(max(0, n_pos - ring), n_pos):  # the ring holds the last `ring` positions
        kc[:, p % ring] = k[:, p]
        vt[:, :, p % ring] = v[:, p]
    scale = np.float32(1 / np.sqrt(D))
    out = np.empty_like(q)
    getattr(ops, kernel)(q, np.ascontiguousarray(kc.transpose(0, 2, 1)), vt, start, H // Hkv, scale, window, np.float32(softcap),
                         False, out)
    ref = _attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         range(start, start + T), H // Hkv, float(scale), window, softcap)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_window_changes_the_result():
    """A window shorter than the context really masks (the reference comparison can fail)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 8, 20)).astype(np.float32)  # keys d-major
    vt = rng.standard_normal((1, 8, 20)).astype(np.float32)
    a, b = np.empty_like(q), np.empty_like(q)
    ops.attention_serial(q, k, vt, 19, 2, np.float32(0.35), 0, np.float32(0), False, a)
    ops.attention_serial(q, k, vt, 19, 2, np.float32(0.35), 4, np.float32(0), False, b)
    assert np.abs(a - b).max() > 1e-2


def test_gelu_tanh_gate_matches_float64():
    rng = np.random.default_rng(2)
    gate = (4 * rng.standard_normal((3, 600))).astype(np.float32)
    gate[0, :6] = [-200.0, 200.0, 0.0, -12.0, 12.0, -1e-3]
    up = rng.standard_normal((3, 600)).astype(np.float32)
    g = gate.astype(np.float64)
    u = np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)
    ref = 0.5 * g * (1.0 + np.tanh(u)) * up
    with np.errstate(over="ignore"):  # exp(-2u) overflows to inf for the most negative g: the result is 0
        np.testing.assert_allclose(ref, g / (1.0 + np.exp(-2.0 * u)) * up, rtol=1e-9, atol=1e-12)  # the form we use
    ops.glu(gate, up, gate, ops.ACT_GELU)
    np.testing.assert_allclose(gate, ref, rtol=3e-6, atol=1e-9)  # atol: tails where 1 + tanh cancels in float64
