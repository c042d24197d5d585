"""`qllama quantize` against the live ggml/llama.cpp of llama-cpp-python (issue 30 item 3).

Oracles:
- ggml's own `ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix)` from
  llama-cpp-python's libggml-base, called through ctypes (the loader of tests/test_iquants.py):
  our `quantize_chunk` must write the same bytes for random rows, with and without importance
  weights;
- llama.cpp's `llama_model_quantize` for whole files of the presets that need no matrix: the same
  type for every tensor and the same bytes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from qllama import quantize as qz
from qllama.errors import QllamaError
from qllama.gguf.reader import GGUFFile
from qllama.gguf.types import GGML_TYPES, IQ3_S, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, type_name
from qllama.quantize.blocks import quantize_chunk
from qllama.quantize.presets import NEEDS_IMATRIX

from test_iquants import _ggml_cpu
from test_quantize import F32_MODEL, _llama_quantize, _need, _rows, _write_model

NEW_PRESETS = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "TQ1_0", "TQ2_0"]


def ggml_quantize_chunk(type_id: int, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml's bytes for rows x (n_rows, ne0); imatrix: (ne0,) weights shared by every row, or None."""
    _, cpu = _ggml_cpu()
    f = cpu.ggml_quantize_chunk  # (in libggml-base, which _ggml_cpu loaded globally)
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]
    cpu.ggml_quantize_init.argtypes = [ctypes.c_int]
    cpu.ggml_quantize_init(type_id)
    x = np.ascontiguousarray(x, np.float32)
    n_rows, ne0 = x.shape
    out = np.zeros((n_rows, GGML_TYPES[type_id].row_bytes(ne0)), np.uint8)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    f(type_id, x.ctypes.data, out.ctypes.data, 0, n_rows, ne0, None if qw is None else qw.ctypes.data)
    return out


def _awkward_rows(seed: int) -> np.ndarray:
    """(24, 512): gaussian rows with test_quantize's awkward blocks, an all-zero super-block, tiny
    values, an outlier and a row of wide range."""
    x = _rows(seed, 24, 512)
    x[3, :256] = 0
    x[4] *= 1e-6
    x[5, 100] = 1.5
    x[6] *= 100
    return x


@pytest.mark.oracle
@pytest.mark.parametrize("type_id", [IQ4_NL, IQ4_XS, IQ3_S, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K], ids=type_name)
def test_chunk_bytes_equal_ggml(type_id):
    x = _awkward_rows(type_id)
    np.testing.assert_array_equal(quantize_chunk(x, type_id), ggml_quantize_chunk(type_id, x))


def _assert_same_tensors(ours: Path, theirs: Path) -> None:
    a, b = GGUFFile(ours), GGUFFile(theirs)
    assert a.metadata["general.file_type"] == b.metadata["general.file_type"]
    assert sorted(a.tensors) == sorted(b.tensors)  # (llama.cpp writes them in its own order)
    for name, t in b.tensors.items():
        assert (name, a.tensors[name].type_name) == (name, t.type_name)
        assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name


@pytest.mark.oracle
@pytest.mark.parametrize("preset", NEW_PRESETS)
def test_tiny_model_file_equals_llama_cpp(tmp_path, preset):
    """The tiny model (ffn_down ne0 = 288: the q4_0 / iq4_nl / q5_0 fallbacks; tied embeddings)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src, ours, theirs = tmp_path / "in.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    _write_model(src, nested=False, tied=True)
    qz.quantize_gguf(src, ours, preset)
    _llama_quantize(llama_cpp, src, theirs, qz.PRESETS[preset].ftype)
    _assert_same_tensors(ours, theirs)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("preset", NEW_PRESETS)
def test_shared_model_file_equals_llama_cpp(tmp_path, preset):
    llama_cpp = pytest.importorskip("llama_cpp")
    src, ours, theirs = _need(F32_MODEL), tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    qz.quantize_gguf(src, ours, preset)
    _llama_quantize(llama_cpp, src, theirs, qz.PRESETS[preset].ftype)
    _assert_same_tensors(ours, theirs)


def _importance(seed: int, ne0: int) -> np.ndarray:
    """(ne0,) positive weights with the spread of a real matrix, and one zero column."""
    rng = np.random.default_rng(seed)
    w = (rng.lognormal(0, 1.5, ne0) * 1e-3).astype(np.float32)
    w[3] = 0
    return w


WEIGHTED = [IQ4_NL, IQ4_XS, IQ3_S, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1]


@pytest.mark.oracle
@pytest.mark.parametrize("type_id", WEIGHTED, ids=type_name)
def test_chunk_with_imatrix_bytes_equal_ggml(type_id):
    x = _awkward_rows(100 + type_id)
    qw = _importance(type_id, x.shape[1])
    np.testing.assert_array_equal(quantize_chunk(x, type_id, qw), ggml_quantize_chunk(type_id, x, qw))


# the presets that need a matrix (ggml asserts its grid types get weights)
GRID_PRESETS = ["IQ3_XXS", "IQ3_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M"]
IMATRIX_PRESETS = NEW_PRESETS + GRID_PRESETS + ["Q2_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.oracle
@pytest.mark.parametrize("preset", IMATRIX_PRESETS)
def test_tiny_model_with_imatrix_equals_ggml(tmp_path, preset):
    """Every tensor of a file quantized with a matrix (written in llama.cpp's layout, one tensor's
    count 0, one tensor without an entry) == ggml_quantize_chunk of the f32 rows with sums / counts."""
    from qllama.quantize.imatrix import write_imatrix

    src, ours = tmp_path / "in.gguf", tmp_path / "ours.gguf"
    weights = _write_model(src, nested=False, tied=True)
    sums, counts = {}, {}
    for i, (name, x) in enumerate(weights.items()):
        if x.ndim == 2 and (name != "blk.1.attn_q.weight" or preset in NEEDS_IMATRIX):  # (no entry: no weights)
            sums[name] = (_importance(i, x.shape[1]) * 7)[None, :]  # (1, ne0)
            counts[name] = np.array([0.0 if name == "blk.2.ffn_up.weight" else 7.0], np.float32)
    write_imatrix(tmp_path / "imatrix.gguf", sums, counts)
    if preset in NEEDS_IMATRIX:  # llama.cpp refuses a tensor of a grid type (q2_K in Q2_K_S) without weights
        write_imatrix(tmp_path / "partial.gguf", {"blk.0.attn_q.weight": sums["blk.0.attn_q.weight"]},
                      {"blk.0.attn_q.weight": counts["blk.0.attn_q.weight"]})
        with pytest.raises(QllamaError, match=f"no entry for blk.0.attn_k.weight, which {preset} needs"):
            qz.quantize_gguf(src, ours, preset, imatrix=tmp_path / "partial.gguf")
    qz.quantize_gguf(src, ours, preset, imatrix=tmp_path / "imatrix.gguf")
    out = GGUFFile(ours)
    assert out.metadata["quantize.imatrix.entries_count"] == len(sums)
    for name, t in out.tensors.items():
        x = weights[name]
        if x.ndim == 1:
            continue
        qw = None
        if name in sums:
            c = counts[name][0]
            qw = sums[name][0] / np.float32(c) if c > 0 else np.ones(x.shape[1], np.float32)
        ref = ggml_quantize_chunk(t.type_id, x, qw)
        assert bytes(out.tensor_bytes(name)) == ref.tobytes(), (name, t.type_name)


@pytest.mark.oracle
@pytest.mark.parametrize("preset", IMATRIX_PRESETS)
def test_tiny_model_with_imatrix_file_equals_llama_cpp(tmp_path, preset):
    """The whole file, quantized with a matrix, equals llama.cpp's `llama_model_quantize` given the
    same matrix (the values llama-quantize passes: sums / counts, ones where a count is 0): the
    per-tensor type choices that depend on a matrix, and every tensor's bytes."""
    assert_file_with_imatrix_equals_llama_cpp(tmp_path, preset, tied=True)


def assert_file_with_imatrix_equals_llama_cpp(tmp_path, preset: str, **model) -> None:
    """`test_tiny_model_with_imatrix_file_equals_llama_cpp` on _write_model(**model)'s file."""
    from qllama.quantize.imatrix import write_imatrix
    from test_iquants import llama_cpp_quantize

    src, ours, theirs = tmp_path / "in.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    weights = _write_model(src, nested=False, **model)
    sums, counts, values = {}, {}, {}
    for i, (name, x) in enumerate(weights.items()):
        if x.ndim == 2:
            sums[name] = (_importance(i, x.shape[1]) * 7)[None, :]  # (1, ne0)
            counts[name] = np.array([0.0 if name == "blk.2.ffn_up.weight" else 7.0], np.float32)
            c = counts[name][0]
            values[name] = sums[name][0] / np.float32(c) if c > 0 else np.ones(x.shape[1], np.float32)
    write_imatrix(tmp_path / "imatrix.gguf", sums, counts)
    qz.quantize_gguf(src, ours, preset, imatrix=tmp_path / "imatrix.gguf")
    llama_cpp_quantize(src, theirs, qz.PRESETS[preset].ftype, imatrix=values)
    _assert_same_tensors(ours, theirs)
