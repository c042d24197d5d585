"""`qllama serve`: the OpenAI-compatible server, driven by the official `openai` client and raw HTTP.

Exact answers come from "scripted" models: every token's embedding is one direction, layers add
nothing, and the output row of the next scripted token is 10 on that direction, so greedy
decoding follows a chain we choose ("<assistant>" -> "Hi! the and" -> end of sequence) and the
log-probabilities are computable by hand. Continuous batching is checked on random weights
(every logit depends on the whole context): each request's greedy output equals the same
request run alone through `Model.complete`. The server runs in a thread on 127.0.0.1 with an
ephemeral port and is always stopped.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import qllama  # noqa: E402
from qllama.server.app import ServerState, create_app  # noqa: E402
from qllama.server.engine import model_forward  # noqa: E402
from qllama.server.scheduler import Scheduler  # noqa: E402
from tools.make_model import ModelSpec, write_model  # noqa: E402

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
GEN_LAST = "<0x3E>"  # ">" is no piece of the tiny vocabulary: a byte token ends the generation prompt
CHAIN = [GEN_LAST, "H", "i", "!", "▁the", "▁and", "</s>"]  # answers "Hi! the and"
ANSWER = "Hi! the and"
TIMEOUT = 60.0


def scripted_model(path, chain=CHAIN, default=".", template=TEMPLATE, n_ctx=256):
    """A model whose greedy continuation of chain[0] is chain[1:], and `default` after any other token."""
    from qllama.gguf.reader import GGUFFile

    n_embd = 64
    write_model(path, ModelSpec(n_embd=n_embd, n_layer=1, n_head=4, n_head_kv=2, n_ff=64, n_ctx=n_ctx,
                                weight_type="f32", chat_template=template))
    gf = GGUFFile(path)
    tokens = list(gf.metadata["tokenizer.ggml.tokens"])
    tid = {t: i for i, t in enumerate(tokens)}
    where = {name: (gf.data_offset + t.offset, t.n_elements) for name, t in gf.tensors.items()}
    gf.close()

    def tensor(name):
        off, n = where[name]
        return np.memmap(path, dtype=np.float32, mode="r+", offset=off, shape=(n,))

    embd = tensor("token_embd.weight").reshape(len(tokens), n_embd)  # (n_vocab, n_embd)
    out = tensor("output.weight").reshape(len(tokens), n_embd)  # (n_vocab, n_embd)
    embd[:] = 0.0
    embd[:, 0] = 1.0
    out[:] = 0.0
    out[tid[default], 0] = 10.0
    for state, (cur, nxt) in enumerate(zip(chain, chain[1:]), start=1):
        embd[tid[cur]] = 0.0
        embd[tid[cur], state] = 1.0
        out[tid[nxt], state] = 10.0
    for name in where:
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            tensor(name)[:] = 0.0  # layers add nothing
        elif name.endswith("norm.weight"):
            tensor(name)[:] = 1.0
    embd.flush()
    out.flush()
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    random = d / "random.gguf"
    write_model(random, ModelSpec(n_embd=64, n_layer=2, n_ctx=256, weight_type="q8_0", chat_template=TEMPLATE, seed=7))
    return {
        "hi": scripted_model(d / "hi.gguf"),
        "plain": scripted_model(d / "plain.gguf", template=None),
        "long": scripted_model(d / "long.gguf", n_ctx=4096),  # streams that last
        "random": random,
    }


class Running:
    def __init__(self, url, llm, scheduler):
        self.url = url
        self.llm = llm
        self.scheduler = scheduler

    def client(self, api_key="none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=TIMEOUT, max_retries=0, **kw)

    def post(self, path, body=None, content=None, headers=None):
        return httpx.post(self.url + path, json=body, content=content, headers=headers, timeout=TIMEOUT)

    def health(self):
        return httpx.get(self.url + "/health", timeout=TIMEOUT).json()

    def wait(self, cond, what, timeout=TIMEOUT):
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)


@contextmanager
def serve(path, *, parallel=2, chunk=16, max_queue=8, api_key=None, n_ctx=None, chat_template=None):
    """uvicorn in a thread on 127.0.0.1:<ephemeral>; always stopped."""
    llm = qllama.load(path, n_ctx=n_ctx, n_threads=1)
    forward, new_cache, _ = model_forward(llm)
    sched = Scheduler(forward, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=parallel, max_queue=max_queue,
                      chunk=chunk)
    app = create_app(ServerState(llm, sched, "test-model", api_key=api_key, chat_template=chat_template))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    sched.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + TIMEOUT
        while not server.started:
            assert thread.is_alive() and time.monotonic() < end, "the server did not start"
            time.sleep(0.02)
        yield Running(f"http://127.0.0.1:{sock.getsockname()[1]}", llm, sched)
    finally:
        sched.close()
        server.should_exit = True
        thread.join(15)
        sched.join(15)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def hi(paths):
    with serve(paths["hi"]) as s:
        yield s


USER = [{"role": "user", "content": "hello"}]


def lengths(llm, text):
    return len(llm.tokenize(text, add_bos=True, parse_special=True))


# -- the openai client: both endpoints, streaming and not -------------------------------------------

def test_models_and_health(hi):
    models = hi.client().models.list()
    assert [m.id for m in models.data] == ["test-model"]
    h = hi.health()
    assert h["status"] == "ok" and h["slots_idle"] + h["slots_processing"] == 2


def test_chat_completion(hi):
    r = hi.client().chat.completions.create(model="x", messages=USER, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ANSWER and c.finish_reason == "stop"
    n_prompt = len(hi.llm.chat_tokens(USER))
    assert r.object == "chat.completion" and r.model == "test-model" and r.id.startswith("chatcmpl-")
    # 5 text tokens and the end-of-sequence token, as llama.cpp counts them
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 6, n_prompt + 6)


def test_chat_stream_with_usage(hi):
    chunks = list(hi.client().chat.completions.create(model="x", messages=USER, temperature=0, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(hi.llm.chat_tokens(USER))


def test_completion(hi):
    r = hi.client().completions.create(model="x", prompt="hello>", temperature=0)
    assert r.choices[0].text == ANSWER and r.choices[0].finish_reason == "stop" and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (lengths(hi.llm, "hello>"), 6)
    # no chain start: the default token until max_tokens
    r = hi.client().completions.create(model="x", prompt="hello", max_tokens=5, temperature=0)
    assert r.choices[0].text == "....." and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_metrics_count_the_steps_wall_time_in_and_around_the_forward_passes(hi):
    """/metrics' qllama:forward_seconds_total and qllama:step_seconds_total grow with a request's
    steps, the steps' time at least that of their forward passes (what bench_server reads)."""
    def counters():
        text = httpx.get(hi.url + "/metrics", timeout=TIMEOUT).text
        values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("qllama:"))
        return float(values["qllama:forward_seconds_total"]), float(values["qllama:step_seconds_total"])

    fw0, st0 = counters()
    steps0 = hi.scheduler.steps
    r = hi.client().completions.create(model="x", prompt="hello>", temperature=0)
    assert r.usage.completion_tokens == 6
    assert hi.scheduler.steps - steps0 >= 6  # (the prompt's step, then one per sampled token but the last)

    def grown():  # (the last step's time is added just after its event went out)
        fw1, st1 = counters()
        return 0 < fw1 - fw0 <= st1 - st0

    hi.wait(grown, "the step counters")


def test_completion_stream_raw_sse_ends_with_done(hi):
    with httpx.stream("POST", hi.url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": "hello>", "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert all(o["object"] == "text_completion" for o in objs)
    assert "".join(o["choices"][0]["text"] for o in objs if o["choices"]) == ANSWER
    assert objs[-2]["choices"][0]["finish_reason"] == "stop" and objs[-1]["usage"]["completion_tokens"] == 6


def test_completion_stream_with_the_client(hi):
    chunks = list(hi.client().completions.create(model="x", prompt="hello>", temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stop, text", [(" the", "Hi!"), (["zzz", "and"], "Hi! the "), ("!", "Hi"), ("H", "")])
def test_stop_strings(hi, stop, text):
    client = hi.client()
    r = client.chat.completions.create(model="x", messages=USER, temperature=0, stop=stop)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="x", prompt="hello>", temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_max_tokens_and_max_completion_tokens(hi):
    client = hi.client()
    r = client.chat.completions.create(model="x", messages=USER, temperature=0, max_tokens=2)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == ("Hi", "length", 2)
    r = client.chat.completions.create(model="x", messages=USER, temperature=0, max_completion_tokens=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hi!", "length")
    r = client.completions.create(model="x", prompt="hello>", max_tokens=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "length", 0)


def test_logprobs_are_the_models_hand_computed_values(hi):
    # the next token's logit is 10 * rmsnorm(one-hot) = 10 / sqrt(1/64 + eps); every other logit is 0
    top = 10.0 / np.sqrt(1.0 / 64 + 1e-5)
    n_vocab = hi.llm.n_vocab
    chosen = -np.log1p((n_vocab - 1) * np.exp(-top))
    r = hi.client().chat.completions.create(model="x", messages=USER, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == ANSWER  # the end-of-sequence token is not in the text
    for t in content:
        assert t.logprob == pytest.approx(chosen, abs=1e-9)
        assert [x.token for x in t.top_logprobs][0] == t.token and len(t.top_logprobs) == 2
        assert t.top_logprobs[1].logprob == pytest.approx(chosen - top, abs=1e-4)
        assert bytes(t.bytes) == t.token.encode()
    chunks = hi.client().chat.completions.create(model="x", messages=USER, temperature=0, logprobs=True,
                                                 stream=True, stop=" the")
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(t.token for t in streamed) == "Hi! the"  # the tokens generated (the stop string's too)
    r = hi.client().completions.create(model="x", prompt="hello>", temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == ANSWER and lp.text_offset == [0, 1, 2, 3, 7]
    assert all(v == pytest.approx(chosen, abs=1e-9) for v in lp.token_logprobs)


def test_sampling_options_and_seed(paths):
    with serve(paths["random"]) as s:
        client = s.client()
        kw = dict(model="x", prompt="the cat", max_tokens=12, temperature=0.9, top_p=0.9, seed=3,
                  extra_body={"top_k": 20, "min_p": 0.01, "repeat_penalty": 1.1})
        a = client.completions.create(**kw).choices[0].text
        b = client.completions.create(**kw).choices[0].text
        others = {client.completions.create(**{**kw, "seed": seed}).choices[0].text for seed in range(4, 9)}
    assert a == b and others != {a}


# -- raw HTTP: errors in OpenAI's shape --------------------------------------------------------------

def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_invalid_json_and_wrong_types_are_400(hi):
    err = error_of(hi.post("/v1/chat/completions", content=b"{not json"), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    for body, param in [({"messages": USER, "max_tokens": "ten"}, "max_tokens"),
                        ({"messages": USER, "temperature": True}, "temperature"),
                        ({"messages": "hello"}, "messages"),
                        ({"messages": USER, "stop": 3}, "stop"),
                        ({"messages": USER, "top_p": 2}, "top_p"),
                        ({"messages": USER, "repeat_penalty": 0}, "repeat_penalty"),
                        ({"messages": USER, "stream_options": []}, "stream_options"),
                        ({"messages": USER, "top_logprobs": 2}, "top_logprobs")]:
        assert error_of(hi.post("/v1/chat/completions", body), 400)["param"] == param, body
    assert error_of(hi.post("/v1/completions", {"max_tokens": 3}), 400)["param"] == "prompt"
    assert error_of(hi.post("/v1/completions", {"prompt": [1, 10**6]}), 400)["param"] == "prompt"
    assert error_of(hi.post("/v1/completions", [1, 2]), 400)["type"] == "invalid_request_error"


def test_content_parts_are_joined_with_newlines_as_llama_cpp_does(hi):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    r = hi.post("/v1/chat/completions", {"messages": parts, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER
    assert r.json()["usage"]["prompt_tokens"] == len(hi.llm.chat_tokens([{"role": "user", "content": "hel\nlo"}]))
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert error_of(hi.post("/v1/chat/completions", {"messages": image}), 400)["param"] == "messages"


def test_n_above_one_is_400(hi):
    with pytest.raises(openai.BadRequestError) as e:
        hi.client().chat.completions.create(model="x", messages=USER, n=2)
    assert e.value.body["param"] == "n"


def test_integral_floats_count_as_integers(hi):
    r = hi.post("/v1/completions", {"prompt": "hello>", "max_tokens": 2.0, "top_k": 40.0, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hi"
    assert error_of(hi.post("/v1/completions", {"prompt": "x", "max_tokens": 2.5}), 400)["param"] == "max_tokens"


def test_unknown_fields_are_ignored(hi):
    r = hi.post("/v1/chat/completions", {"messages": USER, "temperature": 0, "frobnicate": {"a": [1]},
                                         "tools": None, "user": "me"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER


def test_prompt_longer_than_the_context_is_400_naming_both_lengths(paths):
    with serve(paths["hi"], n_ctx=32) as s:
        prompt = "hello " * 40
        n = lengths(s.llm, prompt)
        err = error_of(s.post("/v1/completions", {"prompt": prompt}), 400)
        assert str(n) in err["message"] and "32" in err["message"] and err["type"] == "exceed_context_size_error"
        assert (err["n_prompt_tokens"], err["n_ctx"]) == (n, 32)
        for big in ("hello " * 4000, [{"role": "user", "content": "hello " * 4000}]):  # > 16 KB: tokenized off the loop
            path = "/v1/completions" if isinstance(big, str) else "/v1/chat/completions"
            err = error_of(s.post(path, {"prompt": big} if isinstance(big, str) else {"messages": big}), 400)
            assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] > 4000
        # a prompt that fits but fills the context: the answer stops at the end of the context
        r = s.client().completions.create(model="x", prompt="x" * 28, temperature=0)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 32 + 1


def test_api_key(paths):
    with serve(paths["hi"], api_key="s3cret") as s:
        body = {"messages": USER, "temperature": 0}
        assert error_of(s.post("/v1/chat/completions", body), 401)["type"] == "authentication_error"
        error_of(s.post("/v1/chat/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
        error_of(s.post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "s3cretX"}), 401)
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="nope").chat.completions.create(model="x", messages=USER)
        r = s.client(api_key="s3cret").chat.completions.create(model="x", messages=USER, temperature=0)
        assert r.choices[0].message.content == ANSWER
        assert httpx.get(s.url + "/health").status_code == 200  # public, as in llama.cpp


def test_body_over_1mb_is_413(hi):
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    assert error_of(hi.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    # without a Content-Length (chunked upload) the limit holds while reading
    r = httpx.post(hi.url + "/v1/completions", content=iter([big[:600_000], big[600_000:]]), timeout=TIMEOUT)
    error_of(r, 413)


def test_unknown_route_is_404_in_openai_shape(hi):
    assert error_of(httpx.get(hi.url + "/v1/nothing", timeout=TIMEOUT), 404)["type"] == "not_found_error"


def test_model_without_template_400_on_chat_but_completions_work(paths):
    with serve(paths["plain"]) as s:
        err = error_of(s.post("/v1/chat/completions", {"messages": USER}), 400)
        assert "no chat template" in err["message"]
        assert s.client().completions.create(model="x", prompt="hello>", temperature=0).choices[0].text == ANSWER


def test_chat_template_given_as_a_file(paths, tmp_path):
    tf = tmp_path / "t.jinja"
    tf.write_text(TEMPLATE)
    with serve(paths["plain"], chat_template=str(tf)) as s:
        r = s.client().chat.completions.create(model="x", messages=USER, temperature=0)
        assert r.choices[0].message.content == ANSWER


def test_template_is_rendered_in_the_sandbox(tmp_path):
    path = scripted_model(tmp_path / "evil.gguf", template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with serve(path) as s:
        err = error_of(s.post("/v1/chat/completions", {"messages": USER}), 400)
        assert err["message"].startswith("chat template") and "not allowed" in err["message"]


# -- slots, queue, cancellation, continuous batching ---------------------------------------------------

def open_stream(s, max_tokens=10_000, prompt="hello"):
    """A streaming completion of '.....' (the default token) that runs until closed."""
    cm = httpx.stream("POST", s.url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    r = cm.__enter__()
    lines = r.iter_lines()
    assert next(lines).startswith("data: ")  # it is decoding
    return cm, lines


def test_queue_bound_503_with_retry_after_and_disconnect_frees_the_slot(paths):
    with serve(paths["long"], parallel=1, max_queue=1) as s:
        forward = s.scheduler.forward
        s.scheduler.forward = lambda segments: (time.sleep(0.005), forward(segments))[1]  # the stream outlasts the test
        busy, _ = open_stream(s)
        queued = {}
        t = threading.Thread(target=lambda: queued.setdefault("r", s.client().completions.create(
            model="x", prompt="hello>", temperature=0)))
        t.start()
        s.wait(lambda: s.health()["requests_waiting"] == 1, "the second request to wait")
        r = s.post("/v1/completions", {"prompt": "hello>"})
        assert error_of(r, 503)["type"] == "unavailable_error" and r.headers["retry-after"] == "1"
        busy.__exit__(None, None, None)  # the first client goes away: its slot serves the waiting one
        t.join(TIMEOUT)
        assert queued["r"].choices[0].text == ANSWER
        s.wait(lambda: s.health()["slots_processing"] == 0, "the slot to be free")


def test_a_cancelled_job_leaves_its_slot_at_the_next_step(paths):
    """Scheduler level: the step after cancel() evaluates nothing for that job."""
    from qllama.server.scheduler import Job
    from qllama.server.schemas import GenParams

    llm = qllama.load(paths["hi"], n_threads=1)
    forward, new_cache, _ = model_forward(llm)
    seen = []

    def spy(segments):
        seen.append([len(ids) for ids, _ in segments])
        return forward(segments)

    sched = Scheduler(spy, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=2, chunk=4)
    events = {"a": [], "b": []}
    a = Job([1] + list(range(300, 310)), GenParams(max_tokens=50), events["a"].append)  # 11 tokens
    b = Job([1] + list(range(310, 315)), GenParams(max_tokens=50), events["b"].append)  # 6 tokens
    sched.submit(a)
    sched.submit(b)
    for _ in range(4):
        sched.step()
    # 4 prompt tokens per step in all, oldest job first; a sampling slot adds its one token:
    # a 4+4+3 (then decodes), b 1+4 so far
    assert seen == [[4], [4], [3, 1], [1, 4]]
    a.cancel()
    sched.step()
    assert seen[-1] == [1] and sched.n_busy == 1  # only b ran: its last prompt token
    assert events["a"] and all(e.kind == "text" for e in events["a"])  # no more events after cancel
    assert "".join(e.text for e in events["b"]) == "."  # b's prompt was done at step 5


def test_queue_bound_counts_waiting_jobs_beyond_the_free_slots():
    from qllama.server.scheduler import Job, QueueFull
    from qllama.server.schemas import GenParams

    class Tok:
        eog_ids = frozenset()

    sched = Scheduler(None, lambda: None, Tok(), 64, n_parallel=2, max_queue=0)
    sched.submit(Job([1], GenParams(), print))
    sched.submit(Job([1], GenParams(), print))  # two free slots: no waiting
    with pytest.raises(QueueFull):
        sched.submit(Job([1], GenParams(), print))
    sched._queue[0].cancel()  # a cancelled job no longer counts
    sched.submit(Job([1], GenParams(), print))


def test_mailbox_delivers_a_steps_events_in_order_with_one_wakeup():
    import asyncio

    from qllama.server.app import Mailbox
    from qllama.server.scheduler import Event

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
        box, qa, qb = Mailbox(loop), asyncio.Queue(), asyncio.Queue()
        posts = [(qa, Event("text", text="a1")), (qb, Event("text", text="b1")), (qa, Event("done", text="a2"))]
        worker = threading.Thread(target=lambda: [box.post(q, e) for q, e in posts])
        worker.start()
        worker.join()  # the loop has not run meanwhile: all three wait for one delivery
        await asyncio.sleep(0)
        got_a = [qa.get_nowait().text for _ in range(qa.qsize())]
        got_b = [qb.get_nowait().text for _ in range(qb.qsize())]
        box.post(qb, Event("text", text="b2"))  # the next step schedules a new delivery
        await asyncio.sleep(0)
        return len(wakeups), got_a, got_b, qb.get_nowait().text

    assert asyncio.run(main()) == (2, ["a1", "a2"], ["b1"], "b2")

    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    loop.close()
    for _ in range(2):  # a closed loop: every post fails (none is left waiting for a delivery)
        with pytest.raises(RuntimeError):
            box.post(asyncio.Queue(), Event("text"))


def test_a_failing_step_fails_its_jobs_and_the_loop_goes_on(paths):
    from qllama.server.scheduler import Job
    from qllama.server.schemas import GenParams

    llm = qllama.load(paths["hi"], n_threads=1)
    forward, new_cache, _ = model_forward(llm)
    calls = []

    def flaky(segments):
        calls.append(len(segments))
        if len(calls) == 2:
            raise RuntimeError("boom")
        return forward(segments)

    sched = Scheduler(flaky, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=1, chunk=64)
    first, second = [], []
    sched.submit(Job([1, 300], GenParams(max_tokens=5), first.append))
    sched.step()
    sched.step()  # raises inside forward
    assert first[-1].kind == "error" and "boom" in first[-1].message and sched.n_busy == 0
    sched.submit(Job([1, 300], GenParams(max_tokens=3), second.append))
    while sched.step():
        pass
    assert second[-1].kind == "done" and second[-1].usage.completion_tokens == 3
    assert second[-1].usage.cached_tokens == 0  # the failed slot's cache was dropped


def test_prefix_reuse(hi):
    client = hi.client()
    long_user = [{"role": "user", "content": "tell me about the sea and the sky"}]
    n = len(hi.llm.chat_tokens(long_user))
    client.chat.completions.create(model="x", messages=long_user, temperature=0)
    r = client.chat.completions.create(model="x", messages=long_user, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == n - 1 and r.choices[0].message.content == ANSWER
    longer = long_user + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "more"}]
    # the slot holds the old prompt and the answer's tokens (all but the end-of-sequence token)
    held = hi.llm.chat_tokens(long_user) + [hi.llm.tokenizer.token_id(t) for t in CHAIN[1:-1]]
    ids = hi.llm.chat_tokens(longer)
    common = next(i for i, (x, y) in enumerate(zip(ids, held)) if x != y)
    assert common > len(hi.llm.chat_tokens(long_user))  # part of the answer is reused too
    r = client.chat.completions.create(model="x", messages=longer, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == common and r.choices[0].message.content == ANSWER


def hold_first_step(sched, n):
    """Make the scheduler's first forward pass wait until n requests have arrived, so that they
    surely run side by side (however fast the machine)."""
    forward, held = sched.forward, [True]

    def gated(segments):
        end = time.monotonic() + TIMEOUT
        while held[0] and sched.n_busy + sched.n_waiting < n and time.monotonic() < end:
            time.sleep(0.01)
        held[0] = False
        return forward(segments)

    sched.forward = gated


def test_concurrent_greedy_output_equals_each_request_alone(paths):
    prompts = ["the cat sat", "on the mat and then", "a", "is it the end of the world as we know it"]
    max_tokens = [60, 25, 47, 70]
    with serve(paths["random"], parallel=4, chunk=3) as s:
        got = [None] * len(prompts)
        hold_first_step(s.scheduler, len(prompts))

        def ask(i):
            got[i] = s.client().completions.create(model="x", prompt=prompts[i], max_tokens=max_tokens[i],
                                                   temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert s.scheduler.max_busy >= 2  # they did share steps
        alone = [s.llm.complete(s.llm.tokenize(p, parse_special=True), max_tokens=n, temperature=0)
                 for p, n in zip(prompts, max_tokens)]
    assert got == alone


# -- the command ---------------------------------------------------------------------------------------

def run_cli(args, capsys):
    from qllama.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code, capsys.readouterr().err


def test_serve_without_the_extra_is_one_error_line(paths, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # import uvicorn -> ImportError
    code, err = run_cli(["serve", str(paths["hi"])], capsys)
    assert code == 1 and err == "error: qllama serve needs the server extra: pip install 'qllama[server]'\n"


def test_serve_warns_when_listening_beyond_loopback_without_a_key(tmp_path, capsys):
    from qllama.cli.serve_cmd import security_warning

    assert security_warning("127.0.0.1", None) is None and security_warning("::1", None) is None
    assert security_warning("0.0.0.0", "k") is None and "--api-key" in security_warning("0.0.0.0", None)
    # the warning comes first, before the model is loaded (a missing file here: nothing is bound)
    code, err = run_cli(["serve", str(tmp_path / "missing.gguf"), "--host", "0.0.0.0"], capsys)
    lines = err.splitlines()
    assert code == 1 and lines[0].startswith("warning: listening on 0.0.0.0 without --api-key")
    assert lines[1].startswith("error:") and len(lines) == 2


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_other_families_batched_and_reused_equal_alone(arch, tmp_path):
    """NeoX RoPE and biases (qwen2); a sliding window of 8 with its ring cache (gemma3): batched
    steps, and prompts that share a prefix with what a slot holds, still answer as alone."""
    from tools.make_model import family_spec

    path = tmp_path / f"{arch}.gguf"
    kw = {"sliding_window": 8} if arch == "gemma3" else {}
    write_model(path, family_spec(arch, n_embd=64, n_layer=2, n_ctx=256, weight_type="q8_0", seed=3, **kw))
    prompts = ["the cat sat on the mat", "the cat sat on the mat and then it", "a dog", "the cat sat on a hat"]
    with serve(path, parallel=2, chunk=5) as s:
        # alone first: it also compiles the kernels (on an empty cache that can take longer than
        # TIMEOUT, and a group still running when the next starts finds no slot to reuse)
        alone = [s.llm.complete(s.llm.tokenize(p, parse_special=True), max_tokens=20, temperature=0) for p in prompts]
        got = [None] * len(prompts)
        cached = [None] * len(prompts)

        def ask(i):
            r = s.client().completions.create(model="x", prompt=prompts[i], max_tokens=20, temperature=0)
            got[i], cached[i] = r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

        # three at once on two slots, then one that finds "the cat sat on" in a slot
        for group in (prompts[:3], prompts[3:]):
            threads = [threading.Thread(target=ask, args=(prompts.index(p),)) for p in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
                assert not t.is_alive(), "a request did not finish in time"
    assert got == alone
    assert cached[3] > len(s.llm.tokenize("the cat sat on")) - 2  # "the cat sat on" came from a slot


def test_a_port_in_use_is_one_clear_error():
    from qllama.cli.serve_cmd import bind_socket
    from qllama.errors import QllamaError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(QllamaError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port).close()
    sock = bind_socket("127.0.0.1", 0)  # port 0: any free port
    assert sock.getsockname()[1] > 0
    sock.close()


def test_a_prompt_sharing_little_goes_to_the_least_recently_used_slot():
    """A prompt that shares only BOS with a slot's long cached history must not overwrite it
    while another slot is idle; one sharing at least half its ids reuses the slot that holds them."""
    from types import SimpleNamespace

    from qllama.server.scheduler import pick_slot

    chat = SimpleNamespace(tokens=[1] + list(range(100, 140)), last_used=7)  # BOS + a long conversation
    idle = SimpleNamespace(tokens=[], last_used=0)
    assert pick_slot([chat, idle], [1, 5, 6, 7]) is idle  # shares BOS only: 1 of 4 ids
    assert pick_slot([chat, idle], [1] + list(range(100, 110)) + [9, 9]) is chat  # 11 of 13 ids
    older = SimpleNamespace(tokens=[1, 2, 3], last_used=3)
    assert pick_slot([chat, older], [1, 8, 8, 8, 8]) is older  # neither is similar: the older one


# -- issue 28: OpenAI's penalties, logit_bias, llama-server's ignore_eos; roles are checked ---------

def test_unknown_roles_and_invalid_message_shapes_are_400(hi):
    for messages, what in [([{"role": "wizard", "content": "hi"}], "role must be one of"),
                           ([{"role": "user"}], "has no 'content'"),
                           ([{"role": "system"}, {"role": "user", "content": "hi"}], "has no 'content'"),
                           (["hi"], "must be an object"),
                           ([{"content": "hi"}], "string 'role'"),
                           ([{"role": "user", "content": 3}], "content must be")]:
        r = hi.post("/v1/chat/completions", {"messages": messages})
        err = error_of(r, 400)
        assert err["type"] == "invalid_request_error" and err["param"] == "messages" and what in err["message"], err
        assert set(r.json()) == {"error"} and err["code"] == 400
    r = hi.post("/v1/chat/completions", {"messages": [{"role": "developer", "content": "be kind"}] + USER,
                                         "temperature": 0})
    assert r.status_code == 200  # OpenAI's newer name of the system role


def test_logit_bias_on_the_server_as_openai_defines_it(hi):
    dot = list(hi.llm.metadata["tokenizer.ggml.tokens"]).index(".")
    # "." gets +100: above the chain's 10 at every step
    r = hi.post("/v1/completions", {"prompt": "hello>", "max_tokens": 4, "temperature": 0, "logit_bias": {str(dot): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "...."
    r = hi.client().chat.completions.create(model="x", messages=USER, temperature=0, max_tokens=3,
                                            logit_bias={str(dot): 100})
    assert r.choices[0].message.content == "..."
    # llama-server's list form, where false bans a token: the default "." banned, the chain still answers
    r = hi.post("/v1/completions", {"prompt": "hello>", "temperature": 0, "logit_bias": [[dot, False]]})
    assert r.json()["choices"][0]["text"] == ANSWER
    for bias, what in [({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"), ({"5": "1"}, "a number"),
                       ({str(10**6): 1}, "out of range"), ([1, 2], "an object")]:
        err = error_of(hi.post("/v1/completions", {"prompt": "hi", "logit_bias": bias}), 400)
        assert err["param"] == "logit_bias" and what in err["message"], (bias, err)


def test_penalties_and_ignore_eos_on_the_server(hi):
    from qllama.server.schemas import parse_completion

    p = parse_completion({"prompt": "x", "presence_penalty": 1.5, "frequency_penalty": -0.5, "ignore_eos": True})
    s = p.params.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.ignore_eos) == (1.5, -0.5, True)
    for key, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("presence_penalty", "1"),
                       ("ignore_eos", 1)]:
        assert error_of(hi.post("/v1/completions", {"prompt": "x", key: value}), 400)["param"] == key
    # the chain ends with </s>; with ignore_eos it is never sampled and generation runs to max_tokens
    r = hi.client().completions.create(model="x", prompt="hello>", temperature=0, max_tokens=9,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 9
    assert r.choices[0].text.startswith(ANSWER) and r.choices[0].text.endswith(".")
    # presence penalty reaches the sampler: "." after "hello" scores 10 x 8 (the final RMSNorm scales the one-hot
    # embedding by sqrt(64)) = 80; repeat_penalty 100 leaves 0.8 (still the argmax against 0), and a presence
    # penalty of 2 takes it to -1.2, below the other tokens' 0
    def first(**extra):
        r = hi.post("/v1/completions", {"prompt": "hello.", "temperature": 0, "max_tokens": 1, "repeat_penalty": 100,
                                        **extra})
        return r.json()["choices"][0]["text"]

    assert first() == "." and first(presence_penalty=2.0) != "." and first(frequency_penalty=2.0) != "."
