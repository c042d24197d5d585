"""The sampler, step by step, on distributions small enough to check by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qllama.errors import QllamaError
from qllama.generation.sampling import (
    Sampler,
    SamplingParams,
    apply_repeat_penalty,
    min_p_filter,
    softmax,
    top_k_filter,
    top_p_filter,
)


def test_defaults_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n) == (0.8, 40, 0.95, 0.05, 1.0, 64)


def test_greedy_at_zero_temperature():
    s = Sampler(SamplingParams(temperature=0.0))
    assert s.sample(np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)) == 1


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -2.0, 1.0, 4.0], dtype=np.float32)
    apply_repeat_penalty(logits, np.array([0, 1, 1]), 2.0)  # token 1 twice: penalised once
    assert logits.tolist() == [1.0, -4.0, 1.0, 4.0]


def test_top_k_keeps_the_k_largest_sorted():
    ids, lg = top_k_filter(np.arange(5), np.array([1.0, 5.0, 3.0, 4.0, 2.0]), 3)
    assert ids.tolist() == [1, 3, 2] and lg.tolist() == [5.0, 4.0, 3.0]


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125 (logits are log-probs)
    lg = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
    ids = np.arange(4)
    assert top_p_filter(ids, lg, 0.5)[0].tolist() == [0]  # 0.5 >= 0.5
    assert top_p_filter(ids, lg, 0.6)[0].tolist() == [0, 1]  # 0.75 >= 0.6
    assert top_p_filter(ids, lg, 0.8)[0].tolist() == [0, 1, 2]  # 0.875 >= 0.8
    assert top_p_filter(ids, lg, 1.0)[0].tolist() == [0, 1, 2, 3]


def test_min_p_is_relative_to_the_top_probability():
    lg = np.log(np.array([0.5, 0.25, 0.125, 0.05, 0.075]))
    # keep p >= 0.3 * 0.5 = 0.15
    assert min_p_filter(np.arange(5), lg, 0.3)[0].tolist() == [0, 1]
    # keep p >= 0.2 * 0.5 = 0.1
    assert min_p_filter(np.arange(5), lg, 0.2)[0].tolist() == [0, 1, 2]


def test_temperature_sharpens_the_distribution_as_computed_by_hand():
    # two tokens, logits 0 and ln 3: probabilities 1/4, 3/4; at T=0.5 they become 1/10, 9/10
    lg = np.array([0.0, math.log(3.0)], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=123))
    draws = np.array([s.sample(lg) for _ in range(20000)])
    assert abs(draws.mean() - 0.9) < 0.01
    np.testing.assert_allclose(softmax(lg / 0.5), [0.1, 0.9], rtol=1e-6)


def test_chain_order_top_k_then_top_p_then_min_p():
    # after top-k=3: probs of [4, 3, 2] renormalised; top-p 0.7 keeps [4, 3]; only those are drawn
    lg = np.array([4.0, 3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, top_p=0.7, min_p=0.0, seed=1))
    draws = {s.sample(lg) for _ in range(2000)}
    assert draws == {0, 1}
    p = softmax(np.array([4.0, 3.0]))
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, top_p=0.7, min_p=0.0, seed=2))
    freq = np.mean([s.sample(lg) == 0 for _ in range(20000)])
    assert abs(freq - p[0]) < 0.015


def test_same_seed_same_tokens_and_penalty_window():
    lg = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    a = Sampler(SamplingParams(seed=42, repeat_penalty=1.3, repeat_last_n=4))
    b = Sampler(SamplingParams(seed=42, repeat_penalty=1.3, repeat_last_n=4))
    seq_a, seq_b = [], []
    for _ in range(30):
        ta, tb = a.sample(lg), b.sample(lg)
        a.accept(ta)
        b.accept(tb)
        seq_a.append(ta)
        seq_b.append(tb)
    assert seq_a == seq_b
    assert len(a.recent) == 4 and list(a.recent) == seq_a[-4:]


def test_sample_does_not_modify_its_input():
    lg = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams(repeat_penalty=2.0, temperature=0.0))
    s.accept(2)
    assert s.sample(lg) == 1  # 3/2 = 1.5 < 2
    assert lg.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("kw", [dict(top_p=1.5), dict(min_p=-0.1), dict(repeat_penalty=0.0), dict(temperature=float("nan"))])
def test_bad_parameters_are_errors(kw):
    with pytest.raises(QllamaError):
        Sampler(SamplingParams(**kw))


# -- llama.cpp's penalties sampler (repeat, frequency, presence), logit bias, ignore_eos ------------

def test_penalties_as_llama_cpp_applies_them_by_hand():
    from qllama.generation.sampling import apply_penalties

    logits = np.array([2.0, -2.0, 1.0, 4.0, 0.5], dtype=np.float32)
    # token 0 seen once, 1 twice, 3 three times: repeat 2, then c * 0.5 + 0.25 subtracted
    apply_penalties(logits, np.array([0, 1, 1, 3, 3, 3]), 2.0, 0.5, 0.25)
    # 0: 2/2 - (0.5 + 0.25); 1: -2*2 - (1.0 + 0.25); 3: 4/2 - (1.5 + 0.25); 2 and 4 untouched
    assert logits.tolist() == [0.25, -5.25, 1.0, 0.25, 0.5]


def test_presence_penalty_changes_the_greedy_choice():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    plain = Sampler(SamplingParams(temperature=0.0))
    plain.accept(0)
    assert plain.sample(logits) == 0
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.2))  # 3.0 - 0.2 = 2.8 < 2.9
    s.accept(0)
    assert s.sample(logits) == 1


def test_frequency_penalty_counts_only_the_window():
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=2,
                               frequency_penalty=math.log(2)))
    for t in (0, 0, 0, 1):  # the window holds [0, 1]: each seen once
        s.accept(t)
    ids, probs = s.distribution(np.zeros(3, dtype=np.float32))
    # logits -ln2, -ln2, 0 -> weights 1/2, 1/2, 1 -> 0.25, 0.25, 0.5
    got = dict(zip(ids.tolist(), probs.tolist()))
    assert got == pytest.approx({0: 0.25, 1: 0.25, 2: 0.5}, abs=1e-7)


def test_logit_bias_comes_first_and_minus_inf_bans():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={0: 5.0})).sample(logits) == 0  # 6 > 3
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={2: -math.inf})).sample(logits) == 1
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias=[(1, math.log(3))]))
    ids, probs = s.distribution(np.zeros(2, dtype=np.float32))
    assert dict(zip(ids.tolist(), probs.tolist())) == pytest.approx({0: 0.25, 1: 0.75}, abs=1e-7)


def test_logit_bias_is_normalised_and_checked():
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
    with pytest.raises(QllamaError, match="not a token id"):
        Sampler(SamplingParams(logit_bias={-1: 1.0}))
    with pytest.raises(QllamaError, match="must be a number or -inf"):
        Sampler(SamplingParams(logit_bias={1: math.inf}))
    with pytest.raises(QllamaError, match="out of range"):
        Sampler(SamplingParams(logit_bias={5: 1.0})).sample(np.zeros(3, dtype=np.float32))


def test_suppressed_tokens_are_never_sampled():
    s = Sampler(SamplingParams(temperature=0.0, ignore_eos=True))
    s.suppress([2])
    assert s.sample(np.array([0.0, 1.0, 5.0], dtype=np.float32)) == 1
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    s.suppress([0])
    assert all(s.sample(np.array([9.0, 0.0, 0.0], dtype=np.float32)) != 0 for _ in range(50))
