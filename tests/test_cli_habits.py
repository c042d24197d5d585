"""The CLI habits of issue 13: llama.cpp's spellings, --seed -1, clean errors, Ctrl-C during a
compile, --json, requantizing, the memory check of the context, the version line.

Most tests call `qllama.cli.main` in this process (kernels compiled once for the session);
those about processes (Ctrl-C, warnings printed once) run `python -m qllama`.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import REPO
from tools.make_model import ModelSpec, write_model

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("habits")
    plain, chat, q8 = d / "plain.gguf", d / "chat.gguf", d / "q8.gguf"
    write_model(plain, ModelSpec(seed=5, n_ctx=128))
    write_model(chat, ModelSpec(seed=6, n_ctx=128, chat_template=TEMPLATE))
    write_model(q8, ModelSpec(seed=7, n_ctx=128, weight_type="q8_0"))
    return {"plain": plain, "chat": chat, "q8": q8, "dir": d}


def cli_main(capsys, *args, stdin: str | None = None, monkeypatch=None):
    """Run the CLI in this process: (exit status, stdout, stderr)."""
    from qllama.cli import main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def python_m(*args, env=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "qllama", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


# -- argv pre-pass -----------------------------------------------------------------------------


def test_rewrite_argv_drops_cpu_meaningless_flags_and_moves_dash_m():
    from qllama.cli import rewrite_argv

    args, notes = rewrite_argv(["run", "-ngl", "99", "-p", "hi", "--mlock", "-m", "x.gguf", "--no-mmap",
                                "--n-gpu-layers=5", "-n", "3"])
    assert args == ["run", "x.gguf", "-p", "hi", "-n", "3"]
    assert [n.split()[1] for n in notes] == ["-ngl", "--mlock", "--no-mmap", "--n-gpu-layers"]
    assert all(n.startswith("note: ") and "ignored" in n for n in notes)
    # --model=, global options before the command, chat's --n-predict, and nothing after --
    assert rewrite_argv(["--debug", "chat", "--model=m.gguf", "--n-predict", "5"])[0] == \
        ["--debug", "chat", "m.gguf", "--max-tokens", "5"]
    assert rewrite_argv(["run", "m", "--", "-m", "-ngl"])[0] == ["run", "m", "--", "-m", "-ngl"]
    # quantize has no MODEL-first argument: -m is left to click (an error there)
    assert rewrite_argv(["quantize", "-m", "a"])[0] == ["quantize", "-m", "a"]


def test_llama_cpp_spellings_give_the_same_run(models, capsys):
    m = models["plain"]
    code, ref, _ = cli_main(capsys, "run", m, "the cat", "-n", "6", "--temp", "0.7", "--seed", "3", "-c", "64", "-t", "1",
                          "-b", "4", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.1", "--repeat-penalty", "1.1")
    assert code == 0 and ref.strip()
    code, out, err = cli_main(capsys, "run", "-m", m, "-p", "the cat", "--n-predict", "6", "--temp", "0.7", "-s", "3",
                            "--ctx-size", "64", "--threads", "1", "--batch-size", "4", "--top-k", "20", "--top-p", "0.9",
                            "--min-p", "0.1", "--repeat-penalty", "1.1", "-ngl", "99", "--mlock", "--no-mmap")
    assert code == 0, err
    assert out == ref
    assert "note: -ngl is ignored" in err and "note: --mlock is ignored" in err and "note: --no-mmap is ignored" in err
    prompt_file = models["dir"] / "prompt.txt"
    prompt_file.write_text("the cat", encoding="utf-8")
    code, out, _ = cli_main(capsys, "run", "--model", m, "-f", prompt_file, "-n", "6", "--temp", "0.7", "--seed", "3",
                          "-c", "64", "-t", "1", "-b", "4", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.1",
                          "--repeat-penalty", "1.1")
    assert code == 0 and out == ref


def test_dash_m_works_for_tokenize_and_inspect(models, capsys):
    code, out, _ = cli_main(capsys, "tokenize", "-m", models["plain"], "-p", "the", "--ids")
    assert code == 0 and out.strip() == "[1, 262]"  # BOS, "▁the"
    code, out, _ = cli_main(capsys, "inspect", "-m", models["plain"])
    assert code == 0 and "llama" in out


# -- --seed -1 ---------------------------------------------------------------------------------


def test_seed_minus_one_means_random(models, capsys, monkeypatch):
    from qllama import api

    seeds = []
    real_stream = api.Model.stream

    def spy(self, prompt, **kw):
        seeds.append(kw.get("seed", "absent"))
        return real_stream(self, prompt, **kw)

    monkeypatch.setattr(api.Model, "stream", spy)
    code, out, err = cli_main(capsys, "run", models["plain"], "the", "-n", "4", "--seed", "-1", "-t", "1")
    assert code == 0 and "Traceback" not in err, err
    code, out, err = cli_main(capsys, "chat", models["chat"], "-n", "4", "--seed", "-1", "-t", "1",
                            stdin="hello\n", monkeypatch=monkeypatch)
    assert code == 0 and "Traceback" not in err, err
    assert seeds == [None, None]  # None: the sampler draws a random seed


def test_negative_seed_other_than_minus_one_is_a_usage_error(models, capsys):
    code, _, err = cli_main(capsys, "run", models["plain"], "the", "--seed", "-2")
    assert code == 2 and "-1 for a random one" in one_error_line(err)


# -- errors and wording --------------------------------------------------------------------------


def test_missing_prompt_file_names_it(models, capsys):
    code, _, err = cli_main(capsys, "run", models["plain"], "-f", "nope.txt")
    assert code == 1 and one_error_line(err) == "error: nope.txt: no such file"


def test_no_arguments_prints_the_help_and_succeeds(capsys):
    code, out, err = cli_main(capsys)
    assert code == 0 and err == ""
    assert out.startswith("Usage: qllama") and "  run " in out and "error:" not in out


def test_version(capsys):
    import numba

    from qllama import __version__
    from qllama.kernels._x86 import ISA
    from qllama.qtensor import int8_activations

    for args in (["--version"], ["version"]):
        code, out, _ = cli_main(capsys, *args)
        assert code == 0
        lines = out.splitlines()
        assert lines[0] == f"qllama {__version__}"
        assert f"numba {numba.__version__}, numpy {np.__version__}" in lines[1]
        expected = f"SIMD: {ISA} (int8 dot products" if int8_activations() else "SIMD: portable"
        assert lines[2].startswith(expected)


def test_huge_context_is_one_error_before_allocating(models, capsys):
    code, _, err = cli_main(capsys, "run", models["plain"], "hi", "-c", "999999999")
    line = one_error_line(err)
    assert code == 1 and "999999999 tokens" in line and line.count("GiB") == 2 and "-c/--ctx-size" in line


def test_context_check_is_in_the_library():
    """2 (K and V) x layers x positions x KV heads x head_dim x 2 bytes (the f16 cache), against the memory given."""
    from qllama.errors import ContextSizeError
    from qllama.runtime.memory import check_context, kv_cache_bytes

    class Args:
        n_layer, n_head_kv, head_dim, n_ctx_train, n_swa = 16, 8, 64, 131072, 0

        @staticmethod
        def is_swa(il):
            return False

    assert kv_cache_bytes(Args, 4096, 512) == 2 * 16 * 4096 * 8 * 64 * 2 == 134217728
    assert kv_cache_bytes(Args, 4096, 512, ("f32", "f32")) == 268435456  # an f32 cache: twice
    check_context(Args, 4096, 512, available=134217728)  # exactly fits
    with pytest.raises(ContextSizeError, match=r"4096 tokens needs 128 MiB .* only 127 MiB") as e:
        check_context(Args, 4096, 512, available=134217728 - 2**20)
    with pytest.raises(ContextSizeError, match=r"4096 tokens needs 256 MiB"):
        check_context(Args, 4096, 512, available=134217728, kv_types=("f32", "f32"))
    assert "-c" not in str(e.value)  # library errors name no CLI flags


def test_context_check_counts_window_layers_as_rings():
    """Gemma 3's pattern: 5 window layers keep window + batch positions, 1 global layer keeps n_ctx;
    the estimate equals what a KVCache of that shape really allocates."""
    from qllama.runtime.memory import kv_cache_bytes
    from qllama.models.kvcache import KVCache

    class Args:
        n_layer, n_head_kv, head_dim, n_ctx_train, n_swa = 6, 1, 256, 32768, 512

        @staticmethod
        def is_swa(il):
            return il % 6 < 5

    need = kv_cache_bytes(Args, 32768, 512)
    assert need == 2 * (5 * (512 + 512) + 32768) * 1 * 256 * 2 == 38797312  # f16
    cache = KVCache(6, 1, 256, 32768, [512] * 5 + [0], 512)
    assert cache.nbytes == need


def test_context_beyond_training_warns_once(models):
    r = python_m("run", models["plain"], "the", "-n", "2", "-c", "256", "-t", "1")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "256" in warnings[0] and "128" in warnings[0]
    r = python_m("run", models["plain"], "the", "-n", "2", "-c", "128", "-t", "1")
    assert r.returncode == 0 and "warning:" not in r.stderr


def test_raw_with_system_warns_and_ignores_it(models, capsys):
    m = models["chat"]
    code, ref, _ = cli_main(capsys, "run", m, "the cat", "--raw", "-n", "5", "--temp", "0", "-t", "1")
    assert code == 0
    code, out, err = cli_main(capsys, "run", m, "the cat", "--raw", "--system", "be brief", "-n", "5", "--temp", "0", "-t", "1")
    assert code == 0 and out == ref
    assert "warning: --system is ignored with --raw" in err


# -- quantize --allow-requantize ---------------------------------------------------------------


def test_requantize_needs_the_flag_and_then_works(models, capsys):
    from qllama.gguf.reader import GGUFFile
    from qllama.qtensor import QTensor

    src, d = models["q8"], models["dir"]
    code, _, err = cli_main(capsys, "quantize", src, d / "never.gguf", "Q4_0")
    line = one_error_line(err)
    assert code == 1 and "already quantized" in line and "--allow-requantize" in line
    assert not (d / "never.gguf").exists()

    # to F16: exactly the q8_0 values rounded to half precision
    code, _, err = cli_main(capsys, "quantize", src, d / "f16.gguf", "F16", "--allow-requantize")
    assert code == 0 and "warning: requantizing q8_0" in err, err
    # to Q4_0: close to the q8_0 values (within q4_0's own error)
    code, _, _ = cli_main(capsys, "quantize", src, d / "q4.gguf", "Q4_0", "--allow-requantize")
    assert code == 0
    with GGUFFile(src) as a, GGUFFile(d / "f16.gguf") as b, GGUFFile(d / "q4.gguf") as c:
        name = "blk.0.ffn_up.weight"
        assert a.tensors[name].type_name == "q8_0" and b.tensors[name].type_name == "f16"
        assert c.tensors[name].type_name == "q4_0"
        w = QTensor.from_gguf(a, name).dequantize()
        np.testing.assert_array_equal(QTensor.from_gguf(b, name).dequantize(), w.astype(np.float16).astype(np.float32))
        w4 = QTensor.from_gguf(c, name).dequantize()
        rel = np.linalg.norm(w4 - w) / np.linalg.norm(w)
        assert 0 < rel < 0.15  # q4_0 on Gaussian weights: ~0.1


# -- run --json and the warm-up ----------------------------------------------------------------


def test_run_json_is_one_document(models, capsys):
    import qllama

    m = models["plain"]
    llm = qllama.load(m)
    chunks = list(llm.stream("the cat", max_tokens=7, temperature=0.0))
    code, out, err = cli_main(capsys, "run", m, "the cat", "-n", "7", "--temp", "0", "--json", "-t", "1")
    assert code == 0, err
    doc = json.loads(out)  # the whole stdout is one JSON document: no streamed text
    assert doc["text"] == "".join(c.text for c in chunks)
    assert doc["tokens"] == [t for c in chunks for t in c.token_ids]
    assert doc["finish_reason"] == chunks[-1].finish_reason == "length"
    t = doc["timings"]
    assert t["gen_tokens"] == 7 and t["prompt_tokens"] == len(llm.tokenize("the cat")) and t["compile_s"] > 0


def test_warmup_is_reported_apart_from_prompt_speed(models):
    import qllama
    from qllama.generation.session import Timings

    llm = qllama.load(models["plain"], n_threads=1)
    s = llm.warmup()
    assert s > 0 and llm.compile_s == s and llm.kernels_cached()
    llm.complete("the cat", max_tokens=2, temperature=0)
    assert llm.last_timings.compile_s == s
    report = Timings(load_s=0.1, compile_s=8.25, prompt_tokens=37, prompt_s=0.5).report()
    lines = report.splitlines()
    assert lines[1].startswith("warm-up time") and "8250.00 ms" in lines[1]
    assert "37 tokens" in lines[2] and "74.00 tokens per second" in lines[2]  # 37 / 0.5 s, compile excluded


def test_kernel_types_name_the_matrices(models):
    import qllama

    assert qllama.load(models["q8"]).kernel_types() == ["q8_0"]
    assert qllama.load(models["plain"]).kernel_types() == ["f32"]


# -- perplexity progress -----------------------------------------------------------------------


def test_perplexity_draws_no_progress_when_piped(models):
    text = models["dir"] / "text.txt"
    text.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    r = python_m("perplexity", models["plain"], text, "-c", "32", "--chunks", "3", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "[1/" not in r.stderr
    assert r.stdout.startswith("perplexity: ")


# -- Ctrl-C swallowed by Numba's compile -----------------------------------------------------------

INJECT = textwrap.dedent("""
    # A SIGINT delivered while LLVM's "object compiled" ctypes callback runs: exactly where a
    # Ctrl-C during a Numba compile can land. ctypes swallows the KeyboardInterrupt there and
    # Numba then fails with "RuntimeError: no compiled object yet".
    import os, signal, sys
    import numba.core.codegen as cg
    orig = cg.CPUCodeLibrary._object_compiled_hook.__func__
    def hook(cls, ll_module, buf):
        os.kill(os.getpid(), signal.SIGINT)
        return orig(cls, ll_module, buf)
    cg.CPUCodeLibrary._object_compiled_hook = classmethod(hook)
    from qllama.cli import main
    main(sys.argv[1:])
""")


def test_ctrl_c_inside_a_numba_compile_exits_130_without_traceback(models, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}  # empty: compiles
    r = subprocess.run([sys.executable, "-c", INJECT, "run", str(models["plain"]), "the", "-n", "2", "-t", "1"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    assert "compiling kernels for f32 (first run only)..." in r.stderr
    assert r.stderr.rstrip().endswith("interrupted")


def test_warmup_compiles_everything_a_generation_then_uses(tmp_path):
    """After Model.warmup(), a long prompt (batched prefill, attention long enough to go parallel)
    and decoding compile nothing more: the compile never leaks into the prompt or eval times."""
    import qllama
    from numba.core.registry import CPUDispatcher

    def compiled() -> dict[str, int]:
        seen = {}
        for name, mod in list(sys.modules.items()):
            if name.startswith("qllama.") and mod is not None:
                for attr, obj in vars(mod).items():
                    if isinstance(obj, CPUDispatcher):
                        seen[f"{name}.{attr}"] = len(obj.overloads)
        return seen

    path = tmp_path / "heads.gguf"  # 32 query heads as real models have: long attention is parallel work
    write_model(path, ModelSpec(n_embd=128, n_head=32, n_head_kv=8, n_ff=256, n_ctx=512, seed=9))
    llm = qllama.load(path)
    llm.warmup()
    before = compiled()
    prompt = "the cat sat on the mat and the dog " * 12  # ~100 tokens: one prefill batch of many tokens
    llm.complete(prompt, max_tokens=6, temperature=0.8, seed=1)
    after = compiled()
    grown = {k: (before.get(k, 0), n) for k, n in after.items() if n != before.get(k, 0)}
    assert not grown, f"compiled after the warm-up: {grown}"


SWALLOW = textwrap.dedent("""
    # A Ctrl-C during the warm-up that some code swallows with a bare `except:`.
    import os, signal, sys, time
    from qllama import api
    def warmup(self):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except BaseException:
            pass
        return 0.0
    api.Model.warmup = warmup
    from qllama.cli import main
    main(sys.argv[1:])
""")


def test_ctrl_c_swallowed_during_the_warm_up_still_stops(models):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", SWALLOW, "run", str(models["plain"]), "the", "-n", "2", "-t", "1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 130, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr and r.stderr.rstrip().endswith("interrupted")


# -- issue 28: llama.cpp's spellings, round two ---------------------------------------------------


def run_json(capsys, *args, stdin=None, monkeypatch=None):
    code, out, err = cli_main(capsys, "run", *args, "--json", "-t", "1", stdin=stdin, monkeypatch=monkeypatch)
    assert code == 0, err
    return json.loads(out), err


def test_without_n_the_run_stops_quietly_at_a_full_context(models, capsys):
    m = models["plain"]  # n_ctx 128: the default 256 tokens do not fit
    doc, err = run_json(capsys, m, "the cat", "--temp", "0", "--ignore-eos")
    assert "context is full" not in err and doc["finish_reason"] == "context"
    n_prompt = doc["prompt_tokens"]
    # the prompt's positions, then one token per free position, and the last one sampled but not evaluated
    assert len(doc["tokens"]) == 128 - n_prompt + 1
    minus_one, err = run_json(capsys, m, "the cat", "--temp", "0", "--ignore-eos", "-n", "-1")
    assert minus_one["tokens"] == doc["tokens"] and "context is full" not in err
    # an explicit -n beyond the context still says so, as before
    asked, err = run_json(capsys, m, "the cat", "--temp", "0", "--ignore-eos", "-n", "500")
    assert asked["tokens"] == doc["tokens"] and "stopped: the context is full (128 tokens; raise -c/--ctx-size)" in err


def test_the_demo_ends_cleanly(capsys):
    code, out, err = cli_main(capsys, "run", "demo", "ROMEO:", "-t", "1", "--seed", "1")
    assert code == 0 and out.strip(), err
    assert "context is full" not in err and "stopped" not in err


def test_multi_letter_single_dash_options_are_never_clusters(models, capsys):
    code, _, err = cli_main(capsys, "perplexity", models["plain"], "-cnv")
    assert code == 2 and one_error_line(err) == ("error: no such option: -cnv (single-dash options of several letters "
                                                 "are never read as clusters of one-letter ones)")
    code, _, err = cli_main(capsys, "run", models["plain"], "x", "-nx")
    assert code == 2 and "no such option: -nx" in err
    # values are values: -n -1, a prompt that starts with a dash
    doc, _ = run_json(capsys, models["plain"], "-p", "-the cat", "-n", "-1", "--temp", "0", "-c", "16")
    assert doc["finish_reason"] in ("context", "eog")


def test_flash_attn_is_accepted_with_a_note_and_changes_nothing(models, capsys):
    m = models["plain"]
    ref, _ = run_json(capsys, m, "the cat", "-n", "5", "--temp", "0")
    for flag in (["-fa"], ["-fa", "on"], ["--flash-attn", "auto"], ["--flash-attn=off"], ["-fa", "1"]):
        doc, err = run_json(capsys, m, "the cat", *flag, "-n", "5", "--temp", "0")
        assert doc["tokens"] == ref["tokens"], flag
        assert f"note: {flag[0].partition('=')[0]} is accepted and ignored" in err
    code, _, err = cli_main(capsys, "run", m, "x", "--flash-attn=maybe")
    assert code == 2 and one_error_line(err).startswith("error: --flash-attn takes one of")


def test_conversation_flags_and_sys(models, capsys, monkeypatch):
    m = models["chat"]
    raw, _ = run_json(capsys, m, "the cat", "-n", "5", "--temp", "0", "--raw")
    no_cnv, _ = run_json(capsys, m, "the cat", "-n", "5", "--temp", "0", "-no-cnv")
    templated, _ = run_json(capsys, m, "the cat", "-n", "5", "--temp", "0")
    assert no_cnv["tokens"] == raw["tokens"] and no_cnv["prompt_tokens"] == raw["prompt_tokens"]
    assert templated["prompt_tokens"] > raw["prompt_tokens"]  # the template's markers
    system, _ = run_json(capsys, m, "the cat", "-n", "5", "--temp", "0", "--system", "be brief")
    sys_, _ = run_json(capsys, m, "the cat", "-n", "5", "--temp", "0", "-sys", "be brief")
    assert sys_ == {**system, "timings": sys_["timings"]}
    # -cnv: the chat, with PROMPT as the first message, then the lines of stdin
    code, out, err = cli_main(capsys, "run", m, "the cat", "-cnv", "-n", "3", "--temp", "0", "-t", "1",
                              stdin="the dog\n", monkeypatch=monkeypatch)
    assert code == 0, err
    code2, out2, _ = cli_main(capsys, "chat", m, "-n", "3", "--temp", "0", "-t", "1",
                              stdin="the cat\nthe dog\n", monkeypatch=monkeypatch)
    assert code2 == 0 and out == out2 and len(out.splitlines()) == 2


def test_logit_bias_presence_penalty_and_ignore_eos_reach_the_sampler(models, capsys):
    m = models["plain"]
    ref, _ = run_json(capsys, m, "the cat", "-n", "6", "--temp", "0")
    first = ref["tokens"][0]
    banned, _ = run_json(capsys, m, "the cat", "-n", "6", "--temp", "0", "--logit-bias", f"{first}-inf")
    assert first not in banned["tokens"]
    forced, _ = run_json(capsys, m, "the cat", "-n", "6", "--temp", "0", "--logit-bias", "100+50",
                         "--logit-bias", "100+50")  # biases add up, as in llama.cpp: +100
    assert forced["tokens"] == [100] * 6
    # a presence penalty of 1000 over the whole context: no token appears twice, nor repeats the prompt
    import qllama

    prompt_ids = qllama.load(m).tokenize("the cat")
    doc, _ = run_json(capsys, m, "the cat", "-n", "30", "--temp", "0", "--presence-penalty", "1000",
                      "--repeat-last-n", "-1", "--ignore-eos")
    assert len(doc["tokens"]) == 30 and len(set(doc["tokens"])) == 30 and not set(doc["tokens"]) & set(prompt_ids)


def test_reverse_prompt_is_a_stop_string_in_run(models, capsys):
    m = models["plain"]
    ref, _ = run_json(capsys, m, "the cat", "-n", "12", "--temp", "0", "--ignore-eos")
    text = ref["text"]
    cut = text[len(text) // 2:][:3]
    doc, _ = run_json(capsys, m, "the cat", "-n", "12", "--temp", "0", "--ignore-eos", "-r", cut)
    assert doc["text"] == text[: text.index(cut)] and doc["finish_reason"] == "stop"


def test_interactive_completion_continues_the_text_with_the_lines_typed(models, capsys, monkeypatch):
    m = models["plain"]
    code, plain, _ = cli_main(capsys, "run", m, "the cat", "-n", "6", "--temp", "0", "-t", "1", "--ignore-eos")
    code, out, err = cli_main(capsys, "run", m, "the cat", "-i", "-n", "6", "--temp", "0", "-t", "1", "--ignore-eos",
                              "-v", stdin="", monkeypatch=monkeypatch)
    assert code == 0 and out == plain, err  # no input: the same 6 tokens, then the end
    code, out2, err = cli_main(capsys, "run", m, "the cat", "-i", "-n", "6", "--temp", "0", "-t", "1", "--ignore-eos",
                               "-v", stdin="a dog\n\n", monkeypatch=monkeypatch)
    assert code == 0, err
    assert out2.startswith(plain.rstrip("\n")) and len(out2) > len(plain)  # two more turns of text
    assert err.count("[stopped: length]") == 3 and "reused" in err  # the KV cache kept the text
    # a reverse prompt ends a turn where it appears (shown), and control returns to the input
    cut = plain.strip()[-2:]
    code, out3, err = cli_main(capsys, "run", m, "the cat", "-i", "-r", cut, "-n", "6", "--temp", "0", "-t", "1",
                               "--ignore-eos", "-v", stdin="", monkeypatch=monkeypatch)
    assert out3.rstrip("\n").endswith(cut) and "[stopped: reverse prompt]" in err


def test_help_and_readme_agree_on_threads_and_the_api_example_does_not_warn(capsys):
    import re
    import warnings

    import qllama

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for cmd in ("run", "chat"):
        code, out, _ = cli_main(capsys, cmd, "--help")
        assert code == 0 and "physical cores)" not in out
        assert "adapted to how busy the machine is" in " ".join(out.split())
    assert "(default: adapted to how busy the machine is" in " ".join(readme.split())
    code, out, _ = cli_main(capsys, "run", "--help")
    for flag in ("-cnv, --conversation", "-no-cnv, --no-conversation", "-sys, --system", "-r, --reverse-prompt",
                 "-i, --interactive", "--ignore-eos", "--presence-penalty", "--frequency-penalty", "--logit-bias"):
        assert flag in out and flag.split(",")[0] in readme, flag
    # the README's Python API example loads the demo as written there, without a warning
    m = re.search(r'model = qllama\.load\("demo"(.*?)\)', readme)
    assert m and "n_ctx" not in m.group(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = qllama.load("demo", n_threads=2)
    assert model.n_ctx == 256
