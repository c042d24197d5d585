"""`qllama serve` in a subprocess on 127.0.0.1 (an ephemeral port), for tests that drive it with
real clients. Bounded: `timeout` ends it after `limit_s` whatever happens to the test process,
and `stop()` ends it at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(ROOT, "..", "shared", "templates")


class ServedCLI:
    def __init__(self, *args: str, limit_s: int = 900, ready_s: float = 180.0):
        cmd = ["timeout", str(limit_s), sys.executable, "-m", "qllama", "serve", *args, "--host", "127.0.0.1",
               "--port", "0"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        found = threading.Event()
        self.url = ""

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
                if m and not found.is_set():
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(ready_s) or not self.url:
            self.stop()
            raise RuntimeError("qllama serve did not start:\n" + "".join(self.log[-20:]))
        self.base_url = self.url + "/v1"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="none", timeout=120.0, max_retries=0, **kw)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120.0)

    def alive(self) -> bool:
        return httpx.get(self.url + "/health", timeout=10.0).json()["status"] == "ok"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
