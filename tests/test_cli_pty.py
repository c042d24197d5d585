"""The CLI driven like a person at a terminal (a pseudo-terminal, through pexpect): the first
run with an empty Numba cache, Ctrl-C during that compile, `run` without a prompt, the errors
of issue 13 and perplexity's progress line.

A terminal merges stdout and stderr and turns "\\n" into "\\r\\n"; `transcript` undoes the latter.
"""

from __future__ import annotations

import io
import os
import re
import sys

import pytest

from conftest import REPO
from tools.make_model import ModelSpec, write_model

pexpect = pytest.importorskip("pexpect")

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("pty")
    plain, chat, q8 = d / "plain.gguf", d / "chat.gguf", d / "q8.gguf"
    write_model(plain, ModelSpec(seed=21, n_ctx=128))
    write_model(chat, ModelSpec(seed=22, n_ctx=128, chat_template=TEMPLATE))
    write_model(q8, ModelSpec(seed=23, n_ctx=128, weight_type="q8_0"))
    return {"plain": plain, "chat": chat, "q8": q8, "dir": d}


def spawn(*args, numba_cache: str | os.PathLike | None = None, timeout: float = 300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb"}
    if numba_cache is not None:
        env["NUMBA_CACHE_DIR"] = str(numba_cache)
    # codec_errors: at a Ctrl-C the terminal itself discards the output still queued (ISIG without
    # NOFLSH), which can cut a UTF-8 character in two; a terminal shows a stray byte, so read it so
    # (strict decoding failed the Ctrl-C test about one run in three on a Zen 5 host)
    child = pexpect.spawn(sys.executable, ["-m", "qllama", *map(str, args)], env=env, encoding="utf-8",
                          codec_errors="replace", timeout=timeout, dimensions=(40, 250))
    child.logfile_read = io.StringIO()
    return child


def finish(child, timeout: float = 300) -> tuple[int | None, str]:
    """Wait for the end; (exit status, everything the terminal showed)."""
    child.expect(pexpect.EOF, timeout=timeout)
    # the last byte can come well before the exit (interpreter and compile-pool teardown on a busy
    # machine): close() alone would then end the process by a signal and report no exit status
    if child.isalive():
        child.wait()
    child.close()
    return child.exitstatus, transcript(child)


def transcript(child) -> str:
    # (colorama, where a machine has it installed, resets the terminal's colours at Numba's exit)
    return child.logfile_read.getvalue().replace("\r\n", "\n").removesuffix("\x1b[0m")


def test_ctrl_c_during_the_first_compile(models, tmp_path):
    """Empty Numba cache: the 'compiling' line comes first, a spinner after a second; Ctrl-C then
    ends the process with status 130 and no traceback."""
    child = spawn("run", models["plain"], "the cat", "-n", "4", "-t", "1", numba_cache=tmp_path / "cache")
    child.expect_exact("compiling kernels for f32 (first run only)...")
    child.expect(r"[|/\\-] compiling\.\.\. \d+ s")  # the spinner (a terminal, more than a second)
    child.sendintr()
    status, shown = finish(child)
    assert status == 130, shown
    assert "Traceback" not in shown and "Exception ignored" not in shown
    assert shown.rstrip().endswith("interrupted")


@pytest.mark.slow  # a complete cold compile: 25-60 s on 2 busy cores
def test_first_run_says_it_compiles_then_generates(models, tmp_path):
    import qllama

    expected = qllama.load(models["plain"]).complete("the cat", max_tokens=6, temperature=0.0)
    child = spawn("run", models["plain"], "the cat", "-n", "6", "--temp", "0", "-t", "1",
                  numba_cache=tmp_path / "cache", timeout=900)
    child.expect_exact("compiling kernels for f32 (first run only)...")
    status, shown = finish(child, timeout=900)
    assert status == 0, shown
    after = shown.split("compiling kernels for f32 (first run only)...", 1)[1]
    assert re.search(r"kernels compiled in \d+\.\d s", after)
    assert expected + "\n" in after  # the text comes after the message
    assert re.search(r"warm-up time += +\d+\.\d+ ms", after)
    # the second run finds the cache warm: no message
    status, shown = finish(spawn("run", models["plain"], "the cat", "-n", "6", "--temp", "0", "-t", "1",
                                 numba_cache=tmp_path / "cache"))
    assert status == 0 and "compiling" not in shown and expected in shown


def test_run_without_a_prompt_on_a_terminal_starts_the_chat(models):
    child = spawn("run", models["chat"], "-t", "1")
    child.expect_exact("/help")  # the chat's greeting notice
    child.expect_exact("> ")
    child.sendline("/exit")
    status, shown = finish(child)
    assert status == 0 and "Traceback" not in shown and "no prompt" not in shown


@pytest.mark.parametrize("case", ["missing file", "huge context", "bad seed", "requantize", "no arguments"])
def test_errors_at_a_terminal(models, case):
    m, d = models["plain"], models["dir"]
    args, pattern, code = {
        "missing file": (["run", m, "-f", "nope.txt"], r"^error: nope\.txt: no such file$", 1),
        "huge context": (["run", m, "hi", "-c", "999999999"],
                         r"^error: a context of 999999999 tokens needs [\d.]+ GiB .* [\d.]+ GiB .*-c/--ctx-size\)$", 1),
        "bad seed": (["run", m, "hi", "--seed", "-2"], r"^error: .*-1 for a random one$", 2),
        "requantize": (["quantize", models["q8"], d / "out.gguf", "Q4_0"], r"^error: .*--allow-requantize$", 1),
        "no arguments": ([], r"^Usage: qllama \[OPTIONS\] COMMAND", 0),
    }[case]
    status, shown = finish(spawn(*args))
    assert status == code, shown
    assert re.search(pattern, shown, re.M), shown
    assert "Traceback" not in shown and "error: Usage" not in shown


def test_perplexity_progress_on_a_terminal(models):
    text = models["dir"] / "text.txt"
    text.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    # (llama-perplexity's spellings: -m MODEL -f FILE)
    status, shown = finish(spawn("perplexity", "-m", models["plain"], "-f", text, "-c", "32", "--chunks", "3", "-t", "1"))
    assert status == 0, shown
    assert "\r[1/3] perplexity" in shown and "[3/3] perplexity" in shown
