"""Continuous batching: up to n_parallel requests share each forward step over the weights.

    asyncio side (app.py)                      worker thread (the only user of the model)
    submit(job) ──► waiting queue (bounded) ──► free slot (its own KV cache + the ids it holds)
                                                  │ every step: one segment per busy slot
                                                  │   prefilling: the next chunk of its prompt
                                                  │   decoding:   its last sampled token
                                                  ▼ forward(segments) ─► logits per segment
    job.emit(Event) ◄── text / done / error ◄── sample, detokenize, stop strings

New requests join between steps; prompts are evaluated at most `chunk` tokens per step (all
prompts together, oldest first), so streams that are already decoding keep flowing. A cancelled job (its client went away) leaves its slot
at the next step. A slot keeps the ids its cache holds after its job ends, and a new prompt
goes to the free slot sharing the longest prefix with it, if that prefix is at least half the
prompt (llama.cpp's --slot-prompt-similarity 0.5); only the rest is evaluated. Otherwise it goes
to the least recently used free slot, so that a prompt sharing only BOS does not overwrite a
long cached conversation while an idle slot waits.
Each request has its own Sampler (and RNG), and each segment is evaluated at its own cache
positions, so a request's output does not depend on what else runs beside it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..generation.constrained import constrained_sampler
from ..generation.session import common_prefix
from ..qtensor import PROMPT_MIN_TOKENS
from .schemas import GenParams
from ..generation.text import TextOutput
from .logprobs import TokenLogprob, token_logprob

FINISH_STOP = "stop"  # an end-of-generation token or a stop string
FINISH_LENGTH = "length"  # max_tokens reached or the context is full


class QueueFull(Exception):
    """More requests wait than the queue holds."""


class ShuttingDown(Exception):
    """The scheduler no longer accepts requests."""


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_ms: float = 0.0  # from the job's start in a slot to its first sampled token
    predicted_ms: float = 0.0  # from the first to the last sampled token


@dataclass
class Event:
    """What the worker tells a job's client: new text, the end (with usage), or an error."""

    kind: str  # "text" | "done" | "error"
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    message: str = ""
    status: int = 500  # of an error: 503 when the server is shutting down


class Job:
    """One request: prompt ids, what to generate, and where its events go.

    `emit` is called from the worker thread; the app wraps it to hand events to its event loop.
    """

    def __init__(self, prompt_ids: Sequence[int], params: GenParams, emit: Callable[[Event], None]):
        self.prompt = [int(t) for t in prompt_ids]
        self.params = params
        self.emit = emit
        self.cancelled = False
        self.t_submit = time.perf_counter()

    def cancel(self) -> None:
        """Stop this job at the next step (safe from any thread: a plain flag)."""
        self.cancelled = True


class _Run:
    """A job while it occupies a slot."""

    def __init__(self, job: Job, cached: int, tokenizer, seq: int):
        self.job = job
        self.seq = seq  # admission order: older prompts are evaluated first
        self.pos = cached  # next prompt index to evaluate
        self.cached = cached
        self.sampler = constrained_sampler(job.params.sampling, job.params.constraint)  # a plain Sampler without one
        if job.params.sampling.ignore_eos:  # end-of-generation tokens are never sampled
            self.sampler.suppress(tokenizer.eog_ids)
        for t in job.prompt:
            self.sampler.accept(t)
        self.output = TextOutput(tokenizer, job.params.stop, special=job.params.special)
        self.next_token: int | None = None  # sampled, not yet in the cache
        self.n_gen = 0
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.job.prompt)


class Slot:
    """A KV cache and the token ids it holds; busy while `run` is set."""

    def __init__(self, index: int, cache):
        self.index = index
        self.cache = cache
        self.tokens: list[int] = []  # ids at cache positions [0, cache.n_past)
        self.run: _Run | None = None
        self.last_used = 0


def rewind(cache, n: int) -> int:
    """Keep cache positions [0, n); returns how many were kept (a sliding-window cache may
    have overwritten what they need, then 0)."""
    if hasattr(cache, "rewind"):
        return cache.rewind(n)
    cache.n_past = n
    return n


SLOT_SIMILARITY = 0.5  # the least shared fraction of a prompt for a slot's cache to be chosen


def pick_slot(free: Sequence["Slot"], prompt: Sequence[int]) -> "Slot":
    """The free slot sharing the longest prefix with prompt if that covers SLOT_SIMILARITY of
    it, else the least recently used free slot (as llama.cpp's server picks)."""
    best = max(free, key=lambda s: (common_prefix(s.tokens, prompt), -s.last_used))
    if common_prefix(best.tokens, prompt) >= SLOT_SIMILARITY * len(prompt):
        return best
    return min(free, key=lambda s: s.last_used)


class Scheduler:
    """The batching loop over one model. `start()` runs it in a worker thread; `submit` queues.

    `forward(segments)` takes [(token ids, cache)] and returns, per segment, the logits
    (n_vocab,) of its last token; engine.py builds it from a loaded model.
    """

    def __init__(self, forward, new_cache, tokenizer, n_ctx: int, *, n_parallel: int = 4,
                 max_queue: int = 64, chunk: int = 128):
        if n_parallel < 1 or chunk < 1 or max_queue < 0:
            raise ValueError("n_parallel and chunk must be >= 1, max_queue >= 0")
        self.forward = forward
        # each step's thread count, adapted to the machine (engine.model_forward; None: the model's, fixed)
        self.threads = getattr(forward, "threads", None)
        self.tokenizer = tokenizer
        self.eog = tokenizer.eog_ids
        self.n_ctx = n_ctx
        self.chunk = chunk
        self.max_queue = max_queue
        self.slots = [Slot(i, new_cache()) for i in range(n_parallel)]
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._closing_message = "the server is shutting down"
        self._thread: threading.Thread | None = None
        self._clock = 0  # step counter (least recently used slot choice)
        self._admitted = 0
        self.steps = 0  # forward passes done
        self.max_busy = 0  # most slots that shared one step
        # totals over finished jobs (the /metrics endpoint): prompt tokens evaluated (cache excluded)
        # and their seconds, tokens sampled and theirs, jobs finished, busy slots summed over steps;
        # and over steps: wall seconds in the forward passes and in whole steps (the difference is
        # the server's own cost per step: admitting, sampling, detokenizing, handing events over)
        self.totals = {"prompt_tokens": 0, "prompt_seconds": 0.0, "predicted_tokens": 0, "predicted_seconds": 0.0,
                       "requests": 0, "busy_slot_steps": 0, "forward_seconds": 0.0, "step_seconds": 0.0}

    # -- the asyncio side ------------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a worker thread (tests; `qllama serve` runs it on its main thread: see `run`)."""
        self._thread = threading.Thread(target=self._loop, name="qllama-scheduler", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until `close`. Numba's parallel regions cost far
        less when launched from the main thread (~12 us against ~90 us each with the OpenMP layer)."""
        self._loop()

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull or ShuttingDown."""
        with self._cond:
            if self._closing:
                raise ShuttingDown(self._closing_message)
            room = self.max_queue + sum(s.run is None for s in self.slots)  # free slots take jobs at the next step
            if len(self._queue) >= room:
                self._queue = deque(j for j in self._queue if not j.cancelled)
                if len(self._queue) >= room:
                    raise QueueFull(f"{len(self._queue)} requests are already waiting for a slot")
            self._queue.append(job)
            self._cond.notify()

    def close(self, message: str | None = None) -> None:
        """Stop taking requests; running and waiting jobs get an error event.

        Only sets flags (no lock), so it may be called from a signal handler; the worker
        notices within its wait timeout.
        """
        if message:
            self._closing_message = message
        self._closing = True

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def n_busy(self) -> int:
        return sum(s.run is not None for s in self.slots)

    @property
    def n_waiting(self) -> int:
        return len(self._queue)

    # -- the worker ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._queue and not self.n_busy:
                    self._cond.wait(timeout=0.1)
            if self._closing:
                break
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug must not leave clients waiting forever
                self._fail_running(f"internal error: {type(e).__name__}: {e}")
        self._fail_all(self._closing_message)

    def _fail_running(self, message: str) -> None:
        for slot in self.slots:
            if slot.run is not None:
                _send(slot.run.job, Event("error", message=message))
                slot.run, slot.tokens = None, []
                rewind(slot.cache, 0)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            waiting, self._queue = list(self._queue), deque()
        for job in waiting:
            _send(job, Event("error", message=message, status=503))
        for slot in self.slots:
            if slot.run is not None:
                _send(slot.run.job, Event("error", message=message, status=503))
                slot.run = None

    def _admit(self) -> None:
        """Move waiting jobs into free slots, each to the slot sharing the longest prefix."""
        with self._cond:
            while self._queue:
                free = [s for s in self.slots if s.run is None]
                if not free:
                    return
                job = self._queue.popleft()
                if job.cancelled:
                    continue
                slot = pick_slot(free, job.prompt)
                # keep the common prefix; evaluate at least the last prompt token (for its logits)
                keep = rewind(slot.cache, min(common_prefix(slot.tokens, job.prompt), len(job.prompt) - 1))
                del slot.tokens[keep:]
                self._admitted += 1
                slot.run = _Run(job, keep, self.tokenizer, self._admitted)

    def step(self) -> bool:
        """One forward pass: a token of every decoding slot and up to `chunk` prompt tokens;
        False when there was nothing to do."""
        t0 = time.perf_counter()
        did = self._step()
        if did:
            self.totals["step_seconds"] += time.perf_counter() - t0
        return did

    def _step(self) -> bool:
        self._admit()
        busy = []
        for slot in self.slots:
            if slot.run is not None and slot.run.job.cancelled:
                slot.run = None  # the cache still holds slot.tokens: reusable
            elif slot.run is not None:
                busy.append(slot)
        if not busy:
            return False
        self._clock += 1
        # decoding slots take one token each; prompts share `chunk` tokens, oldest job first
        budget = self.chunk
        step, segments, prompts = [], [], []
        for slot in sorted(busy, key=lambda s: s.run.seq):
            run = slot.run
            if run.prefilling:
                ids = run.job.prompt[run.pos : run.pos + budget]
                budget -= len(ids)
                if not ids:
                    continue
            else:
                ids = [run.next_token]
            step.append(slot)
            segments.append((ids, slot.cache))
            # a prompt's rows as `Session.prefill` runs them (decided per prompt: every chunk alike)
            prompts.append(run.prefilling and len(run.job.prompt) - run.cached >= PROMPT_MIN_TOKENS)
        busy = step
        self.max_busy = max(self.max_busy, len(busy))
        kw = {"prompt": prompts} if getattr(self.forward, "takes_prompt", False) else {}
        t0 = time.perf_counter()
        try:
            if self.threads is None:
                logits = self.forward(segments, **kw)
            else:
                n_tok = sum(len(ids) for ids, _ in segments)
                logits = self.threads.run(len(segments), n_tok, lambda n: self.forward(segments, n_threads=n, **kw))
        except Exception as e:  # noqa: BLE001 - reported to the clients of this step, the loop goes on
            for slot in busy:
                _send(slot.run.job, Event("error", message=f"evaluation failed: {e}"))
                slot.run, slot.tokens = None, []
                rewind(slot.cache, 0)
            return True
        self.steps += 1
        self.totals["forward_seconds"] += time.perf_counter() - t0
        self.totals["busy_slot_steps"] += len(busy)
        for slot, (ids, _), row in zip(busy, segments, logits):
            run = slot.run
            slot.tokens.extend(ids)
            slot.last_used = self._clock
            if run.prefilling:
                run.pos += len(ids)
                if run.prefilling:
                    continue
            try:
                self._advance(slot, row)
            except Exception as e:  # noqa: BLE001 - this job fails, the others go on
                _send(run.job, Event("error", message=f"generation failed: {type(e).__name__}: {e}"))
                slot.run = None
        return True

    def _advance(self, slot: Slot, logits: np.ndarray) -> None:
        """Sample the next token of a slot from its logits (n_vocab,) and tell the client."""
        run = slot.run
        job = run.job
        prm = job.params
        if prm.max_tokens is not None and run.n_gen >= prm.max_tokens:
            return self._finish(slot, FINISH_LENGTH, *run.output.finish())
        token = run.sampler.sample(logits)
        run.sampler.accept(token)
        run.n_gen += 1
        if run.t_first is None:
            run.t_first = time.perf_counter()
        if token in self.eog:  # not part of the text, nor of the logprobs
            return self._finish(slot, FINISH_STOP, *run.output.finish())
        lp = token_logprob(self.tokenizer, logits, token, prm.logprobs) if prm.logprobs is not None else None
        text, lps, stopped = run.output.feed(token, lp)
        if stopped:
            return self._finish(slot, FINISH_STOP, text, lps)
        if text and not _send(job, Event("text", text=text, logprobs=lps)):
            job.cancel()
        if slot.cache.n_past >= self.n_ctx:  # no room to evaluate the token just sampled
            return self._finish(slot, FINISH_LENGTH, *run.output.finish())
        run.next_token = token

    def _finish(self, slot: Slot, reason: str, text: str, lps: list[TokenLogprob]) -> None:
        """The last event of a job (with the text not sent yet) and a free slot."""
        run = slot.run
        now = time.perf_counter()
        t_first = run.t_first or now
        usage = Usage(len(run.job.prompt), run.n_gen, run.cached,
                      prompt_ms=1000.0 * (t_first - run.t_start), predicted_ms=1000.0 * (now - t_first))
        t = self.totals
        t["prompt_tokens"] += usage.prompt_tokens - usage.cached_tokens
        t["prompt_seconds"] += usage.prompt_ms / 1000.0
        t["predicted_tokens"] += usage.completion_tokens
        t["predicted_seconds"] += usage.predicted_ms / 1000.0
        t["requests"] += 1
        _send(run.job, Event("done", text=text, logprobs=lps, finish_reason=reason, usage=usage))
        slot.run = None


def _send(job: Job, event: Event) -> bool:
    """Hand an event to the job's client; False if it cannot take it any more."""
    try:
        job.emit(event)
        return True
    except Exception:  # noqa: BLE001 - the client's event loop is gone
        return False
