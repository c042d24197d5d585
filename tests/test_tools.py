"""Tool calls and reasoning on `qllama serve`: each family's call syntax parsed into OpenAI's
`tool_calls`, forced calls constrained to the functions' schemas (so even the tiny demo model
makes valid calls), full round trips (call -> tool result -> answer) with the official openai
client, streamed calls assembled by the client, and <think> kept apart as reasoning_content.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from qllama.server.tools import ChatPost, call_grammar, detect_format, parse_calls, parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
TEMPLATES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "templates")


def args_of(call) -> dict:
    fn = call["function"] if isinstance(call, dict) else call.function
    return json.loads(fn["arguments"] if isinstance(fn, dict) else fn.arguments)


def check_weather_args(args: dict) -> None:
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 20
    assert args["unit"] in ("C", "F")


# -- parsing each family's syntax --------------------------------------------------------------------

@pytest.mark.parametrize("fmt, text, content", [
    ("hermes", 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>',
     "Let me see."),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}', ""),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}', ""),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}, "id": "abcDEF123"}]', ""),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}, "id": "abcDEF123"}]', ""),
    ("phi4", 'functools[{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}]', ""),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}]}', ""),
    ("generic", '{"tool_call": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}}', ""),
])
def test_native_formats_parse(fmt, text, content):
    got, calls = parse_calls(fmt, text)
    assert got == content and len(calls) == 1
    c = calls[0]
    assert c["type"] == "function" and c["id"] and c["function"]["name"] == "get_weather"
    assert args_of(c) == {"city": "Rome", "unit": "C"}


def test_text_that_is_no_call_stays_content():
    for fmt in ("hermes", "llama3", "mistral", "phi4"):
        assert parse_calls(fmt, "Hello {there}") == ("Hello {there}", [])
    assert parse_calls("generic", '{"response": "Hi"}') == ("Hi", [])
    assert parse_calls("generic", '{"response": "Hi the')[0] == "Hi the"  # cut by max_tokens: the answer so far
    assert parse_calls("hermes", "<tool_call>\n{broken\n</tool_call>")[1] == []


def test_several_calls_and_streaming_holds_them_back():
    text = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    post = ChatPost(fmt="hermes")
    deltas = []
    for ch in text:  # one character at a time: the trigger arrives in pieces
        deltas += post.feed(ch)
    last, calls = post.finish()
    assert "".join(d.get("content", "") for d in deltas + last) == "Checking."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("source, fmt", [("qwen", "hermes"), ("llama31", "llama3"), ("llama32", "llama3"),
                                         ("phi35", "generic"), ("none", "generic")])
def test_format_from_the_template(source, fmt):
    files = {"qwen": "Qwen-Qwen2.5-7B-Instruct.jinja", "llama31": "meta-llama-Llama-3.1-8B-Instruct.jinja",
             "llama32": "meta-llama-Llama-3.2-3B-Instruct.jinja", "phi35": "microsoft-Phi-3.5-mini-instruct.jinja"}
    if source == "none":
        assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") == fmt
        return
    path = os.path.join(TEMPLATES, files[source])
    if not os.path.exists(path):
        pytest.skip("../shared/templates is not here")
    assert detect_format(open(path, encoding="utf-8").read()) == fmt
    assert detect_format("... [TOOL_CALLS] ... tools") == "mistral" and detect_format("functools[ tools") == "phi4"


def test_tool_choice_validation():
    from qllama.server.schemas import ApiError

    assert parse_tools({"tools": [WEATHER]}).choice == "auto"
    req = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                       "parallel_tool_calls": False})
    assert req.choice == "named" and [f["name"] for f in req.chosen()] == ["get_time"] and not req.parallel
    for bad in [{"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tools": [WEATHER], "tool_choice": "sometimes"}, {"tools": [{"type": "code"}]},
                {"tool_choice": "required"}]:
        with pytest.raises(ApiError) as e:
            parse_tools(bad)
        assert e.value.status == 400


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "phi4", "generic"])
def test_forced_call_grammars_compile(fmt):
    pytest.importorskip("llguidance")
    import qllama
    from qllama.generation.constrained import Constraint

    from qllama.hub.refs import resolve

    tok = qllama.load_tokenizer(resolve("demo"))
    req = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    kind, spec = call_grammar(fmt, req, tok)
    Constraint.from_spec(tok, kind, spec).check_start()
    assert call_grammar(fmt, parse_tools({"tools": [WEATHER], "tool_choice": "none"}), tok) is None


def test_reasoning_is_kept_apart():
    assert ChatPost().message("<think>\nLet me think.\n</think>\n\nParis.") == ("\nLet me think.\n", "Paris.", [])
    post = ChatPost()
    post.open_thinking()  # DeepSeek-R1's template opens <think> in the prompt
    assert post.message("Hmm.</think>Paris.") == ("Hmm.", "Paris.", [])
    assert ChatPost(reasoning=False).message("<think>x</think>y") == (None, "<think>x</think>y", [])
    assert ChatPost().message("No thinking here.") == (None, "No thinking here.", [])


# -- the server, through the openai client ------------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("starlette")
sys.path.insert(0, os.path.dirname(__file__))
from _serve_cli import ServedCLI  # noqa: E402

QWEN = os.path.join(TEMPLATES, "Qwen-Qwen2.5-7B-Instruct.jinja")


@pytest.fixture(scope="module", params=["chatml", "qwen"])
def server(request):
    """The demo model with chatml (no tool support: the generic format) or Qwen 2.5's own template
    (Hermes <tool_call>, tools and tool results rendered by the template)."""
    if request.param == "qwen" and not os.path.exists(QWEN):
        pytest.skip("../shared/templates is not here")
    s = ServedCLI("demo", "--chat-template", "chatml" if request.param == "chatml" else QWEN, "-np", "2", "-c", "2048")
    yield s
    s.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(server, choice):
    c = server.client()
    messages = [{"role": "user", "content": "What is the weather in Verona?"}]
    r = c.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                                  parallel_tool_calls=False, max_tokens=100, temperature=0.7, seed=1)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.id and call.type == "function" and call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather" or isinstance(choice, dict):
        assert call.function.name == "get_weather"
        check_weather_args(json.loads(call.function.arguments))
    messages += [ch.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": "sunny, 21 C"}]
    r2 = c.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, TIME],
                                   parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result were rendered
    ch2 = r2.choices[0]
    if ch2.finish_reason == "tool_calls":  # the tiny model may call again: still a valid call
        assert ch2.message.tool_calls[0].function.name in ("get_weather", "get_time")
    else:
        assert ch2.message.tool_calls is None and ch2.message.content is not None


def test_streamed_tool_calls_are_assembled_by_the_client(server):
    c = server.client()
    with c.chat.completions.stream(model="demo", messages=[{"role": "user", "content": "Weather?"}],
                                   tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                   max_tokens=100, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    check_weather_args(json.loads(call.function.arguments))


def test_auto_answers_or_calls(server):
    r = server.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello"}],
                                                tools=[WEATHER], parallel_tool_calls=False, max_tokens=40, temperature=0)
    ch = r.choices[0]
    if ch.finish_reason == "tool_calls":
        check_weather_args(json.loads(ch.message.tool_calls[0].function.arguments))
    else:
        assert ch.message.tool_calls is None and isinstance(ch.message.content, str)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "often"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400(server, extra, param):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == 400
    assert server.alive()


def test_cli_reasoning_view_dims_or_hides():
    import io

    from qllama.cli.reasoning_view import DIM, RESET, ReasoningView

    class Tty(io.StringIO):
        def isatty(self):
            return True

    text = "<think>Let me see.</think>\n\nParis."
    for out, hide, want in [(io.StringIO(), False, text), (io.StringIO(), True, "Paris."),
                            (Tty(), False, f"{DIM}Let me see.{RESET}Paris."), (Tty(), True, "Paris.")]:
        view = ReasoningView(out, hide=hide)
        for ch in text:
            view.write(ch)
        view.finish()
        got = out.getvalue()
        assert got.replace(RESET + DIM, "") == want


@pytest.mark.parametrize("fmt, free, call, bad", [
    ("hermes", "Let me think about it.", 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     'Sure. <tool_call>\n{"name": "launch"'),
    ("llama3", "Hello there.", '{"name": "get_time", "parameters": {"zone": "CET"}}', '{"name": "launch"'),
    ("mistral", "Hello there.", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}, "id": "abcDEF123"}]',
     '[TOOL_CALLS][{"name": "launch"'),
    ("phi4", "Hello there.", 'functools[{"name": "get_time", "arguments": {"zone": "CET"}}]', 'functools[{"name": "launch"'),
])
def test_auto_is_lazy_free_text_until_the_trigger(fmt, free, call, bad):
    """tool_choice auto in a native format: any text, but from the family's trigger on only valid calls."""
    pytest.importorskip("llguidance")
    import qllama
    from qllama.generation.constrained import Constraint
    from qllama.hub.refs import resolve

    tok = qllama.load_tokenizer(resolve("demo"))
    kind, spec = call_grammar(fmt, parse_tools({"tools": [WEATHER, TIME]}), tok)

    def consumed(text):
        c = Constraint.from_spec(tok, kind, spec)
        ids = tok.encode("\n" + text)[2:]  # no SentencePiece dummy-prefix space: the text as generated
        assert tok.decode(ids) == text
        return c.matcher.try_consume_tokens(ids) == len(ids) and c.matcher.is_accepting()

    assert consumed(free) and consumed(call) and not consumed(bad)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_gpt_oss_channels(step):
    """gpt-oss (harmony): the analysis channel is reasoning, final is content, a commentary message
    to=functions.NAME is a call; markers may arrive in pieces."""
    text = ("<|channel|>analysis<|message|>They ask the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "unit": "C"}<|call|>')
    post = ChatPost(harmony=True)
    deltas = []
    for i in range(0, len(text), step):
        deltas += post.feed(text[i:i + step])
    last, calls = post.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas + last) == "They ask the weather."
    assert "".join(d.get("content", "") for d in deltas + last) == ""
    assert calls[0]["function"]["name"] == "get_weather" and args_of(calls[0]) == {"city": "Rome", "unit": "C"}
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    assert ChatPost(harmony=True).message(answer) == ("Easy.", "Paris.", [])
    assert ChatPost(harmony=True, reasoning=False).message(answer) == (None, answer, [])
    assert detect_format("{% if tools %}...{% endif %}<|start|>assistant<|channel|>final<|message|>") == "harmony"


@pytest.mark.slow
def test_smollm2_structured_output_and_tool_choice():
    """A real instruct model (SmolLM2-135M-Instruct, its own chatml template without tools: the generic
    format) decides by itself: a weather question becomes a call, a haiku request an answer; its
    structured output validates. Greedy, so the same every run."""
    from pydantic import BaseModel

    from tools.fetch_smollm2 import smollm2_or_skip

    path = str(smollm2_or_skip())
    s = ServedCLI(path, "-np", "2", "-c", "2048")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    try:
        c = s.client()

        class City(BaseModel):
            name: str
            country: str

        r = c.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "Give me facts about Paris as JSON."}],
                                     response_format=City, max_tokens=100, temperature=0)
        assert r.choices[0].message.parsed.name == "Paris"
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
                                      tools=tools, max_tokens=100, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Write a haiku about the sea."}],
                                      tools=tools, max_tokens=100, temperature=0)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
        assert "sea" in r.choices[0].message.content
    finally:
        s.stop()


def test_generic_response_streams_as_it_decodes():
    text = '{"response": "Hello, \\"world\\" \\u00e9t\\u00e9\\nmore."}'
    post = ChatPost(fmt="generic")
    deltas = []
    for ch in text:
        deltas += post.feed(ch)
    assert len(deltas) > 10  # streamed, not all at the end
    last, calls = post.finish()
    assert "".join(d.get("content", "") for d in deltas + last) == 'Hello, "world" \u00e9t\u00e9\nmore.' and not calls
    post = ChatPost(fmt="generic")
    assert post.message('{"response": "cut off \\u00') == (None, "cut off ", [])


@pytest.mark.parametrize("name, fmt, call_text, result_text", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "<tool_response>\nsunny\n</tool_response>"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"'),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"'),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}',
     '{"tool_response": {"tool": "get_weather", "response": "sunny"}}'),
])
def test_real_templates_render_tools_calls_and_results(name, fmt, call_text, result_text):
    """The published templates receive `tools`, the assistant's call (arguments as an object) and the
    tool's result, and write them in their own syntax; a template without tool support gets the
    generic fallback's system message."""
    from qllama.chat import ChatTemplate
    from qllama.server.tools import prepare_messages

    path = os.path.join(TEMPLATES, name)
    if not os.path.exists(path):
        pytest.skip("../shared/templates is not here")
    t = ChatTemplate.from_spec(path)
    assert detect_format(t.source) == fmt
    req = parse_tools({"tools": [WEATHER]})
    msgs = [{"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}]
    out = t.render(prepare_messages(msgs, fmt, req), add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                   tools=req.tools if fmt != "generic" else None)
    assert call_text in out and result_text in out and "get_weather" in out.split(call_text)[0]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro\\"me", "n": [1, {"a": "}"}]}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Ro\\"me", "n": [1, {"a": "}"}]}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]}'),
])
def test_streamed_arguments_come_as_they_are_written(fmt, text):
    """OpenAI's streamed calls: the id and name first, then the arguments in pieces; assembled as a
    client does, they equal the parsed calls (same ids)."""
    post = ChatPost(fmt=fmt)
    deltas = []
    for ch in text:
        deltas += post.feed(ch)
    last, calls = post.finish()
    deltas += last
    acc: dict = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            e = acc.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            e["id"] = tc.get("id") or e["id"]
            e["name"] += tc.get("function", {}).get("name", "")
            e["arguments"] += tc.get("function", {}).get("arguments", "")
    assert sum("tool_calls" in d for d in deltas) > 20  # in pieces, not whole at the end
    assert [e["name"] for e in acc.values()] == ["get_weather", "get_time"]
    assert [e["id"] for e in acc.values()] == [c["id"] for c in calls]
    assert [json.loads(e["arguments"]) for e in acc.values()] == [args_of(c) for c in calls]
    assert args_of(calls[0]) == {"city": 'Ro"me', "n": [1, {"a": "}"}]}


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """llama-server's chat_template_kwargs (e.g. Qwen3's enable_thinking) are template variables."""
    from starlette.testclient import TestClient

    import qllama
    from qllama.server.app import ServerState, create_app
    from qllama.server.engine import model_forward
    from qllama.server.scheduler import Scheduler

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m.content }}{% endfor %}"
                   "{% if enable_thinking is defined and not enable_thinking %} no-think{% endif %}")
    llm = qllama.load("demo", n_threads=1)
    forward, new_cache, _ = model_forward(llm)
    sched = Scheduler(forward, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=1)
    sched.start()
    try:
        with TestClient(create_app(ServerState(llm, sched, "demo", chat_template=str(tpl)))) as c:
            def n_prompt(extra):
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ROMEO:"}],
                                                         "max_tokens": 1, **extra})
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens"]
            assert n_prompt({"chat_template_kwargs": {"enable_thinking": False}}) > n_prompt({})
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "chat_template_kwargs": "yes"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        sched.close()
        sched.join(10)


def test_llama_3_1_builtin_tool_calls_parse():
    """After <|python_tag|>, Llama 3.1's built-in tools write `name.call(key=value, ...)`: one call
    with those arguments, as llama.cpp's common/chat.cpp reads it; anything else stays text."""
    from qllama.server.tools import parse_calls

    content, calls = parse_calls("llama3", '<|python_tag|>brave_search.call(query="weather in Paris", n=3)')
    assert content == "" and len(calls) == 1
    assert calls[0]["function"]["name"] == "brave_search"
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "weather in Paris", "n": 3}
    text = "<|python_tag|>brave_search.call(query=open('x'))"  # not a literal: not a call
    assert parse_calls("llama3", text) == (text, [])
