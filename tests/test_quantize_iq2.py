"""The grid-search quantizers of iq3_xxs, iq2_xxs, iq2_xs and iq2_s (kernels/quantize_iq2.py) against
ggml's own `ggml_quantize_chunk` (llama-cpp-python's libggml-base through ctypes): the same bytes
for awkward random rows (an all-zero super-block, tiny values, an outlier, a wide row), with
importance weights and, for the two types ggml quantizes without them, without."""

from __future__ import annotations

import numpy as np
import pytest
from test_quantize_ggml import (
    GRID_PRESETS,
    _awkward_rows,
    _importance,
    assert_file_with_imatrix_equals_llama_cpp,
    ggml_quantize_chunk,
)

from qllama.errors import QllamaError
from qllama.gguf.types import IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS, type_name
from qllama.quantize.blocks import quantize_array, quantize_chunk

GRID_TYPES = [IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S]


@pytest.mark.oracle
@pytest.mark.parametrize("type_id", GRID_TYPES, ids=type_name)
def test_chunk_with_weights_bytes_equal_ggml(type_id):
    x = _awkward_rows(200 + type_id)
    x[7, 256:] *= 1e-9  # a super-block near ggml's 1e-8 / 1e-15 "all zero" thresholds
    qw = _importance(type_id, x.shape[1])
    qw[300:310] = 0  # a run of zero weights: whole groups weightless
    np.testing.assert_array_equal(quantize_chunk(x, type_id, qw), ggml_quantize_chunk(type_id, x, qw))


@pytest.mark.oracle
@pytest.mark.parametrize("type_id", [IQ3_XXS, IQ2_S], ids=type_name)
def test_chunk_without_weights_bytes_equal_ggml(type_id):
    x = _awkward_rows(300 + type_id)
    np.testing.assert_array_equal(quantize_chunk(x, type_id), ggml_quantize_chunk(type_id, x))


@pytest.mark.parametrize("type_id", [IQ2_XXS, IQ2_XS], ids=type_name)
def test_iq2_xxs_xs_need_weights(type_id):
    """ggml asserts quant_weights for these two; qllama says so instead."""
    x = _awkward_rows(1)[:2]
    with pytest.raises(QllamaError, match="needs importance weights"):
        quantize_chunk(x, type_id)
    with pytest.raises(QllamaError, match="needs importance weights"):
        quantize_array(x, type_id)


def test_all_zero_rows_are_zero_blocks():
    """Hand-computed: an all-zero super-block is d = 0 and every byte 0, in each type."""
    x = np.zeros((2, 512), np.float32)
    for t in GRID_TYPES:
        assert not quantize_chunk(x, t, np.ones(512, np.float32)).any(), type_name(t)


@pytest.mark.oracle
@pytest.mark.parametrize("preset", GRID_PRESETS)
def test_deep_gqa_model_with_imatrix_file_equals_llama_cpp(tmp_path, preset):
    """16 layers and 4 query heads per K/V head: the layer-dependent rules (the first eighth's
    ffn_down, IQ3_XS's middle ffn_gate / ffn_up) and the gqa >= 4 attn_v rule, with llama.cpp's
    own choices and bytes given the same matrix."""
    pytest.importorskip("llama_cpp")
    assert_file_with_imatrix_equals_llama_cpp(tmp_path, preset, n_layer=16, n_head_kv=1)
