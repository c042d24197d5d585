"""Layer-by-layer comparison of qllama's activations with llama.cpp's (llama-cpp-python).

Both engines evaluate the same token ids (teacher-forced, every position's logits); llama.cpp's
tensors are read through its graph eval callback (`cb_eval`: each named graph node after it is
computed), qllama's through its named points (`Model.trace`). For each layer the table shows,
per tensor, the relative error ||qllama - llama.cpp|| / ||llama.cpp|| over the chosen rows (one
position, or all), and the column where it first jumps tells which operation departs. With
--local, each qllama point is computed from llama.cpp's value of the point before it (activation
patching), so a column shows the error of its own operations alone: on SmolLM2 Q4_1 the int8
products (v, a_out, f_out, logits) are then 0 and the float steps about one ulp.

    python tools/compare_layers.py                         # SmolLM2 (tools/fetch_smollm2.py), text position 61
    python tools/compare_layers.py MODEL.gguf --prompt "The capital of France is"
    python tools/compare_layers.py --position 303 --rows all --kv f32
    python tools/compare_layers.py --max-abs               # max |difference| instead of the relative error
    python tools/compare_layers.py --local                 # each operation's own error (see above)

Point names (qllama -> llama.cpp): embed -> embd (Gemma: inp_scaled), blk.i.attn_norm -> attn_norm-i, attn_q ->
Qcur-i (after RoPE), attn_k -> Kcur-i, attn_v -> Vcur-i, attn_z -> kqv_out-i, attn_out ->
attn_out-i, ffn_in -> ffn_norm-i, ffn_act -> ffn_swiglu-i / ffn_geglu-i, ffn_out -> ffn_out-i,
resid -> l_out-i, result_norm -> result_norm, logits -> result_output. qllama's attn_k/attn_v are
the values as stored in its KV cache (f16-rounded with an f16 cache); llama.cpp's Kcur/Vcur are
float32 before the store, so they are rounded the same way here before the comparison.
Families whose blocks add other nodes (post-norms) are compared on these points only.
Needs llama-cpp-python (the oracle); a one-line `error:` without it.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# qllama point -> llama.cpp graph node name ({i}: the layer); a tuple tries each name in turn
POINTS = {
    "attn_norm": "attn_norm-{i}",
    "attn_q": "Qcur-{i}",
    "attn_k": "Kcur-{i}",
    "attn_v": "Vcur-{i}",
    "attn_z": "kqv_out-{i}",
    "attn_out": "attn_out-{i}",
    "ffn_in": "ffn_norm-{i}",
    "ffn_act": ("ffn_swiglu-{i}", "ffn_geglu-{i}"),
    "ffn_out": "ffn_out-{i}",
    "resid": "l_out-{i}",
}
GLOBAL = {"embed": ("inp_scaled", "embd"), "result_norm": "result_norm", "logits": "result_output"}  # Gemma scales: inp_scaled
SHORT = {"attn_norm": "a_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_z": "z", "attn_out": "a_out",
         "ffn_in": "f_norm", "ffn_act": "f_act", "ffn_out": "f_out", "resid": "resid"}
GGML_F32, GGML_F16 = 0, 1


class _GgmlTensor(ctypes.Structure):
    """The head of ggml.h's `struct ggml_tensor` (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64), as the oracle's ggml lays it out."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def _tensor_array(t: _GgmlTensor) -> np.ndarray:
    """A copy of a computed f32/f16 tensor as float32, NumPy axes reversed from ggml's (ne3..ne0)."""
    dtype = {GGML_F32: np.float32, GGML_F16: np.float16}[t.type]
    ne = [int(t.ne[k]) for k in range(4)]
    nb = [int(t.nb[k]) for k in range(4)]
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(dtype).itemsize
    raw = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_uint8)), shape=(span,))
    view = np.lib.stride_tricks.as_strided(raw.view(dtype) if nb[0] == np.dtype(dtype).itemsize else raw,
                                           shape=ne[::-1], strides=nb[::-1])
    return np.array(view, dtype=np.float32)


class LlamaCppTaps:
    """llama-cpp-python with an eval callback that keeps the wanted rows of the named nodes.

    `run(ids)` evaluates the ids from an empty cache (batches of 512, as tests/test_families_oracle.py
    runs the oracle) and returns {node name: (rows, ...) float32} for the token positions in `rows`
    plus the logits (T, n_vocab)."""

    def __init__(self, path: str, n_ctx: int, kv: str, names: set[str]):
        import llama_cpp
        import llama_cpp.llama_cpp as lc

        self.names = names
        self.rows: np.ndarray = np.zeros(0, np.int64)
        self.got: dict[str, dict[int, np.ndarray]] = {}  # name -> micro-batch start -> rows
        self.base = self.next_base = 0

        @lc.ggml_backend_sched_eval_callback
        def tap(t_ptr, ask, _user):
            t = _GgmlTensor.from_address(t_ptr)
            name = t.name.decode("utf-8", "replace")
            if ask:
                return name in self.names or name == "embd"
            if name == "embd":  # the first node of each micro-batch: where its rows start
                self.base, self.next_base = self.next_base, self.next_base + int(t.ne[1])
            if name in self.names and t.type in (GGML_F32, GGML_F16):
                # tokens are ggml's outermost dimension of size n_ubatch: ne1 of (n_embd, T), ne2 of (D, heads, T)
                n_tok = self.next_base - self.base
                dim = max((k for k in (1, 2, 3) if t.ne[k] == n_tok), default=1)
                a = _tensor_array(t)  # (ne3, ne2, ne1, ne0)
                tok_axis = 3 - dim
                pos = np.arange(self.base, self.base + n_tok)
                keep = np.flatnonzero(np.isin(pos, self.rows))
                if keep.size:
                    part = np.moveaxis(np.take(a, keep, axis=tok_axis), tok_axis, 0)
                    # a name given twice in a micro-batch (Qcur before and after RoPE): the last one counts
                    self.got.setdefault(name, {})[self.base] = part.reshape(keep.size, -1)
            return True

        self._tap = tap  # kept alive as long as the context
        original = lc.llama_context_default_params

        def with_tap():
            p = original()
            p.cb_eval = tap
            return p

        ggml_type = {"f16": GGML_F16, "f32": GGML_F32}[kv]
        lc.llama_context_default_params = with_tap
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=2, logits_all=True,
                                       verbose=False, seed=0, type_k=ggml_type, type_v=ggml_type, flash_attn=False)
        finally:
            lc.llama_context_default_params = original

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def run(self, ids: list[int], rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        self.rows, self.got = np.asarray(rows), {}
        self.base = self.next_base = 0
        self.llm.reset()
        self.llm.eval(list(ids))
        logits = np.array(self.llm.scores[: len(ids)], dtype=np.float64)
        return {k: np.concatenate([v[b] for b in sorted(v)]) for k, v in self.got.items()}, logits


def qllama_points(path: str, ids: list[int], rows: np.ndarray, n_ctx: int, kv: str,
                  patch: dict | None = None) -> tuple[dict, np.ndarray]:
    """qllama's points at the given rows {point name: (rows, ...)} and its logits (T, n_vocab).

    patch: {point name: llama.cpp's array (T, ...) over every position}: qllama's value at each
    such point is recorded and then replaced by llama.cpp's, so that the next point shows only the
    error of the operations in between (llama.cpp's K and V are stored into the cache as its own)."""
    import qllama

    model = qllama.load(path, n_ctx=n_ctx, type_k=kv, type_v=kv)
    caps = ["embed", "result_norm", "logits"] + [f"blk.*.{p}" for p in POINTS]
    if not patch:
        with model.trace(capture=caps) as t:
            logits = model.logits(ids).astype(np.float64)
        return {n: t[n][rows] for n in t.names()}, logits
    seen: dict[str, np.ndarray] = {}

    def swap(name, arr, _il):
        seen[name] = np.array(arr[rows], dtype=np.float32)
        if name in patch:
            return patch[name].reshape(arr.shape)
        return None

    with model.hooks.add(caps, swap):
        logits = model.logits(ids).astype(np.float64)
    return seen, logits


def llama_names(n_layer: int) -> dict[str, tuple[str, ...]]:
    """qllama point name -> the llama.cpp node names that may hold it."""
    out = {p: (n,) if isinstance(n, str) else n for p, n in GLOBAL.items()}
    for i in range(n_layer):
        for p, spec in POINTS.items():
            out[f"blk.{i}.{p}"] = tuple(s.format(i=i) for s in ((spec,) if isinstance(spec, str) else spec))
    return out


def rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64).reshape(-1), np.asarray(want, np.float64).reshape(-1)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def compare(ours: dict, theirs: dict, n_layer: int, kv: str, max_abs: bool = False) -> tuple[list, list]:
    """Rows of (layer, {point: value}) and the global points' values; value = relative error
    (or max |difference|); None where llama.cpp has no such node."""
    def metric(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - b))) if max_abs else rel(a, b)

    def theirs_of(spec, i=None):
        for name in (spec,) if isinstance(spec, str) else spec:
            name = name.format(i=i)
            if name in theirs:
                return theirs[name]
        return None

    table = []
    for i in range(n_layer):
        vals = {}
        for p, spec in POINTS.items():
            b, a = theirs_of(spec, i), ours.get(f"blk.{i}.{p}")
            if b is None or a is None:
                vals[p] = None
                continue
            b = b.reshape(a.shape)
            if p in ("attn_k", "attn_v") and kv == "f16":
                b = b.astype(np.float16).astype(np.float32)  # as llama.cpp stores them
            vals[p] = metric(a, b)
        table.append((i, vals))
    glob = []
    for p, spec in GLOBAL.items():
        b = theirs_of(spec)
        if b is not None and p in ours:
            glob.append((p, metric(ours[p], b.reshape(ours[p].shape))))
    return table, glob


def layer_errors(taps: LlamaCppTaps, path: str, ids: list[int], rows: np.ndarray, n_layer: int, kv: str, n_ctx: int,
                 local: bool = False, max_abs: bool = False) -> tuple[list, list, np.ndarray, np.ndarray]:
    """Both engines on ids; (per-layer table, global points, llama.cpp logits, qllama logits), as
    `compare` gives them. local: every qllama point is fed llama.cpp's value of the previous one
    (keeps every row of every tensor in memory)."""
    theirs, want = taps.run(ids, np.arange(len(ids)) if local else rows)
    patch = None
    if local:
        which = llama_names(n_layer)
        patch = {p: theirs[next(n for n in ns if n in theirs)] for p, ns in which.items()
                 if p != "logits" and any(n in theirs for n in ns)}  # the first name present, as `compare` takes it
        theirs = {k: v[rows] for k, v in theirs.items()}
    ours, got = qllama_points(path, ids, rows, n_ctx, kv, patch)
    table, glob = compare(ours, theirs, n_layer, kv, max_abs)
    return table, glob, want, got


def argmax_report(got: np.ndarray, want: np.ndarray, margin: float = 0.1) -> str:
    top2 = np.sort(want, axis=1)[:, -2:]
    sure = (top2[:, 1] - top2[:, 0]) >= margin
    agree = np.argmax(got, axis=1) == np.argmax(want, axis=1)
    bad = np.flatnonzero(sure & ~agree)
    return (f"{len(got)} positions: argmax agrees at {int((agree & sure).sum())}/{int(sure.sum())} with llama.cpp margin "
            f">= {margin}; differs at {bad.tolist()}; max |dlogit| {np.abs(got - want).max():.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("model", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 via tools/fetch_smollm2.py)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="text to evaluate (BOS added as llama.cpp adds it)")
    src.add_argument("--text", help="file whose text is evaluated (default: ../shared/models/shakespeare-val.txt, first 12000 chars)")
    ap.add_argument("--position", type=int, default=None,
                    help="the position compared; the ids are cut after it (default: the last one of --prompt, 61 of the text)")
    ap.add_argument("--rows", choices=["position", "all"], default="position",
                    help="rows the errors are taken over: the chosen position only, or every position up to it")
    ap.add_argument("--kv", choices=["f16", "f32"], default="f16", help="KV cache type of both engines (default f16)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--local", action="store_true",
                    help="feed each qllama point llama.cpp's value of the point before it (activation patching): "
                         "each column is then the error of its own operations alone")
    ap.add_argument("--max-abs", action="store_true", help="print max |difference| instead of the relative error")
    args = ap.parse_args(argv)

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("error: llama-cpp-python (the oracle) is not installed", file=sys.stderr)
        return 1
    if args.model:
        path = Path(args.model)
        if not path.is_file():
            print(f"error: {path} is not a file", file=sys.stderr)
            return 1
    else:
        from tools.fetch_smollm2 import FetchError, fetch

        try:
            path = fetch()
        except FetchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if args.prompt is not None:
        text = args.prompt
    else:
        tp = Path(args.text) if args.text else REPO.parent / "shared" / "models" / "shakespeare-val.txt"
        if not tp.is_file():
            print(f"error: {tp} is not a file", file=sys.stderr)
            return 1
        text = tp.read_text(encoding="utf-8", errors="replace")[: None if args.text else 12000]

    import qllama

    n_layer = qllama.load(path, n_ctx=16).args.n_layer
    which = llama_names(n_layer)
    names = {n for ns in which.values() for n in ns}
    lc = LlamaCppTaps(str(path), args.n_ctx, args.kv, names)
    ids = lc.tokenize(text)
    pos = args.position if args.position is not None else (len(ids) - 1 if args.prompt is not None else 61)
    if not 0 <= pos < min(len(ids), args.n_ctx):
        print(f"error: position {pos} is outside the {min(len(ids), args.n_ctx)} tokens", file=sys.stderr)
        return 1
    ids = ids[: pos + 1]
    rows = np.arange(pos + 1) if args.rows == "all" else np.array([pos])
    table, glob, want, got = layer_errors(lc, str(path), ids, rows, n_layer, args.kv, args.n_ctx, args.local, args.max_abs)

    what = "max |qllama - llama.cpp|" if args.max_abs else "relative error ||qllama - llama.cpp|| / ||llama.cpp||"
    print(f"{path.name}: {len(ids)} tokens, KV {args.kv}, rows: {'position ' + str(pos) if args.rows == 'position' else 'all'}; "
          f"{what}{'; each point from llama.cpp inputs (--local)' if args.local else ''}")
    print("layer " + " ".join(f"{SHORT[p]:>8}" for p in POINTS))
    for p, v in glob[:1]:
        print(f"{p:>5} {v:8.2e}")
    for i, vals in table:
        print(f"{i:5d} " + " ".join(f"{v:8.2e}" if v is not None else f"{'-':>8}" for v in vals.values()))
    for p, v in glob[1:]:
        print(f"{p}: {v:.3e}")
    w, g = want[pos], got[pos]
    print(f"position {pos}: llama.cpp argmax {int(np.argmax(w))} (margin {np.sort(w)[-1] - np.sort(w)[-2]:.3f}), "
          f"qllama argmax {int(np.argmax(g))}; max |dlogit| at this position {np.abs(g - w).max():.4f}")
    print(argmax_report(got, want))
    return 0


if __name__ == "__main__":
    sys.exit(main())
