"""Named points in the forward pass: capture (trace) and hooks that may replace an array.

Every family's forward pass fires the same points (TransformerLens's hook points, named after
GGUF tensors). T is the tokens of the forward call, H/Hkv the query/KV heads, D head_dim,
P = n_past + T the positions in the cache after the call.

| point | shape | meaning |
| --- | --- | --- |
| `embed` | (T, n_embd) | token embedding rows (Gemma: times sqrt(n_embd)), the residual stream before block 0 |
| `blk.{i}.attn_norm` | (T, n_embd) | RMSNorm of the residual stream: the attention's input |
| `blk.{i}.attn_q` | (T, H, D) | queries after bias, Q-norm (qwen3, gemma3) and RoPE |
| `blk.{i}.attn_k` | (T, Hkv, D) | keys of the new tokens after bias, K-norm and RoPE (as stored in the KV cache: f16-rounded with the default f16 cache) |
| `blk.{i}.attn_v` | (T, Hkv, D) | values of the new tokens (as stored in the KV cache) |
| `blk.{i}.attn_scores` | (T, H, P) | scaled (and Gemma-2 softcapped) query-key scores over every cached position; -inf where masked (future, outside the sliding window) |
| `blk.{i}.attn_probs` | (T, H, P) | softmax of the scores: attention weights over the cached positions (0 where masked) |
| `blk.{i}.attn_z` | (T, H, D) | per-head attention output (probs @ values), before the output projection (TransformerLens's hook_z) |
| `blk.{i}.attn_out` | (T, n_embd) | the attention output projection (Gemma: before post_attention_norm) |
| `blk.{i}.ffn_in` | (T, n_embd) | RMSNorm of the residual stream: the FFN's input |
| `blk.{i}.ffn_moe_logits` | (T, n_expert) | mixture of experts: the router's logits (ffn_gate_inp); a hook may mask or bias experts |
| `blk.{i}.ffn_moe_experts` | (T, n_expert_used) | the chosen expert ids (as floats), best first; a hook may force others |
| `blk.{i}.ffn_moe_weights` | (T, n_expert_used) | those experts' weights (router probabilities, renormalised / scaled as the family does) |
| `blk.{i}.ffn_act` | (T, n_ff) | act(gate) * up: the input of ffn_down (dense FFN layers only) |
| `blk.{i}.ffn_out` | (T, n_embd) | ffn_down's output (Gemma: before post_ffw_norm) |
| `blk.{i}.resid` | (T, n_embd) | the residual stream after block i |
| `result_norm` | (R, n_embd) | final RMSNorm of the rows whose logits are computed (R = T for `Model.logits`, else the last row) |
| `logits` | (R, n_vocab) | output projection, after the family's final softcap |

`attn_scores` and `attn_probs` are not produced by the fused attention kernel: for a layer in
which one of them is captured or hooked, that layer's attention runs through a NumPy path
(`attention_numpy`) from the same rotated queries and cached keys/values, with GQA, the
sliding window and the softcap as the kernel has them; the output then follows from the
(possibly replaced) probabilities. Every other point costs nothing beyond a copy when captured.

A forward pass over several sequences at once (the server's batched steps) fires the
attention points (attn_q .. attn_z) once per sequence, with that sequence's rows.

When nothing is traced or hooked, the model runs its plain execution (models/step.py), whose
points return their array as it is; a `Probe` is the execution while hooks or traces are active.
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from ..errors import QllamaError
from .kvcache import from_f32, is_blocks, query_as_keys, to_f32
from .step import PLAIN, Execution, Step

BLOCK_POINTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_scores", "attn_probs", "attn_z", "attn_out",
                "ffn_in", "ffn_act", "ffn_out", "resid")
MOE_POINTS = ("ffn_moe_logits", "ffn_moe_experts", "ffn_moe_weights")  # the router of a mixture of experts
# a mixture-of-experts block's points: the router's instead of ffn_act (each expert has its own)
MOE_BLOCK_POINTS = BLOCK_POINTS[: BLOCK_POINTS.index("ffn_act")] + MOE_POINTS + ("ffn_out", "resid")
ATTN_WEIGHTS = ("attn_scores", "attn_probs")  # need the NumPy attention path

HookFn = Callable[[str, np.ndarray, "int | None"], "np.ndarray | None"]


def point_names(n_layer: int, moe: bool = False) -> list[str]:
    """Every point of an n_layer model (moe: a mixture of experts), in the order a forward pass fires them."""
    block = MOE_BLOCK_POINTS if moe else BLOCK_POINTS
    return ["embed"] + [f"blk.{i}.{p}" for i in range(n_layer) for p in block] + ["result_norm", "logits"]


def full_name(point: str, il: int | None) -> str:
    return point if il is None else f"blk.{il}.{point}"


def _patterns(spec: str | Iterable[str]) -> tuple[str, ...]:
    pats = (spec,) if isinstance(spec, str) else tuple(spec)
    if not pats or not all(isinstance(p, str) and p for p in pats):
        raise QllamaError("point patterns must be non-empty strings such as 'blk.*.resid'")
    return pats


def _check_known(pats: Sequence[str], n_layer: int, moe: bool = False) -> None:
    names = point_names(n_layer, moe)
    for p in pats:
        if not fnmatch.filter(names, p):
            block = MOE_BLOCK_POINTS if moe else BLOCK_POINTS
            raise QllamaError(f"no point matches {p!r} (points: embed, blk.N.{{{','.join(block)}}}, "
                              f"result_norm, logits; N < {n_layer})")


class HookHandle:
    """Returned by `Hooks.add`; `remove()` takes the hook out (idempotent). Also a context manager."""

    def __init__(self, probe: "Probe", hook: "_Hook"):
        self._probe, self._hook = probe, hook

    def remove(self) -> None:
        self._probe._remove(self._hook)

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclass(eq=False)
class _Hook:
    patterns: tuple[str, ...]
    fn: HookFn


class Hooks:
    """`model.hooks`: functions called at named points, in the order they were added.

    `fn(name, array, layer)` gets the full point name, the array (a view of the model's own
    buffer: copy it to keep it; editing it in place is not guaranteed to take effect) and the
    block index (None for embed/result_norm/logits). It may return a replacement of the same
    shape (ablation, activation patching, steering) or None to leave the array as it is; a
    replaced attn_k/attn_v is written into the KV cache, so later tokens see it too. Hooks stay until removed and apply to every forward pass:
    `logits`, `generate`/`stream` (prompt and each decoding step), chat.
    """

    def __init__(self, probe: "Probe"):
        self._probe = probe

    def add(self, pattern: str | Iterable[str], fn: HookFn) -> HookHandle:
        """Call fn at every point matching the glob pattern(s), e.g. "blk.5.ffn_out", "blk.*.resid"."""
        if not callable(fn):
            raise QllamaError("a hook must be callable as fn(name, array, layer)")
        pats = _patterns(pattern)
        _check_known(pats, self._probe.n_layer, self._probe.moe)
        hook = _Hook(pats, fn)
        self._probe._add(hook)
        return HookHandle(self._probe, hook)

    def clear(self) -> None:
        """Remove every hook."""
        for h in list(self._probe.hooks):
            self._probe._remove(h)

    def __len__(self) -> int:
        return len(self._probe.hooks)


class Trace:
    """Arrays captured at the points matching `capture`, over every forward call of the block.

    - `t[name]`: the calls' arrays concatenated along the token axis (axis 0); attn_scores and
      attn_probs are padded on the position axis to the longest call (-inf / 0), so that the
      rows of a generation form one (T_total, H, P_max) map over absolute positions.
    - `t.calls(name)`: the list of arrays, one per firing (one per forward call).
    - `name in t`, `t.names()`, `t.keys()`.
    Arrays are copies, in float32, as the model used them (after any hooks).
    """

    def __init__(self, probe: "Probe", capture: str | Iterable[str]):
        self._probe = probe
        self.patterns = _patterns(capture)
        _check_known(self.patterns, probe.n_layer, probe.moe)
        self._data: dict[str, list[np.ndarray]] = {}

    def _store(self, name: str, arr: np.ndarray) -> None:
        self._data.setdefault(name, []).append(np.array(arr, dtype=np.float32, copy=True))

    def names(self) -> list[str]:
        return list(self._data)

    keys = names

    def __contains__(self, name: str) -> bool:
        return name in self._data

    def calls(self, name: str) -> list[np.ndarray]:
        if name not in self._data:
            raise KeyError(name)
        return self._data[name]

    def __getitem__(self, name: str) -> np.ndarray:
        parts = self.calls(name)
        if len(parts) == 1:
            return parts[0]
        if name.rsplit(".", 1)[-1] in ATTN_WEIGHTS:
            width = max(p.shape[-1] for p in parts)
            fill = -np.inf if name.endswith("scores") else 0.0
            parts = [np.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, width - p.shape[-1])], constant_values=fill)
                     for p in parts]
        return np.concatenate(parts, axis=0)

    def __enter__(self) -> "Trace":
        self._probe._add(self)
        return self

    def __exit__(self, *exc) -> None:
        self._probe._remove(self)


class ProbedStep(Step):
    """A forward round whose named points go through the hooks and traces of `probe`; no fused
    decode kernels (they skip the points inside a layer)."""

    def __init__(self, probe: "Probe", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe = probe

    def point(self, name: str, x: np.ndarray) -> np.ndarray:
        return self.probe.fire(name, self.il, x)

    def wants(self, name: str) -> bool:
        return self.probe.wants(name, self.il)

    def attention_inputs(self, q: np.ndarray, k_cache: np.ndarray, vt_cache: np.ndarray, start: int) -> np.ndarray:
        return attention_points(self.probe, self.il, q, k_cache, vt_cache, start)


class Probe(Execution):
    """The hooks and traces of one Transformer. While any is active it is the model's
    `execution` (rounds run as `ProbedStep`s); `checks=False` for the checked re-run of
    `nonfinite.locate`, which must not check (and re-run) again."""

    def __init__(self, model, checks: bool = True):
        super().__init__(fused=False, checks=checks)
        self.model = model
        self.n_layer = model.args.n_layer
        self.moe = model.args.n_expert > 0  # a mixture of experts: router points instead of ffn_act
        self.hooks: list[_Hook] = []
        self.traces: list[Trace] = []
        self._route: dict[tuple[str, int | None], tuple[list, list, str]] = {}

    def step(self, model, n_threads: int, n_rows: int, prompt: "bool | np.ndarray" = False) -> Step:
        return ProbedStep(self, n_threads, None, self.checks, prompt=prompt)

    # -- registry --

    def _add(self, item) -> None:
        (self.hooks if isinstance(item, _Hook) else self.traces).append(item)
        self._changed()

    def _remove(self, item) -> None:
        items = self.hooks if isinstance(item, _Hook) else self.traces
        if item in items:
            items.remove(item)
        self._changed()

    def _changed(self) -> None:
        self._route.clear()
        active = bool(self.hooks or self.traces)
        if active and self.model.execution is not self:
            self._outside = self.model.execution  # (the plain execution, or a timed one)
            self.model.execution = self
        elif not active and self.model.execution is self:
            self.model.execution = getattr(self, "_outside", PLAIN)

    def _consumers(self, point: str, il: int | None) -> tuple[list, list, str]:
        key = (point, il)
        r = self._route.get(key)
        if r is None:
            name = full_name(point, il)
            hooks = [h for h in self.hooks if any(fnmatch.fnmatchcase(name, p) for p in h.patterns)]
            traces = [t for t in self.traces if any(fnmatch.fnmatchcase(name, p) for p in t.patterns)]
            r = self._route[key] = (hooks, traces, name)
        return r

    # -- called by the forward pass --

    def wants(self, point: str, il: int | None) -> bool:
        """Whether a hook or trace reads this point (the attention weights need their own path)."""
        hooks, traces, _ = self._consumers(point, il)
        return bool(hooks or traces)

    def fire(self, point: str, il: int | None, arr: np.ndarray) -> np.ndarray:
        """Run the hooks on arr, capture the result; returns the array the model goes on with."""
        hooks, traces, name = self._consumers(point, il)
        for h in hooks:
            out = h.fn(name, arr, il)
            if out is not None:
                out = np.asarray(out)
                if out.shape != arr.shape:
                    raise QllamaError(f"hook on {name} returned shape {out.shape}, expected {arr.shape}")
                arr = np.ascontiguousarray(out, dtype=np.float32)
        for t in traces:
            t._store(name, arr)
        return arr


_PROBES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Transformer -> its Probe


def probe_of(model) -> Probe:
    """The Probe (hooks and traces registry) of a Transformer, created on first use."""
    p = _PROBES.get(model)
    if p is None:
        p = _PROBES[model] = Probe(model)
    return p


# -- the NumPy attention path (attn_scores / attn_probs) -------------------------------------


def attention_numpy(probe: Probe, il: int, q: np.ndarray, k_cache: np.ndarray, vt_cache: np.ndarray, start: int,
                    n_rep: int, scale: float, window: int, softcap: float, q_scaled: bool = False,
                    sinks: np.ndarray | None = None) -> np.ndarray:
    """Attention of one segment as `kernels.layer_ops.attention` computes it, with the scores and
    probabilities fired as points. q: (T, H, D) roped; caches of one layer (Hkv, ring, D) and
    (Hkv, D, ring), float32 or f16 bits, already holding positions start..start+T-1. As the
    kernel does with an f16 cache, the queries (f16 keys; first multiplied by the scale if
    q_scaled) and the probabilities after the hooks (f16 values) are rounded to f16 for the
    products. A quantized cache (both arrays (Hkv, ring, D/32) blocks, see models.kvcache):
    keys and values dequantized, the queries as its kernel converts them (`query_as_keys`), the
    probabilities not rounded (llama.cpp's flash attention). sinks: (H,) float32 attention sinks
    (gpt-oss): one more logit per head in the softmax's max and denominator, with no value (ggml's
    soft_max with sinks). Returns (T, H, D) float32."""
    n_tok, n_head, head_dim = q.shape
    ring = k_cache.shape[1]
    n_pos = start + n_tok
    first = max(0, n_pos - ring)  # the oldest position the ring still holds
    kpos = np.arange(first, n_pos)
    slots = kpos % ring
    k = np.repeat(to_f32(k_cache[:, slots, :]), n_rep, axis=0)  # (H, P', D)
    blocks = is_blocks(k_cache)  # a quantized cache: values row-major too; products as its flash attention's
    v_rows = to_f32(vt_cache[:, slots, :]) if blocks else to_f32(vt_cache[:, :, slots]).transpose(0, 2, 1)
    v = np.repeat(v_rows, n_rep, axis=0)  # (H, P', D)
    if blocks:
        if q_scaled:
            q, scale = q * np.float32(scale), 1.0
        q = query_as_keys(q, k_cache)
    elif k_cache.dtype == np.uint16:
        if q_scaled:  # scaled, then rounded
            q, scale = q * np.float32(scale), 1.0
        q = to_f32(from_f32(q, k_cache))
    s = np.matmul(q.transpose(1, 0, 2), k.transpose(0, 2, 1)) * np.float32(scale)  # (H, T, P')
    if softcap > 0:
        s = np.tanh(s * np.float32(1.0 / softcap)) * np.float32(softcap)
    qpos = np.arange(start, n_pos)
    diff = qpos[:, None] - kpos[None, :]  # (T, P')
    masked = diff < 0
    if window > 0:
        masked |= diff >= window
    scores = np.full((n_tok, n_head, n_pos), -np.inf, np.float32)
    scores[:, :, first:] = np.where(masked[:, None, :], np.float32(-np.inf), s.transpose(1, 0, 2))
    scores = probe.fire("attn_scores", il, scores)
    best = scores.max(axis=2, keepdims=True)
    if sinks is None:
        e = np.exp(scores - best)
        probs = (e / e.sum(axis=2, keepdims=True)).astype(np.float32)
    else:  # the sink joins the max and the sum, and takes no value
        sk = sinks.astype(np.float32)[None, :, None]  # (1, H, 1)
        best = np.maximum(best, sk)
        e = np.exp(scores - best)
        total = e.sum(axis=2, keepdims=True, dtype=np.float64) + np.exp(sk - best)
        probs = (e * (1.0 / total)).astype(np.float32)
    probs = probe.fire("attn_probs", il, probs)
    if vt_cache.dtype == np.uint16:
        probs = to_f32(from_f32(probs, vt_cache))
    out = np.matmul(probs[:, :, first:].transpose(1, 0, 2), v)  # (H, T, D)
    return np.ascontiguousarray(out.transpose(1, 0, 2), dtype=np.float32)


def attention_points(probe: Probe, il: int, q: np.ndarray, k_cache: np.ndarray, vt_cache: np.ndarray,
                     start: int) -> np.ndarray:
    """Fire attn_q, attn_k, attn_v for one segment after RoPE and the cache store; a replaced key
    or value is written back into the cache. Returns the queries to attend with (T, H, D)."""
    q = probe.fire("attn_q", il, q)
    n_tok = q.shape[0]
    slots = None
    if probe.wants("attn_k", il) or probe.wants("attn_v", il):
        slots = np.arange(start, start + n_tok) % k_cache.shape[1]
        k = np.ascontiguousarray(to_f32(k_cache[:, slots, :]).transpose(1, 0, 2))  # (T, Hkv, D) as roped and stored
        k2 = probe.fire("attn_k", il, k)
        if k2 is not k:
            k_cache[:, slots, :] = from_f32(k2, k_cache).transpose(1, 0, 2)
        if is_blocks(vt_cache):  # a quantized cache keeps values row-major, as blocks
            v = np.ascontiguousarray(to_f32(vt_cache[:, slots, :]).transpose(1, 0, 2))  # (T, Hkv, D)
            v2 = probe.fire("attn_v", il, v)
            if v2 is not v:
                vt_cache[:, slots, :] = from_f32(v2, vt_cache).transpose(1, 0, 2)
            return q
        v = np.ascontiguousarray(to_f32(vt_cache[:, :, slots]).transpose(2, 0, 1))  # (T, Hkv, D)
        v2 = probe.fire("attn_v", il, v)
        if v2 is not v:
            vt_cache[:, :, slots] = from_f32(v2, vt_cache).transpose(1, 2, 0)
    return q


def first_nonfinite(model, run: Callable[[], object]) -> tuple[int | None, str, int] | None:
    """Call `run()` (e.g. one forward step of `model`, a Transformer) with every point checked;
    return (layer, full point name, token row) of the first point holding a NaN or Inf, or None.

    attn_scores and attn_probs are not checked (masked scores are -inf by design, and reading
    them would switch the attention path); attn_z shows a bad attention as well.
    """
    found: list[tuple[int | None, str, int]] = []

    def check(name, arr, il):
        if not found and not np.isfinite(arr).all():
            rows = np.nonzero(~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1))[0]
            found.append((il, name, int(rows[0]) if rows.size else 0))
        return None

    probe = probe_of(model)
    pats = ["embed", "result_norm", "logits"] + [f"blk.*.{p}" for p in BLOCK_POINTS if p not in ATTN_WEIGHTS]
    hook = _Hook(tuple(pats), check)
    probe._add(hook)
    try:
        run()
    finally:
        probe._remove(hook)
    return found[0] if found else None


__all__ = ["BLOCK_POINTS", "MOE_POINTS", "MOE_BLOCK_POINTS", "Hooks", "HookHandle", "Trace", "Probe", "ProbedStep", "probe_of", "point_names",
           "attention_numpy", "attention_points", "first_nonfinite"]
