"""`qllama chat` and instruct-aware `qllama run`, end to end.

Most tests use *scripted* models: tiny-vocabulary Llama GGUFs whose layers add nothing to the
residual stream (attn_output and ffn_down are zero), so the logits are a lookup on the last
token: a bigram table we choose. After the generation prompt "<assistant>" (whose last token is
the byte ">") such a model answers e.g. "H", "i", "!", then "</s>" (end of turn), with a margin
of 80 logits, whatever the sampling settings. That makes answers, end-of-turn stops and the
number of tokens each turn evaluates exact, hand-checkable values. The KV cache's *contents*
cannot change a scripted model's output, so reuse correctness (same answer with and without
the cache) is checked on random models in test_chat_api.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from tools.make_model import ModelSpec, write_model

# Plain-text role markers; "</s>" (the tiny vocabulary's EOS, a control token) ends each turn.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
GEN_PROMPT_LAST = "<0x3E>"  # ">": not a piece of the tiny vocabulary, so a byte token


def scripted_model(path: Path, chain: list[str], default: str = ".", n_ctx: int = 256,
                   template: str | None = TEMPLATE) -> Path:
    """Write a model whose greedy answer after `chain[0]` is chain[1:], and `default` after any other token.

    `chain` holds token texts as stored in the vocabulary (e.g. [GEN_PROMPT_LAST, "H", "i", "!", "</s>"]).
    """
    from qllama.gguf.reader import GGUFFile

    write_model(path, ModelSpec(n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=64, n_ctx=n_ctx,
                                weight_type="f32", chat_template=template))
    gf = GGUFFile(path)
    tokens = gf.metadata["tokenizer.ggml.tokens"]
    tid = {t: i for i, t in enumerate(tokens)}
    info = {name: (gf.data_offset + t.offset, t.n_elements) for name, t in gf.tensors.items()}
    n_vocab, n_embd = len(tokens), 64
    gf.close()

    def tensor(name: str) -> np.memmap:
        off, n = info[name]
        return np.memmap(path, dtype=np.float32, mode="r+", offset=off, shape=(n,))

    embd = tensor("token_embd.weight").reshape(n_vocab, n_embd)  # (n_vocab, n_embd)
    out = tensor("output.weight").reshape(n_vocab, n_embd)  # (n_vocab, n_embd)
    embd[:] = 0.0
    embd[:, 0] = 1.0  # every token: state 0 ...
    out[:] = 0.0
    out[tid[default], 0] = 10.0  # ... which predicts `default`
    for state, (cur, nxt) in enumerate(zip(chain, chain[1:]), start=1):
        embd[tid[cur]] = 0.0
        embd[tid[cur], state] = 1.0  # one direction per scripted token
        out[tid[nxt], state] = 10.0
    for name in info:  # layers add nothing: the residual stream stays the embedding
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            tensor(name)[:] = 0.0
        elif name.endswith("norm.weight"):
            tensor(name)[:] = 1.0
    for m in (embd, out):
        m.flush()
    return path


HI = [GEN_PROMPT_LAST, "H", "i", "!", "</s>"]  # answers "Hi!"
HE = [GEN_PROMPT_LAST, "h", "e", "</s>"]  # answers "he", sampled as h+e: not the canonical "he" token


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    return {
        "hi": scripted_model(d / "hi.gguf", HI),
        "he": scripted_model(d / "he.gguf", HE),
        "dots": scripted_model(d / "dots.gguf", [], n_ctx=4096),  # "....." until stopped
        "plain": scripted_model(d / "plain.gguf", HI, template=None),  # no chat template
    }


def cli(*args, stdin: str = "", process: bool = False) -> subprocess.CompletedProcess:
    """Run `qllama ARGS` with `stdin` (not a terminal): in a new process, or in this one through
    `qllama.cli.main` (the same code path, without paying Python and Numba start-up each time)."""
    args = [str(a) for a in args]
    if process:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run([sys.executable, "-m", "qllama", *args], input=stdin, capture_output=True,
                              text=True, timeout=300, env=env)
    from qllama.cli import main

    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), io.StringIO(), io.StringIO()
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        out, err = sys.stdout.getvalue(), sys.stderr.getvalue()
        sys.stdin, sys.stdout, sys.stderr = saved
    return subprocess.CompletedProcess(args, code, out, err)


STATS = re.compile(r"\[prompt: (\d+) tokens evaluated, (\d+) reused from the cache")


def stats(stderr: str) -> list[tuple[int, int]]:
    """(evaluated, reused) of each answer, from --verbose output."""
    return [(int(a), int(b)) for a, b in STATS.findall(stderr)]


def conversation_ids(model_path, messages) -> list[int]:
    import qllama

    return qllama.load(model_path).chat_tokens(messages)


def session(model_path, **kw):
    """An in-process ChatSession writing to StringIO buffers."""
    import qllama
    from qllama.cli.chat_cmd import ChatSession

    llm = qllama.load(model_path, n_ctx=kw.pop("n_ctx", None))
    kw.setdefault("sampling", {"temperature": 0.0})
    return ChatSession(llm, out=io.StringIO(), err=io.StringIO(), **kw)


# -- the scripted model itself -------------------------------------------------------------------

def test_scripted_model_answers_as_scripted(models):
    import qllama

    m = qllama.load(models["hi"])
    ids = m.chat_tokens([{"role": "user", "content": "hello"}])
    assert m.tokenizer.token_text(ids[-1]) == GEN_PROMPT_LAST
    got = [t for c in m.stream(ids, max_tokens=10, temperature=1.0, seed=1) for t in c.token_ids]
    assert [m.tokenizer.token_text(t) for t in got] == ["H", "i", "!"]
    assert m.last_timings.gen_tokens == 4  # H i ! and the end-of-turn </s>


# -- qllama run (issue item 3) ----------------------------------------------------------------------

def test_run_wraps_the_prompt_and_stops_at_end_of_turn(models):
    r = cli("run", models["hi"], "hello", "-v", "-n", "50", process=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hi!\n"
    assert "prompt format: chat template gguf" in r.stderr and "stopped: eog" in r.stderr
    n = len(conversation_ids(models["hi"], [{"role": "user", "content": "hello"}]))
    assert f"; {n} prompt tokens" in r.stderr


def test_run_system_prompt_is_part_of_the_wrapped_prompt(models):
    r = cli("run", models["hi"], "hello", "--system", "be brief", "-v")
    assert r.returncode == 0, r.stderr
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert f"; {len(conversation_ids(models['hi'], msgs))} prompt tokens" in r.stderr
    assert r.stdout == "Hi!\n"


def test_run_raw_is_plain_completion(models):
    r = cli("run", models["hi"], "hello", "--raw", "-v", "-n", "5")
    assert r.returncode == 0, r.stderr
    assert "prompt format: completion (--raw)" in r.stderr and "stopped: length" in r.stderr
    assert r.stdout == ".....\n"  # "hello" does not end with the generation prompt
    import qllama

    n = len(qllama.load(models["hi"]).tokenize("hello"))
    assert f"; {n} prompt tokens" in r.stderr


def test_run_without_template_is_completion(models):
    r = cli("run", models["plain"], "hello", "-v", "-n", "3")
    assert r.returncode == 0, r.stderr
    assert "prompt format: completion (no chat template)" in r.stderr and r.stdout == "...\n"
    r = cli("run", models["plain"], "hello", "--system", "x")
    assert r.returncode == 1 and r.stderr.startswith("error:") and "--chat-template" in r.stderr


def test_run_chat_template_file_on_a_model_without_one(models, tmp_path):
    tf = tmp_path / "t.jinja"
    tf.write_text(TEMPLATE)
    r = cli("run", models["plain"], "hello", "--chat-template", tf, "-v")
    assert r.returncode == 0, r.stderr
    assert f"prompt format: chat template file:{tf}" in r.stderr and r.stdout == "Hi!\n"


# -- qllama chat through a pipe (one message per line) -----------------------------------------------

def test_chat_pipe_answers_each_line_and_reuses_the_cache(models):
    r = cli("chat", models["hi"], "-v", stdin="hello\nagain\nand again\n", process=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hi!\nHi!\nHi!\n"
    msgs, sizes = [], []
    for text in ("hello", "again", "and again"):
        msgs.append({"role": "user", "content": text})
        sizes.append(len(conversation_ids(models["hi"], msgs)))
        msgs.append({"role": "assistant", "content": "Hi!"})
    held = [s + 3 for s in sizes]  # the prompt and H i ! are in the cache (the final </s> is not)
    # turn k evaluates exactly its new tokens: "</s>" closing the last answer + "<user>...<assistant>"
    assert stats(r.stderr) == [(sizes[0], 0), (sizes[1] - held[0], held[0]), (sizes[2] - held[1], held[1])]
    assert "loaded <qllama.Model" in r.stderr and "chat template gguf" in r.stderr


def test_chat_keeps_the_model_own_tokens_of_an_answer(models):
    """The "he" model samples h+e; re-tokenized, the answer is the single token "he". The cache keeps
    the sampled tokens, so the next turn still evaluates only its own tokens."""
    r = cli("chat", models["he"], "-v", stdin="hello\nagain\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "he\nhe\n"
    m1 = [{"role": "user", "content": "hello"}]
    m2 = m1 + [{"role": "assistant", "content": "he"}, {"role": "user", "content": "again"}]
    n1, n2 = len(conversation_ids(models["he"], m1)), len(conversation_ids(models["he"], m2))
    # canonical ids are one token shorter (he vs h+e); the cache holds n1 + 2 tokens
    assert stats(r.stderr) == [(n1, 0), (n2 + 1 - (n1 + 2), n1 + 2)]


def test_prompt_ids_splice_gives_the_rendered_text(models):
    chat = session(models["he"])
    assert chat.ask("hello") == "he"
    chat.conv.turns.append({"role": "user", "content": "again"})
    held = list(chat.llm.session.tokens)
    ids = chat.prompt_ids()
    canonical = chat.llm.chat_tokens(chat.conv.messages())
    tok = chat.llm.tokenizer
    assert ids[: len(held)] == held and ids != canonical
    assert [tok.token_text(t) for t in held[-2:]] == ["h", "e"]
    # the same text: only the answer's split differs
    assert tok.decode(ids, special=True) == tok.decode(canonical, special=True)
    assert len(ids) == len(canonical) + 1 and ids[len(held):] == canonical[len(held) - 1:]


def test_prompt_ids_after_an_edit_falls_back_to_the_canonical_ids(models):
    chat = session(models["he"])
    chat.ask("hello")
    chat.conv.turns[0]["content"] = "changed"  # history no longer matches the cache
    chat.conv.turns.append({"role": "user", "content": "again"})
    assert chat.prompt_ids() == chat.llm.chat_tokens(chat.conv.messages())


def test_session_answers_equal_a_fresh_evaluation_of_the_same_prompt(tmp_path):
    """With reused (and spliced) cache contents, a random model, whose every logit depends on the whole
    context, answers exactly as a fresh evaluation of the same prompt ids does."""
    import qllama

    path = tmp_path / "random.gguf"
    write_model(path, ModelSpec(n_embd=64, n_layer=2, n_ctx=256, weight_type="f32", chat_template=TEMPLATE, seed=12))
    chat = session(path, max_tokens=8)
    fresh = qllama.load(path)
    reused, spliced = [], []
    for q in ["the cat", "and then?", "is the end"]:
        chat.conv.turns.append({"role": "user", "content": q})
        ids = chat.prompt_ids()
        spliced.append(ids != chat.llm.chat_tokens(chat.conv.messages()))
        chat.conv.turns.pop()
        answer = chat.ask(q)
        reused.append(chat.llm.last_timings.cached_tokens)
        fresh.session.reset()
        assert answer == fresh.complete(ids, max_tokens=8, temperature=0.0)
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])
    # seed 12 samples non-canonical splits, so the splice is exercised (if make_model changes, pick another seed)
    assert not spliced[0] and any(spliced), spliced


def test_chat_commands_save_load_system_reset(models, tmp_path):
    f1, f2, f3 = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    script = f"hello\n/system be kind\nagain\n/save {f1}\n/reset\n/save {f2}\n/load {f1}\nthird\n/save {f3}\n"
    r = cli("chat", models["hi"], stdin=script)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hi!\nHi!\nHi!\n"
    a = json.loads(f1.read_text())
    assert a == [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello"},
                 {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "again"},
                 {"role": "assistant", "content": "Hi!"}]
    assert json.loads(f2.read_text()) == a[:1]  # /reset keeps the system prompt
    assert json.loads(f3.read_text()) == a + [{"role": "user", "content": "third"}, {"role": "assistant", "content": "Hi!"}]
    for notice in ("[system prompt set]", f"[saved 5 messages to {f1}]", "[the conversation is cleared",
                   f"[loaded 5 messages from {f1}]"):
        assert notice in r.stderr


def test_chat_exit_and_bad_commands_keep_or_end_the_session(models, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"role": "robot", "content": "x"}]')
    script = (f"/load {tmp_path / 'missing.json'}\n/load {bad}\n/bogus\n/save\n"
              "//slash\nline one \\\nline two\n/save " + str(tmp_path / "s.json") + "\n/exit\nnot sent\n")
    r = cli("chat", models["hi"], stdin=script)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hi!\nHi!\n"  # "//slash" and the two-line message; nothing after /exit
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 4 and "missing.json" in errors[0] and "message 0" in errors[1]
    assert "unknown command /bogus" in errors[2] and "/save needs a file name" in errors[3]
    saved = json.loads((tmp_path / "s.json").read_text())
    assert [m["content"] for m in saved if m["role"] == "user"] == ["/slash", "line one \nline two"]


def test_chat_without_template_suggests_chat_template(models, tmp_path):
    r = cli("chat", models["plain"], stdin="hello\n")
    assert r.returncode == 1 and r.stderr.startswith("error:") and "--chat-template" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    tf = tmp_path / "t.jinja"
    tf.write_text(TEMPLATE)
    r = cli("chat", models["plain"], "--chat-template", tf, stdin="hello\n")
    assert r.returncode == 0 and r.stdout == "Hi!\n", r.stderr


def test_chat_template_by_builtin_name(models):
    """--chat-template NAME on a model without a template: the built-in renders the conversation."""
    r = cli("chat", models["plain"], "--chat-template", "zephyr", "-v", "-n", "3", stdin="hello\n")
    assert r.returncode == 0, r.stderr
    assert "prompt format: chat template builtin:zephyr (--chat-template)" in r.stderr
    assert r.stdout == "...\n"  # zephyr's generation prompt ends in "\n", not the scripted ">"
    msgs = [{"role": "user", "content": "hello"}]
    import qllama

    n = len(qllama.load(models["plain"]).chat_tokens(msgs, chat_template="zephyr"))
    assert stats(r.stderr) == [(n, 0)]


@pytest.mark.parametrize("command", ["run", "chat"])
@pytest.mark.parametrize("spec, message", [
    ("vicuna", "error: unknown chat template 'vicuna': neither a built-in name nor a file"),
    ("missing.jinja", "error: no such chat template file: missing.jinja"),
])
def test_unknown_chat_template_is_one_clean_error_listing_the_names(models, command, spec, message):
    r = cli(command, models["hi"], *(["hello"] if command == "run" else []), "--chat-template", spec, stdin="hello\n")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)
    assert "llama-3" in lines[0] and "chatml" in lines[0] and "gemma" in lines[0] and "phi-3" in lines[0]


def test_chat_on_a_model_with_chat_tokens_but_no_template_suggests_the_option(tmp_path):
    from conftest import shared_path

    vocab = shared_path("vocab", "ggml-vocab-llama-bpe.gguf")
    path = tmp_path / "l3.gguf"
    write_model(path, ModelSpec(n_embd=64, n_layer=1, n_ctx=256, weight_type="q8_0", vocab=str(vocab), seed=3))
    r = cli("chat", path, stdin="hello\n")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: chat needs a chat template and the model has none")
    assert "--chat-template NAME (e.g. llama-3, which fits its vocabulary)" in lines[0]


def test_chat_template_that_rejects_the_system_prompt_fails_at_start(models, tmp_path):
    tf = tmp_path / "nosys.jinja"
    tf.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + TEMPLATE)
    r = cli("chat", models["hi"], "--chat-template", tf, "--system", "x", stdin="hello\n")
    assert r.returncode == 1 and r.stderr.startswith("error:") and "no system role" in r.stderr
    # in a session, /system with such a template is refused and the session goes on
    r = cli("chat", models["hi"], "--chat-template", tf, stdin="/system x\nhello\n")
    assert r.returncode == 0 and r.stdout == "Hi!\n" and "no system role" in r.stderr


def test_a_template_error_mid_session_is_reported_and_the_session_goes_on(models, tmp_path):
    tf = tmp_path / "boom.jinja"
    tf.write_text("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom') }}"
                  "{% endif %}{% endfor %}" + TEMPLATE)
    f = tmp_path / "s.json"
    r = cli("chat", models["hi"], "--chat-template", tf, stdin=f"hello\nboom\nagain\n/save {f}\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hi!\nHi!\n" and "error: chat template" in r.stderr and "no boom" in r.stderr
    assert [m["content"] for m in json.loads(f.read_text())] == ["hello", "Hi!", "again", "Hi!"]


def test_run_real_llama3_vocab_without_template_is_completion_unless_asked(tmp_path):
    """Issue 12.6: a GGUF without tokenizer.chat_template runs as completion, even with the Llama 3
    chat tokens in its vocabulary (every Llama 3 base model has them); --chat-template NAME chats."""
    import qllama
    from conftest import shared_path

    vocab = shared_path("vocab", "ggml-vocab-llama-bpe.gguf")
    path = tmp_path / "l3.gguf"
    write_model(path, ModelSpec(n_embd=64, n_layer=1, n_ctx=256, weight_type="q8_0", vocab=str(vocab), seed=3,
                                name="Llama-3.2-1B-Instruct"))
    r = cli("run", path, "hello", "-v", "-n", "3", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "prompt format: completion (no chat template): the GGUF has none; to chat, use --chat-template NAME " \
           "(e.g. llama-3, which fits its vocabulary)" in r.stderr
    assert f"; {len(qllama.load(path).tokenize('hello'))} prompt tokens" in r.stderr
    for name in ("llama-3", "llama3"):
        r = cli("run", path, "hello", "-v", "-n", "3", "--temp", "0", "--chat-template", name)
        assert r.returncode == 0, r.stderr
        assert "prompt format: chat template builtin:llama-3 (--chat-template)" in r.stderr
        n = len(qllama.load(path).chat_tokens([{"role": "user", "content": "hello"}], chat_template="llama-3"))
        assert f"; {n} prompt tokens" in r.stderr


# -- context overflow ------------------------------------------------------------------------------

def test_context_overflow_drops_oldest_turns_and_keeps_the_system_prompt(models):
    chat = session(models["hi"], n_ctx=64, system="sys", max_tokens=8, verbose=True)
    n_ctx = chat.llm.n_ctx
    for i in range(12):
        assert chat.ask(f"q{i}") == "Hi!"
        assert len(chat.llm.session.tokens) <= n_ctx
    err = chat.err.getvalue()
    assert "[the conversation outgrew the context of 64 tokens: dropped the" in err
    assert "(the system prompt is kept)" in err
    msgs = chat.conv.messages()
    assert msgs[0] == {"role": "system", "content": "sys"} and msgs[1]["role"] == "user"
    assert msgs[-2:] == [{"role": "user", "content": "q11"}, {"role": "assistant", "content": "Hi!"}]
    assert "q0" not in [m["content"] for m in msgs]
    # what is left fits with room for an answer; the dropped turns made it shrink to half
    assert len(chat.llm.chat_tokens(msgs)) <= n_ctx - 8
    # after a drop, the cache is reused again on the following turns (not re-evaluated each turn)
    ev = stats(err)
    assert sum(1 for e, r in ev[1:] if r == 0 or e > 20) <= 4 and all(r > 0 for e, r in ev[1:])


def test_a_message_larger_than_the_context_is_refused_and_the_session_goes_on(models):
    chat = session(models["hi"], n_ctx=128, system="sys", max_tokens=8)
    assert chat.ask("hello") == "Hi!"
    assert chat.ask("x" * 200) is None
    assert "do not fit in the context of 128" in chat.err.getvalue()
    assert "dropped" not in chat.err.getvalue()
    assert chat.ask("again") == "Hi!"
    assert [m["content"] for m in chat.conv.turns] == ["hello", "Hi!", "again", "Hi!"]


def test_answer_cut_by_a_full_context(models):
    chat = session(models["dots"], n_ctx=48, max_tokens=-1)
    answer = chat.ask("hello")
    assert set(answer) == {"."} and len(chat.llm.session.tokens) == 48
    assert "the context of 48 tokens is full" in chat.err.getvalue()
    assert chat.ask("again") is not None  # the next turn drops the old one to make room
    assert "dropped the 2 oldest messages" in chat.err.getvalue()


def test_prompt_ids_alignment_by_hand():
    """Hand-made tokens: 0 is a control token; held splits "ab" as a+b and ends in the byte 0x8c
    that, decoded, came back as U+FFFD (3 bytes) in the canonical ids."""
    from qllama.chat import aligned_prefix, prompt_ids

    pieces = {0: b"", 1: b"<u>", 2: b"a", 3: b"b", 4: b"ab", 5: b"\x8c", 6: "\ufffd".encode(), 7: b"q"}
    tb = pieces.__getitem__
    held = [1, 0, 2, 3, 5]  # <u> </s> a b \x8c
    ids = [1, 0, 4, 6, 0, 1, 7, 0]  # <u> </s> ab \ufffd </s> <u> q </s>
    assert aligned_prefix(held, ids, tb) == (4, 3)  # a+b kept; the bytes part at \x8c vs \ufffd
    assert prompt_ids(ids, held, tb) == [1, 0, 2, 3, 6, 0, 1, 7, 0]
    # same runs: taken whole up to the control token after them
    assert aligned_prefix([1, 0, 2, 3], [1, 0, 4, 0, 7], tb) == (4, 3)
    # nothing in common beyond the shared tokens: the canonical ids, unchanged
    assert prompt_ids([7, 0], [1, 0], tb) == [7, 0] and prompt_ids(ids, ids[:3], tb) is ids


def test_drop_oldest_turn_keeps_roles_alternating():
    from qllama.chat import Conversation

    c = Conversation("s", [{"role": "user", "content": "1"}, {"role": "assistant", "content": "a"},
                           {"role": "user", "content": "2"}, {"role": "user", "content": "3"}])
    assert c.drop_oldest_turn() == 2 and [m["content"] for m in c.turns] == ["2", "3"]
    assert c.drop_oldest_turn() == 1 and c.drop_oldest_turn() == 0  # never the pending message
    assert c.messages()[0] == {"role": "system", "content": "s"}


@pytest.mark.parametrize("text, message", [
    ("not json", "not JSON"),
    ('{"messages": 3}', "list of messages"),
    ('[{"role": "user", "content": 3}]', "message 0"),
    ('[{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]', "may only come first"),
])
def test_conversation_json_errors(text, message):
    from qllama.chat import Conversation
    from qllama.errors import QllamaError

    with pytest.raises(QllamaError, match=message):
        Conversation.from_json(text)


# -- the interactive program, driven through a pseudo-terminal ------------------------------------------

def spawn_chat(*args):
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "qllama", "chat", *map(str, args)], env=env,
                          encoding="utf-8", timeout=180, dimensions=(24, 200))
    return pexpect, child


def test_pty_session_typed_messages_commands_and_ctrl_d(models):
    pexpect, child = spawn_chat(models["hi"], "-v")
    try:
        child.expect_exact("/help for commands")
        child.expect_exact("> ")
        child.sendline("hello")
        child.expect_exact("Hi!")
        child.expect(STATS)
        assert int(child.match.group(2)) == 0
        child.expect_exact("> ")
        child.sendline("/system be brief")
        child.expect_exact("[system prompt set]")
        child.expect_exact("> ")
        child.sendline("again")
        child.expect_exact("Hi!")
        child.expect(STATS)
        assert int(child.match.group(2)) > 0  # BOS at least; the system prompt changed the rest
        child.expect_exact("> ")
        child.sendline("and again")
        child.expect_exact("Hi!")
        child.expect(STATS)
        evaluated, reused = int(child.match.group(1)), int(child.match.group(2))
        assert evaluated < reused  # only the new turn
        child.expect_exact("> ")
        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_pty_ctrl_c_stops_the_answer_not_the_session(models, tmp_path):
    saved = tmp_path / "conv.json"
    pexpect, child = spawn_chat(models["dots"])
    try:
        child.expect_exact("> ")
        for text in ("hello", "again"):
            child.sendline(text)
            child.expect_exact("....")  # the answer is streaming
            child.sendintr()  # Ctrl-C
            child.expect_exact("[interrupted]")
            child.expect_exact("> ")
        child.sendintr()  # Ctrl-C at the prompt: a fresh prompt, still running
        child.expect_exact("> ")
        child.sendline(f"/save {saved}")
        child.expect_exact("[saved 4 messages")
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    conv = json.loads(saved.read_text())
    assert [m["role"] for m in conv] == ["user", "assistant"] * 2
    assert [conv[0]["content"], conv[2]["content"]] == ["hello", "again"]
    for m in conv[1::2]:  # the partial answers, well short of the 4096-token context
        assert set(m["content"]) == {"."} and 4 <= len(m["content"]) < 4000
