"""Generation, in layers: a Session (model + KV cache + the tokens in it) turns prompts into
logits; `stream_generate` turns logits into sampled tokens and tokens into text chunks with
a finish reason and timings. The API and CLI sit on top and never touch the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..errors import ContextOverflowError, QllamaError
from ..models import KVCache, Transformer
from ..qtensor import PROMPT_MIN_TOKENS
from ..runtime.threads import ThreadAdapter, adapter_for
from .sampling import Sampler
from .text import TextOutput

# Why a generation ended.
FINISH_EOG = "eog"  # an end-of-generation token (eos, eot, <|im_end|>...)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_STOP = "stop"  # a stop string appeared (it is not part of the text)
FINISH_CONTEXT = "context"  # the KV cache is full (n_ctx positions)


@dataclass
class Timings:
    """Wall times of one generation (seconds) and token counts, like llama.cpp's perf report."""

    load_s: float = 0.0
    compile_s: float = 0.0  # kernel warm-up before generating (Numba compile, or its cache load)
    prompt_tokens: int = 0  # tokens evaluated for the prompt (cached prefix excluded)
    prompt_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens reused from the KV cache
    gen_tokens: int = 0  # tokens sampled
    gen_s: float = 0.0
    lookup: int = 0  # prompt-lookup drafts per forward (0: off; see qllama.generation.lookup)
    lookup_note: str = ""  # why lookup did not draft, if it did not
    draft_tokens: int = 0  # tokens drafted from n-gram matches
    draft_accepted: int = 0  # drafts the model agreed with
    gen_forwards: int = 0  # forward passes while generating with lookup
    draft_forwards: int = 0  # of those, the ones that verified drafts (the rest: one-token steps)
    decode_threads: str = ""  # the adaptive thread count's state after generating (qllama.runtime.threads); "" if fixed

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0

    def report(self) -> str:
        """Two lines in llama.cpp's style."""
        def line(label: str, s: float, n: int, unit: str) -> str:
            per = 1000.0 * s / n if n else 0.0
            tps = n / s if s > 0 else 0.0
            return f"{label} {1000.0 * s:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

        lines = [f"load time        = {1000.0 * self.load_s:10.2f} ms"]
        if self.compile_s:
            lines.append(f"warm-up time     = {1000.0 * self.compile_s:10.2f} ms (kernel compile or cache load)")
        lines.append(line("prompt eval time =", self.prompt_s, self.prompt_tokens, "tokens"))
        lines.append(line("       eval time =", self.gen_s, self.gen_tokens, "runs  "))
        if self.cached_tokens:
            lines.append(f"(reused {self.cached_tokens} cached prompt tokens)")
        if self.lookup:
            rate = 100.0 * self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0
            per = self.gen_tokens / self.gen_forwards if self.gen_forwards else 0.0
            lines.append(f"lookup           = {self.draft_accepted} of {self.draft_tokens} drafts accepted ({rate:.1f}%), "
                         f"{per:.2f} tokens per forward ({self.gen_forwards} forwards, {self.draft_forwards} with drafts)")
        elif self.lookup_note:
            lines.append(f"lookup           = {self.lookup_note}")
        if self.decode_threads:
            lines.append(f"decode threads   = {self.decode_threads}")
        return "\n".join(lines)


@dataclass
class Chunk:
    """A piece of generated text, the token ids it came from, and (on the last chunk) why it ended."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share (a cache's tokens and a new prompt)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    """A model with its KV cache and the token sequence the cache holds.

    `prefill` reuses the longest common prefix of the cached tokens and the new prompt, so a
    chat turn evaluates only its new tokens.

    adapt_threads: one-token decode steps pick their thread count from measured step times
    (`qllama.runtime.threads`), between the current Numba thread count (kept for prefill) and fewer;
    False keeps the current count everywhere (an explicit thread count).
    """

    def __init__(self, model: Transformer, batch_size: int = 512, adapt_threads: bool = False):
        if batch_size < 1:
            raise QllamaError("batch size must be >= 1")
        self.model = model
        self.batch_size = batch_size
        # the decode session owns the thread count of its steps: the model's (fixed), or adapted
        self.threads: ThreadAdapter | None = adapter_for(model.n_threads) if adapt_threads else None
        self.cache: KVCache = model.new_cache()
        self.tokens: list[int] = []  # what positions [0, cache.n_past) hold
        # progress(done, total) of a prompt's evaluation: (0, total) first, then after each batch
        # (the CLI draws it on a terminal: qllama.cli.terminal.PromptProgress); None: not called
        self.progress = None

    @property
    def n_ctx(self) -> int:
        return self.cache.n_ctx

    def reset(self) -> None:
        self.cache.rewind(0)
        self.tokens = []

    def prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Make the cache hold exactly `ids`; return (logits of the last token (n_vocab,), tokens evaluated)."""
        if not ids:
            raise QllamaError("the prompt is empty (no tokens)")
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}"
            )
        if self.threads is not None:  # a new request: its first step reads the machine's load again
            self.threads.new_request()
        common = min(common_prefix(self.tokens, ids), len(ids) - 1)  # re-evaluate at least one token to get its logits
        common = self.cache.rewind(common)  # 0 when a sliding-window layer no longer holds what it needs
        self.tokens = list(ids[:common])
        logits = None
        progress = self.progress
        if progress is not None:
            progress(0, len(ids) - common)
        prompt = len(ids) - common >= PROMPT_MIN_TOKENS  # (llama.cpp's prompt arithmetic, every chunk alike)
        for start in range(common, len(ids), self.batch_size):
            batch = ids[start : start + self.batch_size]
            if self.threads is None:
                logits = self.model.forward(batch, self.cache, prompt=prompt)
            else:  # a short batch's regions are as short as a decode step's: it runs at decode's count
                logits = self.threads.run_batch(len(batch), lambda n: self.model.forward(batch, self.cache, n_threads=n,
                                                                                          prompt=prompt))
            self.tokens.extend(batch)
            if progress is not None:
                progress(start + len(batch) - common, len(ids) - common)
        assert logits is not None
        return logits[-1], len(ids) - common

    def decode(self, token: int) -> np.ndarray:
        """Append one token; return its logits (n_vocab,)."""
        if self.threads is None:
            logits = self.model.forward([token], self.cache)
        else:
            logits = self.threads.run(lambda n: self.model.forward([token], self.cache, n_threads=n))
        self.tokens.append(int(token))
        return logits[-1]

    @property
    def full(self) -> bool:
        return self.cache.n_past >= self.n_ctx


class _PlainSteps:
    """The token source of `stream_generate`: one sampled token per one-token forward."""

    def __init__(self, session: Session, sampler: Sampler, logits: np.ndarray):
        self.session, self.sampler, self.logits = session, sampler, logits

    @property
    def full(self) -> bool:
        return self.session.full

    def next_token(self) -> int:
        token = self.sampler.sample(self.logits)
        self.sampler.accept(token)
        return token

    def advance(self, token: int) -> None:
        self.logits = self.session.decode(token)


def stream_generate(
    session: Session,
    tokenizer,
    prompt_ids: list[int],
    sampler: Sampler,
    max_tokens: int = 256,
    stop: Iterable[str] = (),
    timings: Timings | None = None,
    lookup: int = 0,
) -> Iterator[Chunk]:
    """Evaluate the prompt, then sample up to max_tokens tokens, yielding text chunks.

    Multi-byte characters are never split (the tokenizer's streaming decoder holds back
    incomplete UTF-8). Text that may be the start of a stop string is held back until it is
    known not to be one. The last chunk has a finish_reason (possibly with empty text).
    lookup > 0 drafts up to that many tokens per forward from n-gram matches (`qllama.generation.lookup`): the
    same tokens (greedy) or the same distribution (sampling), fewer passes over the weights.
    """
    timings = timings if timings is not None else Timings()
    eog = tokenizer.eog_ids
    if getattr(getattr(sampler, "params", None), "ignore_eos", False):  # as llama.cpp's --ignore-eos: never the end
        sampler.suppress(eog)
        eog = frozenset()
    clock = time.perf_counter

    t0 = clock()
    logits, n_eval = session.prefill(list(prompt_ids))
    timings.prompt_s = clock() - t0
    timings.prompt_tokens = n_eval
    timings.cached_tokens = len(prompt_ids) - n_eval
    for t in prompt_ids:
        sampler.accept(t)
    if lookup:
        from .lookup import LookupSteps

        steps = LookupSteps(session, sampler, logits, list(prompt_ids), lookup, eog, max_tokens, timings)
    else:
        steps = _PlainSteps(session, sampler, logits)

    output = TextOutput(tokenizer, stop)
    reason = None
    t_gen = clock()
    try:
        while True:
            if timings.gen_tokens >= max_tokens:
                reason = FINISH_LENGTH
                break
            token = steps.next_token()
            timings.gen_tokens += 1
            if token in eog:
                reason = FINISH_EOG
                break
            text, ids, stopped = output.feed(token, token)
            if stopped:
                final = Chunk(text, ids, FINISH_STOP)
                break
            if text:
                yield Chunk(text, ids)
            if steps.full:
                reason = FINISH_CONTEXT
                break
            steps.advance(token)
    finally:
        timings.gen_s = clock() - t_gen
        adapter = getattr(session, "threads", None)  # stand-in sessions (tests) may have none
        if adapter is not None:
            timings.decode_threads = adapter.describe()
    if reason is None:  # a stop string
        yield final
        return
    text, ids = output.finish()
    yield Chunk(text, ids, reason)
