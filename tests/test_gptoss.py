"""gpt-oss (llama.cpp's openai-moe-iswa graph) on synthetic files written as convert_hf_to_gguf.py
lays them out (tools/make_moe.py, family "gpt-oss"): Q/K/V/O biases, attention sinks, a window on
even layers, YaRN RoPE, post_attention_norm, a biased router (top-k on logits, softmax over the k)
and biased experts with swiglu_oai; experts in f32 and in MXFP4 (as the published files).

- qllama == the float64 reference (tests/reference_moe.GptOssReference) within 1e-4 (float path),
  and within 3e-2 on the int8 path given the experts qllama chose;
- a prompt (batch) == token by token: bit for bit without window layers, within 1e-5 with them;
- `oracle`: against llama-cpp-python, logits, argmax at clear positions, perplexity, f32 and f16
  KV caches.
"""

from __future__ import annotations

import numpy as np
import pytest

import qllama
from reference_moe import GptOssReference, greedy_departure, moe_files, rel_err, yarn_rope
from tools.make_moe import moe_spec, write_moe

EXACT_KV = dict(type_k="f32", type_v="f32")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_BASE = dict(n_embd=64, n_head=4, n_head_kv=2, n_layer=2, n_swa=16, yarn_factor=32.0, yarn_orig_ctx=64)
CASES = {
    "gpt-oss-f32": moe_spec("gpt-oss", seed=21, **_BASE),
    "gpt-oss-mxfp4": moe_spec("gpt-oss", seed=22, types={k: "mxfp4" for k in EXPERTS}, **_BASE),
    "gpt-oss-mxfp4-q8": moe_spec("gpt-oss", seed=23, weight_type="q8_0", types={k: "mxfp4" for k in EXPERTS},
                                 **{**_BASE, "n_embd": 128, "n_layer": 3}),
}
N_TOKENS = 48  # beyond the window (16) and the YaRN original context (64) in the oracle runs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return moe_files(tmp_path_factory.mktemp("gptoss"), CASES)


def _ids(model, n: int = N_TOKENS, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.n_vocab, size=n).tolist()


def test_the_family_reads_the_file(files):
    model = qllama.load(files("gpt-oss-mxfp4"), n_ctx=128)
    a = model.args
    assert (a.arch, a.n_expert, a.n_expert_used, a.n_swa, a.rope_scale) == ("gpt-oss", 8, 4, 16, 32.0)
    assert a.swa_layers == (True, False)  # windowed on even layers (pattern 2)
    lw = model.weights.layers[0]
    assert lw.moe.up.type_id == 39 and lw.attn_sinks.shape == (4,) and lw.attn_output_b.shape == (64,)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_reference(files, name, int8_mode):
    path = files(name)
    model = qllama.load(path, n_ctx=128, **EXACT_KV)
    ids = _ids(model)
    ref_model = GptOssReference(path)
    int8_mode(False)
    err = rel_err(model.logits(ids), ref_model.logits(ids))
    assert err <= 1e-4, f"{name}: float path relative error {err:.2e}"
    int8_mode(True)
    with model.trace(capture="blk.*.ffn_moe_experts") as t:
        got8 = model.logits(ids)
    chosen = {n: t[n] for n in t.names()}
    err8 = rel_err(got8, ref_model.logits(ids, hook=lambda n, a, il: chosen.get(n)))
    print(f"\n{name}: float {err:.1e}, int8 {err8:.1e} (same experts)")
    assert err8 <= 3e-2


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "gpt-oss-mxfp4-q8"])
def test_prefill_equals_token_by_token(tmp_path, name, window, kv, int8_mode):
    """Bit for bit (int8 path: experts, router, the attention kernel with sinks, and with q8_0
    attention matrices the fused one-token Q|K|V and output kernels), window layers included:
    their rings wrap at other slots for other batch sizes, and the attention kernel's sums follow
    the keys' order, not the slots'."""
    from dataclasses import replace

    int8_mode(True)
    path = tmp_path / "g.gguf"
    write_moe(path, replace(CASES[name], n_swa=window))
    kw = dict(type_k=kv, type_v=kv)
    ids = _ids(qllama.load(path, n_ctx=128, **kw), seed=1)
    full = qllama.load(path, n_ctx=128, **kw).logits(ids)
    for bs in (1, 7):
        m = qllama.load(path, n_ctx=128, batch_size=bs, **kw)
        got = m.logits(ids)
        if bs == 1 and name.endswith("q8"):  # one-token steps took the fused Q|K|V and output kernels
            assert m.forward_model._plan
            assert all(lw.moe._decode for lw in m.forward_model.weights.layers)  # router + experts: moe_decode
        np.testing.assert_array_equal(got, full, err_msg=f"batch {bs}")


def test_swiglu_oai_and_yarn_tables_follow_ggml():
    from qllama.models.gptoss import swiglu_oai, yarn_rope_tables

    g = np.array([-20.0, -1.0, 0.0, 0.5, 6.9, 7.0, 30.0], np.float32)
    u = np.array([-30.0, -7.5, -1.0, 0.0, 3.0, 7.0, 9.0], np.float32)
    x = np.minimum(g.astype(np.float64), 7.0)
    want = x / (1 + np.exp(-1.702 * x)) * (np.clip(u, -7, 7) + 1)
    np.testing.assert_allclose(swiglu_oai(g, u), want, rtol=1e-6, atol=1e-6)
    # the tables rotate a unit pair as the reference's element-by-element rope_yarn
    cos, sin = yarn_rope_tables(16, 150000.0, 1 / 32, 64, 1.0, 200)
    pos = np.array([0.0, 1.0, 63.0, 199.0])
    x = np.zeros((4, 1, 16))
    x[..., :8] = 1.0
    r = yarn_rope(x, pos, 16, 150000.0, 32.0, 64)
    np.testing.assert_allclose(r[:, 0, :8], cos[pos.astype(int)], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(r[:, 0, 8:], sin[pos.astype(int)], rtol=1e-6, atol=1e-6)


def test_attention_sinks_of_minus_infinity_change_nothing():
    from qllama.models.points import attention_numpy

    class NoProbe:
        def fire(self, point, il, arr):
            return arr

    rng = np.random.default_rng(3)
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 32, 8)).astype(np.float32)
    vt = rng.standard_normal((2, 8, 32)).astype(np.float32)
    plain = attention_numpy(NoProbe(), 0, q, k, vt, 3, 2, 0.35, 0, 0.0)
    inf = attention_numpy(NoProbe(), 0, q, k, vt, 3, 2, 0.35, 0, 0.0, sinks=np.full(4, -np.inf, np.float32))
    np.testing.assert_allclose(inf, plain, rtol=1e-6, atol=1e-7)
    big = attention_numpy(NoProbe(), 0, q, k, vt, 3, 2, 0.35, 0, 0.0, sinks=np.full(4, 50.0, np.float32))
    assert np.abs(big).max() < 1e-10  # a dominant sink takes all the probability and gives nothing


# -- against llama.cpp --------------------------------------------------------------------------

NEAR_TIE = 1e-3
N_ORACLE = 160  # beyond the window (16) and YaRN's original context (64)
MARGIN = 0.1


def _lcpp(path, n_ctx: int, kv: str):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    t = {"f16": 1, "f32": 0}[kv]
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=2, logits_all=True,
                           verbose=False, seed=0, type_k=t, type_v=t, flash_attn=False)


def _nll(lg: np.ndarray, ids) -> float:
    n = len(ids)
    lg = lg[n // 2 : n - 1]
    lg = lg - lg.max(axis=1, keepdims=True)
    logp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
    tgt = np.asarray(ids[n // 2 + 1 :])
    return float(-logp[np.arange(tgt.size), tgt].mean())


def _margins(lg: np.ndarray) -> np.ndarray:
    top2 = np.sort(lg, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


@pytest.mark.oracle
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_oracle_logits_argmax_perplexity(tmp_path, name, kv):
    from dataclasses import replace

    path = tmp_path / f"{name}.gguf"
    write_moe(path, replace(CASES[name], n_ctx=512, seed=CASES[name].seed + 100, router_std=4.0))
    llm = _lcpp(path, 512, kv)
    model = qllama.load(path, n_ctx=512, type_k=kv, type_v=kv)
    ids = _ids(model, N_ORACLE, seed=5)
    llm.reset()
    llm.eval(list(ids))
    want = np.array(llm.scores[: len(ids)], dtype=np.float64)
    with model.trace(capture="blk.*.ffn_moe_logits") as t:
        got = model.logits(ids).astype(np.float64)
    k = model.args.n_expert_used
    gaps = [np.diff(np.sort(t[n], axis=1)[:, -k - 1 : -k + 1], axis=1)[:, 0] for n in t.names()]
    ties = int(sum((g < NEAR_TIE).sum() for g in gaps))  # k-th and (k+1)-th router logits this close
    sure = _margins(want) >= MARGIN
    agree = np.argmax(got, axis=1) == np.argmax(want, axis=1)
    d = float(np.abs(got - want).max())
    ppl_q, ppl_l = np.exp(_nll(got, ids)), np.exp(_nll(want, ids))
    print(f"\nORACLE-GPTOSS {name} {kv} cache: max|Δlogit| {d:.3e}, argmax agrees at {int((agree & sure).sum())}/"
          f"{int(sure.sum())} clear positions ({int(agree.sum())}/{len(ids)} overall); perplexity qllama {ppl_q:.4f} "
          f"llama.cpp {ppl_l:.4f} ({(ppl_q / ppl_l - 1) * 100:+.3f}%); routing near-ties (top-k logit gap < {NEAR_TIE}): "
          f"{ties} of {len(ids) * model.args.n_layer} token-layers")
    assert sure.sum() > len(ids) // 2
    assert agree[sure].all(), f"argmax differs at {np.flatnonzero(sure & ~agree).tolist()}"
    assert d <= (1e-4 if name == "gpt-oss-f32" and kv == "f32" else 0.6)
    assert abs(ppl_q / ppl_l - 1) <= 0.01


# -- llama.cpp's MXFP4_MOE quantize preset -------------------------------------------------------


def test_mxfp4_quantizer_equals_gguf_py():
    import gguf

    from qllama.quantize import quantize_array

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((16, 320)) * rng.uniform(1e-4, 30, (16, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: e = 0
    np.testing.assert_array_equal(quantize_array(x, 39), gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4))


def _quantized_types(path) -> dict[str, str]:
    from qllama.gguf.reader import GGUFFile

    return {n: t.type_name for n, t in GGUFFile(str(path)).tensors.items()}


def test_mxfp4_moe_preset(files, tmp_path):
    """Experts (3-D) MXFP4, every other quantized matrix q8_0, norms/biases/sinks/router as they were."""
    import subprocess
    import sys

    from conftest import REPO

    src, dst = files("gpt-oss-f32"), tmp_path / "mxfp4-moe.gguf"
    out = subprocess.run([sys.executable, "-m", "qllama", "quantize", src, str(dst), "MXFP4_MOE"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    types = _quantized_types(dst)
    assert types["blk.0.ffn_up_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "mxfp4"
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == types["token_embd.weight"] == "q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_sinks.weight"] == "f32"
    assert types["blk.0.ffn_up_exps.bias"] == "f32"
    ids = list(range(3, 40))
    a = qllama.load(src, n_ctx=64).logits(ids)
    b = qllama.load(str(dst), n_ctx=64).logits(ids)
    assert rel_err(b, a) < 0.5


@pytest.mark.oracle
def test_mxfp4_moe_preset_equals_llama_quantize(files, tmp_path):
    """The same tensor types and the same bytes as llama.cpp's llama-quantize MXFP4_MOE (ftype 38)."""
    import ctypes
    import subprocess
    import sys

    from conftest import REPO
    from qllama.gguf.reader import GGUFFile

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    src = files("gpt-oss-f32")
    mine, theirs = tmp_path / "qllama.gguf", tmp_path / "llama.gguf"
    out = subprocess.run([sys.executable, "-m", "qllama", "quantize", src, str(mine), "MXFP4_MOE"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 38
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    assert _quantized_types(mine) == _quantized_types(theirs)
    gm, gt = GGUFFile(str(mine)), GGUFFile(str(theirs))
    for name in gm.tensors:
        np.testing.assert_array_equal(gm.tensor_bytes(name), gt.tensor_bytes(name), err_msg=name)


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "gpt-oss-mxfp4-q8"])
def test_oracle_greedy_tokens(tmp_path, name):
    """Greedy continuations (f16 caches, both defaults) past the window agree until a departure at a near-tie."""
    from dataclasses import replace

    path = tmp_path / f"{name}.gguf"
    write_moe(path, replace(CASES[name], n_ctx=256, seed=CASES[name].seed + 200, router_std=4.0))
    llm = _lcpp(path, 256, "f16")
    tr = qllama.load(path, n_ctx=256).forward_model
    prompt = np.random.default_rng(6).integers(0, tr.args.n_vocab, size=12).tolist()
    j, margins = greedy_departure(llm, tr, prompt, 40)
    print(f"\nGREEDY-GPTOSS {name}: " + ("all 40 tokens equal" if j is None else
                                        f"departs at token {j}, llama.cpp margin {margins[j]:.3f}"))
    assert j is None or margins[j] < MARGIN


def test_router_points_and_forced_experts(files, float_path):
    """The router is a named point on gpt-oss too: forcing experts 0..k-1 everywhere changes the
    logits exactly as the reference does with the same experts."""
    path = files("gpt-oss-f32")
    model = qllama.load(path, n_ctx=64, **EXACT_KV)
    ids = _ids(model, 20)
    k = model.args.n_expert_used
    forced = np.tile(np.arange(k, dtype=np.float32), (len(ids), 1))
    with model.hooks.add("blk.*.ffn_moe_experts", lambda name, a, il: forced):
        got = model.logits(ids)
    ref = GptOssReference(path).logits(ids, hook=lambda n, a, il: forced if n.endswith("ffn_moe_experts") else None)
    assert rel_err(got, ref) <= 1e-4
    with model.trace(capture="blk.0.ffn_moe_*") as t:
        model.logits(ids)
    assert t["blk.0.ffn_moe_logits"].shape == (len(ids), 8) and t["blk.0.ffn_moe_weights"].shape == (len(ids), k)
    np.testing.assert_allclose(t["blk.0.ffn_moe_weights"].sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("window", [0, 8])
def test_attention_kernel_sinks_equal_the_numpy_path(window):
    """kernels.layer_ops.attention(sinks=) == points.attention_numpy(sinks=) (float32 ulps), its
    parallel form == its serial form bit for bit, and sinks of -inf == no sinks."""
    from qllama.kernels import layer_ops as ops
    from qllama.models.points import attention_numpy

    class NoProbe:
        def fire(self, point, il, arr):
            return arr

    rng = np.random.default_rng(window)
    T, H, Hkv, D, ring, start = 6, 8, 2, 16, 64, 20
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, ring, D)).astype(np.float32)
    vt = rng.standard_normal((Hkv, D, ring)).astype(np.float32)
    sinks = (2 * rng.standard_normal(H)).astype(np.float32)
    serial, par, none, minf = (np.empty((T, H, D), np.float32) for _ in range(4))
    kt = np.ascontiguousarray(k.transpose(0, 2, 1))  # the kernels' keys are d-major
    ops.attention_serial(q, kt, vt, start, 4, 0.25, window, 0.0, False, serial, sinks=sinks)
    ops.attention(q, kt, vt, start, 4, 0.25, window, 0.0, False, par, sinks=sinks)
    np.testing.assert_array_equal(serial, par)
    ref = attention_numpy(NoProbe(), 0, q, k, vt, start, 4, 0.25, window, 0.0, False, sinks=sinks)
    np.testing.assert_allclose(serial, ref, rtol=0, atol=2e-6)
    ops.attention_serial(q, kt, vt, start, 4, 0.25, window, 0.0, False, none)
    ops.attention_serial(q, kt, vt, start, 4, 0.25, window, 0.0, False, minf, sinks=np.full(H, -np.inf, np.float32))
    np.testing.assert_array_equal(none, minf)
    assert np.abs(serial - none).max() > 1e-3  # the sinks matter
