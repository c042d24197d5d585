"""One-token steps on the int8 path with fused kernels (`kernels/fused.py`), planned at load.

A decode token of a small model is hundreds of small kernels; what it costs is mostly the
Python -> Numba calls and parallel regions around them. `DecodePlan` is built once per model
(on its first one-token step): for every layer the packed matrices, their type ids and
activation forms, grouped so that matrices sharing an input run in one call (Q|K|V; gate|up
with the GLU and ffn_down). A `DecodeState` holds preallocated buffers and, per layer, the
argument tuples of those calls, so a step does no per-matrix Python work and allocates
nothing but the returned logits.

Used by `Transformer` for a step of 1 to MAX_ROWS tokens (one decode token; a server step of
several streams, one token each; prompt lookup's verify batch; a short prompt) when nothing is
hooked, traced or timed by points (those see every named point through the unfused building
blocks), the int8 path is on, and every matrix of the model has a fused kernel (else the
unfused path runs). A state serves one row count (`DecodePlan.acquire(n)`). Results equal the
unfused int8 path bit for bit, and every row of an n-token step its one-token step's
(tests/test_models_forward.py, tests/test_multi_sequence.py, tests/test_fused_steps.py).

`KernelClock`: when set on a model (`qllama bench --profile`), both paths time each kernel
call by kind; the step's wall time minus those is Python overhead.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..qtensor import ACTIVATION_FORMS, FUSED_TYPES, TYPES, QTensor

if TYPE_CHECKING:
    from .base import Weights

# Steps of up to this many rows take the fused kernels (more: the unfused blocks, whose batches of
# qtensor.GEMM_MIN_TOKENS or more run the gemm). The n-token row kernels read each row once for
# every token (4 at a time). CPU time of a T-token forward in one-token steps, fused / unfused, 1
# thread, load ~3: 1B Q4_K_M (the gemm unfused) T=8 2.75 / 3.02, 9 3.16 / 3.27, 12 4.12 / 3.80,
# 16 5.31 / 4.53; SmolLM2 Q4_1 (no gemm) T=9 3.88 / 4.38, 12 5.65 / 5.89, 16 6.41 / 6.38. 9 rows
# is a verify batch of prompt lookup's 8 drafts
MAX_ROWS = 9


def form_buffers(form: str, n_tok: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty (xq int8 (n_tok, n), d float32 (n_tok, n / per_d), sums (n_tok, n / per_sum)) for an
    activation of `form` (qtensor.ACTIVATION_FORMS), as the fused kernels fill them."""
    f = ACTIVATION_FORMS[form]
    return (np.empty((n_tok, n), np.int8), np.empty((n_tok, n // f.per_d), np.float32),
            np.empty((n_tok, n // f.per_sum), f.sum_dtype))


class KernelClock:
    """Seconds per kind of kernel call (`seconds`) and per (layer, kind) (`per_layer`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.per_layer: dict[tuple[int | None, str], float] = {}
        self.calls: dict[str, int] = {}

    def add(self, kind: str, il: int | None, dt: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + dt
        self.calls[kind] = self.calls.get(kind, 0) + 1
        key = (il, kind)
        self.per_layer[key] = self.per_layer.get(key, 0.0) + dt

    def run(self, kind: str, il: int | None, fn, *args):
        """fn(*args), timed as `kind`; returns its result."""
        t0 = time.perf_counter()
        r = fn(*args)
        self.add(kind, il, time.perf_counter() - t0)
        return r


def _form(w: QTensor) -> str | None:
    return TYPES[w.type_id].int8_form


class DecodePlan:
    """Which calls a step of 1 to MAX_ROWS tokens makes, per layer; None from `build` when a matrix
    has no fused kernel."""

    def __init__(self, weights: "Weights", n_embd: int, q_dim: int, kv_dim: int, n_ff: int):
        self.weights = weights
        self.dims = (n_embd, q_dim, kv_dim, n_ff)
        self._free: dict[int, list[DecodeState]] = {}  # per row count, states not in use (one per concurrent forward)

    @classmethod
    def build(cls, weights: "Weights", n_embd: int, q_dim: int, kv_dim: int, n_ff: int) -> "DecodePlan | None":
        for lw in weights.layers:
            mats = [lw.attn_q, lw.attn_k, lw.attn_v, lw.attn_qkv, lw.attn_output, lw.ffn_gate, lw.ffn_up, lw.ffn_down]
            if any(w is not None and w.type_id not in FUSED_TYPES for w in mats):
                return None
        return cls(weights, n_embd, q_dim, kv_dim, n_ff)

    def acquire(self, n: int = 1) -> "DecodeState":
        """A state for a step of n rows (1 <= n <= MAX_ROWS)."""
        try:
            return self._free[n].pop()
        except (KeyError, IndexError):
            return DecodeState(self, n)

    def release(self, state: "DecodeState") -> None:
        self._free.setdefault(state.n, []).append(state)


class DecodeState:
    """Buffers of one step of n rows and the argument tuples of every layer's fused calls."""

    def __init__(self, plan: DecodePlan, n: int = 1):
        from ..kernels import fused

        self._fused = fused
        self.n = n  # rows of the steps this state runs
        n_embd, q_dim, kv_dim, n_ff = plan.dims
        self._quant: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._empty_raw = np.zeros((0, 1), np.uint8)  # an unused slot of a fused call
        self._empty_raw.flags.writeable = False
        self._empty_out = np.zeros((n, 0), np.float32)
        self.q = np.empty((n, q_dim), np.float32)  # (n, q_dim)
        self.k = np.empty((n, kv_dim), np.float32)  # (n, kv_dim)
        self.v = np.empty((n, kv_dim), np.float32)
        self.attn_out = np.empty((n, n_embd), np.float32)
        self.gate = np.empty((n, n_ff), np.float32)
        self.up = np.empty((n, n_ff), np.float32)
        self.ffn_out = np.empty((n, n_embd), np.float32)
        self.qkv_calls, self.out_calls, self.ffn_calls = [], [], []
        for lw in plan.weights.layers:
            if lw.attn_qkv is not None:  # one fused Q|K|V matrix (phi3): split by the caller
                fused_out = np.empty((n, q_dim + 2 * kv_dim), np.float32)
                self.qkv_calls.append((self._calls([(lw.attn_qkv, fused_out)]), fused_out))
            else:
                self.qkv_calls.append((self._calls([(lw.attn_q, self.q), (lw.attn_k, self.k), (lw.attn_v, self.v)]), None))
            self.out_calls.append(self._calls([(lw.attn_output, self.attn_out)]))
            self.ffn_calls.append(self._ffn_call(lw, n_ff) if lw.moe is None else None)  # (MoE: models/moe.py)
        self._out_w = plan.weights.output
        self._out_ok = plan.weights.output.type_id in FUSED_TYPES
        self._logits_call: list | None = None  # the output matrix's call (`_calls`), made on first use

    def _qbuf(self, form: str, n: int):
        key = (form, n)
        if key not in self._quant:
            self._quant[key] = form_buffers(form, self.n, n)
        return self._quant[key]

    def _calls(self, mats: list[tuple[QTensor, np.ndarray]]) -> list[list]:
        """One list per fused.matvec3 call: matrices grouped by activation form, in order, as
        [form, xq, xd, xs, t0, r0, o0, t1, r1, o1, t2, r2, o2, chunk address, quantizer address];
        the addresses are 0 until `_ready` finds them."""
        groups: dict[str, list] = {}
        for w, out in mats:
            groups.setdefault(_form(w), []).append((w, out))
        calls = []
        for form, ms in groups.items():
            slots = []
            for i in range(3):
                slots += [ms[i][0].type_id, ms[i][0].raw, ms[i][1]] if i < len(ms) else [0, self._empty_raw, self._empty_out]
            calls.append([form, *self._qbuf(form, ms[0][0].n_cols), *slots, 0, 0])
        return calls

    def _ready(self, call: list, x: np.ndarray) -> tuple:
        """fused.matvec3's arguments after x for `call` (see `_calls`), n_threads apart. The
        addresses are found on first use (a warm-up that only records gets 0, and the next use
        asks again)."""
        if not call[-2]:
            slots = self._slots(call[4:13], call[1:4])
            chunk = self._fused.rows_address(*slots, *call[1:4]) if slots else 0
            if chunk:
                call[4:13], call[-2] = slots, chunk
        if not call[-1]:
            call[-1] = self._fused.quant_address(call[0], x, *call[1:4])
        return (call[-1], *call[1:-1])

    def _slots(self, slots, acts) -> list | None:
        """A call's matrix slots as the kernels take them: type ids for one row, else each type's
        n-token row kernel by address (`fused.n_token_slots`; None while compile_pool records)."""
        return list(slots) if self.n == 1 else self._fused.n_token_slots(slots, *acts)

    def _ffn_call(self, lw, n_ff: int):
        """("ffn", args before act, args after act) for separate gate and up of one form; else
        ("split", gate|up calls, gu buffer, down calls): matvecs, then the GLU apart (phi3's fused ffn_up)."""
        gate, up, down = lw.ffn_gate, lw.ffn_up, lw.ffn_down
        if gate is not None and _form(gate) == _form(up):
            fg, fd = _form(gate), _form(down)
            pre = [fg, *self._qbuf(fg, gate.n_cols), gate.type_id, gate.raw, self.gate, up.type_id, up.raw, self.up]
            post = [fd, *self._qbuf(fd, down.n_cols), down.type_id, down.raw, self.ffn_out, self._empty_raw,
                    self._empty_out]
            return ("ffn", pre, post, [0, 0, 0, 0, 0])  # (+ the kernels' addresses, found on first use)
        if gate is None:  # gate|up in one matrix, gate first
            gu = np.empty((self.n, 2 * n_ff), np.float32)  # (n, 2 n_ff)
            return ("split", self._calls([(up, gu)]), gu, self._calls([(down, self.ffn_out)]))
        return ("split2", self._calls([(gate, self.gate), (up, self.up)]), None, self._calls([(down, self.ffn_out)]))

    # -- the steps (h, attn: (n, dim) float32 C-contiguous) --

    def qkv(self, il: int, h: np.ndarray, nt: int, clock: KernelClock | None):
        """-> q (n, q_dim), k, v (n, kv_dim): views of this state's buffers."""
        calls, fused_out = self.qkv_calls[il]
        mv = self._fused.matvec3
        for call in calls:
            args = self._ready(call, h)
            if clock is None:
                mv(h, *args, nt)
            else:
                clock.run("quantize x + attn_q|k|v (fused)", il, mv, h, *args, nt)
        if fused_out is None:
            return self.q, self.k, self.v
        qd, kd = self.q.shape[1], self.k.shape[1]
        return fused_out[:, :qd], fused_out[:, qd : qd + kd], fused_out[:, qd + kd :]

    def out_proj(self, il: int, attn: np.ndarray, nt: int, clock: KernelClock | None) -> np.ndarray:
        mv = self._fused.matvec3
        for call in self.out_calls[il]:
            args = self._ready(call, attn)
            if clock is None:
                mv(attn, *args, nt)
            else:
                clock.run("quantize x + attn_output (fused)", il, mv, attn, *args, nt)
        return self.attn_out

    def ffn(self, il: int, h: np.ndarray, act: int, nt: int, clock: KernelClock | None) -> np.ndarray:
        call = self.ffn_calls[il]
        if call[0] == "ffn":
            _, pre, post, ad = call
            if not all(ad):
                if not ad[0]:  # (for n rows, the type ids become the row kernels' addresses, once)
                    er, eo = self._empty_raw, self._empty_out
                    gu = self._slots([*pre[4:10], pre[4], er, eo], pre[1:4])
                    dn = self._slots([*post[4:7], post[4], er, eo, post[4], er, eo], post[1:4])
                    chunks = [self._fused.rows_address(*gu, *pre[1:4]), self._fused.rows_address(*dn, *post[1:4])] \
                        if gu and dn else [0, 0]
                    if all(chunks):
                        pre[4:10], post[4:7], ad[0:2] = gu[:6], dn[:3], chunks
                ad[2] = ad[2] or self._fused.quant_address(pre[0], h, *pre[1:4])
                ad[3] = ad[3] or self._fused.quant_address(post[0], self.gate, *post[1:4])
                ad[4] = ad[4] or self._fused.glu_address(self.gate, self.up, act)
            args = (ad[2], *pre[1:], act, ad[3], *post[1:], ad[0], ad[1], ad[4], nt)
            if clock is None:
                self._fused.ffn(h, *args)
            else:
                clock.run("quantize x + ffn_gate|up + glu + quantize + ffn_down (fused)", il, self._fused.ffn, h, *args)
            return self.ffn_out
        from ..kernels.layer_ops import glu

        _, gu_calls, gu, down_calls = call
        n_ff = self.gate.shape[1]
        run = (lambda kind, fn, *a: fn(*a)) if clock is None else (lambda kind, fn, *a: clock.run(kind, il, fn, *a))
        for call in gu_calls:
            args = self._ready(call, h)
            run("quantize x + ffn_gate|up (fused)", self._fused.matvec3, h, *args, nt)
        if gu is not None:
            self.gate[:] = gu[:, :n_ff]
            self.up[:] = gu[:, n_ff:]
        run("glu", glu, self.gate, self.up, self.gate, act)
        for call in down_calls:
            args = self._ready(call, self.gate)
            run("quantize x + ffn_down (fused)", self._fused.matvec3, self.gate, *args, nt)
        return self.ffn_out

    def logits(self, hn: np.ndarray, nt: int, clock: KernelClock | None) -> np.ndarray | None:
        """The output projection of hn (n, n_embd) into a new (n, n_vocab) array; None if its type
        has no fused kernel or hn has another row count."""
        if not self._out_ok or hn.shape[0] != self.n:
            return None
        w = self._out_w
        out = np.empty((self.n, w.n_rows), np.float32)
        if self._logits_call is None:
            self._logits_call = self._calls([(w, out)])[0]
        call = self._logits_call
        call[6] = out  # (a new array of the same kind each step: the addresses stay)
        args = self._ready(call, hn)
        call[6] = None  # (not kept alive by the state)
        if clock is None:
            self._fused.matvec3(hn, *args, nt)
        else:
            clock.run("quantize x + output (logits)", None, self._fused.matvec3, hn, *args, nt)
        return out
