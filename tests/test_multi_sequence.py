"""A server step over k sequences (`Transformer.forward_many`, one new token per cache) gives each
sequence exactly the logits of its own one-token step, bit for bit, on the int8 path, the
sequences at different depths: through the fused calls (k up to decode.MAX_ROWS, each type's
n-token row kernel), and through the unfused blocks (k = 2-4 take the row kernels,
qtensor.GEMM_MIN_TOKENS, k >= 5 the gemm); k = 1 is the fused decode step."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.gguf.reader import GGUFFile
from qllama.models import build_model, read_args
from tools.make_model import ModelSpec, write_model

N_CTX = 64


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    """A llama file in Q4_K_M's main types: q4_K matrices, q6_K ffn_down and output; rows in
    multiples of 16 (every matrix can take the gemm)."""
    path = tmp_path_factory.mktemp("multi") / "q4_k.gguf"
    write_model(path, ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, seed=41, weight_type="q4_K",
                                types={"ffn_down": "q6_K", "output": "q6_K"}))
    return path


@pytest.mark.parametrize("fused_rows", [None, 1], ids=["fused", "unfused"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_each_row_of_a_k_sequence_step_equals_its_one_token_step(q4_k_m_file, n_threads, fused_rows, int8_mode):
    from qllama.kernels._x86 import HAVE_AVX2
    from qllama.models.decode import MAX_ROWS
    from qllama.models.step import Plain
    from qllama.qtensor import GEMM_MIN_TOKENS

    if not HAVE_AVX2:
        pytest.skip("the int8 path needs AVX2")
    int8_mode(True)
    gf = GGUFFile(q4_k_m_file)
    m = build_model(gf, read_args(gf.metadata), N_CTX, 8)
    m.n_threads = n_threads
    rng = np.random.default_rng(7)
    k_max = GEMM_MIN_TOKENS + 1 if fused_rows else MAX_ROWS  # (unfused: one step on each side of the gemm switch)
    prompts = [rng.integers(3, m.args.n_vocab, size=3 + 2 * s).tolist() for s in range(k_max)]
    alone = [m.new_cache() for _ in prompts]
    many = [m.new_cache() for _ in prompts]
    for p, a, b in zip(prompts, alone, many):
        m.forward(p, a)
        m.forward(p, b)
    for k in range(1, k_max + 1):  # a step of k sequences, then each of them alone
        step = rng.integers(3, m.args.n_vocab, size=k).tolist()
        with m.executing(Plain(fused_rows=fused_rows)):  # (one-token steps keep the fused decode step)
            out = m.forward_many([([t], c) for t, c in zip(step, many[:k])])
        for i in range(k):
            one = m.forward([step[i]], alone[i])  # the fused one-token step
            np.testing.assert_array_equal(out[i], one, err_msg=f"k={k}, sequence {i}")
    assert [c.n_past for c in many] == [c.n_past for c in alone]
