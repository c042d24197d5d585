"""The models package beyond single-family logits (tests/test_families.py covers those):

- a sliding-window layer's ring cache (window + batch slots) gives the logits of a full cache,
  at a context of more than twice the window, in prefill rounds and token by token;
- `forward_many` (several caches in one pass over the weights) equals separate forwards,
  greedy tokens included;
- `KVCache.rewind` refuses a prefix whose window positions the ring has overwritten;
- the registry: every supported architecture, and one error line for the others.
"""

from __future__ import annotations

import numpy as np
import pytest

from qllama.errors import UnsupportedError
from qllama.gguf.reader import GGUFFile
from qllama.models import SUPPORTED_ARCHITECTURES, build_model, read_args
from qllama.models.step import Plain
from tools.make_model import ModelSpec, family_spec, write_model

WINDOW = 8
N_CTX = 96


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    specs = {
        # 6 layers: 5 windowed (own RoPE base) + 1 global, as llama.cpp's gemma3 pattern
        "gemma3": family_spec("gemma3", n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, n_layer=6,
                              sliding_window=WINDOW, seed=21),
        "gemma2": family_spec("gemma2", n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, n_layer=2,
                              sliding_window=WINDOW, attn_softcap=5.0, final_softcap=10.0, seed=22),
        "qwen2": family_spec("qwen2", n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_layer=2, seed=23),
        "llama": ModelSpec(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_layer=2, seed=24),
    }
    paths = {}
    for name, spec in specs.items():
        paths[name] = root / f"{name}.gguf"
        write_model(paths[name], spec)
    return paths


def _model(path, batch: int, n_ctx: int = N_CTX):
    gf = GGUFFile(path)
    return build_model(gf, read_args(gf.metadata), n_ctx, batch)


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _run(model, ids, chunk: int) -> np.ndarray:
    cache = model.new_cache()
    return np.concatenate([model.forward(ids[i : i + chunk], cache, all_logits=True) for i in range(0, len(ids), chunk)])


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_ring_cache_equals_full_cache_past_twice_the_window(files, arch, float_path):
    full = _model(files[arch], batch=512)  # window + 512 >= n_ctx: every layer holds all positions
    ring = _model(files[arch], batch=4)  # window layers hold 8 + 4 slots
    # f32 caches: chunks of other sizes sum in other orders (by a last bit), which an f16 cache can
    # turn into a stored value one fp16 ulp (5e-4) away, amplified over 6 layers (seen on AVX-512)
    full.kv_types = ring.kv_types = ("f32", "f32")
    cache = ring.new_cache()
    a = ring.args
    assert [c.shape[1] for c in cache.k] == [WINDOW + 4 if a.is_swa(i) else N_CTX for i in range(a.n_layer)]
    assert full.new_cache().k[0].shape[1] == N_CTX
    assert cache.max_batch == 5  # a batch may not overwrite what its first query still reads
    ids = _ids(3 * WINDOW + 5, a.n_vocab)  # 29 positions: more than 3 windows
    want = _run(full, ids, 512)
    scale = np.abs(want).max()
    for chunk in (1, 3, 4, 29):  # 29: forward splits it into rounds of max_batch
        np.testing.assert_allclose(_run(ring, ids, chunk), want, rtol=0, atol=1e-5 * scale, err_msg=f"chunk {chunk}")


def test_ring_cache_uses_a_fraction_of_the_memory(files):
    """Gemma 3's pattern (5 window layers : 1 global) at a long context: ~1/6 of the KV bytes."""
    big = _model(files["gemma3"], batch=8, n_ctx=4096)
    full_bytes = 6 * 2 * 4096 * big.args.kv_dim * 2  # f16 K and V (the default cache type)
    assert big.new_cache().nbytes == (5 * (WINDOW + 8) + 4096) * 2 * big.args.kv_dim * 2
    assert big.new_cache().nbytes < full_bytes / 5


def test_window_matters(files, float_path):
    """Past the window, a model whose layers saw everything gives other logits (the test can fail)."""
    m = _model(files["gemma3"], batch=512)
    ids = _ids(3 * WINDOW, m.args.n_vocab)
    want = _run(m, ids, 512)
    from dataclasses import replace

    wide = type(m)(replace(m.args, n_swa=10**6), m.weights, N_CTX)
    assert np.abs(_run(wide, ids, 512) - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_forward_many_equals_separate_forwards(files, arch, float_path):
    m = _model(files[arch], batch=4)
    v = m.args.n_vocab
    prompts = [_ids(n, v, seed=s) for n, s in ((5, 1), (13, 2), (1, 3))]
    alone_caches = [m.new_cache() for _ in prompts]
    many_caches = [m.new_cache() for _ in prompts]
    # prefill: all three prompts in one pass (13 > max_batch 5: rounds) vs one by one
    alone = [m.forward(p, c, all_logits=True) for p, c in zip(prompts, alone_caches)]
    many = m.forward_many(list(zip(prompts, many_caches)), all_logits=True)
    for a, b in zip(alone, many):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
    # greedy decode of 12 steps, every segment in one pass per step; a segment whose prompt
    # is prefilled alongside joins at step 4
    last = [int(np.argmax(a[-1])) for a in alone]
    toks_alone = [[t] for t in last]
    toks_many = [[t] for t in last]
    for step in range(12):
        for i, c in enumerate(alone_caches):
            toks_alone[i].append(int(np.argmax(m.forward([toks_alone[i][-1]], c)[-1])))
        segs = [([toks_many[i][-1]], c) for i, c in enumerate(many_caches)]
        if step == 4:
            extra_cache = m.new_cache()
            segs.append((prompts[1], extra_cache))
        out = m.forward_many(segs)
        assert all(o.shape == (1, v) for o in out)
        for i in range(len(many_caches)):
            toks_many[i].append(int(np.argmax(out[i][-1])))
        if step == 4:
            np.testing.assert_allclose(out[3], alone[1][-1:], rtol=0, atol=1e-5 * np.abs(alone[1]).max())
    assert toks_many == toks_alone
    assert [c.n_past for c in many_caches] == [c.n_past for c in alone_caches]


def test_forward_many_rejects_a_shared_cache(files):
    m = _model(files["llama"], batch=512)
    c = m.new_cache()
    with pytest.raises(Exception, match="own cache"):
        m.forward_many([([1], c), ([2], c)])


def test_rewind_keeps_a_prefix_only_while_the_ring_still_holds_its_window(files, float_path):
    m = _model(files["gemma3"], batch=4)  # ring of 12 slots, window 8
    ids = _ids(20, m.args.n_vocab, seed=5)
    cache = m.new_cache()
    _run_into(m, ids, cache)
    assert cache.rewind(19) == 19  # positions 12..18 are still in the ring
    assert cache.rewind(10) == 0  # position 10 needs 3..9, overwritten by 15..19 (and 12..14)
    cache = m.new_cache()
    _run_into(m, ids[:12], cache)
    assert cache.rewind(6) == 6  # nothing overwritten yet
    got = m.forward(ids[6:20], cache, all_logits=True)
    want = _run(m, ids, 20)[6:]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _run_into(model, ids, cache):
    for i in range(0, len(ids), 4):
        model.forward(ids[i : i + 4], cache)


def test_registry_lists_the_families():
    assert set(SUPPORTED_ARCHITECTURES) == {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                                            "qwen3moe", "olmoe", "qwen2moe", "granite", "granitemoe", "gpt-oss"}
    with pytest.raises(UnsupportedError) as e:
        read_args({"general.architecture": "mamba"})
    msg = str(e.value)
    assert "'mamba'" in msg and "\n" not in msg and all(a in msg for a in SUPPORTED_ARCHITECTURES)


def test_session_prefix_reuse_over_a_ring(files, float_path):
    """A chat-like Session reuses the cached prefix when the ring still holds its window, and
    evaluates everything again when it does not; the logits equal a fresh evaluation either way."""
    from qllama.generation.session import Session

    m = _model(files["gemma3"], batch=4)
    session = Session(m, batch_size=4)
    v = m.args.n_vocab
    first = _ids(18, v, seed=7)
    session.prefill(first)
    for prompt, evaluated in ((first + _ids(5, v, seed=8), 5), (first[:6] + _ids(6, v, seed=9), 12)):
        logits, n_eval = session.prefill(prompt)
        assert n_eval == evaluated  # 18 cached positions reused; then position 6 needs 0..5, overwritten: all 12 again
        fresh = m.forward(prompt, m.new_cache())[-1]
        np.testing.assert_allclose(logits, fresh, rtol=0, atol=1e-5 * np.abs(fresh).max())


# -- fused one-token steps (models/decode.py, kernels/fused.py) --------------------------------

# type mixes that exercise every grouping of the fused calls: Q|K|V split by activation form
# (q4_1/q8_1 with q8_0 V), ffn_down in another form than gate|up, gate and up in different
# forms (two groups, GLU apart), phi3's fused attn_qkv and gate|up ffn_up, biases (qwen2),
# Q/K head norms (qwen3), post norms, GELU and softcaps (gemma2); q2_K has no fused kernel.
_FUSED_SPECS = {
    "llama-q4_1-mixed": ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, seed=31, weight_type="q4_1",
                                  types={"attn_v": "q8_0", "ffn_down": "q4_K", "output": "q6_K"}),
    "llama-kquants": ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, seed=32, weight_type="q4_K",
                               types={"attn_v": "q6_K", "ffn_gate": "q5_K", "ffn_up": "q5_0", "output": "q8_0"}),
    "qwen2-q5_1": family_spec("qwen2", n_embd=128, n_ff=256, n_head=4, n_head_kv=2, n_layer=2, seed=33,
                              weight_type="q5_1"),
    "qwen3-q4_0": family_spec("qwen3", n_embd=128, n_ff=256, n_head=4, n_head_kv=2, n_layer=2, seed=34,
                              weight_type="q4_0"),
    "gemma2-q5_0": family_spec("gemma2", n_embd=128, n_ff=256, n_head=4, n_head_kv=2, head_dim=32, n_layer=2,
                               sliding_window=WINDOW, attn_softcap=5.0, final_softcap=10.0, seed=35, weight_type="q5_0"),
    "phi3-q8_0": family_spec("phi3", n_embd=128, n_ff=256, n_head=4, n_layer=2, n_ctx=N_CTX, rope_orig_ctx=64,
                             seed=36, weight_type="q8_0"),
    "llama-q2_K": ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, seed=37, weight_type="q2_K"),
    # i-quants: iq4_xs (q8_K) with iq4_nl (q8_0) V and ffn_down, 17 blocks a row (ggml's odd tail)
    "llama-iq4": ModelSpec(n_embd=256, n_ff=544, n_head=4, n_head_kv=2, n_layer=2, seed=38, weight_type="iq4_xs",
                           types={"attn_v": "iq4_nl", "ffn_down": "iq4_nl", "output": "q6_K"}),
}


@pytest.fixture(scope="module")
def quant_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    paths = {}
    for name, spec in _FUSED_SPECS.items():
        paths[name] = root / f"{name}.gguf"
        write_model(paths[name], spec)
    return paths


def _decode_steps(model, ids, n_steps: int) -> list[np.ndarray]:
    """Prompt ids in one batch, then n_steps one-token steps; the returned arrays, untouched."""
    cache = model.new_cache()
    out = [model.forward(ids, cache)]
    for i in range(n_steps):
        out.append(model.forward([ids[i]], cache))
    return out


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("name", list(_FUSED_SPECS))
def test_fused_decode_equals_unfused_bit_for_bit(quant_files, name, n_threads, int8_mode):
    """On the int8 path, the fused one-token step gives exactly the logits of the unfused building
    blocks (same row intrinsics, same activation rounding, same GLU), with one thread (no parallel
    region) and two; a model with a type that has no fused kernel keeps the unfused path."""
    from qllama.kernels._x86 import HAVE_AVX2
    from qllama.models.decode import DecodePlan
    from qllama.qtensor import get_threads, set_threads

    if not HAVE_AVX2:
        pytest.skip("the int8 path needs AVX2")
    int8_mode(True)
    was = get_threads()
    set_threads(n_threads)
    try:
        m = _model(quant_files[name], batch=16)
        m.n_threads = n_threads
        ids = _ids(12, m.args.n_vocab, seed=5)
        fused = _decode_steps(m, ids, 5)
        m.execution = Plain(fused=False)
        plain = _decode_steps(m, ids, 5)
    finally:
        set_threads(was)
    if name.endswith("q2_K"):
        assert m._plan is False  # no fused kernel for q2_K: every step ran unfused
    else:
        assert isinstance(m._plan, DecodePlan)
    for a, b in zip(fused, plain):
        assert a.shape == b.shape == (1, m.args.n_vocab)
        np.testing.assert_array_equal(a, b)
    assert len({id(a) for a in fused}) == len(fused)  # each step returns its own array (buffers are not handed out)


def test_fused_decode_is_not_used_on_the_float_path(quant_files, float_path):
    """With int8 activations off, one-token steps run the float kernels (no plan is built) and
    match the float path of the unfused blocks exactly."""
    m = _model(quant_files["llama-q4_1-mixed"], batch=16)
    ids = _ids(10, m.args.n_vocab, seed=6)
    a = _decode_steps(m, ids, 3)
    assert m._plan is None
    m.execution = Plain(fused=False)
    b = _decode_steps(m, ids, 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_fused_decode_steps_with_hooks_use_the_named_points(quant_files, int8_mode):
    """A traced one-token step takes the unfused blocks (every point fires) and gives the same logits."""
    from qllama.kernels._x86 import HAVE_AVX2
    from qllama.models.points import Trace, point_names, probe_of

    if not HAVE_AVX2:
        pytest.skip("the int8 path needs AVX2")
    int8_mode(True)
    m = _model(quant_files["llama-q4_1-mixed"], batch=16)
    ids = _ids(8, m.args.n_vocab, seed=7)
    cache = m.new_cache()
    m.forward(ids, cache)
    fast = m.forward([ids[0]], cache)
    cache.n_past -= 1
    with Trace(probe_of(m), "*") as t:
        traced = m.forward([ids[0]], cache)
    np.testing.assert_array_equal(fast, traced)
    assert set(t.names()) == set(point_names(m.args.n_layer))
