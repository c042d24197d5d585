"""`qllama bench` and qllama.bench on a tiny synthetic model: the tests run, the JSON document has
the documented shape, figures are positive, the profile covers the step. No speed is asserted."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from qllama.bench.profile import profile_decode
from qllama.bench.runner import BenchTest, bench_tests, format_table, mean_sd, random_tokens, run_bench
from qllama.bench.profile import OVERHEAD
from tools.make_model import ModelSpec, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    write_model(path, ModelSpec(n_head=4, n_head_kv=2, weight_type="q8_0", seed=5, n_ctx=128))
    return path


def test_mean_sd_hand_computed():
    assert mean_sd([2.0, 4.0, 6.0]) == (4.0, 2.0)  # sample sd: sqrt((4 + 0 + 4) / 2)
    assert mean_sd([5.0]) == (5.0, 0.0)
    assert mean_sd([]) == (0.0, 0.0)


def test_test_names_and_order():
    assert [t.name for t in bench_tests(512, 128, [0, 1024])] == ["pp512", "tg128", "tg128@d1024"]
    assert [t.name for t in bench_tests(0, 16, [0])] == ["tg16"]
    assert [t.name for t in bench_tests(8, 0, [0, 4])] == ["pp8"]
    assert BenchTest("tg", 128, 1024).name == "tg128@d1024"


def test_random_tokens_are_seeded_and_in_range():
    a = random_tokens(100, 50, seed=1)
    assert a == random_tokens(100, 50, seed=1)
    assert a != random_tokens(100, 50, seed=2)
    assert min(a) >= 0 and max(a) < 50


def test_run_bench_document(tiny):
    doc = run_bench(tiny, n_prompt=8, n_gen=4, threads=[1], reps=2, depths=[0, 16])
    assert set(doc) == {"model", "n_threads", "results", "compile_s", "type_k", "type_v"}
    assert doc["type_k"] == doc["type_v"] == "f16"  # llama.cpp's default KV cache
    assert doc["model"] == "tiny.gguf"
    assert doc["n_threads"] == [1]
    assert [r["test"] for r in doc["results"]] == ["pp8", "tg4", "tg4@d16"]
    for r in doc["results"]:
        assert set(r) == {"test", "threads", "mean_tps", "sd_tps", "reps"}
        assert r["threads"] == 1 and r["reps"] == 2
        assert r["mean_tps"] > 0 and math.isfinite(r["mean_tps"])
        assert r["sd_tps"] >= 0
    assert doc["compile_s"] >= 0
    table = format_table(doc)
    assert "| tiny.gguf | 1 | tg4@d16 |" in table and "compile" in table


def test_cli_json_is_one_document(tiny):
    from qllama.cli import cli

    res = CliRunner().invoke(cli, ["bench", str(tiny), "-p", "8", "-n", "4", "-r", "1", "-t", "1", "-d", "8", "--json", "-q"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(r["test"], r["threads"], r["reps"]) for r in doc["results"]] == [("pp8", 1, 1), ("tg4", 1, 1), ("tg4@d8", 1, 1)]


def test_cli_table_and_profile(tiny):
    from qllama.cli import cli

    res = CliRunner().invoke(cli, ["bench", str(tiny), "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-q",
                                   "--profile", "--profile-steps", "3", "--profile-depth", "4"])
    assert res.exit_code == 0, res.output
    assert "| model | threads | test | t/s |" in res.stdout
    assert "| tiny.gguf | 1 | tg4 |" in res.stdout
    assert "ffn_down (fused)" in res.stdout and "attention" in res.stdout and "sampling" in res.stdout
    assert "python overhead" in res.stdout and "calls/token" in res.stdout


def _check_adds_up(p):
    """The parts add up to the measured wall time per step: everything but the overhead was timed
    inside the step, so the overhead (the remainder) is >= 0 up to the clock's resolution per
    timed call (the tolerance of this run), and the kernel calls fit inside the step."""
    tol = (p.calls_per_token + 2) * p.clock_resolution_ms
    assert p.ms[OVERHEAD] >= -tol
    assert sum(p.ms.values()) == pytest.approx(p.total_ms, rel=1e-9)
    assert sum(v for k, v in p.ms.items() if k != OVERHEAD) <= p.total_ms + tol
    assert all(v >= 0 for k, v in p.ms.items() if k != OVERHEAD)
    assert 0 < sum(p.layer_ms.values()) <= p.total_ms + tol


def test_profile_accounts_for_the_step(tiny, int8_mode):
    from qllama.bench.profile import ATTENTION, SAMPLING
    from qllama.kernels._x86 import HAVE_AVX2

    if not HAVE_AVX2:
        pytest.skip("the fused kernels run on the int8 path (AVX2)")
    int8_mode(True)
    p = profile_decode(tiny, steps=3, depth=5, n_threads=1)
    assert p.steps == 3 and p.depth == 5 and p.threads == 1 and p.fused
    fused_kinds = {"quantize x + attn_q|k|v (fused)", "quantize x + attn_output (fused)",
                   "quantize x + ffn_gate|up + glu + quantize + ffn_down (fused)", "quantize x + output (logits)",
                   "rmsnorm", ATTENTION, "embedding"}
    assert set(p.ms) == fused_kinds | {SAMPLING, OVERHEAD}
    # per token on the tiny model (2 blocks): per block one Q|K|V call, one attention, one output
    # projection, one FFN call and two norms; then the final norm, the logits, the embedding
    assert p.calls["quantize x + attn_q|k|v (fused)"] == 2 and p.calls[ATTENTION] == 2
    assert p.calls["rmsnorm"] == 2 * 2 + 1 and p.calls["quantize x + output (logits)"] == 1
    assert sorted(p.layer_ms) == [0, 1] and all(v > 0 for v in p.layer_ms.values())  # the tiny model's two blocks
    _check_adds_up(p)
    assert p.weight_bytes > 0

    u = profile_decode(tiny, steps=3, depth=5, n_threads=1, fused=False)  # the unfused blocks: one call per matrix
    assert not u.fused
    for kind in ("quantize x", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "glu", "ffn_down",
                 "output (logits)", "rmsnorm", ATTENTION):
        assert u.ms[kind] >= 0 and u.calls[kind] > 0, kind
    assert u.calls["attn_q"] == 2 and u.calls["quantize x"] == 2 * 4 + 1  # shared by q/k/v and by gate/up: quantized once
    assert u.calls_per_token > p.calls_per_token
    _check_adds_up(u)


@pytest.mark.parametrize(
    "args",
    [["-r", "0"], ["-t", "0"], ["-t", "x"], ["-p", "-1"], ["-d", "-5"]],
)
def test_cli_rejects_bad_options(tiny, args):
    from qllama.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny), *args])
    assert e.value.code == 2


def test_cli_errors_in_one_line(tmp_path, capsys):
    from qllama.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", str(tmp_path / "missing.gguf"), "-p", "4", "-n", "2", "-r", "1"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    with pytest.raises(SystemExit) as e:
        main(["bench", str(tmp_path / "missing.gguf"), "-p", "0", "-n", "0"])
    assert e.value.code == 1
