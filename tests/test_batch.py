"""`qllama batch`: OpenAI Batch files through the server's app and continuous batching (the
shipped `demo` model). Format, error lines, resume after a crash or a Ctrl-C. The Ray tests at the end
are in the slow suite: a local Ray cluster on 127.0.0.1 (`ray start --head --block`, stopped by the
test) for `--ray ADDRESS --replicas 2`, and Ray Serve with two replicas."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

import qllama  # noqa: E402
from qllama import batch  # noqa: E402
from qllama.errors import QllamaError  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET:", "KING HENRY:", "To be, or not", "HAMLET:", "First Citizen:", "MENENIUS:", "O"]
VOLATILE = ("id", "created", "timings")  # differ between any two answers of the server too


def completion(cid, prompt, mt=12, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "demo", "prompt": prompt, "max_tokens": mt, "temperature": 0, **body}}


def chat(cid, text, n=8):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0}}


def write_lines(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def read_results(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def llm():
    return qllama.load("demo", n_threads=1)


@pytest.fixture(scope="module")
def engine(llm):
    return batch.BatchEngine(llm, model_name="demo", parallel=4, chunk=64, chat_template="chatml")


def run(engine, inp, out):
    results = batch.ResultsFile(str(out))
    return batch.run_job(engine.run, batch.read_input(str(inp)), results, progress=False, echo=lambda m: None)


def test_results_are_the_servers_answers_and_batched(engine, llm, tmp_path):
    reqs = [completion(f"c{i}", p) for i, p in enumerate(PROMPTS)] + [chat("chat", "Hi", 6)]
    inp = write_lines(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    before = engine.scheduler.max_busy
    stats = run(engine, inp, out)
    assert stats.ok == len(reqs) and stats.errors == 0
    assert engine.scheduler.max_busy >= 2 or before >= 2  # several requests shared a step
    lines = read_results(out)
    assert sorted(r["custom_id"] for r in lines) == sorted(r["custom_id"] for r in reqs)
    by_id = {r["custom_id"]: r for r in lines}
    for r in lines:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        assert r["id"].startswith("batch_req_") and r["response"]["request_id"].startswith("req_")
        assert r["response"]["status_code"] == 200
    # the greedy text of each is what the model says alone
    for i, p in enumerate(PROMPTS):
        body = by_id[f"c{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == llm.complete(p, max_tokens=12, temperature=0)
    # the whole body is what `qllama serve` answers (its app behind a real HTTP client)
    from starlette.testclient import TestClient

    from qllama.server.app import ServerState, create_app
    from qllama.server.engine import model_forward
    from qllama.server.scheduler import Scheduler

    forward, new_cache, _ = model_forward(llm)
    sched = Scheduler(forward, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=2)
    sched.start()
    try:
        client = TestClient(create_app(ServerState(llm, sched, "demo", chat_template="chatml")))
        for req in (reqs[0], reqs[3], reqs[-1]):
            served = client.post(req["url"], json=req["body"])
            assert served.status_code == 200
            want = {k: v for k, v in served.json().items() if k not in VOLATILE}
            got = {k: v for k, v in by_id[req["custom_id"]]["response"]["body"].items() if k not in VOLATILE}
            assert got == want
            assert set(by_id[req["custom_id"]]["response"]["body"]) == set(served.json())
        bad = client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"})
    finally:
        sched.close()
        sched.join(10)
    # an error is answered as the server answers it, too
    inp2 = write_lines(tmp_path / "in2.jsonl", [{"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                                                 "body": {"prompt": "x", "temperature": "hot"}}])
    run(engine, inp2, tmp_path / "out2.jsonl")
    (r,) = read_results(tmp_path / "out2.jsonl")
    assert r["response"]["status_code"] == bad.status_code == 400
    assert r["response"]["body"] == bad.json()
    assert r["error"] == {"code": "invalid_request_error", "message": bad.json()["error"]["message"]}


def test_bad_lines_and_requests_give_error_lines_and_the_rest_completes(engine, tmp_path):
    lines = [
        completion("ok1", "ROMEO:"),
        "{not json",
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},  # no custom_id
        {**completion("get", "x"), "method": "GET"},
        {**completion("embed", "x"), "url": "/v1/embeddings"},
        {"custom_id": "nobody", "method": "POST", "url": "/v1/completions"},
        completion("stream", "x", stream=True),
        completion("hot", "x", temperature="hot"),
        completion("n2", "x", n=2),
        completion("dup", "a"),
        completion("dup", "b"),
        completion("toolong", "ROMEO: " * 400),
        completion("ok2", "JULIET:"),
        "[1, 2]",
    ]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    stats = run(engine, inp, out)
    res = read_results(out)
    assert stats.ok == 2 and stats.errors == len(res) - 2 == 11
    by_id = {r["custom_id"]: r for r in res if r["custom_id"] is not None}
    assert len(by_id) == len([r for r in res if r["custom_id"] is not None])  # no custom_id twice
    for cid in ("ok1", "ok2"):
        assert by_id[cid]["response"]["status_code"] == 200 and by_id[cid]["error"] is None
    for cid in ("get", "embed", "nobody", "stream", "hot", "n2", "dup", "toolong"):
        r = by_id[cid]
        assert r["response"]["status_code"] == 400, cid
        assert r["response"]["body"]["error"]["message"] == r["error"]["message"]
    assert "method" in by_id["get"]["error"]["message"]
    assert "/v1/embeddings" in by_id["embed"]["error"]["message"]
    assert by_id["hot"]["response"]["body"]["error"]["param"] == "temperature"
    assert "unique" in by_id["dup"]["error"]["message"] and "lines 10, 11" in by_id["dup"]["error"]["message"]
    assert by_id["toolong"]["error"]["code"] == "exceed_context_size_error"
    nulls = sorted(r["error"]["line"] for r in res if r["custom_id"] is None)
    assert nulls == [2, 3, 14]
    # a re-run has nothing to do: every line, with or without a custom_id, is already answered
    stats = run(engine, inp, out)
    assert stats.done == 0 and len(read_results(out)) == len(res)


def test_resume_after_a_crash_repairs_the_last_line_and_skips_what_is_done(engine, tmp_path):
    reqs = [completion(f"c{i}", p, mt=8) for i, p in enumerate(PROMPTS)]
    inp = write_lines(tmp_path / "in.jsonl", reqs)
    full = tmp_path / "full.jsonl"
    run(engine, inp, full)
    whole = full.read_text().splitlines(keepends=True)
    # a crash after 3 results, in the middle of writing the 4th
    out = tmp_path / "out.jsonl"
    out.write_text("".join(whole[:3]) + whole[3][: len(whole[3]) // 2])
    results = batch.ResultsFile(str(out))
    assert results.repaired == len(whole[3]) // 2 and len(results.done_ids) == 3
    stats = batch.run_job(engine.run, batch.read_input(str(inp)), results, progress=False, echo=lambda m: None)
    assert stats.done == len(reqs) - 3
    text = out.read_text()
    assert text.startswith("".join(whole[:3]))  # what was done stays, byte for byte
    res = read_results(out)
    assert sorted(r["custom_id"] for r in res) == sorted(r["custom_id"] for r in reqs)  # each once
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in res}
    assert texts == {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read_results(full)}
    # a whole last line without its newline is kept (and ended)
    out.write_text(text.rstrip("\n"))
    results = batch.ResultsFile(str(out))
    assert results.repaired == 0 and len(results.done_ids) == len(reqs)
    results.close()
    assert out.read_text() == text


def test_a_file_that_is_not_a_results_file_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\nsomething else\n{"custom_id": "b"}\n')
    with pytest.raises(QllamaError, match="line 2 is not a result line"):
        batch.ResultsFile(str(out))


def test_parse_input_rules():
    reqs = batch.parse_input(["", json.dumps(completion("a", "x")), "  ", json.dumps(completion("a", "y")),
                              json.dumps(completion("b", "z"))])
    assert [(r.line, r.custom_id, r.error is None) for r in reqs] == [(2, "a", False), (5, "b", True)]
    rec = reqs[1].record()
    assert batch.BatchRequest.from_record(json.loads(json.dumps(rec))) == reqs[1]


def cli(*args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "qllama", *args], capture_output=True, text=True, timeout=180,
                          env=env, **kw)


def test_cli_runs_resumes_and_names_the_ray_extra(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [completion(f"c{i}", p, mt=6) for i, p in enumerate(PROMPTS[:4])]
                      + ["oops"])
    out = tmp_path / "out.jsonl"
    p = cli("batch", "demo", "-i", str(inp), "-o", str(out), "--parallel", "4", "-t", "1")
    assert p.returncode == 0, p.stderr
    assert "5 requests in" in p.stderr and "4 ok, 1 errors" in p.stderr
    assert "\r" not in p.stderr  # no progress bar when stderr is not a terminal
    assert len(read_results(out)) == 5
    p = cli("batch", "demo", "-i", str(inp), "-o", str(out))
    assert p.returncode == 0 and "nothing to do" in p.stderr
    assert len(read_results(out)) == 5
    # without Ray installed: one error line naming the extra
    fake = tmp_path / "noray"
    (fake / "ray").mkdir(parents=True)
    (fake / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    p = cli("batch", "demo", "-i", str(inp), "-o", str(tmp_path / "o2.jsonl"), "--ray", "auto", env=env)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == ["error: --ray needs Ray: pip install 'qllama[ray]'"]
    p = cli("batch", "demo", "-i", str(tmp_path / "missing.jsonl"), "-o", str(out))
    assert p.returncode == 1 and p.stderr.startswith("error:") and "Traceback" not in p.stderr


def test_ctrl_c_keeps_every_finished_result_then_the_rerun_completes(tmp_path):
    n = 32
    inp = write_lines(tmp_path / "in.jsonl", [completion(f"c{i}", PROMPTS[i % len(PROMPTS)] + " " * (i // 8), mt=32)
                                              for i in range(n)])
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qllama", "batch", "demo", "-i", str(inp), "-o", str(out),
                             "--parallel", "2", "-t", "1"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        end = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < end, "no results came"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    done = read_results(out)  # every line whole
    assert 2 <= len(done) < n and all(r["response"]["status_code"] == 200 for r in done)
    p = cli("batch", "demo", "-i", str(inp), "-o", str(out), "--parallel", "4", "-t", "1")
    assert p.returncode == 0, p.stderr
    assert f"{len(done)} of {n} requests are already in" in p.stderr
    res = read_results(out)
    assert sorted(r["custom_id"] for r in res) == sorted(f"c{i}" for i in range(n))
    assert all(r["response"]["status_code"] == 200 for r in res)


# -- Ray (slow suite): a local cluster on 127.0.0.1, bounded in time, stopped by the test ------------------


def free_port(lo=6380, hi=6999):
    """A free TCP port on 127.0.0.1 outside Ray's worker port range (10002-19999)."""
    import socket

    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory):
    """Ray's settings for a test cluster: 127.0.0.1 kept as given, no usage stats, and token
    authentication (Ray's default) with a token of the test's own instead of ~/.ray/auth_token."""
    import secrets

    token = tmp_path_factory.mktemp("ray-auth") / "token"
    token.write_text(secrets.token_hex(32))
    env = {**LOOPBACK_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # this process too (Ray reads some of them when it is imported)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory, ray_env):
    """`ray start --head --block` on 127.0.0.1 with 3 logical CPUs (2 replicas and Ray Data's own
    tasks); SIGTERM stops it and every process it started."""
    import shutil
    import socket

    pytest.importorskip("ray.data")
    ray_cli = shutil.which("ray")
    if ray_cli is None:
        pytest.skip("the ray command is not installed")
    port = free_port()
    env = {**os.environ, **ray_env}
    log = tmp_path_factory.mktemp("ray") / "head.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([ray_cli, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                                 "--port", str(port), "--num-cpus", "3", "--include-dashboard", "false",
                                 "--disable-usage-stats"], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < end, "the Ray head did not start"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        time.sleep(2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        current = "/tmp/ray/ray_current_cluster"  # left behind by the stopped head: ray.init() would look for it
        try:
            with open(current) as f:
                if f.read().strip() == f"127.0.0.1:{port}":
                    os.remove(current)
        except OSError:
            pass


def texts(path):
    return {r["custom_id"]: (r["response"]["status_code"], r["response"]["body"].get("choices", [{}])[0].get("text"))
            for r in read_results(path)}


@pytest.mark.slow
def test_ray_batch_over_two_replicas_equals_the_local_run_and_resumes(ray_head, ray_env, engine, tmp_path):
    reqs = [completion(f"c{i}", PROMPTS[i % len(PROMPTS)] + " " * (i // 8), mt=16) for i in range(24)]
    inp = write_lines(tmp_path / "in.jsonl", reqs + ["oops", completion("hot", "x", temperature="hot")])
    local = tmp_path / "local.jsonl"
    run(engine, inp, local)
    out = tmp_path / "ray.jsonl"
    args = ["batch", "demo", "-i", str(inp), "-o", str(out), "--alias", "demo", "--parallel", "4",
            "--ray", ray_head, "--replicas", "2", "--rows-per-call", "4"]
    p = cli(*args, env=ray_env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "26 requests in" in p.stderr and "24 ok, 2 errors" in p.stderr
    assert texts(out) == texts(local)  # the greedy results (and the error lines) of the local run
    # a crash: 5 whole results and half a line; the re-run on Ray completes it, each custom_id once
    whole = out.read_text().splitlines(keepends=True)
    out.write_text("".join(whole[:5]) + whole[5][:40])
    p = cli(*args, env=ray_env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dropped a partial last line" in p.stderr and "5 of 26 requests are already in" in p.stderr
    assert len(read_results(out)) == 26 and texts(out) == texts(local)


@pytest.mark.slow
def test_ray_serve_two_replicas_answer_as_local_serve(llm, ray_head):
    pytest.importorskip("ray.serve")
    openai = pytest.importorskip("openai")
    import ray
    from ray import serve

    from qllama.integrations.ray import app

    port = free_port(8100, 8999)
    ray.init(address=ray_head, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app({"model": "demo", "num_replicas": "2", "parallel": "2", "alias": "demo"}), name="qllama",
                  route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in PROMPTS[:4]:
            want = llm.complete(prompt, max_tokens=12, temperature=0)
            r = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0)
            assert r.choices[0].text == want and r.model == "demo"
            streamed = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == want
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model="demo", prompt="x", temperature=-1)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
