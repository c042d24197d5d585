"""Constrained decoding through llguidance: the API, prompt lookup under a grammar, and the server's
`response_format` / `json_schema` / `grammar` driven by the official openai client against
`qllama serve demo` (a tiny Shakespeare model: the constraint alone makes its output valid).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

llguidance = pytest.importorskip("llguidance")

import qllama  # noqa: E402
from qllama.generation.constrained import Constraint, GrammarError, constraint_for, llg_tokenizer  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["glad", "sad", "wroth"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo():
    return qllama.load("demo", n_threads=1)


def check_person(doc: dict) -> None:
    assert set(doc) == {"name", "age", "mood"}
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 16
    assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 150
    assert doc["mood"] in ("glad", "sad", "wroth")


# -- the library ----------------------------------------------------------------------------------

def test_mask_allows_only_what_the_grammar_can_continue(demo):
    tok = demo.tokenizer
    c = Constraint.from_spec(tok, "regex", "(yes|no)")
    ok = c.allowed(tok.n_vocab)
    pieces = {tok.token_bytes(int(i)) for i in ok.nonzero()[0]}
    assert pieces and all(b"yes".startswith(p) or b"no".startswith(p) for p in pieces)
    assert llg_tokenizer(tok) is llg_tokenizer(tok)  # built once per tokenizer


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=0.9, seed=5), dict(temperature=0, lookup=4)])
def test_api_json_schema_output_validates(demo, options):
    text = demo.complete("ROMEO:", max_tokens=80, json_schema=PERSON, **options)
    check_person(json.loads(text))
    assert demo.last_timings.gen_tokens < 80  # the grammar ended it (end of generation), not max_tokens


def test_lookup_under_a_grammar_gives_greedy_output(demo):
    """Drafts are masked row by row: greedy lookup equals plain greedy under the same grammar."""
    grammar = 'root ::= "ROMEO: " [a-z ,]+ "." "\\n" "ROMEO: " [a-z ,]+ "."'
    plain = demo.complete("ROMEO: what, ho!\nROMEO:", max_tokens=60, temperature=0, grammar=grammar)
    fast = demo.complete("ROMEO: what, ho!\nROMEO:", max_tokens=60, temperature=0, grammar=grammar, lookup=6)
    assert plain == fast


def test_response_format_and_grammar_in_the_api(demo):
    out = demo.complete("ROMEO:", max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert out.startswith("{")
    assert demo.complete("ROMEO:", max_tokens=10, temperature=0, grammar='root ::= "yes" | "no"') in ("yes", "no")
    doc = demo.complete("ROMEO:", max_tokens=80, temperature=0,
                        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    check_person(json.loads(doc))


@pytest.mark.parametrize("bad", [dict(json_schema={"type": "bogus"}), dict(regex="(a"), dict(grammar="root ::= [^"),
                                 dict(json_schema={"type": "string", "pattern": "[^\\s\\S]"}),
                                 dict(response_format={"type": "xml"})])
def test_bad_grammars_are_one_error(demo, bad):
    with pytest.raises(GrammarError):
        constraint_for(demo.tokenizer, **bad)


def test_cli_json_schema(tmp_path):
    import subprocess

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(PERSON))
    r = subprocess.run([sys.executable, "-m", "qllama", "run", "demo", "ROMEO:", "-n", "80", "--temp", "0",
                        "--json-schema", str(schema)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    check_person(json.loads(r.stdout))
    grammar = tmp_path / "yn.gbnf"
    grammar.write_text('root ::= ("Yes" | "No") ", my lord."\n')
    r = subprocess.run([sys.executable, "-m", "qllama", "run", "demo", "ROMEO:", "--temp", "0.9", "--grammar", str(grammar)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("Yes, my lord.", "No, my lord.")
    r = subprocess.run([sys.executable, "-m", "qllama", "run", "demo", "ROMEO:", "--json-schema", '{"type": "bogus"}'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error:")


# -- the server, through the openai client ----------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
sys.path.insert(0, os.path.dirname(__file__))
from _serve_cli import ServedCLI  # noqa: E402


@pytest.fixture(scope="module")
def server():
    s = ServedCLI("demo", "--chat-template", "chatml", "-np", "2", "-c", "2048")
    yield s
    s.stop()


def test_parse_with_a_pydantic_model(server):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=150)
        mood: Literal["glad", "sad", "wroth"]

    r = server.client().chat.completions.parse(
        model="demo", messages=[{"role": "user", "content": "Describe Romeo."}], response_format=Person,
        max_tokens=80, temperature=0.7, seed=3)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and r.choices[0].finish_reason == "stop"


def test_json_object_and_streamed_json_schema(server):
    c = server.client()
    r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=120,
                                  temperature=0, response_format={"type": "json_object", "schema": PERSON})
    check_person(json.loads(r.choices[0].message.content))
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=120, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        if ch.choices]
    check_person(json.loads("".join(parts)))


def test_completions_grammar_and_json_schema(server):
    r = server.post("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 20, "temperature": 0,
                                        "grammar": 'root ::= ("yes" | "no") ", my lord"'})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes, my lord", "no, my lord")
    r = server.client().completions.create(model="demo", prompt="ROMEO:", max_tokens=80, temperature=0,
                                           extra_body={"json_schema": PERSON})
    check_person(json.loads(r.choices[0].text))


@pytest.mark.parametrize("body, param", [
    ({"json_schema": {"type": "bogus"}}, "json_schema"),
    ({"grammar": "root ::= [^"}, "grammar"),
    ({"json_schema": {"type": "string", "pattern": "[^\\s\\S]"}}, "json_schema"),  # matches nothing
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_grammars_are_400_and_the_server_goes_on(server, body, param):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == 400 and err["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, extra_body=body)
    assert server.alive()
    ok = server.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_unbounded_integers_get_llama_cpp_s_16_digits():
    from qllama.generation.constrained import bound_integers

    s = bound_integers({"type": "object", "properties": {"n": {"type": "integer"}, "k": {"type": "integer", "minimum": 0},
                                                         "e": {"type": "integer", "enum": [1, 2]}}})
    assert s["properties"]["n"] == {"type": "integer", "minimum": -(10 ** 16 - 1), "maximum": 10 ** 16 - 1}
    assert s["properties"]["k"] == {"type": "integer", "minimum": 0, "maximum": 10 ** 16 - 1}
    assert s["properties"]["e"] == {"type": "integer", "enum": [1, 2]}


VOCABS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "vocab")


@pytest.mark.parametrize("name", ["falcon", "gpt-2", "llama-bpe", "llama-spm", "starcoder"])
def test_every_tokenizer_kind_gives_valid_json(name):
    """llguidance's view of each vocabulary kind (BPE and SentencePiece): a walk driven by random
    logits under a schema decodes to JSON that validates."""
    import numpy as np

    from qllama.tokenizer import load_tokenizer

    path = os.path.join(VOCABS, f"ggml-vocab-{name}.gguf")
    if not os.path.exists(path):
        pytest.skip("../shared/vocab is not here")
    tok = load_tokenizer(path)
    c = Constraint.from_spec(tok, "json_schema", PERSON)
    rng = np.random.default_rng(7)
    out = []
    for _ in range(200):
        logits = rng.standard_normal(tok.n_vocab).astype(np.float32)
        c.mask(logits)
        t = int(np.argmax(logits))
        if t in tok.eog_ids:
            break
        c.advance(t)
        out.append(t)
    assert c.accepting
    check_person(json.loads(tok.decode(out)))
