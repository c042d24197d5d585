"""Tokenizers against llama.cpp: its test vectors, its rules for specials/BOS/EOG, and round trips.

The vectors in ../shared/vocab are llama.cpp's own (test-tokenizer-0): every text of every
vocabulary must give exactly the listed ids, without BOS and without special parsing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import shared_path
from qllama.errors import QllamaError, UnsupportedError
from qllama.gguf.reader import GGUFFile
from qllama.tokenizer.pretokenizers import get_pretokenizer, known_pretokenizers
from qllama.tokenizer import (
    TokenAttr,
    TokenType,
    Tokenizer,
    clean_up_spaces,
    load_tokenizer,
)

VOCABS = ["llama-spm", "llama-bpe", "gpt-2", "starcoder", "falcon"]
_CACHE: dict[str, tuple[dict, Tokenizer]] = {}


def vocab(name: str) -> tuple[dict, Tokenizer]:
    """(metadata, tokenizer) of ../shared/vocab/ggml-vocab-NAME.gguf, loaded once per session."""
    if name not in _CACHE:
        gf = GGUFFile(shared_path("vocab", f"ggml-vocab-{name}.gguf"))
        _CACHE[name] = (gf.metadata, Tokenizer.from_gguf(gf))
    return _CACHE[name]


def tok(name: str) -> Tokenizer:
    return vocab(name)[1]


def read_vectors(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's (text, ids) pairs: texts separated by a '__ggml_vocab_test__' line."""
    inp = shared_path("vocab", f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    out = shared_path("vocab", f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""
    texts = texts[:-1]
    lines = out.split("\n")
    if lines[-1] == "":
        lines = lines[:-1]
    assert len(lines) == len(texts)
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


# -- exactness against llama.cpp's vectors --------------------------------------------------

@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(name):
    t = tok(name)
    vectors = read_vectors(name)
    assert len(vectors) >= 40
    bad = [(text, t.encode(text), ids) for text, ids in vectors if t.encode(text) != ids]
    assert not bad, f"{len(bad)} of {len(vectors)} differ, first: {bad[0]!r}"


@pytest.mark.parametrize("name", ["llama-bpe", "gpt-2", "starcoder", "falcon"])
def test_exact_engine_matches_vectors(name):
    # the pure-Python BPE engine (the reference for the tiktoken fast path) is exact on its own
    t = tok(name)
    for text, ids in read_vectors(name):
        assert t._bpe.encode_exact(text) == ids, text


def test_llama3_uses_tiktoken_and_agrees_with_exact_engine_on_a_corpus():
    t = tok("llama-bpe")
    assert t._bpe.uses_tiktoken
    text = shared_path("models", "shakespeare-val.txt").read_text(encoding="utf-8")
    rng = np.random.default_rng(0)
    # plus random mixtures of scripts, digits, punctuation and whitespace runs
    alphabet = list("aZ09 \t\n\r'.,!?-_()[]{}<>|/\\\"") + ["é", "ß", "Ж", "中", "文", "😀", "\u00a0", "\u3000",
                                                          "١", "ǅ", "𝔘", "\u0301", "ﬁ"]
    junk = "".join(rng.choice(alphabet, size=20000))
    for sample in (text, junk):
        assert t.encode(sample) == t._bpe.encode_exact(sample)


def test_gpt2_and_spm_decode_vectors_back():
    for name in ("gpt-2", "llama-bpe"):
        t = tok(name)
        for text, ids in read_vectors(name):
            assert t.decode(ids) == clean_up_spaces(text)  # byte-level BPE is lossless but for clean-up
    t = tok("llama-spm")
    for text, ids in read_vectors("llama-spm"):
        assert t.decode(ids) == text


# -- round trips (property tests) ----------------------------------------------------------

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)
_prop = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_prop
@given(_text)
def test_roundtrip_bpe(s):
    # llama.cpp's exception: BPE vocabularies with clean_spaces rewrite " ." and " 's" when decoding
    t = tok("llama-bpe")
    assert t.clean_spaces
    assert t.decode(t.encode(s)) == clean_up_spaces(s)


@_prop
@given(_text)
def test_roundtrip_spm(s):
    # llama.cpp's exception: a literal "▁" (U+2581) in the text is SentencePiece's space, so it
    # comes back as " ". The dummy-prefix space is stripped again by the decoder.
    t = tok("llama-spm")
    assert t.decode(t.encode(s)) == s.replace("\u2581", " ")


@_prop
@given(_text)
def test_spm_word_split_is_exact(s):
    # the speed trick (encoding "▁word" pieces separately) equals encoding the whole text at once
    spm = tok("llama-spm")._spm
    assert spm.word_split
    escaped = (" " + s).replace(" ", "\u2581")
    assert spm.encode(escaped) == spm._encode(escaped)


@pytest.mark.parametrize("name", ["llama-bpe", "llama-spm", "gpt-2"])
@_prop
@given(data=st.data())
def test_stream_decoder_equals_decode(name, data):
    t = tok(name)
    ids = data.draw(st.one_of(
        st.lists(st.integers(0, t.n_vocab - 1), max_size=30),  # random ids split UTF-8 anywhere
        _text.map(t.encode),
    ))
    dec = t.stream_decoder()
    streamed = "".join(dec.feed(i) for i in ids) + dec.flush()
    assert streamed == t.decode(ids)


def test_stream_decoder_holds_back_incomplete_utf8():
    t = tok("llama-spm")
    euro = [t.token_id(f"<0x{b:02X}>") for b in "€".encode()]
    dec = t.stream_decoder()
    assert [dec.feed(i) for i in euro] == ["", "", "€"]
    assert dec.feed(euro[0]) == "" and dec.flush() == "\ufffd"  # unfinished sequence at the end


def test_stream_decoder_continuation_is_llama_cpp_streaming():
    # generated tokens continue the prompt: no leading-space strip, no clean-up (llama.cpp prints
    # token pieces as they are while generating)
    t = tok("llama-spm")
    ids = t.encode("Hello world")  # [▁Hello, ▁world]
    assert t.decode(ids) == "Hello world"
    for dec in (t.stream_decoder(continuation=True), t.stream_decoder(strip_leading_space=False)):
        assert "".join(dec.feed(i) for i in ids) + dec.flush() == " Hello world"
    t = tok("llama-bpe")
    ids = t.encode("Hi .")
    dec = t.stream_decoder(continuation=True)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == "Hi ." and t.decode(ids) == "Hi."


def test_generated_text_matches_llama_cpp_reference():
    # llama.cpp's greedy continuations of the trained model, as text, from their token ids
    import json

    t = tok("llama-spm")
    ref = json.loads(shared_path("models", "shakespeare-spm-f32.reference.json").read_text())
    for case in ref["greedy"]["cases"]:
        assert t.encode(case["prompt"], add_bos=True) == case["prompt_tokens"]
        dec = t.stream_decoder(continuation=True)
        text = "".join(dec.feed(i) for i in case["greedy_tokens"]) + dec.flush()
        assert text == case["greedy_text"]


# -- decoding rules ----------------------------------------------------------------------------

def test_clean_up_spaces_passes():
    assert clean_up_spaces("Hello , world . Yes ! No ?") == "Hello, world. Yes! No?"
    assert clean_up_spaces("a ' b") == "a'b"
    assert clean_up_spaces("I 'm you 're we 've it 's") == "I'm you're we've it's"
    assert clean_up_spaces("don 't I 'd we 'll") == "don 't I 'd we 'll"  # llama.cpp keeps these
    assert clean_up_spaces("  .") == " ."


def test_decode_specials():
    t = tok("llama-bpe")
    eot = t.token_id("<|eot_id|>")
    ids = t.encode("Hi") + [eot]
    assert t.decode(ids) == "Hi"  # control tokens are not rendered by default
    assert t.decode(ids, special=True) == "Hi<|eot_id|>"
    assert t.is_control(eot) and not t.is_control(ids[0])
    assert t.piece(eot) == "<|eot_id|>" and t.token_bytes(eot) == b""


def test_spm_decode_strips_the_dummy_prefix_like_llama_cpp():
    t = tok("llama-spm")
    assert t.decode([15043, 3186]) == "Hello world"
    # BOS first: llama.cpp's detokenizer spends the strip on the (invisible) BOS
    assert t.decode([t.bos_id, 15043]) == " Hello"
    assert t.decode([t.token_id("<0x20>"), 15043]) == " Hello"  # the byte piece " " was stripped
    assert t.token_bytes(t.token_id("<0x0A>")) == b"\n" and t.piece(t.unk_id) == "<unk>"


def test_bad_ids_raise():
    t = tok("gpt-2")
    with pytest.raises(QllamaError):
        t.decode([t.n_vocab])
    with pytest.raises(QllamaError):
        t.token_bytes(-1)


# -- special tokens, BOS/EOS, EOG ----------------------------------------------------------------

def test_llama3_specials_and_bos():
    t = tok("llama-bpe")
    assert (t.bos_id, t.eos_id, t.add_bos, t.add_eos) == (128000, 128001, True, False)
    assert t.encode("Hello<|eot_id|>") == [9906, 27, 91, 68, 354, 851, 91, 29]
    assert t.encode("Hello<|eot_id|>", parse_special=True) == [9906, 128009]
    assert t.encode("Hello", add_bos=True) == [128000, 9906]
    # never a second BOS when the text already starts with one
    assert t.encode("<|begin_of_text|>Hello", add_bos=True, parse_special=True) == [128000, 9906]
    assert t.eot_id == 128009
    assert {128001, 128009} <= t.eog_ids and 128000 not in t.eog_ids


def test_spm_specials_and_bos():
    t = tok("llama-spm")
    assert (t.bos_id, t.eos_id, t.unk_id, t.add_bos, t.add_eos) == (1, 2, 0, True, False)
    assert t.encode("Hello", add_bos=True) == [1, 15043]
    # after a special token the next fragment gets the dummy-prefix space again
    assert t.encode("<s>Hello</s>", parse_special=True) == [1, 15043, 2]
    assert t.encode("</s>", parse_special=False) == t.encode("</s>")
    assert t.encode("</s>") != [2]
    assert t.eog_ids == frozenset({2})
    assert t.encode("") == [] and t.encode("", add_bos=True) == [1]


def test_gpt2_has_no_bos_by_default():
    t = tok("gpt-2")
    assert t.add_bos is False
    assert t.encode("Hello", add_bos=True) == t.encode("Hello")
    assert t.eog_ids == frozenset({50256})


def _without(md: dict, *keys: str) -> dict:
    return {k: v for k, v in md.items() if k not in keys}


def test_defaults_when_keys_are_absent():
    md = vocab("llama-spm")[0]
    t = Tokenizer.from_metadata(_without(md, "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                                         "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"))
    assert (t.bos_id, t.eos_id, t.add_bos, t.add_eos, t.add_space_prefix) == (1, 2, True, False, True)
    md = vocab("llama-bpe")[0]
    t = Tokenizer.from_metadata(_without(md, "tokenizer.ggml.bos_token_id"))
    assert t.add_bos and t.bos_id == 11  # llama.cpp's BPE default BOS id
    md = vocab("gpt-2")[0]
    t = Tokenizer.from_metadata({**md, "tokenizer.ggml.add_bos_token": True})
    assert t.encode("Hi", add_bos=True)[0] == 50256
    t = Tokenizer.from_metadata({**_without(md, "tokenizer.ggml.bos_token_id"), "tokenizer.ggml.pre": "glm4"})
    assert t.bos_id is None and not t.add_bos  # GLM-4 has no BOS default


def test_add_space_prefix_false():
    md = vocab("llama-spm")[0]
    t = Tokenizer.from_metadata({**md, "tokenizer.ggml.add_space_prefix": False})
    assert t.encode("Hello") == [10994]  # "Hello" without "▁"
    assert t.decode([15043]) == " Hello"  # and no strip when decoding


def _extended_spm(extra: list[tuple[str, int]], **keys) -> Tokenizer:
    """The Llama 2 vocabulary plus extra (text, token type) tokens."""
    md = dict(vocab("llama-spm")[0])
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [t for t, _ in extra]
    md["tokenizer.ggml.token_type"] = np.concatenate(
        [md["tokenizer.ggml.token_type"], np.array([ty for _, ty in extra], dtype=np.int32)])
    md["tokenizer.ggml.scores"] = np.concatenate(
        [md["tokenizer.ggml.scores"], np.zeros(len(extra), dtype=np.float32)])
    md.update(keys)
    return Tokenizer.from_metadata(md)


def test_user_defined_tokens_are_always_matched_control_only_when_parsing():
    t = _extended_spm([("<|user|>", TokenType.USER_DEFINED), ("<|ctl|>", TokenType.CONTROL)])
    user, ctl = 32000, 32001
    assert t.encode("a<|user|>b")[1:2] == [user]  # llama.cpp cuts user-defined text even so
    assert ctl not in t.encode("a<|ctl|>b")
    assert t.encode("a<|ctl|>b", parse_special=True) == [263, ctl, 289]  # "▁a", ctl, "▁b"
    assert t.decode([user]) == "<|user|>" and t.decode([ctl]) == ""


def test_phi3_strips_spaces_after_special_tokens():
    extra = [("<|user|>", TokenType.CONTROL), ("<|end|>", TokenType.CONTROL)]
    plain = _extended_spm(extra)
    phi3 = _extended_spm(extra, **{"general.name": "Phi-3 mini"})
    text = "<|user|>\nHi<|end|> ok"
    assert phi3.encode(text, parse_special=True) == [32000, 6324, 32001, 3431]  # "▁Hi", "▁ok"
    assert plain.encode(text, parse_special=True) != phi3.encode(text, parse_special=True)
    assert 32001 in phi3.eog_ids  # <|end|> ends a turn


def test_eot_detected_by_text_becomes_control():
    t = _extended_spm([("<|im_end|>", TokenType.NORMAL)])
    assert t.eot_id == 32000 and t.is_control(32000) and 32000 in t.eog_ids
    assert t.attr(32000) & TokenAttr.CONTROL


# -- pre-tokenizers ------------------------------------------------------------------------------

def test_pretokenizer_splits():
    assert get_pretokenizer("llama-bpe").split("Hello  world 12345!!\n\n x") == \
        ["Hello", " ", " world", " ", "123", "45", "!!\n\n", " x"]
    assert get_pretokenizer("starcoder").split("ab 12 c") == ["ab", " ", "1", "2", " c"]
    assert get_pretokenizer("gpt-2").split("I'm  ok") == ["I", "'m", " ", " ok"]
    assert get_pretokenizer("qwen2").split("x 123") == ["x", " ", "1", "2", "3"]
    assert get_pretokenizer("falcon").split("1234,5") == ["123", "4", ",", "5"]
    assert get_pretokenizer("deepseek-coder").split("ab12\ncd") == ["ab", "1", "2", "\n", "cd"]
    assert get_pretokenizer("tekken").split("HelloWorld") == ["Hello", "World"]
    # non-ASCII whitespace counts as \s (llama.cpp's whitespace table)
    assert get_pretokenizer("gpt-2").split("a\u3000\u3000\u3000b") == ["a", "\u3000\u3000", "\u3000", "b"]


@pytest.mark.parametrize("pre", known_pretokenizers())
@settings(max_examples=25, deadline=None)
@given(s=_text)
def test_pretokenizer_pieces_cover_the_text(pre, s):
    pieces = get_pretokenizer(pre).split(s)
    assert "".join(pieces) == s and all(pieces)


def test_unknown_pre_warns_once_and_falls_back(capsys):
    md = vocab("gpt-2")[0]
    a = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "no-such-pre"})
    b = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "no-such-pre"})
    err = capsys.readouterr().err
    assert err.count("no-such-pre") == 1 and "warning" in err
    assert a.pre.type == "default"
    default = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "default"})
    s = "Hello, world 12345 ... it's"
    assert a.encode(s) == b.encode(s) == default.encode(s)


# -- errors and loading --------------------------------------------------------------------------

def test_missing_or_unsupported_tokenizer():
    with pytest.raises(QllamaError, match="no tokenizer"):
        Tokenizer.from_metadata({"general.architecture": "llama"})
    for model in ("bert", "t5", "rwkv", "no_vocab"):
        with pytest.raises(UnsupportedError, match=model):
            Tokenizer.from_metadata({"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a"]})


def test_malformed_metadata():
    md = vocab("gpt-2")[0]
    with pytest.raises(QllamaError, match="merges"):
        Tokenizer.from_metadata(_without(md, "tokenizer.ggml.merges"))
    with pytest.raises(QllamaError, match="tokens"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.tokens": [1, 2]})
    with pytest.raises(QllamaError, match="duplicate"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.tokens": ["a", "a"], "tokenizer.ggml.token_type":
                                 np.ones(2, np.int32)})
    with pytest.raises(QllamaError, match="token_type"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.token_type": np.ones(3, np.int32)})
    small = {**_without(md, "tokenizer.ggml.bos_token_id"), "tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"][:5],
             "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"][:5]}
    assert Tokenizer.from_metadata(small).bos_id is None  # the default id 11 is out of range
    with pytest.raises(QllamaError, match="bos_token_id"):
        Tokenizer.from_metadata({**small, "tokenizer.ggml.add_bos_token": True})


def test_load_tokenizer_on_vocab_only_file():
    import qllama

    t = qllama.load_tokenizer(shared_path("vocab", "ggml-vocab-llama-spm.gguf"))
    assert isinstance(t, qllama.Tokenizer) and t.model == "llama" and t.n_vocab == 32000
    assert load_tokenizer(shared_path("vocab", "ggml-vocab-gpt-2.gguf")).model == "gpt2"


# -- llama.cpp itself, when llama-cpp-python is installed ------------------------------------------

def _llama_cpp_detokenize(llama_cpp, ref, ids: list[int], special: bool) -> str:
    import ctypes

    arr = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 * len(ids) + 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(ref._model.vocab, arr, len(ids), buf, size, False, special)
    assert n >= 0
    return buf.raw[:n].decode("utf-8", "replace")


def _assigned_char(rng) -> str:
    # llama.cpp's Unicode table is 15.1; code points assigned later are classified differently
    # by our regex engine (a documented limitation), so draw from those assigned in Unicode 14
    import unicodedata

    while True:
        c = chr(int(rng.integers(0, 0x30000)))
        if unicodedata.category(c) not in ("Cn", "Cs"):
            return c


@pytest.mark.oracle
@pytest.mark.parametrize("name", VOCABS)
def test_against_llama_cpp_live(name):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = shared_path("vocab", f"ggml-vocab-{name}.gguf")
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    t = tok(name)
    rng = np.random.default_rng(1)
    texts = [x for x, _ in read_vectors(name)]
    texts += [shared_path("models", "shakespeare-val.txt").read_text(encoding="utf-8")[:5000]]
    alphabet = list("aZ09 \t\n\r'.,!?<>|/-_") + ["é", "ß", "中", "😀", "\u00a0", "\u3000", "\u0301", "'s", " 'RE",
                                                 "\u2581", "<s>", "</s>", "<|endoftext|>", "<|eot_id|>", "\x00", "\x85"]
    texts += ["".join(rng.choice(alphabet, size=int(rng.integers(0, 60)))) for _ in range(150)]
    texts += ["".join(_assigned_char(rng) for _ in range(int(rng.integers(0, 30)))) for _ in range(150)]
    for text in texts:
        for special in (False, True):
            assert t.encode(text, parse_special=special) == ref.tokenize(
                text.encode("utf-8"), add_bos=False, special=special), (text, special)
        assert t.encode(text, add_bos=True) == ref.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    for _ in range(500):  # decoding random ids, with and without a leading BOS
        ids = [int(i) for i in rng.integers(0, t.n_vocab, size=int(rng.integers(0, 10)))]
        if rng.random() < 0.3 and t.bos_id is not None:
            ids = [t.bos_id, *ids]
        for special in (False, True):
            assert t.decode(ids, special=special) == _llama_cpp_detokenize(llama_cpp, ref, ids, special), ids


def _gpt2_vocab_with_pre(path, pre: str) -> None:
    """The GPT-2 vocabulary written as a vocab-only GGUF whose `tokenizer.ggml.pre` is `pre`."""
    import gguf

    md = vocab("gpt-2")[0]
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types([int(x) for x in md["tokenizer.ggml.token_type"]])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(50256)
    w.add_eos_token_id(50256)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.oracle
@pytest.mark.slow  # ~2 s per family
@pytest.mark.parametrize("pre", known_pretokenizers())
def test_pretokenizer_families_against_llama_cpp(pre, tmp_path):
    # every family's splitting rules, checked by running llama.cpp on the same vocabulary
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / f"{pre}.gguf"
    _gpt2_vocab_with_pre(path, pre)
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    t = load_tokenizer(path)
    rng = np.random.default_rng(2)
    alphabet = list("aZbQ09 \t\n\r'.,!?<>|/-_$+=^~`\"()[]{}") + [
        "é", "ß", "Ж", "中", "文", "😀", "\u00a0", "\u3000", "١", "\u0301", "ǅ", "'s", "'RE", " 's", "…", "。", "，",
        "、", "।", "ﬁ", "Ａ", "！", "‘", "  ", "\n\n", "123456", "µ", "Ω", "ώ", "가"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 50))))
        assert t.encode(text) == ref.tokenize(text.encode("utf-8"), add_bos=False, special=False), text
