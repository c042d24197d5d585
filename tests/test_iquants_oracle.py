"""Issue 30 item 2: the llama.cpp presets that need an importance matrix (IQ3_XXS, IQ2_XXS, IQ2_XS,
IQ2_S, IQ2_M, IQ1_S, IQ1_M, Q2_K_S), made by llama.cpp from the trained model and compared with
llama.cpp running the same file (oracle).

The importance matrix is computed as `llama-imatrix` computes it: for every matrix a `blk.*`
matmul multiplies, the sum over tokens of each input column's squared activation, and the number
of tokens (output.weight is left out, as without --process-output), over chunks of the context
size whose first token is BOS. The activations are qllama's own (the f32 model, traced at the
points that feed each projection). The matrix is written in llama-imatrix's GGUF layout
(`write_imatrix_gguf`: `<tensor>.in_sum2`, `<tensor>.counts`, `imatrix.*` keys), read back as
llama-quantize reads it (`read_imatrix_gguf`: sum / count), and passed to llama.cpp's own
`llama_model_quantize` (its `llama_model_imatrix_data` array), so the per-tensor types, the
quantizer and the file layout are llama.cpp's own.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from qllama.gguf import types as gt

# preset -> (llama_ftype, the type the preset is named for, which the file must hold)
IMATRIX_FTYPES = {"IQ3_XXS": (23, gt.IQ3_XXS), "IQ2_XXS": (19, gt.IQ2_XXS), "IQ2_XS": (20, gt.IQ2_XS),
                  "IQ2_S": (28, gt.IQ2_XS), "IQ2_M": (29, gt.IQ2_S), "IQ1_S": (24, gt.IQ1_S),
                  "IQ1_M": (31, gt.IQ1_M), "Q2_K_S": (21, gt.Q2_K)}
# the projection each traced point feeds (qllama.models.points): llama.cpp's matmul inputs
FEEDS = {"attn_norm": ("attn_q", "attn_k", "attn_v"), "attn_z": ("attn_output",),
         "ffn_in": ("ffn_gate", "ffn_up"), "ffn_act": ("ffn_down",)}
CALIBRATION_CTX = 256  # llama-imatrix's chunk: the model's training context
CALIBRATION_CHUNKS = 32  # llama-imatrix --chunks 32 (the text has 67)


def calibration_text() -> str:
    """The held-out text after the part the comparisons score (test_families_oracle._text)."""
    from conftest import shared_path

    return shared_path("models", "shakespeare-val.txt").read_text()[6000:]


def calibration_chunks(ids: list[int], n_ctx: int, max_chunks: int) -> list[list[int]]:
    """llama-imatrix's chunks of a tokenized text (BOS first): n_ctx tokens each, BOS in front."""
    chunks = [list(ids[c * n_ctx:(c + 1) * n_ctx]) for c in range(min(len(ids) // n_ctx, max_chunks))]
    for chunk in chunks:
        chunk[0] = ids[0]
    return chunks


def _accumulate(stats: dict, name: str, x: np.ndarray) -> None:
    """Add the rows of x (tokens, ne0) to name's (sum of squares, token count)."""
    x = np.asarray(x, np.float64)
    s, n = stats.get(name, (0.0, 0))
    stats[name] = (s + (x * x).sum(axis=0), n + x.shape[0])


def collect_imatrix(model_path, text: str | list[int], n_ctx: int = CALIBRATION_CTX,
                    max_chunks: int = CALIBRATION_CHUNKS) -> tuple[dict, int]:
    """llama-imatrix's statistics from qllama's activations over a text (or token ids, BOS first):
    ({weight name: (float64 (ne0,) sum of x^2, token count)}, chunks)."""
    import qllama

    model = qllama.load(model_path, n_ctx=n_ctx)
    chunks = calibration_chunks(model.tokenize(text) if isinstance(text, str) else text, n_ctx, max_chunks)
    stats: dict = {}
    for chunk in chunks:
        with model.trace(capture=[f"blk.*.{p}" for p in FEEDS]) as t:
            model.logits(chunk)
        for il in range(model.args.n_layer):
            for point, weights in FEEDS.items():
                x = np.asarray(t[f"blk.{il}.{point}"]).reshape(len(chunk), -1)  # (tokens, ne0)
                for w in weights:
                    _accumulate(stats, f"blk.{il}.{w}.weight", x)
    return stats, len(chunks)


def llama_cpp_imatrix(model_path, chunks: list[list[int]]) -> dict:
    """The same statistics from llama.cpp's own forward pass, collected as llama-imatrix does: an
    eval callback (llama_context_params.cb_eval) that, for every MUL_MAT whose weight is a `blk.*`
    tensor and whose f32 input has >= 16 rows, adds the input rows' squares. Every position's
    logits are asked for (as llama-imatrix does), so the last layer runs on every token."""
    import ctypes as C
    import os

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    base = C.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    base.ggml_op_name.restype, base.ggml_op_name.argtypes = C.c_char_p, [C.c_int]
    base.ggml_tensor_overhead.restype = C.c_size_t

    class Tensor(C.Structure):  # ggml.h's struct ggml_tensor (GGML_MAX_SRC 10, GGML_MAX_NAME 64)
        _fields_ = [("type", C.c_int), ("buffer", C.c_void_p), ("ne", C.c_int64 * 4), ("nb", C.c_size_t * 4),
                    ("op", C.c_int), ("op_params", C.c_int32 * 16), ("flags", C.c_int32), ("src", C.c_void_p * 10),
                    ("view_src", C.c_void_p), ("view_offs", C.c_size_t), ("data", C.c_void_p),
                    ("name", C.c_char * 64), ("extra", C.c_void_p), ("padding", C.c_char * 8)]

    assert C.sizeof(Tensor) + 32 == base.ggml_tensor_overhead(), "ggml_tensor's layout differs from this build"
    stats: dict = {}

    def weight_name(t: Tensor) -> str:  # "CPU#blk.0.attn_q.weight#0" -> "blk.0.attn_q.weight"
        name = Tensor.from_address(t.src[0]).name.decode()
        return name.split("#")[1] if "#" in name else name

    def callback(ptr, ask, _):
        t = Tensor.from_address(ptr)
        if base.ggml_op_name(t.op) != b"MUL_MAT":
            return not ask
        x = Tensor.from_address(t.src[1])
        if ask:
            return x.ne[1] >= 16 and x.type == 0 and weight_name(t).startswith("blk.")
        ne, nb = list(x.ne), list(x.nb)
        n_bytes = sum((n - 1) * b for n, b in zip(ne, nb)) + 4
        rows = np.ndarray(tuple(ne[::-1]), np.float32, (C.c_char * n_bytes).from_address(x.data), 0,
                          tuple(nb[::-1]))  # (ne3, ne2, ne1, ne0)
        _accumulate(stats, weight_name(t), rows.reshape(-1, ne[0]))
        return True

    cb = llama_cpp.ggml_backend_sched_eval_callback(callback)
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    n = len(chunks[0])
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n
    cp.n_threads = cp.n_threads_batch = 2
    cp.cb_eval, cp.cb_eval_user_data = cb, None
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    try:
        for chunk in chunks:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            batch.n_tokens = n
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, True
                batch.seq_id[i][0] = 0
            assert llama_cpp.llama_decode(ctx, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return stats


def write_imatrix_gguf(path, stats: dict, dataset: str, chunk_size: int, n_chunk: int) -> None:
    """llama-imatrix's GGUF output: general.type "imatrix", imatrix.datasets / chunk_count /
    chunk_size, and per matrix `<name>.in_sum2` (f32, ne = [ne0, 1]) and `<name>.counts` (f32,
    ne = [1, 1]), names sorted; no architecture key."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.kv_data[0].pop("general.architecture", None)  # GGUFWriter always adds one; llama-imatrix does not
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [dataset])
    w.add_uint32("imatrix.chunk_count", n_chunk)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name in sorted(stats):
        s, count = stats[name]
        w.add_tensor(f"{name}.in_sum2", np.asarray(s, np.float32).reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.full((1, 1), count, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_imatrix_gguf(path) -> dict[str, np.ndarray]:
    """An imatrix GGUF as llama-quantize reads it: {weight name: float32 in_sum2 / count} (a matrix
    with count 0 gets ones)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arrays = {t.name: np.asarray(t.data, np.float32) for t in r.tensors}
    out = {}
    for key, sums in arrays.items():
        if key.endswith(".in_sum2"):
            name = key[: -len(".in_sum2")]
            counts = arrays[f"{name}.counts"].reshape(-1)  # (n_mat,)
            sums = sums.reshape(counts.size, -1)  # (n_mat, ne0)
            safe = np.where(counts > 0, counts, 1.0).astype(np.float32)
            out[name] = np.where(counts[:, None] > 0, sums / safe[:, None], 1.0).astype(np.float32).reshape(-1)
    return out


@pytest.fixture(scope="module")
def imatrix_files(tmp_path_factory):
    """preset name -> the file llama.cpp made with the importance matrix (made on first use)."""
    from conftest import shared_path
    from test_iquants import llama_cpp_quantize

    src = shared_path("models", "shakespeare-spm-f32.gguf")
    root = tmp_path_factory.mktemp("iq-imatrix")
    stats, n_chunk = collect_imatrix(src, calibration_text())
    imatrix_path = root / "imatrix.gguf"
    write_imatrix_gguf(imatrix_path, stats, "shakespeare-val.txt[6000:]", CALIBRATION_CTX, n_chunk)
    imatrix = read_imatrix_gguf(imatrix_path)
    # llama-quantize records where its matrix came from
    kv = {"quantize.imatrix.file": str(imatrix_path), "quantize.imatrix.dataset": "shakespeare-val.txt[6000:]",
          "quantize.imatrix.entries_count": len(imatrix), "quantize.imatrix.chunks_count": n_chunk}

    @functools.cache
    def get(name: str) -> Path:
        path = root / f"shakespeare-{name}.gguf"
        llama_cpp_quantize(src, path, IMATRIX_FTYPES[name][0], imatrix=imatrix, kv=kv)
        return path

    get.imatrix, get.stats, get.n_chunk = imatrix, stats, n_chunk
    return get


@pytest.mark.oracle
def test_imatrix_file_round_trips_and_covers_every_block_matrix(imatrix_files):
    """The written imatrix GGUF reads back as sum / count for the 7 matrices of each block, with
    llama-imatrix's token count (chunks x context); no output / token_embd entry."""
    stats, imatrix = imatrix_files.stats, imatrix_files.imatrix
    assert imatrix_files.n_chunk >= 10
    assert sorted(imatrix) == sorted(f"blk.{i}.{w}.weight" for i in range(4) for ws in FEEDS.values() for w in ws)
    for name, (s, count) in stats.items():
        assert count == imatrix_files.n_chunk * CALIBRATION_CTX
        np.testing.assert_allclose(imatrix[name], s / count, rtol=1e-6)
        assert imatrix[name].size == (768 if "ffn_down" in name else 256) and (imatrix[name] > 0).all()
    # q, k and v share their input: one vector
    np.testing.assert_array_equal(imatrix["blk.2.attn_q.weight"], imatrix["blk.2.attn_v.weight"])


@pytest.mark.oracle
def test_imatrix_equals_llama_cpps_own_activations():
    """qllama's importance matrix == the one llama.cpp's forward pass gives through llama-imatrix's
    collection (its eval callback), on the same chunks of the f32 model: same entries, same token
    counts, and the same sums to float rounding (f16 KV caches on both sides)."""
    import qllama
    from conftest import shared_path

    src = shared_path("models", "shakespeare-spm-f32.gguf")
    chunks = calibration_chunks(qllama.load(src, n_ctx=CALIBRATION_CTX).tokenize(calibration_text()),
                                CALIBRATION_CTX, 4)
    ours, _ = collect_imatrix(src, calibration_text(), max_chunks=4)
    theirs = llama_cpp_imatrix(src, chunks)
    assert sorted(theirs) == sorted(ours)
    worst = 0.0
    for name, (s, count) in ours.items():
        assert theirs[name][1] == count == 4 * CALIBRATION_CTX
        worst = max(worst, float(np.abs(s / theirs[name][0] - 1).max()))
    print(f"\nIMATRIX vs llama.cpp: max relative difference {worst:.2e}")
    assert worst < 2e-3  # measured 3.1e-4


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("name", list(IMATRIX_FTYPES))
def test_imatrix_presets_match_llama_cpp(imatrix_files, name, tmp_path):
    """llama.cpp's file for a preset that needs an importance matrix: every quantized type in it
    decodes as gguf-py's; perplexity within 0.5% of llama.cpp's; teacher-forced argmax equal at
    every clear position; greedy text equal up to a near-tie (test_iquants.compare_with_llama_cpp)."""
    from qllama.gguf.reader import GGUFFile
    from test_iquants import compare_with_llama_cpp

    path = imatrix_files(name)
    gf = GGUFFile(path)
    assert gf.metadata["general.file_type"] == IMATRIX_FTYPES[name][0]
    assert gf.metadata["quantize.imatrix.chunks_count"] == imatrix_files.n_chunk
    del gf
    compare_with_llama_cpp(path, name, IMATRIX_FTYPES[name][1], tmp_path)


@pytest.mark.oracle
@pytest.mark.slow
def test_rows_not_a_multiple_of_256_fall_back_as_llama_cpp_does(tmp_path):
    """llama.cpp's IQ2_XXS preset on a model whose n_embd (288) is not a multiple of 256: the
    iq2_xxs matrices with 288-long rows fall back to iq4_nl, the q2_K ones (attn_v, token_embd) to
    q4_0, output to q8_0; only ffn_down (768-long rows) stays iq2_xxs. qllama runs llama.cpp's file and matches it
    (synthetic weights, imatrix from random tokens; compare_with_llama_cpp)."""
    from qllama.gguf.reader import GGUFFile
    from test_iquants import compare_with_llama_cpp, llama_cpp_quantize
    from tools.make_model import ModelSpec, write_model

    src = tmp_path / "f32.gguf"
    write_model(src, ModelSpec(n_embd=288, n_layer=2, n_head=4, n_head_kv=4, n_ff=768, n_ctx=256, seed=11))
    ids = [1] + np.random.default_rng(0).integers(3, 300, 8 * 128).tolist()
    stats, _ = collect_imatrix(src, ids, n_ctx=128, max_chunks=8)
    dst = tmp_path / "iq2_xxs.gguf"
    llama_cpp_quantize(src, dst, IMATRIX_FTYPES["IQ2_XXS"][0], imatrix={k: s / n for k, (s, n) in stats.items()})
    gf = GGUFFile(dst)
    types = {n: info.type_name for n, info in gf.tensors.items() if info.type_name != "f32"}
    del gf
    assert types == {"token_embd.weight": "q4_0", "output.weight": "q8_0",
                     **{f"blk.{i}.{w}.weight": "iq4_nl" for i in range(2)
                        for w in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
                     **{f"blk.{i}.attn_v.weight": "q4_0" for i in range(2)},
                     **{f"blk.{i}.ffn_down.weight": "iq2_xxs" for i in range(2)}}, types
    compare_with_llama_cpp(dst, "IQ2_XXS n_embd 288", gt.IQ4_NL, tmp_path, cli_text=False)
