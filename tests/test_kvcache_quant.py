"""Quantized KV caches (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, as llama.cpp's -ctk/-ctv).

- type names and ids, memory, one clean error for a bad type or a head size that is not a
  multiple of 32;
- the store: bytes equal `qllama.quantize.blocks` (ggml's reference quantizers), and the NumPy and
  Numba readers equal gguf-py's dequantizers;
- attention over the blocks equals a NumPy transcription of the same arithmetic (llama.cpp's CPU
  flash attention: Q in q8_0/q8_1, int32 block sums, float32 softmax and accumulation), and
  the parallel form equals the serial one bit for bit;
- whole synthetic models with every type: close to the f32 cache's logits, prefill equal to
  token by token, ring caches, rewinds and prompt lookup, several sequences in one pass, hooks;
- oracle (llama-cpp-python, flash attention on): perplexity on the trained model within 0.5%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import qllama
from conftest import REPO, SHARED, synthetic_models
from qllama.errors import QllamaError
from qllama.models.kvcache import (QUANT_KV_TYPES, KVCache, block_dtype, dequantize_blocks, from_f32, kv_type,
                                   kv_type_id, query_as_keys, to_f32)
from qllama.quantize.blocks import quantize_array
from qllama.runtime.memory import kv_cache_bytes
from tools.make_model import ModelSpec, family_spec

QUANT = list(QUANT_KV_TYPES)  # q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl
ALL = QUANT + ["f16", "f32"]
_DIMS = dict(n_ff=128, n_head=4)
CASES = {
    "llama": ModelSpec(n_layer=2, n_head_kv=2, seed=1, n_embd=128, **_DIMS),  # head_dim 32
    # 5 window layers to one global, window 8: rings wrap within the 40 tokens
    "gemma3": family_spec("gemma3", n_layer=6, n_head_kv=1, head_dim=32, sliding_window=8, seed=9, n_embd=64, **_DIMS),
    "llama16": ModelSpec(n_layer=1, n_head_kv=2, seed=2, n_embd=64, **_DIMS),  # head_dim 16: no quantized cache
}
N_TOKENS = 40
# max |logit - f32-cache logit| / max |f32-cache logit| over 40 tokens, measured on these models:
# llama / gemma3: q8_0 0.0064 / 0.0073, q5_1 0.032 / 0.040, q5_0 0.054 / 0.048, q4_0 0.070 / 0.098,
# q4_1 0.070 / 0.104, iq4_nl 0.086 / 0.107 (random weights amplify the cache's rounding)
REL_TO_F32 = {"q8_0": 0.02, "q5_0": 0.1, "q5_1": 0.1, "q4_0": 0.2, "q4_1": 0.2, "iq4_nl": 0.2}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return synthetic_models(tmp_path_factory, CASES)


def _ids(n_vocab: int, seed: int = 0, n: int = N_TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def _values(rng, shape, scale=1.0) -> np.ndarray:
    """Rows of varied magnitude (one block in ten much larger), as keys and values have."""
    x = rng.standard_normal(shape) * scale
    x *= np.where(rng.random(shape[:-1] + (1,)) < 0.1, 8.0, 1.0)
    return x.astype(np.float32)


# -- names, memory, errors --------------------------------------------------------------------


def test_type_names_and_ggml_ids():
    """Names (any case) and ggml type ids, as llama-cpp-python's type_k / type_v take them."""
    ids = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20}
    for name, i in ids.items():
        assert kv_type(name) == kv_type(name.upper()) == kv_type(i) == name and kv_type_id(name) == i
    for bad in ("q8", "q4_k", "bf16", 9, 10, 12, True, 8.0):
        with pytest.raises(QllamaError, match="not supported") as e:
            kv_type(bad)
        assert "q8_0" in str(e.value) and "--" not in str(e.value)  # names the types, no CLI flag


@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_0", "f16"), ("f32", "iq4_nl"), ("q5_1", "q4_1")])
def test_memory_follows_the_block_bytes(tk, tv):
    windows = [8, 8, 0]
    c = KVCache(3, 2, 64, 100, windows, batch=4, type_k=tk, type_v=tv)
    bpe = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32,
           "f16": 2, "f32": 4}
    assert c.blocks and c.nbytes == round((12 + 12 + 100) * 2 * 64 * (bpe[tk] + bpe[tv]))
    assert c.k[0].shape == c.vt[0].shape == (2, 12, 2) and c.kb[2].shape == (2, 100, 2 * block_dtype(tk).itemsize)

    class Args:  # what the memory check reads
        n_layer, n_head_kv, head_dim, n_swa = 3, 2, 64, 8

        def is_swa(self, il):
            return il < 2

    assert kv_cache_bytes(Args(), 100, 4, (tk, tv)) == c.nbytes


def test_bad_types_and_head_sizes_are_one_clean_error(files):
    with pytest.raises(QllamaError, match="not supported"):
        qllama.load(files("llama"), n_ctx=64, type_k="q8")
    with pytest.raises(QllamaError, match="multiple of 32"):
        qllama.load(files("llama16"), n_ctx=64, type_v="q4_0")
    for args, code, words in ((["-ctk", "q3_k"], 2, "'q3_k' is not one of"), (["-ctv", "q8_0"], 1, "multiple of 32")):
        path = files("llama16") if code == 1 else files("llama")
        out = subprocess.run([sys.executable, "-m", "qllama", "run", path, "hi", "-n", "2", "--temp", "0", *args],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == code and lines[-1].startswith("error:") and words in lines[-1], out.stderr
        assert "Traceback" not in out.stderr


# -- blocks: the store and the readers ----------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_store_writes_the_reference_quantizers_bytes(name):
    """rope_store_quant's key rows are the roped keys of layer_ops.rope_store, and both key and
    value rows are the bytes of quantize_array (ggml's *_ref quantizers), through a wrapping ring."""
    from qllama.kernels import attention_quant as aq
    from qllama.kernels import layer_ops as ops
    from qllama.models.base import rope_tables

    rng = np.random.default_rng(3)
    T, H, Hkv, D, ring, start = 6, 4, 2, 64, 8, 13  # positions 13..18 in slots 5, 6, 7, 0, 1, 2
    cos, sin = rope_tables(48, 10000.0, 1.0, None, 1.0, 32)
    q, k, v = _values(rng, (T, H, D)), _values(rng, (T, Hkv, D)), _values(rng, (T, Hkv, D))
    k[1, 0, :32] = 0.0  # an all-zero block
    tid = kv_type_id(name)
    kb = np.zeros((Hkv, ring, D // 32 * block_dtype(name).itemsize), np.uint8)
    vb = np.zeros_like(kb)
    q1, q2 = q.copy(), q.copy()
    aq.rope_store_quant(q1, k.copy(), v, start, cos, sin, kb, vb, False, tid, tid)
    kft = np.zeros((Hkv, D, ring), np.float32)  # the float path's roped keys (d-major)
    ops.rope_store(q2, k.copy(), v, start, cos, sin, kft, np.zeros((Hkv, D, ring), np.float32), False)
    kf = kft.transpose(0, 2, 1)
    assert np.array_equal(q1, q2)
    slots = np.arange(start, start + T) % ring
    want_k = quantize_array(kf[:, slots].reshape(-1, D), tid).reshape(Hkv, T, -1)
    want_v = quantize_array(v.transpose(1, 0, 2).reshape(-1, D), tid).reshape(Hkv, T, -1)
    assert np.array_equal(kb[:, slots], want_k) and np.array_equal(vb[:, slots], want_v)
    # and back: the reader of the cache gives the dequantized values
    back = to_f32(vb.view(block_dtype(name))[:, slots])
    np.testing.assert_allclose(back, v.transpose(1, 0, 2), rtol=0, atol=0.12 * np.abs(v).max())


@pytest.mark.parametrize("name", QUANT)
def test_readers_equal_gguf_py(name):
    """kvcache.dequantize_blocks (NumPy) and the kernels' to_float (Numba) equal gguf-py's
    dequantizers on the blocks our quantizer wrote (an independent implementation)."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    from qllama.kernels.attention_quant import dequantize_rows, quantize_rows

    rng = np.random.default_rng(5)
    x = _values(rng, (64, 64), scale=3.0)
    x[0] = 0.0
    x[1, :32] = 1.0  # a constant block
    tid = kv_type_id(name)
    raw = quantize_array(x, tid)
    nb = np.zeros_like(raw)
    quantize_rows(tid, x, nb)  # the kernel's quantizer: the same bytes
    assert np.array_equal(nb, raw)
    want = gq.dequantize(raw, GGMLQuantizationType(tid)).reshape(x.shape)
    assert np.array_equal(dequantize_blocks(raw.view(block_dtype(name))), want)
    got = np.empty_like(x)
    dequantize_rows(tid, raw, got)
    assert np.array_equal(got, want)
    # the quantizer is a good one: error well inside a step of the type
    step = {"q8_0": 1 / 127, "q5_0": 1 / 16, "q5_1": 1 / 31, "q4_0": 1 / 8, "q4_1": 1 / 15, "iq4_nl": 1 / 8}[name]
    assert np.abs(want - x).max() <= step * np.abs(x).max()


def test_iq4_nl_quantizer_follows_ggml_ref_by_hand():
    """One block worked through ggml's quantize_row_iq4_nl_ref: d = max / -127, nearest table
    value at 1/d, d refit as sum(x^2 q x) / sum(x^2 q^2)."""
    table = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
    x = np.linspace(-1.0, 2.0, 32).astype(np.float32)
    raw = quantize_array(x, 20)[0]
    d0 = np.float32(2.0) / np.float32(-127.0)
    idx = np.array([int(np.argmin(np.abs(table - np.float32(1.0) / d0 * v))) for v in x])
    q = table[idx]
    sumqx = sumq2 = np.float32(0.0)
    for j in range(32):
        w = x[j] * x[j]
        sumqx = np.float32(sumqx + w * q[j] * x[j])
        sumq2 = np.float32(sumq2 + w * q[j] * q[j])
    assert raw[:2].view(np.float16)[0] == np.float16(sumqx / sumq2)
    assert np.array_equal(raw[2:], (idx[:16] | (idx[16:] << 4)).astype(np.uint8))


# -- attention over the blocks ------------------------------------------------------------------

_INTS = {  # block bytes -> (d, m, integer quants as the vec_dot multiplies them)
    "q8_0": lambda r: r[2:34].view(np.int8).astype(np.int64),
    "q4_0": lambda r: np.concatenate([r[2:18] & 15, r[2:18] >> 4]).astype(np.int64) - 8,
    "iq4_nl": lambda r: np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])[
        np.concatenate([r[2:18] & 15, r[2:18] >> 4])],
    "q4_1": lambda r: np.concatenate([r[4:20] & 15, r[4:20] >> 4]).astype(np.int64),
}


def _ints(name: str, r: np.ndarray) -> np.ndarray:
    if name in _INTS:
        return _INTS[name](r)
    at = 6 if name == "q5_0" else 8
    qh = int(r[at - 4 : at].view("<u4")[0])
    hi = np.array([(qh >> j) & 1 for j in range(32)]) << 4
    return (np.concatenate([r[at : at + 16] & 15, r[at : at + 16] >> 4]).astype(np.int64) | hi) - (16 if name == "q5_0" else 0)


def _q8(x: np.ndarray):
    """ggml's x86 quantize_row_q8_0/q8_1 of one row: (int quants, fp16 d, fp16 d * sum) per block."""
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    iscale = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    qi = np.clip(np.rint(b * iscale[:, None]), -127, 127).astype(np.int64)
    d = (amax / np.float32(127.0)).astype(np.float32)
    return qi, d.astype(np.float16).astype(np.float64), (d * qi.sum(axis=1).astype(np.float32)).astype(np.float16).astype(np.float64)


def _reference(q, kb, vb, tk, tv, start, n_rep, scale, window, softcap, q_scaled):
    """The arithmetic of llama.cpp's CPU flash attention over these blocks, in NumPy (float64 sums)."""
    T, H, D = q.shape
    ring = kb.shape[1]
    kd = kb.view(block_dtype(tk))
    out = np.zeros((T, H, D))
    for t in range(T):
        p = start + t
        lo = max(0, p - window + 1) if window else 0
        pos = np.arange(lo, p + 1)
        slots = pos % ring
        for h in range(H):
            kvh = h // n_rep
            qv = q[t, h] * (np.float32(scale) if q_scaled else np.float32(1.0))
            s = np.zeros(len(pos))
            if tk in QUANT_KV_TYPES:
                qi, qd, qs = _q8(qv.astype(np.float32))
                for j, sl in enumerate(slots):
                    raw = kb[kvh, sl].reshape(D // 32, -1)
                    for b in range(D // 32):
                        dk = float(raw[b, :2].view(np.float16)[0])
                        s[j] += dk * qd[b] * float(_ints(tk, raw[b]) @ qi[b])
                        if tk in ("q4_1", "q5_1"):
                            s[j] += float(raw[b, 2:4].view(np.float16)[0]) * qs[b]
            else:
                qq = qv.astype(np.float16).astype(np.float64) if tk == "f16" else qv.astype(np.float64)
                s = to_f32(kd[kvh, slots]).astype(np.float64) @ qq
            s = s * (1.0 if q_scaled else scale)
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            v = to_f32(vb.view(block_dtype(tv))[kvh, slots]).astype(np.float64)
            out[t, h] = (w @ v) / w.sum()
    return out


@pytest.mark.parametrize("tk,tv", [(n, n) for n in QUANT] + [("q8_0", "f16"), ("f16", "q4_0"), ("f32", "q5_1"), ("q4_1", "f32")])
@pytest.mark.parametrize("q_scaled,window,softcap", [(False, 0, 0.0), (True, 6, 2.0)])
def test_attention_equals_the_numpy_arithmetic(tk, tv, q_scaled, window, softcap):
    from qllama.kernels import attention_quant as aq

    rng = np.random.default_rng(11)
    T, start, H, Hkv, D = 3, 21, 4, 2, 64
    ring = window + T - 1 if window else start + T  # a window layer's ring wraps; a full layer holds all
    q = _values(rng, (T, H, D))
    k, v = _values(rng, (Hkv, ring, D), 2.0), _values(rng, (Hkv, ring, D))
    kb = from_f32(k, np.zeros(1, block_dtype(tk))).view(np.uint8)
    vb = from_f32(v, np.zeros(1, block_dtype(tv))).view(np.uint8)
    args = (kv_type_id(tk), kv_type_id(tv), start, H // Hkv, np.float32(0.125), window, np.float32(softcap), q_scaled)
    got = np.empty_like(q)
    aq.attention_quant_serial(q, kb, vb, *args, got)
    want = _reference(q, kb, vb, tk, tv, start, H // Hkv, 0.125, window, softcap, q_scaled)
    # measured <= 1.7e-7 of the largest output: float32 rounding of the products (the kernel dots dequantized
    # rows; ggml and this reference sum the int products exactly)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    par = np.empty_like(q)
    aq.attention_quant(q, kb, vb, *args, par)
    assert np.array_equal(par, got)  # the parallel form runs the same jobs


class _Pass:
    """A probe that lets every point through (attention_numpy fires attn_scores/attn_probs)."""

    def fire(self, point, il, arr):
        return arr


@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_1", "f16"), ("f16", "iq4_nl")])
def test_numpy_attention_path_equals_the_kernel(tk, tv):
    """points.attention_numpy (the hooks' path for attn_scores/attn_probs) reads the blocks and
    converts the queries as the kernel does. (q4_1/q5_1 keys: the kernel's min term uses q8_1's
    s = fp16(d * sum q), the NumPy path the unrounded sum of the dequantized query: measured
    7e-4 of the largest output apart; 2e-7 for the other types.)"""
    from qllama.kernels import attention_quant as aq
    from qllama.models.points import attention_numpy

    rng = np.random.default_rng(12)
    T, start, H, Hkv, D, window = 3, 21, 4, 2, 64, 6
    ring = window + T - 1
    q = _values(rng, (T, H, D))
    kc = from_f32(_values(rng, (Hkv, ring, D), 2.0), np.zeros(1, block_dtype(tk)))
    vc = from_f32(_values(rng, (Hkv, ring, D)), np.zeros(1, block_dtype(tv)))
    for q_scaled in (False, True):
        want = np.empty_like(q)
        aq.attention_quant_serial(q, kc.view(np.uint8), vc.view(np.uint8), kv_type_id(tk), kv_type_id(tv), start, 2,
                                  np.float32(0.125), window, np.float32(0.0), q_scaled, want)
        got = attention_numpy(_Pass(), 0, q, kc, vc, start, 2, np.float32(0.125), window, np.float32(0.0), q_scaled)
        tol = 2e-3 if tk in ("q4_1", "q5_1") else 3e-6
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
    assert np.array_equal(query_as_keys(q, np.zeros(1, block_dtype("f32"))), q)


# -- whole models -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANT)
def test_models_run_close_to_the_f32_cache_and_prefill_equals_steps(files, name):
    """Each type on a full-attention model and on rings that wrap (gemma3, window 8): logits near
    the f32 cache's, and token by token equal to one batched call."""
    for case in ("llama", "gemma3"):
        path = files(case)
        ref = qllama.load(path, n_ctx=128, batch_size=4, type_k="f32", type_v="f32")
        model = qllama.load(path, n_ctx=128, batch_size=4, type_k=name, type_v=name)  # rings of 8 + 4 slots
        ids = _ids(model.n_vocab, seed=1)
        got = model.logits(ids)
        err = rel_err(got, ref.logits(ids))
        print(f"\n{case} {name}: {err:.4f} of the f32 cache's largest logit")
        assert err <= REL_TO_F32[name]
        fm = model.forward_model
        cache = fm.new_cache()
        assert cache.blocks and cache.type_k == name
        steps = np.concatenate([fm.forward([t], cache) for t in ids])
        np.testing.assert_allclose(steps, got, rtol=0, atol=1e-5 * np.abs(got).max())


def test_mixed_types_and_several_sequences_in_one_pass(files):
    """K and V of different types; the server's steps (forward_many: segments of different
    lengths and positions in one pass) equal each sequence run alone."""
    path = files("gemma3")
    model = qllama.load(path, n_ctx=128, batch_size=8, type_k="q8_0", type_v="q4_1")
    fm = model.forward_model
    a, b = _ids(model.n_vocab, seed=4, n=20), _ids(model.n_vocab, seed=5, n=13)
    alone = [fm.forward(a, fm.new_cache(), True), fm.forward(b, fm.new_cache(), True)]
    ca, cb = fm.new_cache(), fm.new_cache()
    fm.forward(a[:5], ca)
    first = fm.forward_many([(a[5:], ca), (b, cb)], all_logits=True)
    np.testing.assert_allclose(first[0], alone[0][5:], rtol=0, atol=1e-5 * np.abs(alone[0]).max())
    np.testing.assert_allclose(first[1], alone[1], rtol=0, atol=1e-5 * np.abs(alone[1]).max())


def test_rewind_and_prompt_lookup(files):
    """KVCache.rewind keeps what it can (chat's reuse, prompt lookup's refused drafts), and
    greedy lookup gives plain greedy's tokens on a quantized cache."""
    path = files("llama")
    model = qllama.load(path, n_ctx=128, type_k="q5_0", type_v="q8_0")
    fm = model.forward_model
    ids = _ids(model.n_vocab, seed=6)
    whole = fm.forward(ids, fm.new_cache(), True)
    cache = fm.new_cache()
    fm.forward(ids[:30], cache)
    assert cache.rewind(20) == 20
    again = fm.forward(ids[20:], cache, True)
    np.testing.assert_allclose(again, whole[20:], rtol=0, atol=1e-5 * np.abs(whole).max())
    prompt = [model.tokenizer.bos_id] + ids[:12] + ids[:12]
    plain = [t for c in model.stream(prompt, max_tokens=24, temperature=0) for t in c.token_ids]
    fast = [t for c in model.stream(prompt, max_tokens=24, temperature=0, lookup=6) for t in c.token_ids]
    assert fast == plain


def test_hooks_read_and_write_the_quantized_cache(files):
    """attn_probs runs block 0's attention in NumPy from the blocks (attn_z as the kernel's);
    a replaced attn_v is quantized into the cache."""
    path = files("llama")
    model = qllama.load(path, n_ctx=128, type_k="q8_0", type_v="q8_0")
    ids = _ids(model.n_vocab, seed=2)
    with model.trace(capture=["blk.0.attn_z"]) as plain:
        model.logits(ids)
    with model.trace(capture=["blk.0.attn_probs", "blk.0.attn_z", "blk.0.attn_k"]) as t:
        model.logits(ids)
    assert rel_err(t["blk.0.attn_z"], plain["blk.0.attn_z"]) <= 1e-5
    np.testing.assert_allclose(t["blk.0.attn_probs"].sum(axis=2), 1.0, rtol=1e-5)
    k = t["blk.0.attn_k"]  # as stored: q8_0 values
    assert np.array_equal(to_f32(from_f32(k, np.zeros(1, block_dtype("q8_0")))), k)

    def zero_head(name, a, il):
        a = np.array(a)
        a[:, 1] = 0.0
        return a

    handle = model.hooks.add("blk.1.attn_v", zero_head)
    try:
        fm = model.forward_model
        cache = fm.new_cache()
        fm.forward(ids[:10], cache)
    finally:
        handle.remove()
    assert not to_f32(cache.vt[1][1, :10]).any() and to_f32(cache.vt[1][0, :10]).any()


def test_cli_verbose_and_inspect_show_the_kv_bytes(files):
    path = files("llama")
    out = subprocess.run([sys.executable, "-m", "qllama", "run", path, "hello", "-n", "4", "--temp", "0", "-c", "64",
                          "-ctk", "q8_0", "-ctv", "q4_0", "--verbose"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    want = 2 * 2 * 64 * 32 * (34 + 18) // 32  # layers x KV heads x n_ctx x (K + V bytes per 32-element row)
    assert f"{want / 2**20:.2f} MiB KV cache (q8_0 K, q4_0 V)" in out.stderr
    out = subprocess.run([sys.executable, "-m", "qllama", "inspect", path, "-ctk", "iq4_nl", "-ctv", "iq4_nl"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "2 (K,V) x 2 layers x 2 KV heads x 32 dims x 0.5625 B (iq4_nl) = 144 B/token" in out.stdout


# -- llama.cpp ----------------------------------------------------------------------------------

PPL_TOL = 5e-3  # measured on the trained model (8 chunks of 256): see the README's table
PPL_CTX, PPL_CHUNKS = 256, 8


def _lcpp_perplexity(llama_cpp, path, kv: str, text: str) -> float:
    """llama-perplexity's protocol (chunks of n_ctx, BOS first, score the second half), flash attention on."""
    from tools.kv_quant_ppl import llama_cpp_perplexity

    return llama_cpp_perplexity(str(path), text, kv, PPL_CTX, PPL_CHUNKS, threads=2)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("name", QUANT)
def test_perplexity_equals_llama_cpp_with_the_same_cache(name, tmp_path):
    """`qllama perplexity -ctk T -ctv T` within 0.5% of llama.cpp's with the same cache types
    (which need its flash attention), on the trained model in ../shared."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    path = SHARED / "models" / "shakespeare-spm-f32.gguf"
    text_file = SHARED / "models" / "shakespeare-val.txt"
    if not path.is_file() or not text_file.is_file():
        pytest.skip("the trained model in ../shared is absent")
    want = _lcpp_perplexity(llama_cpp, path, name, text_file.read_text(encoding="utf-8"))
    out = subprocess.run([sys.executable, "-m", "qllama", "perplexity", str(path), str(text_file), "-c", str(PPL_CTX),
                          "--chunks", str(PPL_CHUNKS), "--json", "-ctk", name, "-ctv", name], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["ppl"]
    print(f"\nPPL {name} cache: qllama {got:.4f} llama.cpp {want:.4f} ({(got / want - 1) * 100:+.3f}%)")
    assert abs(got / want - 1) <= PPL_TOL


def test_compiling_the_attention_leaves_the_q8_quantizers_exact(tmp_path):
    """Compiled first (a fresh kernel cache), the fast-math attention body must not compile
    act_quant's q8 row quantizers with its flags: their fp16 rounding of d (2^52 trick) would fold
    away, and that cached copy would serve every q8_0 activation (see attention_quant._query_q8)."""
    code = ("import numpy as np\n"
            "from qllama.kernels import attention_quant as aq\n"
            "from qllama.kernels.quantize_k import fp16_round\n"
            "q = np.ones((1, 4, 64), np.float32); kb = np.zeros((2, 8, 68), np.uint8); out = np.empty_like(q)\n"
            "aq.attention_quant_serial(q, kb, kb, 8, 8, 3, 2, np.float32(0.1), 0, np.float32(0), False, out)\n"
            "x = np.float32(0.0183107)\n"
            "print(fp16_round(x) == np.float32(np.float16(x)))\n")
    env = dict(os.environ, QLLAMA_CACHE_DIR=str(tmp_path), QLLAMA_COMPILE_WORKERS="0")
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr


@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_1", "f16"), ("iq4_nl", "q5_0")])
@pytest.mark.parametrize("window", [0, 150])
def test_batch_rows_equal_tokens_alone_at_depth(tk, tv, window):
    """Past 200 keys, a batch and a token alone give the same rows, bit for bit; with a window the
    ring wraps at a place that depends on the batch."""
    from qllama.kernels import attention_quant as aq

    rng = np.random.default_rng(5)
    T, start, H, Hkv, D = 6, 200, 8, 2, 64
    n_pos = start + T
    q = _values(rng, (T, H, D))
    k, v = _values(rng, (Hkv, n_pos, D), 2.0), _values(rng, (Hkv, n_pos, D))

    def ring_cache(ring, upto):
        slots = np.arange(max(0, upto - ring), upto)
        kr, vr = np.zeros((Hkv, ring, D), np.float32), np.zeros((Hkv, ring, D), np.float32)
        kr[:, slots % ring], vr[:, slots % ring] = k[:, slots], v[:, slots]
        return (from_f32(kr, np.zeros(1, block_dtype(tk))).view(np.uint8),
                from_f32(vr, np.zeros(1, block_dtype(tv))).view(np.uint8))

    args = (kv_type_id(tk), kv_type_id(tv))
    tail = (H // Hkv, np.float32(0.125), window, np.float32(0.0), False)
    kb, vb = ring_cache(window + T if window else n_pos, n_pos)
    batch = np.empty_like(q)
    aq.attention_quant(q, kb, vb, *args, start, *tail, batch)
    for t in range(T):
        kb1, vb1 = ring_cache(window + 1 if window else n_pos, start + t + 1)
        one = np.empty_like(q[:1])
        aq.attention_quant_serial(q[t : t + 1].copy(), kb1, vb1, *args, start + t, *tail, one)
        np.testing.assert_array_equal(one[0], batch[t])
