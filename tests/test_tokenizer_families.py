"""Tokenizers and stopping for Gemma 2/3, Qwen 2/2.5/3 and Phi-3, from their GGUF metadata.

There is no vocabulary of these families in ../shared/vocab, so each test builds a small
vocab-only GGUF the way llama.cpp's converter lays that family out (its conversion/gemma.py,
qwen.py and phi.py), from a real vocabulary plus the family's special tokens:
- Gemma: SentencePiece (`llama`), `add_space_prefix = false`, BOS added, `<bos>`/`<eos>`, and
  `<start_of_turn>` / `<end_of_turn>` control tokens (end of turn found by its text);
- Qwen: byte-level BPE with the `qwen2` pre-tokenizer (digits one by one), no BOS, EOS
  `<|im_end|>`, plus `<|endoftext|>` and `<|im_start|>`;
- Phi-3: SentencePiece with the space prefix, `<|user|>` ... `<|end|>` control tokens, the
  vocabulary padded with unused `[PAD{i}]` tokens, and (for files named "Phi3") llama.cpp's
  strip of the spaces after special tokens.
The default suite checks hand-computed ids; the `oracle` tests run llama.cpp
(llama-cpp-python) on the same files.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import shared_path
from qllama.gguf.reader import GGUFFile
from qllama.tokenizer import TokenAttr, TokenType, load_tokenizer
from test_tokenizer import _llama_cpp_detokenize  # noqa: E402  (tests/ is on sys.path)

CTL, UNUSED = int(TokenType.CONTROL), int(TokenType.UNUSED)


def _base(name: str) -> dict:
    return GGUFFile(shared_path("vocab", f"ggml-vocab-{name}.gguf")).metadata


def _write(path, arch: str, name: str, *, model: str, tokens: list[str], types: list[int],
           scores: list[float] | None = None, merges: list[str] | None = None, pre: str = "default",
           ids: dict[str, int], add_bos: bool, add_space_prefix: bool | None = None) -> str:
    """A vocab-only GGUF with the keys llama.cpp's converter writes."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    for key, tid in ids.items():
        getattr(w, f"add_{key}_token_id")(tid)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _spm_with(extra: list[tuple[str, int]], rename: dict[int, str] | None = None):
    md = _base("llama-spm")
    tokens = list(md["tokenizer.ggml.tokens"])
    for i, text in (rename or {}).items():
        tokens[i] = text
    types = [int(x) for x in md["tokenizer.ggml.token_type"]] + [ty for _, ty in extra]
    scores = [float(x) for x in md["tokenizer.ggml.scores"]] + [-1000.0] * len(extra)  # as the converter
    return tokens + [t for t, _ in extra], types, scores


# Gemma: the Llama 2 pieces with Gemma's special tokens (ids of the synthetic file)
G_PAD, G_SOT, G_EOT, G_UNUSED = 32000, 32001, 32002, 32003


def write_gemma(path, name: str = "Gemma 3 synthetic") -> str:
    tokens, types, scores = _spm_with(
        [("<pad>", CTL), ("<start_of_turn>", CTL), ("<end_of_turn>", CTL), ("<unused0>", CTL)],
        rename={1: "<bos>", 2: "<eos>"})
    return _write(path, "gemma3", name, model="llama", tokens=tokens, types=types, scores=scores,
                  ids={"bos": 1, "eos": 2, "unk": 0, "pad": G_PAD}, add_bos=True, add_space_prefix=False)


# Qwen: the GPT-2 pieces and merges with ChatML tokens, pre-tokenizer qwen2
Q_ENDOFTEXT, Q_IM_START, Q_IM_END = 50256, 50257, 50258


def write_qwen(path) -> str:
    md = _base("gpt-2")
    tokens = list(md["tokenizer.ggml.tokens"]) + ["<|im_start|>", "<|im_end|>"]
    types = [int(x) for x in md["tokenizer.ggml.token_type"]] + [CTL, CTL]
    return _write(path, "qwen2", "Qwen2.5 synthetic", model="gpt2", tokens=tokens, types=types,
                  merges=list(md["tokenizer.ggml.merges"]), pre="qwen2",
                  ids={"bos": Q_ENDOFTEXT, "eos": Q_IM_END, "pad": Q_ENDOFTEXT}, add_bos=False)


# Phi-3: the Llama 2 pieces, Phi-3's added tokens 32000..32010, padded to 32064 with unused tokens
P_ENDOFTEXT, P_ASSISTANT, P_SYSTEM, P_END, P_USER, P_PAD0 = 32000, 32001, 32006, 32007, 32010, 32011
_PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
               "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]


def write_phi3(path, name: str = "Phi3") -> str:
    extra = [(t, CTL) for t in _PHI3_ADDED] + [(f"[PAD{i}]", UNUSED) for i in range(32011, 32064)]
    tokens, types, scores = _spm_with(extra)
    return _write(path, "phi3", name, model="llama", tokens=tokens, types=types, scores=scores,
                  ids={"bos": 1, "eos": P_ENDOFTEXT, "unk": 0, "pad": P_ENDOFTEXT}, add_bos=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("families")
    return {"gemma": write_gemma(d / "gemma.gguf"), "qwen": write_qwen(d / "qwen.gguf"),
            "phi3": write_phi3(d / "phi3.gguf"), "phi3.5": write_phi3(d / "phi35.gguf", "Phi 3.5 Mini Instruct")}


# -- Gemma --------------------------------------------------------------------------------------

def test_gemma_spm_without_space_prefix(files):
    t = load_tokenizer(files["gemma"])
    assert (t.model, t.add_space_prefix, t.add_bos, t.bos_id, t.eos_id) == ("llama", False, True, 1, 2)
    assert t.encode("Hello world") == [10994, 3186]  # "Hello" (no "▁"), "▁world"
    assert t.encode("Hello world", add_bos=True) == [1, 10994, 3186]
    # a turn: no "▁" before the text, nor after a special token
    turn = "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    assert t.encode(turn, parse_special=True) == [G_SOT, 1792, 13, 10994, G_EOT, 13, G_SOT, 4299, 13]
    assert G_EOT not in t.encode(turn)  # control tokens are matched only with parse_special
    # Gemma's chat template writes "<bos>" itself: one BOS, not two
    assert t.encode("<bos>" + turn, add_bos=True, parse_special=True) == [1, *t.encode(turn, parse_special=True)]
    assert t.decode([10994, 3186]) == "Hello world"
    assert t.decode([3186]) == " world"  # no leading-space strip without the space prefix


def test_gemma_specials_and_end_of_generation(files):
    t = load_tokenizer(files["gemma"])
    assert t.eot_id == G_EOT and t.is_control(G_EOT)  # found by its text, as llama.cpp does
    assert t.eog_ids == frozenset({2, G_EOT})  # <eos> and <end_of_turn>; not <pad>, not <start_of_turn>
    assert t.attr(G_UNUSED) & TokenAttr.UNUSED  # control tokens named "unused"
    assert t.decode([10994, G_EOT]) == "Hello" and t.decode([10994, G_EOT], special=True) == "Hello<end_of_turn>"


def test_many_special_tokens_are_found_like_one_search_each(files):
    # real Gemma files have thousands of "<unusedN>" tokens: the partition then finds the ones a
    # text holds by their first characters; it must pick exactly the tokens a search per token finds
    from qllama.tokenizer import Tokenizer

    user = int(TokenType.USER_DEFINED)
    many = [(f"<unused{i}>", CTL) for i in range(1, 400)] + [(f"<h{i}>", user) for i in range(80)]
    many += [("\n\n\n", user), ("zq", user)]
    md = dict(GGUFFile(files["gemma"]).metadata)
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [t for t, _ in many]
    md["tokenizer.ggml.token_type"] = np.concatenate([md["tokenizer.ggml.token_type"], [ty for _, ty in many]])
    md["tokenizer.ggml.scores"] = np.concatenate([md["tokenizer.ggml.scores"], np.zeros(len(many), np.float32)])
    t = Tokenizer.from_metadata(md)
    rng = np.random.default_rng(5)
    alphabet = list("<>/\nzqhun1 ab") + ["<unused1", "<h7>", "<unused12>", "<unused399>", "<h79>", "<end_of_turn>"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 30))))
        for parse_special in (False, True):
            cuts = t._cuts[parse_special]
            assert len(cuts.cuts) > cuts._MANY
            assert cuts.occurring_in(text) == [c for c in cuts.cuts if c[1] in text], text
    first = 32000 + 4
    assert t.encode("a<h7>b<unused12>", parse_special=True) == [29874, first + 399 + 7, 29890, first + 11]


# -- Qwen ---------------------------------------------------------------------------------------

def test_qwen2_pretokenizer_and_chatml(files):
    t = load_tokenizer(files["qwen"])
    assert (t.model, t.pre.name, t.add_bos, t.clean_spaces) == ("gpt2", "qwen2", False, False)
    assert t.encode("Hello world") == [15496, 995]
    assert t.encode("x 123") == [87, 220, 16, 17, 18]  # digits one by one ("Ġ123" is a GPT-2 token)
    assert load_tokenizer(shared_path("vocab", "ggml-vocab-gpt-2.gguf")).encode("x 123") == [87, 17031]
    turn = "<|im_start|>user\nHi<|im_end|>\n"
    assert t.encode(turn, parse_special=True) == [Q_IM_START, 7220, 198, 17250, Q_IM_END, 198]
    assert t.encode("Hi", add_bos=True) == [17250]  # Qwen adds no BOS
    assert t.decode(t.encode("Hi .")) == "Hi ."  # no clean-up of spaces for qwen2


def test_qwen_end_of_generation(files):
    t = load_tokenizer(files["qwen"])
    assert t.eos_id == Q_IM_END
    assert t.eog_ids == frozenset({Q_ENDOFTEXT, Q_IM_END})  # <|im_start|> is control but does not stop
    assert t.is_control(Q_IM_START) and t.decode([Q_IM_START, 17250]) == "Hi"


# -- Phi-3 --------------------------------------------------------------------------------------

def test_phi3_spm_strips_spaces_after_specials(files):
    t = load_tokenizer(files["phi3"])
    assert (t.model, t.add_space_prefix, t.add_bos, t.n_vocab) == ("llama", True, False, 32064)
    chat = "<|user|>\nHi<|end|>\n<|assistant|>"
    # llama.cpp marks Phi-3's special tokens RSTRIP when general.name has "phi3"/"phi-3": the
    # "\n" after each goes, and the fragment "Hi" gets the space prefix: "▁Hi"
    assert t.encode(chat, parse_special=True) == [P_USER, 6324, P_END, P_ASSISTANT]
    # other names keep them: " \nHi" is "▁", "\n", "Hi"
    t35 = load_tokenizer(files["phi3.5"])
    assert t35.encode(chat, parse_special=True) == [P_USER, 29871, 13, 18567, P_END, 29871, 13, P_ASSISTANT]
    assert t.encode("Hi", add_bos=True) == [6324]  # add_bos_token = false in this file


def test_phi3_end_of_generation(files):
    t = load_tokenizer(files["phi3"])
    assert t.eog_ids == frozenset({2, P_ENDOFTEXT, P_END})  # </s>, <|endoftext|>, <|end|>
    assert t.attr(P_PAD0) & TokenAttr.UNUSED and t.decode([P_PAD0]) == ""
    assert P_USER not in t.eog_ids and P_SYSTEM not in t.eog_ids


# -- stopping -----------------------------------------------------------------------------------

class _Scripted:
    """A stand-in for generate.Session whose logits force a given token sequence."""

    def __init__(self, n_vocab: int, script: list[int]):
        self.n_vocab, self.script, self.step, self.decoded = n_vocab, script, 0, []
        self.full = False

    def _logits(self) -> np.ndarray:
        logits = np.zeros(self.n_vocab, dtype=np.float32)
        logits[self.script[self.step]] = 1.0
        self.step += 1
        return logits

    def prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        return self._logits(), len(ids)

    def decode(self, token: int) -> np.ndarray:
        self.decoded.append(token)
        return self._logits()


def _generate(t, script: list[int]):
    from qllama.generation.session import stream_generate
    from qllama.generation.sampling import Sampler, SamplingParams

    session = _Scripted(t.n_vocab, script)
    chunks = list(stream_generate(session, t, [1], Sampler(SamplingParams(temperature=0.0)), max_tokens=10))
    return "".join(c.text for c in chunks), chunks[-1].finish_reason, session.decoded


@pytest.mark.parametrize("family, text_ids, stops, passes", [
    ("gemma", [10994, 3186], [2, G_EOT], [G_SOT, G_PAD]),
    ("qwen", [15496, 995], [Q_ENDOFTEXT, Q_IM_END], [Q_IM_START]),
    ("phi3", [15043, 3186], [2, P_ENDOFTEXT, P_END], [P_USER, P_ASSISTANT]),
])
def test_every_end_of_generation_token_stops(files, family, text_ids, stops, passes):
    t = load_tokenizer(files[family])
    for eog in stops:
        text, reason, decoded = _generate(t, [*text_ids, eog, 3186, 3186])
        assert reason == "eog" and decoded == text_ids, t.token_text(eog)
        assert text.strip() == "Hello world"  # the end token prints nothing
    for other in passes:  # control tokens that do not end a turn keep going
        text, reason, decoded = _generate(t, [*text_ids, other, *[3186] * 10])
        assert reason == "length" and other in decoded, t.token_text(other)


# -- llama.cpp on the same files -----------------------------------------------------------------

def _texts(rng) -> list[str]:
    specials = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>",
                "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>", "[PAD32020]", "<unused0>"]
    alphabet = list("aZ09 \t\n'.,!?<>|") + ["é", "中", "😀", " 123", "Hello", " world", "\n\n", "  "] + specials
    texts = ["<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
             "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi 12345<|im_end|>\n",
             "<|system|>\nBe brief.<|end|>\n<|user|>\n Hi <|end|>\n<|assistant|>\n", "", " ", "\n"]
    return texts + ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(300)]


@pytest.mark.oracle
@pytest.mark.parametrize("family", ["gemma", "qwen", "phi3", "phi3.5"])
def test_against_llama_cpp(files, family):
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=files[family], vocab_only=True, verbose=False)
    vocab = ref._model.vocab
    t = load_tokenizer(files[family])
    rng = np.random.default_rng(11)
    for text in _texts(rng):
        data = text.encode("utf-8")
        for special in (False, True):
            assert t.encode(text, parse_special=special) == ref.tokenize(data, add_bos=False, special=special), \
                (text, special)
        theirs = ref.tokenize(data, add_bos=True, special=True)
        if theirs[:2] == [t.bos_id, t.bos_id]:
            theirs = theirs[1:]  # llama.cpp adds BOS before a text that starts with one (and warns); we don't
        assert t.encode(text, add_bos=True, parse_special=True) == theirs, text
    ours = sorted(t.eog_ids)
    theirs = [i for i in range(t.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    assert ours == theirs
    assert (t.bos_id, t.eos_id) == (llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab))
    controls = [i for i in range(t.n_vocab) if llama_cpp.llama_vocab_is_control(vocab, i)]
    assert [i for i in range(t.n_vocab) if t.is_control(i)] == controls
    for _ in range(300):  # decoding random ids, with and without specials
        ids = [int(i) for i in rng.integers(0, t.n_vocab, size=int(rng.integers(0, 8)))]
        ids += [int(rng.choice(ours))] if rng.random() < 0.5 else []
        for special in (False, True):
            assert t.decode(ids, special=special) == _llama_cpp_detokenize(llama_cpp, ref, ids, special), ids


def write_gemma_size(path, text: str) -> str:
    """A Gemma-sized SPM vocabulary (262,144 tokens): the Gemma file's tokens, 6,000 `<unusedN>`
    control tokens, and new pieces joining two adjacent Llama 2 pieces of `text` (so that merges
    reach them), then of random pairs."""
    tokens, types, scores = _spm_with(
        [("<pad>", CTL), ("<start_of_turn>", CTL), ("<end_of_turn>", CTL)]
        + [(f"<unused{i}>", CTL) for i in range(6000)],
        rename={1: "<bos>", 2: "<eos>"})
    base = load_tokenizer(shared_path("vocab", "ggml-vocab-llama-spm.gguf"))
    ids = base.encode(text)
    rng = np.random.default_rng(3)
    pairs = list(zip(ids, ids[1:])) + list(zip(*rng.integers(259, 32000, size=(2, 1_000_000)).tolist()))
    have = set(tokens)
    for a, b in pairs:
        joined = tokens[a] + tokens[b]
        if tokens[b].startswith("\u2581") or joined in have:
            continue
        have.add(joined)
        tokens.append(joined)
        if len(tokens) == 262144:
            break
    n_new = len(tokens) - len(types)
    types += [int(TokenType.NORMAL)] * n_new
    scores += rng.uniform(-32000.0, 0.0, size=n_new).tolist()
    return _write(path, "gemma3", "Gemma 3 size", model="llama", tokens=tokens, types=types, scores=scores,
                  ids={"bos": 1, "eos": 2, "unk": 0, "pad": G_PAD}, add_bos=True, add_space_prefix=False)


@pytest.mark.oracle
@pytest.mark.slow
def test_gemma_sized_vocabulary_against_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    text = shared_path("models", "shakespeare-val.txt").read_text(encoding="utf-8")[:20000]
    path = write_gemma_size(tmp_path / "gemma-262k.gguf", text)
    ref = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    t = load_tokenizer(path)
    assert t.n_vocab == 262144
    rng = np.random.default_rng(4)
    texts = [text, *_texts(rng)[:100]]
    for s in texts:
        for special in (False, True):
            assert t.encode(s, parse_special=special) == ref.tokenize(s.encode("utf-8"), add_bos=False,
                                                                      special=special), (s[:80], special)
    ids = t.encode(text)
    assert max(ids) >= 32000  # the joined pieces are used
    assert sorted(t.eog_ids) == [i for i in range(t.n_vocab) if llama_cpp.llama_vocab_is_eog(ref._model.vocab, i)]
