"""Prompt-lookup decoding (qllama/lookup.py): drafting, the acceptance rule, greedy output equal to
plain greedy token for token on every family (incl. a sliding-window ring cache and the trained
Shakespeare model), the same sampling distribution (chi-square against exact probabilities),
and the cache/session bookkeeping after rejected drafts."""

from __future__ import annotations

import math

import numpy as np
import pytest

import qllama
from conftest import shared_path
from qllama.generation import lookup
from qllama.generation.session import Timings
from qllama.generation.lookup import NgramDrafter, accept_draft, batch_matches_decode
from qllama.qtensor import int8_activations
from tools.make_model import ModelSpec, family_spec, write_model

# name -> (spec, load options). Random-weight models fall into loops under greedy decoding,
# which n-gram drafts predict: every case must accept drafts, so the equality is not vacuous.
_Q4 = dict(n_embd=256, n_ff=512, n_head=4, preset="Q4_K_M")
CASES = {
    "llama-f32": (ModelSpec(n_embd=64, n_ff=128, n_head=4, n_layer=2, seed=1), {}),
    "llama-q4km": (ModelSpec(n_layer=2, seed=2, **_Q4), {}),
    "qwen2-q8_0": (family_spec("qwen2", n_embd=128, n_ff=256, n_head=4, n_layer=2, seed=3, weight_type="q8_0"), {}),
    "qwen3-q4km": (family_spec("qwen3", n_layer=2, n_head_kv=2, head_dim=64, seed=6, **_Q4), {}),
    # window 8 with batch 8: a ring of 16 slots, wrapped many times by 100 tokens
    "gemma3-q4km-ring": (family_spec("gemma3", n_layer=6, n_head_kv=1, head_dim=64, sliding_window=8, seed=10, **_Q4),
                         {"batch_size": 8}),
    "gemma2-f32-ring": (family_spec("gemma2", n_embd=64, n_ff=128, n_head=4, n_layer=3, head_dim=32, sliding_window=8,
                                    attn_softcap=2.0, final_softcap=3.0, seed=7), {"batch_size": 8}),
    "phi3-q4_0": (family_spec("phi3", n_embd=128, n_ff=256, n_head=4, n_layer=2, n_head_kv=4, n_ctx=1024,
                              rope_orig_ctx=256, seed=13, weight_type="q4_0"), {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    loaded: dict[str, qllama.Model] = {}

    def get(name: str) -> qllama.Model:
        if name not in loaded:
            spec, opts = CASES[name]
            path = root / f"{name}.gguf"
            write_model(path, spec)
            loaded[name] = qllama.load(path, n_ctx=256, **opts)
        return loaded[name]

    return get


def _run(model: qllama.Model, ids: list[int], **kw) -> tuple[list[int], str, Timings]:
    out, reason = [], None
    for chunk in model.stream(ids, **kw):
        out += chunk.token_ids
        reason = chunk.finish_reason or reason
    return out, reason, model.last_timings


def _prompt(model: qllama.Model, seed: int, n: int = 24) -> list[int]:
    """A prompt that repeats itself (something to look up), from ids the vocabulary renders."""
    rng = np.random.default_rng(seed)
    part = rng.integers(3, model.n_vocab, size=n // 2).tolist()
    return [model.tokenizer.bos_id] + part + part


# -- drafting ---------------------------------------------------------------------------------


def test_drafter_takes_the_most_recent_longest_match():
    d = NgramDrafter([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2], ngram_max=3)
    # suffix (1, 2): latest earlier occurrence at index 5..6, followed by 4, 7, 1, 2
    assert d.draft(4) == [4, 7, 1, 2]
    d.append(4)  # suffix (1, 2, 4): only one earlier occurrence
    assert d.draft(2) == [7, 1]
    d = NgramDrafter([8, 8, 3, 1, 2, 6, 3, 1], ngram_max=4)
    assert d.draft(2) == [2, 6]  # (3, 1) matches; (8, 3, 1) does not, so n = 2 is used
    assert NgramDrafter([1, 2, 3], ngram_max=2).draft(3) == []  # the suffix never matches itself
    assert NgramDrafter([1, 2, 3, 4], ngram_max=2).draft(0) == []


def test_drafter_continues_a_repeating_pattern_past_the_history():
    d = NgramDrafter([7, 1, 2, 1, 2], ngram_max=2)
    # (1, 2) last seen at 1..2, followed by [1, 2] and then by the draft itself: period 2
    assert d.draft(5) == [1, 2, 1, 2, 1]
    assert NgramDrafter([4, 4, 4], ngram_max=3).draft(3) == [4, 4, 4]


def test_drafter_prefers_the_match_that_reaches_furthest_back():
    # suffix (3, 4, 5): seen before 6 (preceded by 1, 2 as the suffix is: a 5-token match) and,
    # more recently, before 7 (preceded by 9: a 3-token match). The longer match wins.
    h = [1, 2, 3, 4, 5, 6, 9, 3, 4, 5, 7, 8, 1, 2, 3, 4, 5]
    d = NgramDrafter(h, ngram_max=3)
    assert d.find() == (5, 5) and d.draft(3) == [6, 9, 3] and d.match == 5
    d = NgramDrafter(h[:-5] + [0, 0, 3, 4, 5], ngram_max=3)  # now both are 3-token matches: the latest wins
    assert d.draft(2) == [7, 8] and d.match == 3


def test_drafter_min_match_and_draft_length():
    h = [5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 6, 7, 8, 9, 1]  # suffix 6 7 8 9 1 repeats a 5-token span
    d = NgramDrafter(h, ngram_max=4, min_match=5)
    assert d.find() == (6, 5)
    assert d.draft(8) == [2, 3, 4, 0, 6, 7, 8, 9] and d.draft(8, limit_by_match=True) == [2, 3, 4, 0, 6]
    assert NgramDrafter(h, ngram_max=4, min_match=6).draft(8) == []  # too short a match: no draft
    assert NgramDrafter(h[2:], ngram_max=4, min_match=5).draft(8) == []  # now only 4 tokens match
    # shorter n-grams are not indexed below min_match: a 2-token match is no match at all
    assert NgramDrafter([1, 2, 3, 8, 2, 3], ngram_max=4, min_match=3).draft(2) == []
    assert NgramDrafter([1, 2, 3, 8, 2, 3], ngram_max=4, min_match=2).draft(2) == [8, 2]


def test_draft_length_adapts_to_refusals():
    """Halved (not below a token group's 3 drafts) after a draft is refused, doubled (up to n_draft)
    after one is taken whole."""
    from types import SimpleNamespace

    from qllama.generation.lookup import LookupSteps
    from qllama.generation.sampling import Sampler, SamplingParams

    steps = LookupSteps(SimpleNamespace(model=None), Sampler(SamplingParams(temperature=1.0)), np.zeros(4, np.float32),
                        [1, 2, 3], 8, set(), 100, Timings())
    spans = []
    for drafted, accepted in ((8, 8), (8, 5), (4, 0), (3, 1), (3, 3), (0, 0), (6, 6), (8, 8)):
        steps._adapt(drafted, accepted)
        spans.append(steps._span)
    assert spans == [8, 4, 3, 3, 6, 6, 8, 8]


def test_batches_are_whole_token_groups_and_no_match_takes_the_decode_step(models, monkeypatch):
    """A verify batch longer than TOKEN_GROUP is a multiple of it; a step without a draft is the
    session's one-token decode (fused kernels, adaptive threads); output stays plain greedy's."""
    batches, decodes = [], []
    for name, seed, own in (("gemma2-f32-ring", 0, True), ("llama-f32", 1, False)):  # f32: lookup on every host
        model = models(name)
        ids = _prompt(model, seed)
        if own:  # the model's own continuation in the prompt: long matches to draft from
            ids = ids + _run(model, ids, max_tokens=40, temperature=0)[0] + ids[1:]
        plain = _run(model, ids, max_tokens=60, temperature=0)[0]
        s, fm = model.session, model.forward_model
        decode, forward = s.decode, fm.forward

        def verify(toks, cache, all_logits=False, n_threads=None, prompt=False):  # the prompt and decode steps want the last row only
            if all_logits:
                assert not prompt  # (drafts to verify are not a prompt: their rows must equal decode's)
                batches.append(len(toks))
            return forward(toks, cache, all_logits, n_threads, prompt)

        monkeypatch.setattr(s, "decode", lambda t: decodes.append(t) or decode(t))
        monkeypatch.setattr(fm, "forward", verify)
        del batches[:], decodes[:]
        fast, _, t = _run(model, ids, max_tokens=60, temperature=0, lookup=9)
        assert fast == plain
        assert len(batches) + len(decodes) == t.gen_forwards and sum(batches) + len(decodes) == t.gen_forwards + t.draft_tokens
        assert t.draft_forwards == len(batches) and f"({t.gen_forwards} forwards, {len(batches)} with drafts)" in t.report()
        assert all(1 < b <= 10 for b in batches)
        if own:
            assert any(b > lookup.TOKEN_GROUP for b in batches)
            assert all(b % lookup.TOKEN_GROUP == 0 for b in batches if b > lookup.TOKEN_GROUP)
        else:
            assert len(decodes) > len(batches)


# -- the acceptance rule ----------------------------------------------------------------------


class _FixedRng:
    """A stand-in for np.random.Generator: random() returns the given u; choice() records p."""

    def __init__(self, u: float):
        self.u, self.p = u, None

    def random(self) -> float:
        return self.u

    def choice(self, n, p):
        self.p = p
        return int(np.argmax(p))


def test_accept_draft_accepts_below_p_draft_and_else_draws_without_it():
    ids = np.array([10, 20, 30])
    probs = np.array([0.5, 0.3, 0.2])
    assert accept_draft(ids, probs, 20, _FixedRng(0.29)) == 20
    rng = _FixedRng(0.31)
    assert accept_draft(ids, probs, 20, rng) == 10
    assert np.allclose(rng.p, [0.5 / 0.7, 0.0, 0.2 / 0.7])  # the residual: p without the draft, renormalised
    rng = _FixedRng(0.0)
    assert accept_draft(ids, probs, 99, rng) == 10 and np.allclose(rng.p, probs)  # p(draft) = 0: never accepted


def _chi2_p_value(chi2: float, df: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty normal approximation)."""
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_accept_draft_emits_the_target_distribution():
    rng = np.random.default_rng(0)
    ids = np.arange(5) + 100
    probs = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 5000
    for draft in (100, 103, 7):  # the likeliest token, an unlikely one, one outside the candidates
        counts = np.zeros(5)
        for _ in range(n):
            counts[accept_draft(ids, probs, draft, rng) - 100] += 1
        chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
        assert _chi2_p_value(chi2, 4) > 1e-4, (draft, counts / n)


# -- greedy: token for token ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_batched_rows_equal_one_token_decode(models, name):
    """The premise of greedy lookup: with int8 activations or float weights, each row of a
    batched forward has the one-token forward's logits bit for bit (at positions that wrap a
    ring cache too)."""
    model = models(name)
    fm = model.forward_model
    assert batch_matches_decode(fm) == (bool(int8_activations()) or name.endswith(("f32", "f32-ring")))
    if not batch_matches_decode(fm):
        pytest.skip("no int8 kernels on this host: quantized matrices run the float path")
    ids = _prompt(model, 0, 40) + _prompt(model, 1, 40)[1:]
    one, many = fm.new_cache(), fm.new_cache()
    fm.forward(ids[:30], one)
    fm.forward(ids[:30], many)
    seq = np.stack([fm.forward([t], one)[0] for t in ids[30:]])  # (T, n_vocab)
    got, pos = [], 30
    for n in (1, 5, 2, 8, 3):
        n = min(n, many.max_batch)
        got.append(fm.forward(ids[pos : pos + n], many, all_logits=True))
        pos += n
    got = np.concatenate(got)
    assert np.array_equal(got, seq[: len(got)])


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_lookup_equals_plain_greedy(models, name, monkeypatch):
    """The default policy (drafts only from a match of MIN_MATCH tokens), on a prompt that holds
    the model's own greedy continuation of its start (so long matches exist on a random model);
    and drafts from any 1-token match (many refused: the cache rewinds often) with a repeat
    penalty, which must be recorded token by token across accepted and refused drafts."""
    model = models(name)
    start = _prompt(model, 0)
    ids0 = start + _run(model, start, max_tokens=40, temperature=0)[0] + start[1:]
    accepted = 0  # over both runs
    for ids, n_draft, min_match, pen in ((ids0, 8, lookup.MIN_MATCH, {}),
                                         (_prompt(model, 1), 8, 1, dict(repeat_penalty=1.3, repeat_last_n=16))):
        monkeypatch.setattr(lookup, "MIN_MATCH", min_match)
        plain, reason, _ = _run(model, ids, max_tokens=60, temperature=0, **pen)
        fast, reason_l, t = _run(model, ids, max_tokens=60, temperature=0, lookup=n_draft, **pen)
        assert fast == plain and reason_l == reason
        assert len(model.session.tokens) == model.session.cache.n_past
        if batch_matches_decode(model.forward_model):
            assert t.lookup == n_draft and t.draft_tokens > 0 and t.gen_forwards < t.gen_tokens
        accepted += t.draft_accepted
    assert accepted > 0 or not batch_matches_decode(model.forward_model)


def test_greedy_lookup_on_the_trained_model():
    model = qllama.load(shared_path("models", "shakespeare-spm-Q4_K_M.gguf"), n_ctx=256)
    text = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
            "Arise, fair sun, and kill the envious moon.\nROMEO:\nBut soft, what light")
    ids = model.tokenize(text)
    plain, _, _ = _run(model, ids, max_tokens=120, temperature=0)
    fast, _, t = _run(model, ids, max_tokens=120, temperature=0, lookup=6)
    assert fast == plain
    if batch_matches_decode(model.forward_model):
        assert t.draft_accepted > 0 and t.gen_forwards < t.gen_tokens


@pytest.mark.slow
def test_greedy_lookup_on_smollm2_copying_code():
    """The benchmark's task (tools/bench_lookup.py) on the real SmolLM2-135M-Instruct: the same
    tokens as plain greedy, nearly every draft taken, several tokens per forward."""
    from tools.bench_lookup import TASK
    from tools.fetch_smollm2 import smollm2_or_skip

    model = qllama.load(smollm2_or_skip(), n_ctx=1024)
    if not batch_matches_decode(model.forward_model):
        pytest.skip("no int8 kernels on this host: greedy lookup is off for Q4_1")
    ids = model.prepare_prompt(TASK)[0]
    plain, _, _ = _run(model, ids, max_tokens=100, temperature=0)
    fast, _, t = _run(model, ids, max_tokens=100, temperature=0, lookup=8)
    assert fast == plain
    # measured: 78 of 80 drafts taken, 4.8 tokens per forward
    assert t.draft_accepted >= 0.9 * t.draft_tokens and t.gen_tokens >= 3 * t.gen_forwards, t.report()


def test_float_path_greedy_falls_back_to_one_token_decode(models, int8_mode, monkeypatch):
    """Without int8 kernels a quantized model's batched rows round differently: greedy lookup then
    drafts nothing (output still plain greedy's) and the timings say why; sampling still drafts
    (from 1-token matches here: this random model repeats little)."""
    monkeypatch.setattr(lookup, "MIN_MATCH", 1)
    model = models("llama-q4km")
    int8_mode(False)
    assert not batch_matches_decode(model.forward_model)
    ids = _prompt(model, 3)
    plain, _, _ = _run(model, ids, max_tokens=40, temperature=0)
    fast, _, t = _run(model, ids, max_tokens=40, temperature=0, lookup=4)
    assert fast == plain and t.lookup == 0 and t.draft_tokens == 0 and "round differently" in t.report()
    _, _, t = _run(model, ids, max_tokens=40, temperature=0.7, seed=1, lookup=4)
    assert t.lookup == 4 and t.draft_tokens > 0


def test_lookup_stops_like_plain_decoding(models):
    """Context full, max_tokens, stop strings and the cache's record of tokens match plain decoding."""
    model = models("llama-f32")
    ids = _prompt(model, 4, 40)
    small = qllama.load(model.path, n_ctx=len(ids) + 13)
    plain = _run(small, ids, max_tokens=100, temperature=0)
    fast = _run(small, ids, max_tokens=100, temperature=0, lookup=8)
    assert fast[:2] == plain[:2] and plain[1] == "context" and len(plain[0]) == 14
    for n in (0, 1, 7):
        assert _run(model, ids, max_tokens=n, temperature=0, lookup=5)[0] == _run(model, ids, max_tokens=n, temperature=0)[0]
    text = model.detokenize(plain[0])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert (model.complete(ids, max_tokens=50, temperature=0, stop=stop, lookup=6)
            == model.complete(ids, max_tokens=50, temperature=0, stop=stop))
    # the session holds exactly what its cache holds: a follow-up prompt reuses it correctly
    out, _, _ = _run(model, ids, max_tokens=30, temperature=0, lookup=6)
    s = model.session
    assert s.tokens == (ids + out)[: s.cache.n_past]
    follow = ids + out + _prompt(model, 5, 8)[1:]
    got = _run(model, follow, max_tokens=10, temperature=0, lookup=3)[0]
    fresh = qllama.load(model.path, n_ctx=256)
    assert got == _run(fresh, follow, max_tokens=10, temperature=0)[0]
    with pytest.raises(qllama.QllamaError, match="lookup"):
        model.complete(ids, lookup=-1)


# -- sampling: the same distribution --------------------------------------------------------


@pytest.mark.slow
def test_sampling_with_lookup_follows_the_model_distribution(models, monkeypatch):
    """Chi-square of the first three sampled tokens (joint) against their exact probabilities
    from the model, over 2000 seeded lookup runs (a third of them with a draft for token 2,
    drafted from a 1-token match: the acceptance rule holds for any draft policy)."""
    from qllama.generation.sampling import Sampler, SamplingParams

    monkeypatch.setattr(lookup, "MIN_MATCH", 1)

    model = qllama.load(models("llama-f32").path, n_ctx=256, n_threads=1)  # tiny forwards: no thread pool
    # no repeat penalty here: drafts are copies of the history, which a penalty pushes out of the
    # top 3 of this random model (the penalty's bookkeeping is checked with greedy decoding)
    params = dict(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)
    fm = model.forward_model
    base = _prompt(model, 6, 16)
    # in the history: each likely first token a, followed by the likeliest token after it, so
    # that the draft for token 2 is usually a candidate (accepted with probability p(draft))
    ids0 = base + base[1:]
    top = lambda prefix, k: np.argsort(-model.logits(prefix)[-1])[:k].tolist()  # noqa: E731
    ids = base + [x for a in top(ids0, 3) for x in (a, top(ids0 + [a], 1)[0])] + base[1:]

    def dist(prefix: list[int]) -> tuple[np.ndarray, np.ndarray]:
        s = Sampler(SamplingParams(**params))
        for t in prefix:
            s.accept(t)
        return s.distribution(model.logits(prefix)[-1])

    eog = model.tokenizer.eog_ids
    exact: dict[tuple, float] = {}  # token sequences, cut after an end-of-generation token ("eog")

    def walk(prefix: tuple, p: float) -> None:
        if len(prefix) == 3 or (prefix and prefix[-1] == "eog"):
            exact[prefix] = exact.get(prefix, 0.0) + p
            return
        cand, probs = dist(ids + list(prefix))
        for t, pt in zip(cand.tolist(), probs):
            walk(prefix + ("eog" if t in eog else t,), p * pt)

    walk((), 1.0)
    n = 2000
    counts = dict.fromkeys(exact, 0)
    drafted = accepted = 0
    for seed in range(n):
        out, reason, t = _run(model, ids, max_tokens=3, seed=seed, lookup=3, **params)
        counts[tuple(out) + (("eog",) if reason == "eog" else ())] += 1
        drafted += t.draft_tokens
        accepted += t.draft_accepted
    assert drafted > n / 5 and 0 < accepted < drafted  # drafts were made, some taken, some refused
    cells = [k for k in exact if exact[k] * n >= 5]  # the rest pooled into one cell
    obs = [counts[k] for k in cells] + [n - sum(counts[k] for k in cells)]
    exp = [exact[k] * n for k in cells] + [n - sum(exact[k] * n for k in cells)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    assert _chi2_p_value(chi2, len(obs) - 1) > 1e-4, (chi2, len(obs))


def test_cli_run_lookup_reports_the_acceptance(models):
    """`qllama run --lookup N`: the same greedy text as without it, and the acceptance line in the timings."""
    import subprocess
    import sys

    model = models("llama-f32")
    prompt = model.detokenize(_prompt(model, 7)[1:])

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "qllama", "run", str(model.path), "-p", prompt, "--raw", "-n", "40",
                               "--temp", "0", "-c", "256", *extra], capture_output=True, text=True, timeout=300)

    plain, fast = run(), run("--lookup", "5", "--verbose")
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout
    assert "drafts accepted" in fast.stderr and "tokens per forward" in fast.stderr
    assert run("--lookup", "-1").returncode == 2
