"""Mixture of experts: the router and the expert FFNs every MoE family shares.

llama.cpp's `build_moe_ffn` (src/llama-graph.cpp), for the gating every family here uses (softmax):

    logits  = ffn_gate_inp h                      (T, n_expert)         point ffn_moe_logits
    probs   = softmax(logits)                     over all experts
    experts = top-k(probs)                        (T, k), best first     point ffn_moe_experts
    w       = probs[experts]                      (T, k)
    w       = w / max(sum(w), 2^-14)              if the family renormalises (norm_w)
    w       = w * expert_weights_scale            if that scale is neither 0 nor 1
                                                                         point ffn_moe_weights
    y_j     = down_e(act(gate_e h) * up_e h)      for each chosen expert e (slot j)
    out     = w_0 y_0 + w_1 y_1 + ...             summed in slot order, as llama.cpp's adds
    (+ a shared expert: qwen2moe behind a sigmoid gate, granitemoe plain)

The expert tensors are 3-D, expert-major: `ffn_{gate,up}_exps` [n_embd, n_ff_exp, n_expert] and
`ffn_down_exps` [n_ff_exp, n_embd, n_expert], so expert e's rows are one contiguous slice of the
mmap. `ExpertTensor` makes a 2-D QTensor view of that slice on first use (no copy, nothing
dequantized): a decoded token reads only its k experts' rows. A prompt batch groups its tokens by
expert and runs each chosen expert once over all of its tokens (llama.cpp's mul_mat_id) with the
ordinary mat-vec / mat-mat path, so every row gets the value a one-token step gives it, bit for
bit, on the int8 path (the router's mat-mat is the same kernel for one token and many).

Hyper-parameters are read here (`read_moe_args`) with llama.cpp's checks (llama-model.cpp's
load_hparams: expert_count <= LLAMA_MAX_EXPERTS, 0 < expert_used_count <= expert_count).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from ..errors import QllamaError, UnsupportedError
from ..gguf.types import Q6_K, type_name
from ..qtensor import SUPPORTED_TYPES, QTensor, quantize_activation
from .args import Keys, ModelArgs
from .base import LayerWeights, WeightReader, Weights

MAX_EXPERTS = 512  # llama.cpp's LLAMA_MAX_EXPERTS
_EMPTY_RAW = np.zeros((0, 1), np.uint8)  # an unused matrix slot of a fused call
_EMPTY_RAW.flags.writeable = False
_EMPTY_OUT = np.zeros((1, 0), np.float32)
# an expert's tokens from which a matrix takes the gemm (fewer: the row kernels, faster there; 1 thread,
# 8..32 tokens on 28-41 MB of expert rows: q4_K's gemm wins from ~8, q6_K's only from ~16)
GEMM_FROM_TOKENS = {Q6_K: np.int64(16)}
GEMM_FROM_DEFAULT = np.int64(8)
WEIGHT_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp clamps the renormalising sum to the smallest normal fp16
_NO_EXPERTS = np.zeros((0, 0), np.int64)  # the router kernels' "no forced experts"


# -- hyper-parameters ---------------------------------------------------------------------------


def read_moe_args(md: Mapping[str, Any], a: ModelArgs, *, required: bool, n_ff_exp: str = "n_ff",
                  shared: str = "none") -> ModelArgs:
    """a with the expert fields filled, as llama.cpp reads them for the family.

    required: the family has experts in every layer (qwen3moe, qwen2moe, olmoe); else 0 experts
      means a dense model (llama, granite).
    n_ff_exp: "n_ff" (Mixtral, OLMoE, Granite: feed_forward_length) or "key" (Qwen:
      expert_feed_forward_length, else feed_forward_length / expert_used_count).
    shared: "none"; "key" (granitemoe: expert_shared_feed_forward_length, 0 = no shared expert);
      "always" (qwen2moe: that key, else feed_forward_length).
    """
    key = Keys(md, a.arch)
    n_expert = key.int("expert_count", 0)
    n_used = key.int("expert_used_count", 0)
    if n_expert < 0 or n_used < 0:
        raise QllamaError(f"{a.arch}.expert_count {n_expert} and expert_used_count {n_used} must be >= 0")
    if n_expert > MAX_EXPERTS:
        raise QllamaError(f"{a.arch}.expert_count {n_expert} is more than {MAX_EXPERTS} (llama.cpp's limit)")
    if n_used > n_expert:
        raise QllamaError(f"{a.arch}.expert_used_count {n_used} is more than expert_count {n_expert}")
    if n_expert > 0 and n_used == 0:
        raise QllamaError(f"{a.arch}.expert_used_count must be > 0 when expert_count is {n_expert}")
    if required and n_expert == 0:
        raise QllamaError(f"{a.arch}.expert_count must be > 0 for {a.arch}")
    if n_expert == 0:
        return a
    ff_exp = a.n_ff
    if n_ff_exp == "key":
        ff_exp = key.int("expert_feed_forward_length", 0) or a.n_ff // n_used
    ff_sh = 0
    if shared != "none":
        ff_sh = key.int("expert_shared_feed_forward_length", 0)
        if shared == "always" and ff_sh == 0:
            ff_sh = a.n_ff
    if ff_exp <= 0 or ff_sh < 0:
        raise QllamaError(f"{a.arch}: expert feed-forward lengths must be positive (got {ff_exp}, shared {ff_sh})")
    return replace(a, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=ff_exp, n_ff_shexp=ff_sh)


# -- weights --------------------------------------------------------------------------------------


class ExpertTensor:
    """A 3-D expert tensor [ne0, ne1, n_expert] as n_expert 2-D QTensor views [ne0, ne1] of its
    contiguous per-expert slices of the mmap, each made on first use (`self[e]`)."""

    __slots__ = ("name", "type_id", "shape", "raw", "_views")

    def __init__(self, gf, name: str, ne0: int, ne1: int, n_expert: int):
        info = gf.tensors.get(name)
        if info is None:
            raise QllamaError(f"missing tensor {name!r}")
        if tuple(info.shape) != (ne0, ne1, n_expert):
            raise QllamaError(f"tensor {name!r} has shape {list(info.shape)}, expected {[ne0, ne1, n_expert]}")
        if info.type_id not in SUPPORTED_TYPES:
            raise UnsupportedError(f"tensor {name} has type {type_name(info.type_id)}, which qllama cannot run yet")
        raw = gf.tensor_bytes(name)  # uint8, read-only view of the mmap
        if raw.size % n_expert:
            raise QllamaError(f"tensor {name!r}: {raw.size} bytes do not split into {n_expert} experts")
        self.name, self.type_id, self.shape = name, info.type_id, (ne0, ne1)
        self.raw = raw.reshape(n_expert, raw.size // n_expert)  # (n_expert, bytes per expert), no copy
        self._views: list[QTensor | None] = [None] * n_expert
        QTensor.from_bytes(self.type_id, self.raw[0], self.shape, name=f"{name}[0]")  # checks block sizes once

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, e: int) -> QTensor:
        q = self._views[e]
        if q is None:
            q = self._views[e] = QTensor.from_bytes(self.type_id, self.raw[e], self.shape, name=f"{self.name}[{e}]")
        return q

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @property
    def rows3(self) -> np.ndarray:
        """The packed rows of every expert, (n_expert, ne1, row bytes) uint8 (a view)."""
        return self.raw.reshape(len(self._views), self.shape[1], -1)


class MoeFFN:
    """One layer's router, experts and optional shared expert; `forward` is its FFN."""

    router_b: np.ndarray | None = None  # (n_expert,) a bias added to the router's logits (gpt-oss)
    top_k_first = False  # gpt-oss's gate: top k of the logits, then the softmax over those k

    def __init__(self, router: QTensor, gate: ExpertTensor | None, up: ExpertTensor, down: ExpertTensor,
                 n_used: int, norm_w: bool, w_scale: float = 0.0, shared: tuple | None = None,
                 shared_gate: np.ndarray | None = None):
        self.router = router  # [n_embd, n_expert] (ffn_gate_inp; llama.cpp never quantizes it)
        self.gate = gate  # [n_embd, n_ff_exp] x n_expert; None: act(up) alone (llama's optional gate_exps)
        self.up = up  # [n_embd, n_ff_exp] x n_expert
        self.down = down  # [n_ff_exp, n_embd] x n_expert
        self.n_used = n_used
        self.norm_w = norm_w
        self.w_scale = np.float32(w_scale) if w_scale not in (0.0, 1.0) else None
        self.shared = shared  # (gate, up, down) QTensors of the shared expert, or None
        self._fusable: bool | None = None  # whether one-token steps may take kernels/fused.py's ffn per expert
        self._fused_addresses: tuple | None = None  # its kernels' addresses (the same for every expert)
        self._plan: tuple | bool | None = None  # kernels.experts.experts_ffn's fixed arguments; False: not these types
        self.shared_gate = shared_gate  # (n_embd,) qwen2moe's sigmoid gate of the shared expert, or None
        self._decode: tuple | bool | None = None  # kernels.experts.moe_decode's fixed arguments; False: not here

    @classmethod
    def load(cls, r: WeightReader, a: ModelArgs, i: int, *, norm_w: bool, gate_optional: bool = False,
             shared_gate: bool = False, w_scale: float = 0.0) -> "MoeFFN":
        p = f"blk.{i}."
        d, ff, n = a.n_embd, a.n_ff_exp, a.n_expert
        gf = r.gf
        router = r.matrix(p + "ffn_gate_inp.weight", d, n)
        gate = None
        if not gate_optional or r.has(p + "ffn_gate_exps.weight"):
            gate = ExpertTensor(gf, p + "ffn_gate_exps.weight", d, ff, n)
        up = ExpertTensor(gf, p + "ffn_up_exps.weight", d, ff, n)
        down = ExpertTensor(gf, p + "ffn_down_exps.weight", ff, d, n)
        shared = sgate = None
        if a.n_ff_shexp > 0:
            fs = a.n_ff_shexp
            shared = (r.matrix(p + "ffn_gate_shexp.weight", d, fs), r.matrix(p + "ffn_up_shexp.weight", d, fs),
                      r.matrix(p + "ffn_down_shexp.weight", fs, d))
            if shared_gate:
                sgate = r.vector(p + "ffn_gate_inp_shexp.weight", d)
        return cls(router, gate, up, down, a.n_expert_used, norm_w, w_scale, shared, sgate)

    # -- the forward pass --

    def route(self, model, h: np.ndarray, hq) -> tuple[np.ndarray, np.ndarray]:
        """Router: (experts (T, k) int64 best first, weights (T, k) float32), with the points fired."""
        step = model.step
        logits = step.point("ffn_moe_logits", self._router_logits(step, hq))  # (T, n_expert)
        # softmax as ggml's (exp(x - max) in float32, summed in double, scaled by 1/sum), top k, weights
        experts, w = self._gate(logits, _NO_EXPERTS)  # (T, k) int64, (T, k) float32
        if step.wants("ffn_moe_experts"):  # a hook may force other experts
            forced = self._checked_experts(step.point("ffn_moe_experts", experts.astype(np.float32)), logits.shape[1])
            experts, w = self._gate(logits, forced)
        return experts, step.point("ffn_moe_weights", w)

    def _router_logits(self, step, hq) -> np.ndarray:
        """The router's logits (T, n_expert) (+ router_b): the mat-mat kernel for every batch size
        (a token's logits do not depend on its batch)."""
        logits = step.op("ffn_gate_inp (router)", self.router.matmul, hq)
        return logits if self.router_b is None else logits + self.router_b

    def _gate(self, logits: np.ndarray, forced: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(experts, weights) from the router's logits (T, n_expert), or the weights of `forced`
        experts (T, k) int64 ((0, 0): none): kernels/router.py."""
        from ..kernels.router import softmax_top_k, top_k_softmax

        logits = np.ascontiguousarray(logits, np.float32)
        if self.top_k_first:  # (ties to the lower id)
            return top_k_softmax(logits, self.n_used, forced)
        scale = np.float32(0.0 if self.w_scale is None else self.w_scale)
        return softmax_top_k(logits, self.n_used, forced, bool(self.norm_w), scale, WEIGHT_SUM_MIN)

    @staticmethod
    def _checked_experts(ids: np.ndarray, n_expert: int) -> np.ndarray:
        out = np.asarray(ids)
        if not np.all(np.isfinite(out)) or np.any(out != np.round(out)) or out.min() < 0 or out.max() >= n_expert:
            raise QllamaError(f"a hook on ffn_moe_experts returned ids outside 0..{n_expert - 1} or not integers")
        return out.astype(np.int64)

    def forward(self, model, h: np.ndarray, act: int) -> np.ndarray:
        """h (T, n_embd) normed FFN input -> (T, n_embd): the weighted sum of each token's experts."""
        from ..kernels.layer_ops import glu

        step = model.step
        n_tok, n_embd = h.shape
        if n_tok == 1 and step.fused is not None and self.shared is None:  # decode: one call, when it applies
            out = self._decode_call(step, h, act)
            if out is not None:
                return step.point("ffn_out", out)
        hq = quantize_activation(h)  # quantized once for the router, the shared expert and one-token steps
        experts, w = self.route(model, h, hq)
        k = experts.shape[1]
        # every expert in one call (--no-fuse: one-token steps call each matrix), else per expert
        out = self._one_call(step, hq, experts, w, act) if n_tok > 1 or step.fused is not None else None
        if out is None and n_tok == 1:  # decode: the k experts in slot order, on the one activation quantized once
            fused = self._fused_call(step, h, act) if step.fused is not None else None
            for s, e in enumerate(experts[0].tolist()):
                # one fused call per expert (gate|up, GLU, down: kernels/fused.py), else the unfused
                # calls; the same bits either way (as the dense FFN's fused step)
                y = fused(e) if fused is not None else self._expert(step, e, hq, act, glu)  # (1, n_embd)
                y *= w[0, s]
                if out is None:
                    out = y
                else:
                    out += y
        elif out is None:  # a batch: each chosen expert once over its tokens (mul_mat_id), then the same sums
            ys = np.empty((n_tok, k, n_embd), np.float32)  # (T, k, n_embd): each slot's weighted expert output
            ids, bounds, order = _groups(experts, len(self.up))
            for j, e in enumerate(ids.tolist()):
                pos = order[bounds[j] : bounds[j + 1]]  # (n_e,) flat positions routed to expert e
                tok, slot = pos // k, pos % k
                y = self._expert(step, e, quantize_activation(np.ascontiguousarray(h[tok])), act, glu)  # (n_e, n_embd)
                y *= w[tok, slot][:, None]
                ys[tok, slot] = y
            out = ys[:, 0].copy()  # (T, n_embd)
            for s in range(1, k):
                out += ys[:, s]
        if self.shared is not None:
            out += self._shared(model, h, hq, act, glu)
        return step.point("ffn_out", out)

    # -- every chosen expert in one call (kernels/experts.py) --

    _NO_BIAS = np.zeros((0, 0), np.float32)

    def biases(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) expert biases (n_expert, width) float32; (0, 0) arrays for none."""
        return self._NO_BIAS, self._NO_BIAS, self._NO_BIAS

    def act_kernel(self):
        """The GLU kernel (gate, up, out, act) of the experts: layer_ops.glu."""
        return _glu()

    def _one_call(self, step, hq, experts: np.ndarray, w: np.ndarray, act: int) -> np.ndarray | None:
        """The routed experts' weighted sum (T, n_embd) by one kernels.experts.experts_ffn call,
        or None (the per-expert calls) when its kernels do not run these types or their
        addresses are not there yet (a recording warm-up)."""
        from ..kernels.experts import experts_ffn
        from ..qtensor import int8_enabled

        plan = self._experts_plan(act) if int8_enabled() else None  # (the float path: per expert)
        if not plan:
            return None

        (fg, raw_g, raw_u, raw_d, b_g, b_u, b_d, tab, rows_gu, gemm_gu, rows_d, gemm_d, tile_rows, from_gu, from_d,
         act_address, quant_address, dd, ds, phase_address) = plan
        ids, bounds, order = _groups(experts, len(self.up))
        hq_, hd, hs = hq.quantized(fg)
        out = np.empty((w.shape[0], raw_d.shape[1]), np.float32)  # (T, n_embd)
        step.op("ffn_moe experts: gate|up + glu + quantize + down + weighted sum (one call)", experts_ffn,
                hq_, hd, hs, ids, bounds, order, np.require(w, np.float32, "CW"),  # (the types phase_address has)
                raw_g, raw_u, raw_d, b_g, b_u, b_d, tab, rows_gu, gemm_gu, rows_d, gemm_d, tile_rows, from_gu, from_d,
                act_address, np.int64(act), quant_address, dd, ds, out, phase_address, np.int64(step.n_threads))
        return out

    def _decode_call(self, step, h: np.ndarray, act: int) -> np.ndarray | None:
        """A decoded token's FFN (1, n_embd) by one kernels.experts.moe_decode call (router,
        gate, groups, h's quantization, experts), or None when it does not apply (a router not
        in f32, the per-expert kernels, a recording warm-up): then the calls one by one."""
        from ..kernels.experts import moe_decode

        args = self._decode_plan(h, act)
        if args is None:
            return None
        out = np.empty((1, h.shape[1]), np.float32)  # (1, n_embd)
        step.op("ffn_moe: router + top-k + gate|up + glu + quantize + down + weighted sum (one call)", moe_decode,
                np.ascontiguousarray(h), *args, out, self._plan[-1], np.int64(step.n_threads))
        return out

    def _decode_plan(self, h: np.ndarray, act: int) -> tuple | None:
        """moe_decode's arguments between h and out, made once (None while an address is missing)."""
        if self._decode is False:
            return None
        if self._decode is not None:
            return self._decode
        from ..gguf.types import F32
        from ..kernels.floats import matmul_f32
        from ..kernels.fused import quant_address
        from ..kernels.jit import address_of
        from .decode import form_buffers

        plan = self._experts_plan(act)
        if self._plan is False or self.router.type_id != F32:
            self._decode = False
            return None
        if not plan:
            return None
        fg = plan[0]
        w = self.router._typed  # (n_expert, n_embd) float32
        logits = np.empty((1, w.shape[0]), np.float32)
        router_args = (w, h, logits, np.int64(1))
        router_address = address_of(matmul_f32, router_args, lambda: matmul_f32(*router_args))
        xq = form_buffers(fg, 1, h.shape[1])  # h in the experts' int8 form (1, n_embd): the kinds of moe_decode's own
        x_address = quant_address(fg, h, *xq)
        if not (router_address and x_address):
            return None
        rb = np.zeros(0, np.float32) if self.router_b is None else np.array(self.router_b, np.float32)
        scale = np.float32(0.0 if self.w_scale is None else self.w_scale)
        # then experts_ffn's arguments from raw_g on, as _one_call passes them (act after act_address)
        self._decode = (w, rb, np.int64(router_address), self.top_k_first, np.int64(self.n_used), _NO_EXPERTS,
                        bool(self.norm_w), scale, WEIGHT_SUM_MIN, *xq, np.int64(x_address), *plan[1:16], np.int64(act),
                        *plan[16:19])
        return self._decode

    def _experts_plan(self, act: int):
        """experts_ffn's arguments fixed for this layer (matrices, kernels' addresses), made once;
        False when a type has no serial row kernel; None while an address is missing."""
        if self._plan is False:
            return None
        if self._plan is not None:
            return self._plan
        from ..kernels import experts as kx
        from ..kernels.fused import quant_address
        from ..kernels.int8 import TILE_ROWS
        from ..kernels.jit import address_of
        from ..qtensor import TYPES, _fp16_table
        from .decode import form_buffers

        g, u, d = self.gate, self.up, self.down
        kinds = [kx.row_kernels(t.type_id) for t in (g, u, d)] if g is not None else [None]
        if None in kinds or g.type_id != u.type_id:
            self._plan = False
            return None
        fg, fd = TYPES[g.type_id].int8_form, TYPES[d.type_id].int8_form
        (n_embd, n_ff), tab = g.shape, _fp16_table()
        raw_g, raw_u, raw_d = g.rows3, u.rows3, d.rows3

        def addresses(kernels, raw3, form, n_cols) -> tuple[int, int]:  # (row kernel, gemm; -1: none)
            xa = form_buffers(form, 1, n_cols)
            args = (raw3[0], *xa, tab, np.empty((1, raw3.shape[1]), np.float32), np.int64(0), np.int64(0))
            found = [address_of(kn, args, lambda kn=kn: kn(*args)) for kn in kernels if kn is not None]
            if kernels[1] is None or raw3.shape[1] % TILE_ROWS:
                found = found[:1] + [-1]  # (no gemm: -1, not a missing address)
            return found[0], found[1]

        gate_buf, up_buf = np.empty((1, n_ff), np.float32), np.empty((1, n_ff), np.float32)  # (1, n_ff_exp)
        gq = form_buffers(fd, 1, n_ff)
        act_fn = self.act_kernel()
        act_args = (gate_buf, up_buf, gate_buf, act)
        found = (*addresses(kinds[0], raw_g, fg, n_embd), *addresses(kinds[2], raw_d, fd, n_ff),
                 address_of(act_fn, act_args, lambda: act_fn(*act_args)), quant_address(fd, gate_buf, *gq))
        if not all(found):  # a recording warm-up: the per-expert calls this time
            return None
        rows_gu, gemm_gu, rows_d, gemm_d, act_address, q_address = (np.int64(max(a, 0)) for a in found)
        from_gu, from_d = (GEMM_FROM_TOKENS.get(t.type_id, GEMM_FROM_DEFAULT) for t in (g, d))
        plan = (fg, raw_g, raw_u, raw_d, *self.biases(), tab, rows_gu, gemm_gu, rows_d, gemm_d, np.int64(TILE_ROWS),
                from_gu, from_d, act_address, q_address, gq[1], gq[2])
        # the phases' tuple on 0 rows, as experts_ffn makes it: its types give _phase's address
        none = np.zeros(0, np.int64)
        sample = kx.phase_arrays(*form_buffers(fg, 1, n_embd), none, np.zeros(1, np.int64), none,
                                 np.empty((1, self.n_used), np.float32), *plan[1:15], plan[15], np.int64(act),
                                 *plan[16:], np.empty((1, n_embd), np.float32))
        phase_address = kx.phase_address(sample)
        if not phase_address:
            return None
        self._plan = (*plan, np.int64(phase_address))
        return self._plan

    def _fused_call(self, step, h: np.ndarray, act: int):
        """A function e -> expert e's output (1, n_embd) through one kernels.fused.ffn call, or None
        when a matrix type has no fused kernel (or the kernels' addresses are not there yet)."""
        from ..kernels import fused
        from ..qtensor import FUSED_TYPES, TYPES
        from .decode import form_buffers

        if self._fusable is None:  # decided once: the types are the same for every expert
            g, u, d = self.gate, self.up, self.down
            self._fusable = (g is not None and all(t.type_id in FUSED_TYPES for t in (g, u, d))
                             and TYPES[g.type_id].int8_form == TYPES[u.type_id].int8_form)
        if not self._fusable:
            return None
        fg, fd = TYPES[self.gate.type_id].int8_form, TYPES[self.down.type_id].int8_form
        n_embd, n_ff = self.gate.shape  # (ne0, ne1) of each expert's gate

        def qbuf(form: str, n: int):
            return form_buffers(form, 1, n)

        xq = qbuf(fg, n_embd)  # h quantized (each call quantizes it again: n_embd values, nothing next to the rows)
        gq = qbuf(fd, n_ff)
        gate_buf, up_buf = np.empty((1, n_ff), np.float32), np.empty((1, n_ff), np.float32)  # (1, n_ff_exp)
        er, eo = _EMPTY_RAW, _EMPTY_OUT
        tg, tu, td = self.gate.type_id, self.up.type_id, self.down.type_id
        nt = step.n_threads

        def run(e: int) -> np.ndarray:
            out = np.empty((1, n_embd), np.float32)
            ad = self._fused_addresses
            if ad is None:  # (from this expert's views: their types are every expert's)
                ad = (fused.quant_address(fg, h, *xq), fused.quant_address(fd, gate_buf, *gq),
                      fused.rows_address(tg, self.gate[e].raw, gate_buf, tu, self.up[e].raw, up_buf, tg, er, eo, *xq),
                      fused.rows_address(td, self.down[e].raw, out, td, er, eo, td, er, eo, *gq),
                      fused.glu_address(gate_buf, up_buf, act))
                if not all(ad):  # a recording warm-up: this step runs unfused, the next asks again
                    return self._expert(step, e, quantize_activation(h), act, _glu())
                self._fused_addresses = ad
            step.op("quantize x + ffn_moe gate|up + glu + quantize + ffn_moe_down (fused)", fused.ffn, h, ad[0], *xq,
                    tg, self.gate[e].raw, gate_buf, tu, self.up[e].raw, up_buf, act, ad[1], *gq, td, self.down[e].raw,
                    out, er, eo, ad[2], ad[3], ad[4], nt)
            return out

        return run

    def _expert(self, step, e: int, xa, act: int, glu) -> np.ndarray:
        """Expert e on the activation xa (n, n_embd): down(act(gate x) * up x) -> (n, n_embd), in
        decode's rounding (as the one-call kernel of a batch's experts, kernels/experts.py)."""
        up = step.project("ffn_moe_up", self.up[e], xa, as_decode=True)  # (n, n_ff_exp)
        if self.gate is not None:
            g = step.project("ffn_moe_gate", self.gate[e], xa, as_decode=True)  # (n, n_ff_exp)
        else:  # act(up) alone
            g, up = up, np.ones_like(up)
        step.op("glu", glu, g, up, g, act)
        return step.project("ffn_moe_down", self.down[e], quantize_activation(g), as_decode=True)

    def _shared(self, model, h, hq, act, glu) -> np.ndarray:
        """The shared expert (T, n_embd), times sigmoid(h . ffn_gate_inp_shexp) when it has that gate."""
        sg, su, sd = self.shared
        step = model.step
        g = step.project("ffn_gate_shexp", sg, hq)  # (T, n_ff_shexp)
        u = step.project("ffn_up_shexp", su, hq)
        step.op("glu", glu, g, u, g, act)
        y = step.project("ffn_down_shexp", sd, quantize_activation(g))  # (T, n_embd)
        if self.shared_gate is not None:
            z = (h * self.shared_gate).sum(axis=1)  # (T,) row by row (the same value at any batch size)
            y *= (np.float32(1.0) / (np.float32(1.0) + np.exp(-z)))[:, None]
        return y


def _groups(experts: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """experts (T, k) int64 -> (ids (G,) the chosen experts ascending, bounds (G + 1,), order (T k,)):
    expert ids[j]'s flat positions t * k + slot, tokens in order, are order[bounds[j]:bounds[j + 1]]."""
    from ..kernels.router import group_by_expert

    return group_by_expert(np.ascontiguousarray(experts, np.int64), n_expert)


def _glu():
    from ..kernels.layer_ops import glu

    return glu


def load_moe_weights(cls, gf, args: ModelArgs, **moe) -> Weights:
    """Every block with an MoE FFN (`MoeFFN.load` options in moe), embedding, norm, output."""
    r = WeightReader(gf)
    layers: list[LayerWeights] = []
    for i in range(args.n_layer):
        lw = r.layer(i, args, dense_ffn=False, **cls.layer_tensors)
        lw.moe = MoeFFN.load(r, args, i, **moe)
        layers.append(lw)
    return r.model(args, layers, own_output=cls.own_output)


def expert_bytes(gf, args: ModelArgs) -> tuple[int, int]:
    """(bytes of every ffn_*_exps tensor, bytes of the rest) of an open GGUFFile: a decoded token
    reads the rest plus n_expert_used / n_expert of the experts."""
    exp = sum(t.n_bytes or 0 for name, t in gf.tensors.items() if name.endswith("_exps.weight"))
    total = sum(t.n_bytes or 0 for t in gf.tensors.values())
    return exp, total - exp


__all__ = ["MAX_EXPERTS", "ExpertTensor", "MoeFFN", "read_moe_args", "load_moe_weights", "expert_bytes"]
