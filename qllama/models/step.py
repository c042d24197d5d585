"""How a forward round runs: the one seam between the building blocks and the ways they execute.

A building block (`Transformer.norm`, `qkv`, `attend`, `out_proj`, `ffn`, the MoE FFN) makes
one call per step and never asks which mode is on, as llama.cpp's graph builders call
`cb(cur, "attn_norm", il)` after each op:

    step.op(kind, fn, *args)        a kernel call                      fn(*args)
    step.project(kind, w, act)      a weight matrix times activations  project(w, act, prompt=...)
    step.point(name, x)             a named point (hooks, traces)      x
    step.wants(name)                whether a point is read            False
    step.attention_inputs(q, ...)   attn_q/k/v of one segment          q

The model's `execution` chooses a `Step` once per forward round:

- `Plain` (the default): the calls as they are; a step of up to decode.MAX_ROWS tokens on the
  int8 path takes the fused kernels (`step.fused`, models/decode.py);
- `Timed(clock)`: `qllama bench --profile` times every kernel call by kind and layer;
- `points.Probe`: hooks and traces see (and may replace) every named point;
- `Plain(checks=False)` / `Probe(..., checks=False)`: no check of the logits for NaN/Inf (the
  checked re-run that locates a non-finite value, the warm-up's recording pass).

`step.il` is the block being run (None outside the blocks), set by the round.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..qtensor import INT8_TYPES, TYPES, QTensor, int8_enabled

if TYPE_CHECKING:
    from .decode import DecodeState, KernelClock


def project(w: QTensor, act, n_threads: int | None = None, prompt: "bool | np.ndarray" = False) -> np.ndarray:
    """(T, in) activations (an Activation, quantized once when shared) -> (T, out) float32.
    One token takes the mat-vec (decode) kernel, a batch the mat-mat (prefill) kernel; a prompt's
    rows (prompt: all, or a bool mask (T,)) as llama.cpp's prompt kernels round them (`QTensor.matmul`)."""
    if act.n_tok == 1 and not np.any(prompt):
        return w.matvec(act, n_threads=n_threads).reshape(1, -1)
    return w.matmul(act, n_threads=n_threads, prompt=prompt)


class Step:
    """One forward round as it runs plainly (see the module docstring)."""

    clock: "KernelClock | None" = None  # the fused kernels time their parts under a Timed step
    probe = None  # the hooks and traces of a probed step (models/points.py)

    def __init__(self, n_threads: int, fused: "DecodeState | None" = None, checks: bool = True,
                 release: Callable[["DecodeState"], None] | None = None, prompt: "bool | np.ndarray" = False):
        self.n_threads = n_threads  # threads of this round's kernels
        self.prompt = prompt  # which of the round's rows are a prompt's: all, none, or a bool mask (`project`)
        self.fused = fused  # the fused kernels of this round (its row count), or None
        self.checks = checks  # whether the round checks its logits for NaN/Inf
        self.il: int | None = None  # the block being run
        self._release = release

    def op(self, kind: str, fn, *args):
        return fn(*args)

    def project(self, kind: str, w: QTensor, act, rows=None, as_decode: bool = False) -> np.ndarray:
        """w times act, whose rows are the round's rows `rows` (an index; None: all of them);
        as_decode: decode's rounding for every row (a MoE's experts, whose one-call kernel has no
        prompt arithmetic: a token's expert rows round alike in any batch)."""
        return project(w, act, self.n_threads, self.prompt_of(rows, as_decode))

    def prompt_of(self, rows, as_decode: bool = False) -> "bool | np.ndarray":
        """Which of the round's rows `rows` (an index, or None: all) are a prompt's (`project`)."""
        if as_decode:
            return False
        return self.prompt if rows is None or isinstance(self.prompt, bool) else self.prompt[rows]

    def point(self, name: str, x: np.ndarray) -> np.ndarray:
        return x

    def wants(self, name: str) -> bool:
        return False

    def attention_inputs(self, q: np.ndarray, k_cache: np.ndarray, vt_cache: np.ndarray, start: int) -> np.ndarray:
        """The points attn_q, attn_k, attn_v of one segment (after RoPE and the cache store):
        the queries to attend with (a hook may also replace the stored keys and values)."""
        return q

    def end(self) -> None:
        """After the round: the fused state goes back to its plan."""
        if self.fused is not None and self._release is not None:
            self._release(self.fused)


class TimedStep(Step):
    """Every kernel call timed by kind and layer (the activation's quantization apart)."""

    def __init__(self, clock: "KernelClock", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

    def op(self, kind: str, fn, *args):
        return self.clock.run(kind, self.il, fn, *args)

    def project(self, kind: str, w: QTensor, act, rows=None, as_decode: bool = False) -> np.ndarray:
        form = TYPES[w.type_id].int8_form
        if int8_enabled() and w.type_id in INT8_TYPES and form not in act._forms:  # once per shared activation
            self.clock.run("quantize x", self.il, act.quantized, form)
        return self.clock.run(kind, self.il, project, w, act, self.n_threads, self.prompt_of(rows, as_decode))


# steps of 1 to decode.MAX_ROWS tokens on the int8 path use the fused kernels (models/decode.py);
# QLLAMA_FUSED=0 turns them off (the unfused blocks, for before/after measurements), and
# QLLAMA_FUSED=1token keeps them to one-token steps
FUSED_DEFAULT = os.environ.get("QLLAMA_FUSED", "1") != "0"
FUSED_ROWS_DEFAULT = 1 if os.environ.get("QLLAMA_FUSED") == "1token" else None  # (None: decode.MAX_ROWS)


class Execution:
    """Chooses each forward round's Step. `fused`: whether rounds of up to `fused_rows` tokens
    (None: decode.MAX_ROWS) may take the fused kernels; `checks`: whether rounds check their logits."""

    def __init__(self, *, fused: bool = FUSED_DEFAULT, checks: bool = True, fused_rows: int | None = FUSED_ROWS_DEFAULT):
        self.fused, self.checks, self.fused_rows = fused, checks, fused_rows

    def step(self, model, n_threads: int, n_rows: int, prompt: "bool | np.ndarray" = False) -> Step:
        """The Step of a round of n_rows tokens (all segments together; prompt: which rows are a
        prompt's, to take llama.cpp's prompt arithmetic: a round with any takes the unfused calls)."""
        fused = model.fused_state(n_rows, self.fused_rows) if self.fused and not np.any(prompt) else None
        return self._make(n_threads, fused, model.release_fused, prompt)

    def _make(self, n_threads: int, fused, release, prompt: "bool | np.ndarray" = False) -> Step:
        return Step(n_threads, fused, self.checks, release, prompt)


class Plain(Execution):
    """The calls as they are (the default)."""


class Timed(Execution):
    """Every kernel call timed into `clock` (`qllama bench --profile`)."""

    def __init__(self, clock: "KernelClock", *, fused: bool = FUSED_DEFAULT, fused_rows: int | None = FUSED_ROWS_DEFAULT):
        super().__init__(fused=fused, fused_rows=fused_rows)
        self.clock = clock

    def _make(self, n_threads: int, fused, release, prompt: "bool | np.ndarray" = False) -> Step:
        return TimedStep(self.clock, n_threads, fused, self.checks, release, prompt)


PLAIN = Plain()

__all__ = ["Step", "TimedStep", "Execution", "Plain", "Timed", "PLAIN", "project"]
