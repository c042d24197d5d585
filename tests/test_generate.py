"""The generation loop: stop reasons, stop strings, UTF-8-safe chunks, context limits.

A scripted session makes the model "want" a fixed token sequence, so every expected output
is known by construction.
"""

from __future__ import annotations

import codecs

import numpy as np
import pytest

from qllama.generation.session import (
    FINISH_CONTEXT,
    FINISH_EOG,
    FINISH_LENGTH,
    FINISH_STOP,
    ContextOverflowError,
    Timings,
    stream_generate,
)
from qllama.generation.text import held_back
from qllama.generation.sampling import Sampler, SamplingParams

# token id -> bytes. 5 and 6 are the two halves of "é" (0xC3 0xA9); 7..10 the 4 bytes of an emoji.
VOCAB = {0: b"", 1: b"Hello", 2: b" world", 3: b"!", 4: b"\n", 5: b"\xc3", 6: b"\xa9", 7: b"\xf0", 8: b"\x9f",
         9: b"\x98", 10: b"\x80", 11: b"STOP", 12: b"ST", 13: b"OP", 14: b"</s>"}
EOS = 14


class FakeTokenizer:
    eog_ids = frozenset({EOS})

    def stream_decoder(self, special=False, continuation=False):
        assert continuation  # generated text continues the prompt: keep its first space
        dec = codecs.getincrementaldecoder("utf-8")("replace")

        class D:
            def feed(self, tid):
                return dec.decode(VOCAB[tid])

            def flush(self):
                return dec.decode(b"", final=True)

        return D()


class ScriptedSession:
    """Logits that make `script[i]` the argmax at generation step i."""

    def __init__(self, script, n_ctx=100):
        self.script, self.n_ctx, self.step = list(script), n_ctx, 0
        self.n_past = 0

    def _logits(self):
        lg = np.zeros(len(VOCAB), dtype=np.float32)
        lg[self.script[min(self.step, len(self.script) - 1)]] = 10.0
        return lg

    def prefill(self, ids):
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}")
        self.n_past = len(ids)
        return self._logits(), len(ids)

    def decode(self, token):
        self.n_past += 1
        self.step += 1
        return self._logits()

    @property
    def full(self):
        return self.n_past >= self.n_ctx


def run(script, prompt=(1,), **kw):
    chunks = list(stream_generate(ScriptedSession(script, kw.pop("n_ctx", 100)), FakeTokenizer(), list(prompt),
                                  Sampler(SamplingParams(temperature=0.0)), **kw))
    return "".join(c.text for c in chunks), chunks


def test_stops_on_end_of_generation_token():
    text, chunks = run([1, 2, 3, EOS, 1])
    assert text == "Hello world!" and chunks[-1].finish_reason == FINISH_EOG


def test_stops_on_max_tokens():
    text, chunks = run([1, 2, 2, 2, 2], max_tokens=3)
    assert text == "Hello world world" and chunks[-1].finish_reason == FINISH_LENGTH


def test_stop_string_is_not_printed_even_across_tokens():
    text, chunks = run([1, 12, 13, 2], stop=["STOP"])
    assert text == "Hello" and chunks[-1].finish_reason == FINISH_STOP
    # text that only looked like the start of a stop string is released
    text, _ = run([1, 12, 3, EOS], stop=["STOP"])
    assert text == "HelloST!"


def test_multibyte_characters_are_never_split():
    text, chunks = run([1, 5, 6, 7, 8, 9, 10, EOS])
    assert text == "Helloé\U0001F600"
    assert all("\ufffd" not in c.text for c in chunks)
    # every chunk carries the token ids it came from
    assert [t for c in chunks for t in c.token_ids] == [1, 5, 6, 7, 8, 9, 10]


def test_full_context_stops_with_a_reason():
    text, chunks = run([2] * 50, prompt=[1] * 8, n_ctx=10, max_tokens=100)
    assert chunks[-1].finish_reason == FINISH_CONTEXT
    assert text == " world" * 3  # positions 8, 9 evaluated, third token sampled from the last logits


def test_prompt_longer_than_context_names_both_lengths():
    with pytest.raises(ContextOverflowError, match="12 tokens.*10"):
        run([1], prompt=[1] * 12, n_ctx=10)


def test_timings_are_filled():
    t = Timings()
    run([1, 2, EOS], timings=t)
    assert t.prompt_tokens == 1 and t.gen_tokens == 3 and t.gen_s > 0
    assert "prompt eval time" in t.report() and "tokens per second" in t.report()


def test_held_back_is_the_longest_stop_prefix_suffix():
    assert held_back("abcST", ["STOP"]) == 2
    assert held_back("abcS", ["STOP", "Sx"]) == 1
    assert held_back("abc", ["STOP"]) == 0
