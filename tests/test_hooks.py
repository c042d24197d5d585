"""Named points (qllama.models.points) against the float64 reference (tests/reference_forward.py).

On the float path every captured point equals the reference's intermediate at that point (1e-4
relative, as tests/test_families.py holds the logits); an ablation hook (zero one head) and a
steering vector change the logits exactly as the same change in the reference; on the int8
path the captured arrays are within its tolerance (3e-2). Synthetic models of llama and of
gemma3 (NeoX RoPE, Q/K norms, a sliding window of 8 over 40 tokens, 5 local : 1 global) and
gemma2 (attention softcap) from tools/make_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import qllama
from qllama.errors import QllamaError
from qllama.models.points import BLOCK_POINTS, Probe, first_nonfinite, point_names
from qllama.qtensor import int8_activations, set_int8_activations
from conftest import synthetic_models
from reference_forward import Reference
from tools.make_model import ModelSpec, family_spec

FLOAT_TOL = 1e-4
# comparisons with exact (float64) arithmetic run an f32 KV cache; the f16 cache's rounding is
# tested against the reference's own fp16 rounding in test_kvcache.py
EXACT = dict(n_ctx=128, type_k="f32", type_v="f32")
INT8_TOL = 3e-2
N_TOKENS = 40
_F32 = dict(n_embd=64, n_ff=128, n_head=4)
CASES = {
    "llama": ModelSpec(n_layer=2, n_head_kv=2, seed=1, **_F32),
    "gemma3": family_spec("gemma3", n_layer=6, n_head_kv=1, head_dim=32, sliding_window=8, seed=9, **_F32),
    "gemma2": family_spec("gemma2", n_layer=3, n_head_kv=2, head_dim=32, sliding_window=8, attn_softcap=2.0,
                          final_softcap=3.0, seed=7, **_F32),
    "qwen2": family_spec("qwen2", n_layer=2, n_head_kv=2, seed=3, **_F32),  # Q/K/V biases
    "phi3": family_spec("phi3", n_layer=2, n_head_kv=2, rope_dims=12, tied=True, n_ctx=1024, rope_orig_ctx=256,
                        seed=14, **_F32),  # fused qkv and gate|up, partial rotary
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return synthetic_models(tmp_path_factory, CASES)


def _ids(n_vocab: int, n: int = N_TOKENS, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(fin, np.isfinite(got)), "masked (-inf) entries differ"
    return float(np.max(np.abs(got[fin] - ref[fin])) / max(np.max(np.abs(ref[fin])), 1e-30))


def _reference_points(path, ids, hook=None):
    got: dict[str, np.ndarray] = {}

    def tap(name, a, il):
        out = hook(name, a, il) if hook else None
        got[name] = np.array(a if out is None else out)
        return out

    logits = Reference(path, n_ctx=128).logits(ids, hook=tap)  # the context the tests load with (LongRoPE)
    return got, logits


@pytest.mark.parametrize("name", ["llama", "gemma3", "gemma2", "qwen2", "phi3"])
def test_every_point_equals_the_reference(files, name, float_path):
    path = files(name)
    model = qllama.load(path, **EXACT)
    ids = _ids(model.n_vocab)
    ref, _ = _reference_points(path, ids)
    with model.trace(capture="*") as t:
        model.logits(ids)
    names = point_names(model.args.n_layer)
    assert sorted(t.names()) == sorted(names)
    assert sorted(ref) == sorted(names)  # the reference fires the same points
    for n in names:
        assert t[n].shape == ref[n].shape, n
        assert rel_err(t[n], ref[n]) <= FLOAT_TOL, f"{name} {n}: {rel_err(t[n], ref[n]):.2e}"


def test_int8_points_within_tolerance(files):
    path = files("gemma3")
    model = qllama.load(path, n_ctx=128)
    ids = _ids(model.n_vocab)
    ref, _ = _reference_points(path, ids)
    was = bool(int8_activations())
    set_int8_activations(True)
    try:
        with model.trace(capture=["blk.*.resid", "blk.*.attn_probs", "blk.*.ffn_act", "logits"]) as t:
            model.logits(ids)
    finally:
        set_int8_activations(was)
    for n in t.names():
        assert rel_err(t[n], ref[n]) <= INT8_TOL, f"{n}: {rel_err(t[n], ref[n]):.2e}"


def _zero_head(head):
    def fn(name, a, layer):
        a = np.array(a)
        a[:, head] = 0.0
        return a

    return fn


@pytest.mark.parametrize("name,layer,point", [("llama", 1, "attn_probs"), ("llama", 0, "attn_z"),
                                              ("gemma3", 2, "attn_probs"), ("gemma3", 5, "attn_z"),
                                              ("llama", 0, "attn_v"), ("llama", 1, "attn_k"), ("llama", 1, "attn_q")])
def test_head_ablation_matches_reference(files, name, layer, point, float_path):
    path = files(name)
    model = qllama.load(path, **EXACT)
    ids = _ids(model.n_vocab, seed=2)
    base = model.logits(ids)
    target = f"blk.{layer}.{point}"
    fn = _zero_head(1)
    _, ref = _reference_points(path, ids, hook=lambda n, a, il: fn(n, a, il) if n == target else None)
    handle = model.hooks.add(target, fn)
    try:
        got = model.logits(ids)
    finally:
        handle.remove()
    assert rel_err(got, base) > 1e-3  # the ablation changed the logits ...
    assert rel_err(got, ref) <= FLOAT_TOL  # ... exactly as in the reference
    np.testing.assert_array_equal(model.logits(ids), base)  # and removing the hook undoes it


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_steering_vector_matches_reference(files, name, float_path):
    path = files(name)
    model = qllama.load(path, **EXACT)
    ids = _ids(model.n_vocab, seed=3)
    steer = np.random.default_rng(5).standard_normal(model.args.n_embd) * 2.0

    def add(n, a, il):
        return a + steer

    _, ref = _reference_points(path, ids, hook=lambda n, a, il: add(n, a, il) if n == "blk.0.resid" else None)
    with model.hooks.add("blk.0.resid", add):
        got = model.logits(ids)
    assert rel_err(got, ref) <= FLOAT_TOL
    assert rel_err(got, model.logits(ids)) > 1e-3


def test_hooks_run_at_each_generation_step(files, float_path):
    path = files("gemma3")
    model = qllama.load(path, n_ctx=128)
    prompt = _ids(model.n_vocab, n=12, seed=4)
    seen: list[int] = []
    h = model.hooks.add("blk.3.attn_probs", lambda n, a, il: seen.append(a.shape[0] * 1000 + a.shape[2]))
    with model.trace(capture=["blk.3.attn_probs", "logits"]) as t:
        chunks = list(model.stream(prompt, max_tokens=5, temperature=0, add_bos=False))
    h.remove()
    n_gen = sum(len(c.token_ids) for c in chunks)
    # the prompt (12 rows over 12 positions), then one row per decoding step over a growing cache
    assert seen[0] == 12 * 1000 + 12
    assert [s % 1000 for s in seen[1:]] == list(range(13, 13 + len(seen) - 1))
    assert all(s // 1000 == 1 for s in seen[1:]) and len(seen) >= n_gen >= 4
    probs = t["blk.3.attn_probs"]  # one map over absolute positions, rows concatenated
    assert probs.shape[0] == 12 + len(seen) - 1 and probs.shape[2] == seen[-1] % 1000
    np.testing.assert_allclose(probs.sum(axis=2), 1.0, rtol=1e-5)
    assert np.all(np.triu(probs[:, 0, :], k=1)[:12, :12] == 0)  # causal
    # layer 3 is a window layer (window 8): a query sees its last 8 positions only
    assert np.all(probs[-1, :, : probs.shape[2] - 8] == 0)


def test_greedy_generation_follows_a_hook(files, float_path):
    path = files("llama")
    model = qllama.load(path, n_ctx=128)
    prompt = _ids(model.n_vocab, n=6, seed=6)
    plain = list(model.stream(prompt, max_tokens=6, temperature=0, add_bos=False))
    forced = 7

    def force(n, a, il):
        out = np.full_like(a, -1e9)
        out[:, forced] = 0.0
        return out

    with model.hooks.add("logits", force):
        hooked = list(model.stream(prompt, max_tokens=6, temperature=0, add_bos=False))
    toks = [t for c in hooked for t in c.token_ids]
    assert toks and all(t == forced for t in toks)
    assert [t for c in plain for t in c.token_ids] != toks


def test_no_probe_when_nothing_is_active(files):
    """The plain execution runs while nothing is traced or hooked; a Probe only while something is."""
    from qllama.models.points import Probe
    from qllama.models.step import PLAIN

    model = qllama.load(files("llama"), n_ctx=64)
    fm = model.forward_model
    assert fm.execution is PLAIN
    with model.trace(capture="blk.0.resid"):
        assert isinstance(fm.execution, Probe)
    assert fm.execution is PLAIN
    h = model.hooks.add("logits", lambda *a: None)
    assert isinstance(fm.execution, Probe)
    h.remove()
    h.remove()
    assert fm.execution is PLAIN


def test_bad_patterns_and_shapes(files):
    model = qllama.load(files("llama"), n_ctx=64)
    with pytest.raises(QllamaError, match="no point matches"):
        model.trace(capture="blk.9.resid")
    with pytest.raises(QllamaError, match="no point matches"):
        model.hooks.add("blk.*.mlp_out", lambda *a: None)
    with model.hooks.add("blk.0.ffn_out", lambda n, a, il: a[:, :3]):
        with pytest.raises(QllamaError, match="shape"):
            model.logits([1, 2, 3])
    assert not isinstance(model.forward_model.execution, Probe)
    assert set(BLOCK_POINTS) >= {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_scores", "attn_probs",
                                 "attn_out", "ffn_in", "ffn_act", "ffn_out", "resid"}


def test_first_nonfinite_names_the_point(files, float_path):
    model = qllama.load(files("llama"), n_ctx=64)
    fm = model.forward_model
    ids = [1, 2, 3, 4]
    assert first_nonfinite(fm, lambda: fm.forward(ids, fm.new_cache())) is None

    def poison(n, a, il):
        a = np.array(a)
        a[2, 5] = np.nan
        return a

    with model.hooks.add("blk.1.ffn_act", poison):
        hit = first_nonfinite(fm, lambda: fm.forward(ids, fm.new_cache()))
    assert hit == (1, "blk.1.ffn_act", 2)
