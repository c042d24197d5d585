"""ollama's API (/api/*) and llama-server's /tokenize, /detokenize and /metrics on `qllama serve`.

The default suite drives the in-process server of tests/test_server.py (uvicorn in a thread on
127.0.0.1) with httpx and the official `ollama` client, on the scripted model whose greedy answer
is known ("Hi! the and", then the end of sequence). The slow test starts `qllama serve` itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")

from conftest import REPO  # noqa: E402
from test_server import ANSWER, TIMEOUT, USER, paths, serve  # noqa: E402,F401  (paths: the fixture)


@pytest.fixture(scope="module")
def hi(paths):  # noqa: F811
    with serve(paths["hi"]) as s:
        yield s


def client(s):
    return ollama.Client(host=s.url, timeout=TIMEOUT)


GREEDY = {"temperature": 0}


def ndjson(r) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_version_tags_ps_show(hi):
    c = client(hi)
    assert httpx.get(hi.url + "/api/version").json()["version"]
    models = c.list().models
    assert [m.model for m in models] == ["test-model"]
    assert models[0].details.format == "gguf" and models[0].details.family == "llama" and models[0].size > 0
    assert [m.model for m in c.ps().models] == ["test-model"]
    shown = c.show("test-model")
    assert shown.modelinfo["general.architecture"] == "llama" and "messages" in shown.template
    assert shown.details.family == "llama"


def test_chat_with_the_ollama_client_streamed_and_not(hi):
    c = client(hi)
    r = c.chat(model="anything", messages=USER, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == ANSWER and r.done and r.done_reason == "stop"
    n_prompt = len(hi.llm.chat_tokens(USER))
    assert r.prompt_eval_count <= n_prompt and r.eval_count == 6  # 5 text tokens and </s>, as /v1 counts them
    parts = list(c.chat(model="x", messages=USER, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == ANSWER
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].done_reason == "stop"
    assert parts[-1].eval_count == 6 and parts[-1].total_duration > 0


def test_generate_with_options_mapped_to_the_sampler(hi):
    c = client(hi)
    r = c.generate(model="x", prompt="hello", options=GREEDY)  # through the chat template, as ollama does
    assert r.response == ANSWER and r.done_reason == "stop"
    r = c.generate(model="x", prompt="hello>", raw=True, options={**GREEDY, "num_predict": 3})
    assert r.response == "Hi!" and r.done_reason == "length" and r.eval_count == 3
    assert r.context[: len(hi.llm.tokenize("hello>", parse_special=True))] == hi.llm.tokenize("hello>", parse_special=True)
    r = c.generate(model="x", prompt="hello>", raw=True, options={**GREEDY, "stop": [" the"]})
    assert r.response == "Hi!" and r.done_reason == "stop"
    parts = list(c.generate(model="x", prompt="hello>", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == ANSWER and parts[-1].done
    # no prompt: ollama's "load" answer, keep_alive accepted
    r = c.generate(model="x", prompt="", keep_alive="5m")
    assert r.done and r.done_reason == "load" and r.response == ""


def test_ndjson_over_raw_http_and_ollama_errors(hi):
    r = httpx.post(hi.url + "/api/chat", json={"model": "x", "messages": USER, "options": GREEDY}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")  # stream: true by default
    lines = ndjson(r)
    assert "".join(d["message"]["content"] for d in lines) == ANSWER and lines[-1]["done"] is True
    assert {"total_duration", "prompt_eval_count", "eval_count", "eval_duration"} <= set(lines[-1])
    for body, status, what in [({"messages": USER}, 400, "model is required"),
                               ({"model": "x", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
                               ({"model": "x", "messages": USER, "options": {"temperature": "hot"}}, 400, "temperature"),
                               ({"model": "x", "messages": USER, "options": {"top_p": 2}}, 400, "top_p")]:
        r = httpx.post(hi.url + "/api/chat", json=body, timeout=TIMEOUT)
        assert r.status_code == status and what in r.json()["error"] and set(r.json()) == {"error"}, r.text
    with pytest.raises(ollama.ResponseError) as e:
        client(hi).chat(model="x", messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.status_code == 400


def test_tokenize_detokenize_and_metrics(hi):
    llm = hi.llm
    ids = llm.tokenize("hello world", add_bos=False)
    r = httpx.post(hi.url + "/tokenize", json={"content": "hello world"}).json()
    assert r["tokens"] == ids  # add_special false by default, as llama-server
    r = httpx.post(hi.url + "/tokenize", json={"content": "hello world", "add_special": True, "with_pieces": True}).json()
    assert [t["id"] for t in r["tokens"]] == llm.tokenize("hello world") and r["tokens"][0]["id"] == llm.tokenizer.bos_id
    assert httpx.post(hi.url + "/detokenize", json={"tokens": ids}).json()["content"] == llm.detokenize(ids)
    assert httpx.post(hi.url + "/detokenize", json={"tokens": [10**7]}).status_code == 400
    before = hi.scheduler.totals["predicted_tokens"]
    client(hi).generate(model="x", prompt="hello>", raw=True, options={**GREEDY, "num_predict": 2})
    text = httpx.get(hi.url + "/metrics").text
    values = dict(re.findall(r"^(llamacpp:\w+) (\S+)$", text, re.M))
    assert float(values["llamacpp:tokens_predicted_total"]) == before + 2
    assert "# TYPE llamacpp:prompt_tokens_total counter" in text and "llamacpp:requests_processing" in values


@pytest.mark.slow
def test_the_ollama_client_against_qllama_serve(paths, tmp_path):  # noqa: F811
    """`qllama serve` in its own process on 127.0.0.1 (any free port), driven by the ollama client."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "qllama", "serve", str(paths["hi"]), "--port", "0", "-t", "1",
                             "--alias", "hi"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        end = time.monotonic() + 300
        url = None
        while url is None and time.monotonic() < end:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "qllama serve did not start"
        c = ollama.Client(host=url, timeout=TIMEOUT)
        assert [m.model for m in c.list().models] == ["hi"]
        assert c.chat(model="hi", messages=USER, options=GREEDY).message.content == ANSWER
        assert "".join(p.response for p in c.generate(model="hi", prompt="hello>", raw=True, options=GREEDY,
                                                      stream=True)) == ANSWER
    finally:
        proc.terminate()
        proc.wait(30)


def test_format_json_constrains_the_answer(hi):
    pytest.importorskip("llguidance")
    c = client(hi)
    r = c.generate(model="x", prompt="hello>", raw=True, format="json", options={**GREEDY, "num_predict": 4})
    assert r.response.lstrip().startswith("{") and ANSWER not in r.response
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = c.chat(model="x", messages=USER, format=schema, options={**GREEDY, "num_predict": 40})
    assert r.message.content.lstrip().startswith('{"a"') or r.message.content.lstrip().startswith('{ "a"')
    r = httpx.post(hi.url + "/api/generate", json={"model": "x", "prompt": "hi", "format": 3}, timeout=TIMEOUT)
    assert r.status_code == 400 and "format" in r.json()["error"]
