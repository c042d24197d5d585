"""Issue 28's interactive polish: keys typed while an answer streams are not echoed into it,
Ctrl-C stops an answer and not the session, and long prompts show their progress on a terminal."""

from __future__ import annotations

import io
import os
import re
import time

import pytest

from test_cli_pty import TEMPLATE, finish, spawn, transcript
from tools.make_model import ModelSpec, write_model

pexpect = pytest.importorskip("pexpect")
termios = pytest.importorskip("termios")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("terminal")
    plain, chat = d / "plain.gguf", d / "chat.gguf"
    write_model(plain, ModelSpec(seed=31, n_ctx=4096))
    write_model(chat, ModelSpec(seed=32, n_ctx=65536, chat_template=TEMPLATE))
    return {"plain": plain, "chat": chat, "dir": d}


def test_quiet_input_turns_the_echo_off_and_restores_it():
    from qllama.cli.terminal import quiet_input

    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "r", closefd=False) as tty:
            before = termios.tcgetattr(slave)
            assert before[3] & termios.ECHO
            with quiet_input(tty):
                now = termios.tcgetattr(slave)
                assert not now[3] & termios.ECHO and now[3] & termios.ICANON and now[3] & termios.ISIG
            assert termios.tcgetattr(slave) == before
            with pytest.raises(KeyboardInterrupt):
                with quiet_input(tty):
                    raise KeyboardInterrupt  # Ctrl-C while streaming: restored too
            assert termios.tcgetattr(slave) == before
        with quiet_input(io.StringIO()):  # not a terminal: nothing to do
            pass
    finally:
        os.close(master)
        os.close(slave)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_prompt_progress_lines(monkeypatch):
    from qllama.cli import terminal

    clock = iter([10.0, 12.0, 14.0])
    monkeypatch.setattr(terminal.time, "perf_counter", lambda: next(clock))
    out = FakeTerminal()
    p = terminal.PromptProgress(out, min_tokens=256)
    p(0, 1000)
    p(512, 1000)  # 512 tokens in 2 s
    p(1000, 1000)  # done: the line is erased
    shown = out.getvalue()
    assert shown.split("\r")[1:4] == ["prompt: 0/1000 tokens", "prompt: 512/1000 tokens, 256.0 tokens/s", " " * 40]
    assert shown.endswith("\r")
    short = FakeTerminal()
    q = terminal.PromptProgress(short, min_tokens=256)
    q(0, 100), q(100, 100)  # a short prompt: nothing
    piped = io.StringIO()
    r = terminal.PromptProgress(piped)
    r(0, 1000), r(1000, 1000)  # not a terminal: nothing
    assert short.getvalue() == "" and piped.getvalue() == ""


def test_session_reports_prompt_progress_per_batch(models):
    import qllama

    llm = qllama.load(models["plain"], n_threads=1, batch_size=128)
    calls = []
    llm.session.progress = lambda done, total: calls.append((done, total))
    ids = [llm.tokenizer.bos_id] + [5 + (i % 50) for i in range(299)]
    list(llm.stream(ids, max_tokens=1, temperature=0))
    assert calls == [(0, 300), (128, 300), (256, 300), (300, 300)]
    calls.clear()
    list(llm.stream(ids + [7, 8], max_tokens=1, temperature=0))  # only the new tokens (and the last one again)
    assert calls[0][1] == calls[-1][0] and calls[-1][1] <= 4


def test_a_long_prompt_shows_progress_on_a_terminal(models):
    text = models["dir"] / "long.txt"
    text.write_text("the cat sat on the mat. " * 120, encoding="utf-8")
    status, shown = finish(spawn("run", models["plain"], "-f", text, "-b", "64", "-n", "2", "-t", "1", "--raw"))
    assert status == 0, shown
    assert re.search(r"\rprompt: 64/\d+ tokens, [\d.]+ tokens/s", shown), shown


def test_ctrl_c_stops_the_answer_not_the_chat_and_typing_is_not_echoed(models):
    # a context the answer cannot fill before the Ctrl-C below (the default 4096 tokens took 0.5 s on a Zen 5 host)
    child = spawn("chat", models["chat"], "-c", "65536", "-t", "1", "--ignore-eos", "-n", "-1", "--temp", "0")
    child.expect_exact("> ")
    child.sendline("tell me everything")
    time.sleep(1.0)  # the answer streams (a 65536-token context, end of sequence never sampled)
    child.send("zzz")  # typed while it streams
    time.sleep(0.3)
    child.sendintr()
    child.expect_exact("[interrupted]", timeout=60)
    answer = transcript(child)
    child.expect_exact("> ")  # the session goes on
    child.sendline("/exit")
    status, shown = finish(child)
    assert status == 0 and "Traceback" not in shown
    answer = answer.split("tell me everything", 1)[1]
    assert len(answer) > 20 and "zzz" not in answer


def test_interactive_completion_at_a_terminal(models):
    child = spawn("run", models["plain"], "the cat", "-i", "-n", "8", "--temp", "0", "-t", "1", "--ignore-eos")
    child.expect_exact("[interactive completion:")
    time.sleep(1.0)  # the first 8 tokens
    child.sendline("and the dog")
    time.sleep(1.0)
    child.sendintr()  # stops a turn (or an empty prompt line), not the session
    time.sleep(0.5)
    child.sendeof()
    status, shown = finish(child)
    assert status == 0 and "Traceback" not in shown, shown
    assert "and the dog" in shown  # the terminal echoes what is typed at the prompt (not while streaming)
