"""Fused steps of n tokens (models/decode.py, kernels/fused.py): a batch of 2 .. decode.MAX_ROWS
tokens of one sequence (prompt lookup's verify batch, a short prompt) runs the fused calls, each
type's n-token row kernel by address, and gives every row exactly the logits of its own one-token
step and of the unfused blocks, bit for bit, on the type mixes of test_models_forward's fused
cases (every grouping of the fused calls, every fused type and activation form) and on the
i-quant mixes below, whose one-token steps are checked against the unfused blocks too. The server's
steps of n sequences: tests/test_multi_sequence.py."""

from __future__ import annotations

import numpy as np
import pytest
from test_models_forward import _FUSED_SPECS, _ids, _model  # (tests/ is on sys.path)

from qllama.models.decode import MAX_ROWS, DecodePlan, KernelClock
from qllama.models.step import Plain, Timed
from tools.make_model import ModelSpec, write_model

# the i-quant mixes of llama.cpp's IQ3_M and IQ2_XXS files (iq3_s / iq2_xxs Q, K, gate, up with
# q4_K V, attn_output or ffn_down, q6_K / q5_K output; all q8_K activations), one thread's rows odd
_IQ_SPECS = {
    "llama-iq3_s": ModelSpec(n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_layer=2, seed=39, weight_type="iq3_s",
                             types={"attn_v": "q4_K", "attn_output": "q4_K", "ffn_down": "q4_K", "output": "q6_K"}),
    "llama-iq2_xxs": ModelSpec(n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_layer=2, seed=40,
                               weight_type="iq2_xxs", types={"attn_v": "q4_K", "output": "q5_K"}),
}
ALL_SPECS = {**_FUSED_SPECS, **_IQ_SPECS}
SPECS = [name for name in ALL_SPECS if not name.endswith("q2_K")]  # (q2_K: no fused kernel)
PROMPT = 5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_n")
    paths = {}
    for name in SPECS:
        paths[name] = root / f"{name}.gguf"
        write_model(paths[name], ALL_SPECS[name])
    return paths


def _needs_int8(int8_mode):
    from qllama.kernels._x86 import HAVE_AVX2

    if not HAVE_AVX2:
        pytest.skip("the int8 path needs AVX2")
    int8_mode(True)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("name", SPECS)
def test_each_row_of_a_fused_n_token_batch_equals_its_one_token_step(files, name, n_threads, int8_mode):
    _needs_int8(int8_mode)
    m = _model(files[name], batch=16)
    m.n_threads = n_threads
    ids = _ids(PROMPT + MAX_ROWS, m.args.n_vocab, seed=11)
    one = m.new_cache()
    m.forward(ids[:PROMPT], one)
    alone = np.concatenate([m.forward([t], one) for t in ids[PROMPT:]])  # (MAX_ROWS, n_vocab): one-token steps
    assert isinstance(m._plan, DecodePlan), name  # (every matrix type is fused: the steps took the plan)
    cache = m.new_cache()
    m.forward(ids[:PROMPT], cache)
    with m.executing(Plain(fused=False)):
        plain_one = np.concatenate([m.forward([t], cache) for t in ids[PROMPT:]])
    np.testing.assert_array_equal(alone, plain_one, err_msg=f"{name}: one-token steps against the unfused blocks")
    for n in (2, 3, 4, 5, MAX_ROWS):
        batch = ids[PROMPT : PROMPT + n]
        cache = m.new_cache()
        m.forward(ids[:PROMPT], cache)
        fused = m.forward(batch, cache, all_logits=True)  # (n, n_vocab)
        np.testing.assert_array_equal(fused, alone[:n], err_msg=f"{name}: {n} tokens against one-token steps")
        cache.n_past = PROMPT
        with m.executing(Plain(fused=False)):
            plain = m.forward(batch, cache, all_logits=True)
        np.testing.assert_array_equal(fused, plain, err_msg=f"{name}: {n} tokens against the unfused blocks")


def test_an_n_token_step_takes_the_fused_calls_and_more_rows_do_not(files, int8_mode):
    """Up to MAX_ROWS tokens every projection runs in the fused calls (one Q|K|V call per layer and
    activation form, no separate quantize); MAX_ROWS + 1 tokens take the unfused blocks."""
    _needs_int8(int8_mode)
    m = _model(files["llama-kquants"], batch=16)
    ids = _ids(PROMPT + MAX_ROWS + 1, m.args.n_vocab, seed=12)
    for n, fused in ((3, True), (MAX_ROWS, True), (MAX_ROWS + 1, False)):
        cache = m.new_cache()
        m.forward(ids[:PROMPT], cache)
        clock = KernelClock()
        with m.executing(Timed(clock)):
            m.forward(ids[PROMPT : PROMPT + n], cache, all_logits=True)
        kinds = set(clock.calls)
        assert ("quantize x + attn_q|k|v (fused)" in kinds) == fused, kinds
        assert ("quantize x" in kinds) != fused, kinds
        if fused:
            assert clock.calls["quantize x + attn_q|k|v (fused)"] == m.args.n_layer
            assert clock.calls["quantize x + output (logits)"] == 1


def test_the_warm_up_compiles_the_batch_kernels_and_the_fused_n_token_step():
    """The warm-up's prompt is longer than a fused step (so the gemm compiles) and one of its passes
    is a fused step of a few tokens (each type's n-token row kernel)."""
    from qllama.runtime.warmup import PREFILL_TOKENS, SHORT_TOKENS

    assert PREFILL_TOKENS > MAX_ROWS
    assert 2 <= SHORT_TOKENS <= MAX_ROWS
