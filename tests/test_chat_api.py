"""The chat side of the Python API: `Model.apply_chat_template`, `Model.chat_tokens`, `Model.chat`.

Exact answers and token counts come from the scripted models of test_chat_cli.py (a bigram table:
"<assistant>" -> "Hi!" -> end of turn); that KV-cache reuse gives the same answers as a fresh
evaluation is checked on random models, whose every logit depends on the whole context.
"""

from __future__ import annotations

import pytest

from conftest import shared_path
from test_chat_cli import HE, HI, TEMPLATE, scripted_model, session
from tools.make_model import ModelSpec, write_model

USER = [{"role": "user", "content": "hello"}]
L3 = "llama-3"  # the built-in template the Llama 3 vocabulary model is asked to use


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
    """Random weights with the real Llama 3 vocabulary and no template: chat asks for the llama-3 built-in."""
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
    assert m.chat_tokens(msgs, chat_template=str(bos_template)) == ids
    assert m.chat_tokens(msgs, add_bos=False) == ids[1:]


def test_no_template_is_a_library_error_that_names_no_option(tmp_path):
    """Issue 10.6: library errors never name CLI flags (the CLI adds --chat-template, test_chat_cli.py)."""
    import qllama
    from qllama.chat import NoChatTemplateError

    path = scripted_model(tmp_path / "plain.gguf", HI, template=None)
    m = load(path)
    assert m.chat_template() is None
    for call in (lambda: m.apply_chat_template(USER), lambda: list(m.chat(USER))):
        with pytest.raises(NoChatTemplateError, match="chat needs a chat template and the model has none") as e:
            call()
        assert isinstance(e.value, qllama.errors.QllamaError) and "--" not in str(e.value)
    tf = tmp_path / "t.jinja"
    tf.write_text(TEMPLATE)
    assert "".join(m.chat(USER, chat_template=str(tf))) == "Hi!"


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


def play_cli(path, questions, max_tokens):
    """A conversation as `qllama chat` plays it (ChatSession); per turn (evaluated, reused) and the answers."""
    chat = session(path, max_tokens=max_tokens)
    rows, answers = [], []
    for q in questions:
        answers.append(chat.ask(q))
        t = chat.llm.last_timings
        rows.append((t.prompt_tokens, t.cached_tokens))
    return rows, answers


def play_api(path, questions, max_tokens):
    """The same conversation through Model.chat, the caller keeping the messages."""
    m, msgs = load(path), []
    rows, answers = [], []
    for q in questions:
        msgs.append({"role": "user", "content": q})
        answers.append("".join(m.chat(msgs, max_tokens=max_tokens, temperature=0)))
        t = m.last_timings
        rows.append((t.prompt_tokens, t.cached_tokens))
        msgs.append({"role": "assistant", "content": answers[-1]})
    return rows, answers


def test_model_chat_keeps_the_model_own_answer_tokens_like_the_cli(tmp_path):
    """The "he" model samples h+e; re-tokenized, the answer is the one token "he". Model.chat keeps the
    sampled tokens, as `qllama chat` does: each turn evaluates only its own tokens, the same count."""
    path = scripted_model(tmp_path / "he.gguf", HE)
    questions = ["hello", "again", "once more"]
    api, api_answers = play_api(path, questions, 50)
    cli, cli_answers = play_cli(path, questions, 50)
    assert api == cli and api_answers == cli_answers == ["he"] * 3
    m = load(path)
    sizes, msgs = [], []
    for q in questions:
        msgs.append({"role": "user", "content": q})
        sizes.append(len(m.chat_tokens(msgs)))  # canonical: each earlier answer is 1 token ("he"), not h+e
        msgs.append({"role": "assistant", "content": "he"})
    # the cache holds the prompt as evaluated + h e; each spliced prompt is one token longer per earlier answer
    held1 = sizes[0] + 2
    held2 = (sizes[1] + 1) + 2
    assert api == [(sizes[0], 0), (sizes[1] + 1 - held1, held1), (sizes[2] + 2 - held2, held2)]


def test_model_chat_reuse_equals_the_cli_reuse_on_a_random_model(tmp_path):
    """Random weights (seed 12 samples non-canonical splits): per turn, Model.chat evaluates and reuses
    exactly the tokens `qllama chat` does, and answers the same."""
    path = tmp_path / "random.gguf"
    write_model(path, ModelSpec(n_embd=64, n_layer=2, n_ctx=256, weight_type="f32", chat_template=TEMPLATE, seed=12))
    questions = ["the cat", "and then?", "is the end", "or not"]
    api, api_answers = play_api(path, questions, 8)
    cli, cli_answers = play_cli(path, questions, 8)
    assert api == cli and api_answers == cli_answers
    assert api[0][1] == 0 and all(reused > 0 for _, reused in api[1:])


def test_a_model_with_chat_tokens_but_no_template_runs_as_completion(llama3_path):
    """Issue 12.6: the Llama 3 chat tokens in the vocabulary do not make the file a chat model."""
    m = load(llama3_path)
    ids, fmt = m.prepare_prompt("hello")
    assert ids == m.tokenize("hello") and not fmt.chat and fmt.reason == "none"
    assert str(fmt) == "completion (no chat template): the GGUF has none"
    ids, fmt = m.prepare_prompt("hello", chat_template="llama-3")
    assert ids == m.chat_tokens(USER, chat_template="llama-3") and fmt.reason == "requested"
    assert str(fmt) == "chat template builtin:llama-3 (requested)"


def test_chat_with_a_seed_is_reproducible(random_path):
    m = load(random_path)
    a = "".join(m.chat(USER, max_tokens=8, temperature=1.0, seed=42))
    b = "".join(m.chat(USER, max_tokens=8, temperature=1.0, seed=42))
    assert a == b and a


# -- the real Llama 3 vocabulary and templates (../shared) ------------------------------------------

def test_llama3_builtin_template_and_tokens(llama3_path):
    m = load(llama3_path)
    assert m.chat_template() is None  # issue 12.6: the chat tokens of the vocabulary select nothing
    assert m.chat_template(L3).name == "builtin:llama-3"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "}]
    text = m.apply_chat_template(msgs, chat_template=L3)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = m.chat_tokens(msgs, chat_template=L3)
    tok = m.tokenizer
    bos, eot = tok.token_id("<|begin_of_text|>"), tok.token_id("<|eot_id|>")
    assert ids[0] == bos and ids.count(bos) == 1 and ids.count(eot) == 2
    assert ids[-1] == tok.token_id("ĊĊ") and eot in tok.eog_ids  # "\n\n" then the answer; <|eot_id|> ends it


def test_llama3_chat_equals_completion_of_the_chat_tokens(llama3_path):
    m, fresh = load(llama3_path), load(llama3_path)
    answer = "".join(m.chat(USER, chat_template=L3, max_tokens=6, temperature=0))
    assert answer == fresh.complete(m.chat_tokens(USER, chat_template=L3), max_tokens=6, temperature=0)


def test_llama3_multi_turn_reuse_keeps_the_history_before_the_last_answer(llama3_path):
    """Model.chat re-tokenizes the conversation: the cache keeps at least everything before the last
    answer (the llama-3 template trims answers, so a random answer's edges may be evaluated again)."""
    m = load(llama3_path)
    msgs = []
    for question in ["Hello there, who are you?", "Tell me a story.", "Thanks!"]:
        msgs.append({"role": "user", "content": question})
        answer = "".join(m.chat(msgs, chat_template=L3, max_tokens=6, temperature=0))
        t = m.last_timings
        n = len(m.chat_tokens(msgs, chat_template=L3))
        assert t.cached_tokens + t.prompt_tokens == n
        if len(msgs) > 1:
            n_before_answer = len(m.chat_tokens(msgs[:-2], chat_template=L3))  # the previous turn's prompt
            assert t.cached_tokens >= n_before_answer
            assert t.prompt_tokens <= n - n_before_answer
        msgs.append({"role": "assistant", "content": answer})


def test_shared_llama31_template_file_works_with_chat(llama3_path):
    tf = shared_path("templates", "meta-llama-Llama-3.1-8B-Instruct.jinja")
    m = load(llama3_path)
    text = m.apply_chat_template(USER, chat_template=str(tf))
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = m.chat_tokens(USER, chat_template=str(tf))
    assert ids.count(m.tokenizer.bos_id) == 1 and ids[0] == m.tokenizer.bos_id
    answer = "".join(m.chat(USER, chat_template=str(tf), max_tokens=4, temperature=0))
    assert m.last_timings.gen_tokens <= 4 and isinstance(answer, str)
