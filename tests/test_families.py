"""Every model family against the float64 reference written from llama.cpp (reference_forward.py).

Synthetic GGUFs (tools/make_model.py, laid out as llama.cpp's converter writes each family) in
f32 and in llama.cpp's Q4_K_M mix. qllama's logits (`qllama.load(path).logits(ids)`) must be
within 1e-4 relative error of the reference on the float path and within the int8 tolerance
of tests/test_model.py on the int8 path; prefill must equal token-by-token decoding (which
walks the sliding-window layers' cache past the window); `inspect --json` must parse.

The sliding-window families run 40 tokens against a window of 8 (more than twice the window);
the softcaps are set low (2 and 3, real models use 50 and 30) so that they change the result.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import qllama
from conftest import REPO, SHARED
from reference_forward import Reference
from tools.make_model import ModelSpec, family_spec, family_template, write_model

INT8_TOL = 3e-2  # as tests/test_model.py: 8-bit activations per block, compounded over the layers
# Files on which llama.cpp's own int8 path is farther than 3e-2 from the exact (float64) result
# (measured with llama-cpp-python 0.3.36, f32 KV cache: qwen3-q4km 3.07e-2, gemma2-q4km 4.35e-2;
# tests/test_families_oracle.py::test_int8_error_no_worse_than_llamacpp checks it live).
INT8_TOL_CASE = {"qwen3-q4km": 4e-2, "gemma2-q4km": 6e-2}
FLOAT_TOL = 1e-4
EXACT_KV = dict(type_k="f32", type_v="f32")  # float-exact comparisons; the f16 cache: test_kvcache.py
N_TOKENS = 40


def _vocab(kind: str) -> str | None:
    """A real vocabulary from ../shared when present; else the tiny built-in SPM one."""
    p = SHARED / "vocab" / f"ggml-vocab-{kind}.gguf"
    return str(p) if p.is_file() else None


def _spec(arch: str, real_vocab: bool = True, **kw) -> ModelSpec:
    vocab = _vocab("gpt-2" if arch.startswith("qwen") else "llama-spm") if real_vocab else None
    template = family_template(arch, SHARED if SHARED.is_dir() else None)
    if arch == "llama":
        return ModelSpec(vocab=vocab, chat_template=template, **kw)
    return family_spec(arch, vocab=vocab, chat_template=template, **kw)


# name -> (spec, n_ctx to load with). Small shapes; "-q4km" files use n_embd 256 so that the
# k-quants (which need rows of 256) are really used, as in llama.cpp's Q4_K_M mix, and the tiny
# built-in vocabulary (quantizing a 50K x 256 embedding takes seconds; the oracle tests use
# real vocabularies).
_F32 = dict(n_embd=64, n_ff=128, n_head=4)
_Q4 = dict(n_embd=256, n_ff=512, n_head=4, preset="Q4_K_M", real_vocab=False)
CASES = {
    "llama-f32": (_spec("llama", n_layer=2, n_head_kv=2, seed=1, **_F32), 128),
    "llama-q4km": (_spec("llama", n_layer=2, n_head_kv=2, seed=2, **_Q4), 128),
    "qwen2-f32": (_spec("qwen2", n_layer=2, n_head_kv=2, seed=3, **_F32), 128),
    "qwen2-q4km-untied": (_spec("qwen2", n_layer=2, n_head_kv=1, tied=False, seed=4, **_Q4), 128),
    "qwen3-f32": (_spec("qwen3", n_layer=2, n_head_kv=2, head_dim=32, seed=5, **_F32), 128),
    "qwen3-q4km": (_spec("qwen3", n_layer=2, n_head_kv=2, head_dim=128, seed=6, **_Q4), 128),
    "gemma2-f32": (_spec("gemma2", n_layer=3, n_head_kv=2, head_dim=32, sliding_window=8, attn_softcap=2.0,
                         final_softcap=3.0, seed=7, **_F32), 128),
    "gemma2-q4km": (_spec("gemma2", n_layer=3, n_head_kv=2, head_dim=64, sliding_window=8, attn_softcap=2.0,
                          final_softcap=3.0, seed=8, **_Q4), 128),
    "gemma3-f32": (_spec("gemma3", n_layer=6, n_head_kv=1, head_dim=32, sliding_window=8, seed=9, **_F32), 128),
    "gemma3-q4km": (_spec("gemma3", n_layer=6, n_head_kv=1, head_dim=64, sliding_window=8, seed=10, **_Q4), 128),
    # Gemma 3 4B+ style: linear RoPE scaling (8) on the global layers only, final softcapping set
    "gemma3-f32-scaled": (_spec("gemma3", n_layer=6, n_head_kv=2, head_dim=32, sliding_window=8, rope_scale_linear=8.0,
                                final_softcap=3.0, seed=11, **_F32), 128),
    # Phi-3.5 style: MHA, fused qkv / gate|up, LongRoPE (original context 256 of 1024: short
    # factors at n_ctx 256, long ones at 512), a sliding window llama.cpp ignores
    "phi3-f32-short": (_spec("phi3", n_layer=2, n_head_kv=4, n_ctx=1024, rope_orig_ctx=256, sliding_window=8,
                             seed=12, **_F32), 256),
    "phi3-f32-long": (_spec("phi3", n_layer=2, n_head_kv=4, n_ctx=1024, rope_orig_ctx=256, sliding_window=8,
                            seed=12, **_F32), 512),
    "phi3-q4km": (_spec("phi3", n_layer=2, n_head_kv=4, n_ctx=1024, rope_orig_ctx=256, seed=13, **_Q4), 512),
    # Phi-4-mini style: GQA, partial rotary (3/4 of head_dim), tied output
    "phi3-f32-partial": (_spec("phi3", n_layer=2, n_head_kv=2, rope_dims=12, tied=True, n_ctx=1024, rope_orig_ctx=256,
                               seed=14, **_F32), 512),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (path, n_ctx); each file written once per module."""
    root = tmp_path_factory.mktemp("families")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            spec, n_ctx = CASES[name]
            path = root / f"{name.removesuffix('-short').removesuffix('-long')}.gguf"
            if not path.exists():
                write_model(path, spec)
            cache[name] = (path, n_ctx)
        return cache[name]

    return get


def _ids(model, n: int = N_TOKENS, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.n_vocab, size=n).tolist()


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_reference(files, name, int8_mode):
    path, n_ctx = files(name)
    model = qllama.load(path, n_ctx=n_ctx, **EXACT_KV)
    ids = _ids(model)
    ref = Reference(path, n_ctx=n_ctx).logits(ids)
    int8_mode(False)
    got = model.logits(ids)
    assert got.shape == ref.shape
    err = rel_err(got, ref)
    assert err <= FLOAT_TOL, f"{name}: float path relative error {err:.2e}"
    int8_mode(True)
    err8 = rel_err(model.logits(ids), ref)
    assert err8 <= INT8_TOL_CASE.get(name, INT8_TOL), f"{name}: int8 path relative error {err8:.2e}"


@pytest.mark.parametrize("name", ["qwen3-q4km", "gemma2-f32", "gemma3-q4km", "phi3-f32-long"])
def test_prefill_equals_token_by_token(files, name, int8_mode):
    """batch_size 1 decodes one token at a time through the cache (past the window). (An f32
    cache: with f16, the float path's last-bit differences between mat-vec and mat-mat can move
    a stored value by one fp16 ulp.)"""
    int8_mode(False)
    path, n_ctx = files(name)
    model = qllama.load(path, n_ctx=n_ctx, **EXACT_KV)
    ids = _ids(model, seed=1)
    full = model.logits(ids)
    for bs in (1, 7):
        got = qllama.load(path, n_ctx=n_ctx, batch_size=bs, **EXACT_KV).logits(ids)
        np.testing.assert_allclose(got, full, rtol=0, atol=1e-5 * np.abs(full).max(), err_msg=f"batch {bs}")


def test_reference_sees_each_family_feature(files):
    """The reference is not blind: dropping one feature moves its logits (the tests can fail)."""
    path, n_ctx = files("gemma2-f32")
    ref = Reference(path, n_ctx=n_ctx)
    ids = list(range(3, 3 + N_TOKENS))
    base = ref.logits(ids)
    for attr, value in (("n_swa", 10**6), ("attn_softcap", 0.0), ("final_softcap", 0.0), ("embd_scale", 1.0)):
        old = getattr(ref.h, attr)
        setattr(ref.h, attr, value)
        assert rel_err(ref.logits(ids), base) > 1e-3, attr
        setattr(ref.h, attr, old)
    path, _ = files("phi3-f32-short")
    short, long = Reference(path, n_ctx=256), Reference(path, n_ctx=512)
    assert rel_err(short.logits(ids), long.logits(ids)) > 1e-3  # LongRoPE factors chosen by context


@pytest.mark.parametrize("name", ["qwen2-f32", "qwen3-f32", "gemma2-f32", "gemma3-f32", "phi3-f32-short"])
def test_inspect_json_parses(files, name):
    path, _ = files(name)
    out = subprocess.run([sys.executable, "-m", "qllama", "inspect", "--json", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["metadata"]["general.architecture"] == name.split("-")[0]
