"""`qllama serve` as a real process under load and faults (slow suite; loopback only, bounded).

- 32 clients x 4 requests, a quarter of them dropped mid-stream: the server stays up, every
  request that was not dropped gets exactly the text and token count it asked for, all slots
  are free afterwards, and the resident memory returns to its level after a warm-up round.
- SIGTERM while streams are running: each stream ends with an error event, the process exits 0.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_server import scripted_model  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT = 120.0


class ServerProcess:
    """`python -m qllama serve MODEL --port 0 ...`; the port is read from its stderr."""

    def __init__(self, model, *args):
        cmd = [sys.executable, "-m", "qllama", "serve", str(model), "--port", "0", "-t", "1", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log: list[str] = []
        end = time.monotonic() + TIMEOUT
        while True:
            line = self.proc.stderr.readline()
            if not line or time.monotonic() > end:
                self.stop()
                raise AssertionError("the server did not start:\n" + "".join(self.log))
            self.log.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                break
        # keep draining stderr so the server never blocks on a full pipe
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=TIMEOUT).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def dots(tmp_path_factory):
    """Greedy answer: '.' after every token, forever (until max_tokens)."""
    return scripted_model(tmp_path_factory.mktemp("load") / "dots.gguf", n_ctx=512)


def completion(url, max_tokens, stream, drop_after=None):
    """One request; returns (text, completion_tokens), or None when dropped on purpose."""
    body = {"prompt": f"hello {random.randint(0, 10**6)}", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        data = r.json()
        return data["choices"][0]["text"], data["usage"]["completion_tokens"]
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for i, line in enumerate(r.iter_lines()):
            if drop_after is not None and i >= drop_after:
                return None  # leaving the block closes the connection mid-stream
            if not line or line == "data: [DONE]":
                continue
            obj = json.loads(line[len("data: "):])
            assert "error" not in obj, obj
            if obj["choices"]:
                text += obj["choices"][0]["text"]
            if obj.get("usage"):
                usage = obj["usage"]["completion_tokens"]
    return text, usage


def test_32_clients_with_random_disconnects(dots):
    srv = ServerProcess(dots, "--parallel", "4", "-c", "512", "-b", "16")
    try:
        def round_of(n_clients, n_requests, drop_rate, seed):
            results, errors = [], []

            def client(i):
                rng = random.Random(seed * 1000 + i)
                for _ in range(n_requests):
                    n = rng.randint(1, 40)
                    stream = rng.random() < 0.7
                    drop = rng.randint(1, 5) if stream and rng.random() < drop_rate else None
                    try:
                        got = completion(srv.url, n, stream, drop)
                    except Exception as e:  # noqa: BLE001 - collected and reported below
                        errors.append(repr(e))
                        continue
                    if got is not None:
                        results.append((n, got))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT * 2)
            assert not any(t.is_alive() for t in threads), "a client hung"
            assert not errors, errors[:5]
            for n, (text, used) in results:
                assert (text, used) == ("." * n, n)
            return len(results)

        round_of(8, 2, 0.0, seed=1)  # warm-up: every slot used, buffers grown
        time.sleep(0.5)
        base = srv.rss_kb()
        done = round_of(32, 4, 0.25, seed=2)
        assert done >= 64  # most of the 128 requests ran to the end
        end = time.monotonic() + 30
        while (h := srv.health())["slots_processing"] or h["requests_waiting"]:
            assert time.monotonic() < end, h
            time.sleep(0.1)
        assert srv.proc.poll() is None  # still up
        assert completion(srv.url, 7, False) == (".......", 7)
        grown_mb = (srv.rss_kb() - base) / 1024
        assert grown_mb < 32, f"resident memory grew by {grown_mb:.1f} MB after the load"
    finally:
        srv.stop()


def test_sigterm_ends_streams_with_an_error_event_and_exits_0(tmp_path):
    dots = scripted_model(tmp_path / "dots.gguf", n_ctx=4096)  # streams that cannot end before the signal
    srv = ServerProcess(dots, "--parallel", "2")
    try:
        events = [[] for _ in range(3)]  # two decoding, one waiting for a slot
        decoding = threading.Barrier(3, timeout=TIMEOUT)  # readers 0 and 1 have their first tokens
        queued = threading.Barrier(2, timeout=TIMEOUT)  # reader 2 has its response headers (no slot)

        def reader(i):
            body = {"prompt": "hello", "max_tokens": 4000, "temperature": 0, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                lines = (line for line in r.iter_lines() if line)
                if i < 2:
                    events[i].append(next(lines))
                    decoding.wait()
                else:
                    queued.wait()
                events[i].extend(lines)

        # (reader 2 starts only once 0 and 1 hold both slots: started together, the one left
        # waiting could be 0 or 1, whose first token would come after a whole 4000-token stream)
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
        threads[0].start()
        threads[1].start()
        decoding.wait()
        threads[2].start()
        queued.wait()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(TIMEOUT) == 0
        for t in threads:
            t.join(TIMEOUT)
        for ev in events:
            assert ev and ev[-1] != "data: [DONE]", [e[:60] for e in ev[-3:]]
            last = json.loads(ev[-1][len("data: "):])
            assert last["error"]["type"] == "unavailable_error" and "shutting down" in last["error"]["message"]
            assert "data: [DONE]" not in ev
    finally:
        srv.stop()


def test_trained_model_concurrent_chats_equal_each_alone():
    """SmolLM2-135M-Instruct (its own ChatML template): four chats decoded together give each
    the greedy answer it gets alone through Model.complete."""
    from test_server import hold_first_step, serve
    from tools.fetch_smollm2 import smollm2_or_skip

    questions = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
                 "What is 2+2?"]
    with serve(smollm2_or_skip(), parallel=4, chunk=32, n_ctx=512) as s:
        got = [None] * len(questions)
        hold_first_step(s.scheduler, len(questions))

        def ask(i):
            r = s.client().chat.completions.create(model="x", messages=[{"role": "user", "content": questions[i]}],
                                                   temperature=0, max_tokens=24)
            got[i] = (r.choices[0].message.content, r.usage.completion_tokens)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT * 4)
        assert s.scheduler.max_busy >= 2
        alone = [s.llm.complete(s.llm.chat_tokens([{"role": "user", "content": q}]), max_tokens=24, temperature=0)
                 for q in questions]
    assert [g[0] for g in got] == alone
    assert all(0 < g[1] <= 24 for g in got)
