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
from qllama.gguf.reader import GGUFFile
from qllama.gguf.types import GGML_TYPES, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, type_name
from qllama.quantize.blocks import quantize_chunk

from test_iquants import _ggml_cpu
from test_quantize import F32_MODEL, _llama_quantize, _need, _rows, _write_model

NEW_PRESETS = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_NL", "IQ4_XS"]


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
@pytest.mark.parametrize("type_id", [IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K], ids=type_name)
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
