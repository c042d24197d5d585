"""The chat side of the Python API: `Model.apply_chat_template`, `Model.chat_tokens`, `Model.chat`.

Exact answers and token counts come from the scripted models of test_chat_cli.py (a bigram table:
"<assistant>" -> "Hi!" -> end of turn); that KV-cache reuse gives the same answers as a fresh
evaluation is checked on random models, whose every logit depends on the whole context.
"""

from __future__ import annotations

import pytest

from conftest import shared_path
from test_chat_cli import HI, TEMPLATE, scripted_model
from tools.make_model import ModelSpec, write_model

USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def hi_path(tmp_path_factory):
    return scripted_model(tmp_path_factory.mktemp("chatapi") / "hi.gguf", HI)


@pytest.fixture(scope="module")
def random_path(tmp_path_factory):
    """Random weights, tiny vocabulary, the plain-marker template."""
    path = tmp_path_factory.mktemp("chatapi") / "random.gguf"
    write_model(path, ModelSpec(n_embd=64, n_layer=2, n_ctx=256, weight_type="f32", chat_template=TEMPLATE, seed=5))
    return path


@pytest.fixture(scope="module")
def llama3_path(tmp_path_factory):
    """Random weights with the real Llama 3 vocabulary (its chat tokens select the llama-3 built-in)."""
    vocab = shared_path("vocab", "ggml-vocab-llama-bpe.gguf")
    path = tmp_path_factory.mktemp("chatapi") / "llama3.gguf"
    write_model(path, ModelSpec(n_embd=64, n_layer=2, n_ctx=256, weight_type="q8_0", vocab=str(vocab), seed=3))
    return path


def load(path, **kw):
    import qllama

    return qllama.load(path, **kw)


# -- apply_chat_template / chat_tokens ------------------------------------------------------------

def test_apply_chat_template_renders_the_conversation(hi_path):
    m = load(hi_path)
    msgs = [{"role": "system", "content": "S"}, *USER, {"role": "assistant", "content": "Hi!"}]
    assert m.apply_chat_template(msgs) == "<system>S</s><user>hello</s><assistant>Hi!</s><assistant>"
    assert m.apply_chat_template(msgs, add_generation_prompt=False) == "<system>S</s><user>hello</s><assistant>Hi!</s>"
    assert m.apply_chat_template([]) == "<assistant>"


def test_chat_tokens_parse_specials_and_add_bos_once(hi_path, tmp_path):
    m = load(hi_path)
    tok = m.tokenizer
    msgs = USER + [{"role": "assistant", "content": "Hi!"}]
    ids = m.chat_tokens(msgs)
    assert ids == [tok.bos_id] + tok.encode(m.apply_chat_template(msgs), parse_special=True)
    assert ids.count(tok.bos_id) == 1 and ids.count(tok.eos_id) == 2  # "</s>" is the EOS token, not text
    bos_template = tmp_path / "bos.jinja"
    bos_template.write_text("{{ bos_token }}" + TEMPLATE)  # a template that writes BOS itself
    assert m.chat_tokens(msgs, chat_template_file=str(bos_template)) == ids
    assert m.chat_tokens(msgs, add_bos=False) == ids[1:]


def test_no_template_is_an_error_that_names_the_option(tmp_path):
    import qllama

    path = scripted_model(tmp_path / "plain.gguf", HI, template=None)
    m = load(path)
    assert m.chat_template() is None
    for call in (lambda: m.apply_chat_template(USER), lambda: list(m.chat(USER))):
        with pytest.raises(qllama.errors.QllamaError, match="--chat-template"):
            call()
    tf = tmp_path / "t.jinja"
    tf.write_text(TEMPLATE)
    assert "".join(m.chat(USER, chat_template_file=str(tf))) == "Hi!"


# -- Model.chat -----------------------------------------------------------------------------------

def test_chat_streams_text_chunks_and_stops_at_end_of_turn(hi_path):
    m = load(hi_path)
    it = m.chat(USER, max_tokens=50, temperature=0.7, seed=1)
    assert iter(it) is it  # a lazy iterator, not a list
    chunks = list(it)
    assert all(isinstance(c, str) and c for c in chunks) and "".join(chunks) == "Hi!"
    t = m.last_timings
    assert t.gen_tokens == 4 and t.prompt_tokens == len(m.chat_tokens(USER))  # H i ! </s>
    assert "".join(m.chat(USER, max_tokens=2)) == "Hi"  # sampling options are passed through


def test_chat_reuses_the_cache_across_turns(hi_path):
    m = load(hi_path)
    msgs = list(USER)
    held = 0
    for turn, question in enumerate(["hello", "again", "once more", "and again"]):
        if turn:
            msgs.append({"role": "user", "content": question})
        n = len(m.chat_tokens(msgs))
        assert "".join(m.chat(msgs, temperature=0)) == "Hi!"
        t = m.last_timings
        # only the new turn is evaluated: "</s>" + "<user>...</s><assistant>"; the rest comes from the cache
        assert (t.cached_tokens, t.prompt_tokens) == (held, n - held)
        held = n + 3  # the prompt and the answer's H i ! are in the cache
        msgs.append({"role": "assistant", "content": "Hi!"})


def test_cache_reuse_gives_the_answers_of_a_fresh_evaluation(random_path):
    """On a random model every logit depends on the whole context: a wrong reused cache shows."""
    m, fresh = load(random_path), load(random_path)
    msgs = []
    for question in ["the cat", "and the dog?", "then what"]:
        msgs.append({"role": "user", "content": question})
        answer = "".join(m.chat(msgs, max_tokens=8, temperature=0))
        reused = m.last_timings.cached_tokens
        fresh.session.reset()
        assert "".join(fresh.chat(msgs, max_tokens=8, temperature=0)) == answer
        assert fresh.last_timings.cached_tokens == 0
        if len(msgs) > 1:
            assert reused >= len(m.chat_tokens(msgs[:-2]))  # at least the previous prompt: never the whole history
        msgs.append({"role": "assistant", "content": answer})


def test_chat_with_a_seed_is_reproducible(random_path):
    m = load(random_path)
    a = "".join(m.chat(USER, max_tokens=8, temperature=1.0, seed=42))
    b = "".join(m.chat(USER, max_tokens=8, temperature=1.0, seed=42))
    assert a == b and a


# -- the real Llama 3 vocabulary and templates (../shared) ------------------------------------------

def test_llama3_builtin_template_and_tokens(llama3_path):
    m = load(llama3_path)
    assert m.chat_template().name == "builtin:llama-3"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "}]
    text = m.apply_chat_template(msgs)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = m.chat_tokens(msgs)
    tok = m.tokenizer
    bos, eot = tok.token_id("<|begin_of_text|>"), tok.token_id("<|eot_id|>")
    assert ids[0] == bos and ids.count(bos) == 1 and ids.count(eot) == 2
    assert ids[-1] == tok.token_id("ĊĊ") and eot in tok.eog_ids  # "\n\n" then the answer; <|eot_id|> ends it


def test_llama3_chat_equals_completion_of_the_chat_tokens(llama3_path):
    m, fresh = load(llama3_path), load(llama3_path)
    answer = "".join(m.chat(USER, max_tokens=6, temperature=0))
    assert answer == fresh.complete(m.chat_tokens(USER), max_tokens=6, temperature=0)


def test_llama3_multi_turn_reuse_keeps_the_history_before_the_last_answer(llama3_path):
    """Model.chat re-tokenizes the conversation: the cache keeps at least everything before the last
    answer (the llama-3 template trims answers, so a random answer's edges may be evaluated again)."""
    m = load(llama3_path)
    msgs = []
    for question in ["Hello there, who are you?", "Tell me a story.", "Thanks!"]:
        msgs.append({"role": "user", "content": question})
        answer = "".join(m.chat(msgs, max_tokens=6, temperature=0))
        t = m.last_timings
        n = len(m.chat_tokens(msgs))
        assert t.cached_tokens + t.prompt_tokens == n
        if len(msgs) > 1:
            n_before_answer = len(m.chat_tokens(msgs[:-2]))  # the previous turn's prompt
            assert t.cached_tokens >= n_before_answer
            assert t.prompt_tokens <= n - n_before_answer
        msgs.append({"role": "assistant", "content": answer})


def test_shared_llama31_template_file_works_with_chat(llama3_path):
    tf = shared_path("templates", "meta-llama-Llama-3.1-8B-Instruct.jinja")
    m = load(llama3_path)
    text = m.apply_chat_template(USER, chat_template_file=str(tf))
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = m.chat_tokens(USER, chat_template_file=str(tf))
    assert ids.count(m.tokenizer.bos_id) == 1 and ids[0] == m.tokenizer.bos_id
    answer = "".join(m.chat(USER, chat_template_file=str(tf), max_tokens=4, temperature=0))
    assert m.last_timings.gen_tokens <= 4 and isinstance(answer, str)
