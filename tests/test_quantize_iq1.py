"""The ternary and 1-bit quantizers (issue 30 item 3): tq1_0, tq2_0, iq1_s, iq1_m.

Oracles: ggml's own `ggml_quantize_chunk` (llama-cpp-python's libggml-base through ctypes, as
tests/test_quantize_ggml.py) on awkward random rows, with and without importance weights: the
same bytes. By hand: ternary blocks of -a, 0, a come back exactly. The whole preset files are
compared with llama.cpp's in tests/test_quantize_ggml.py (its preset lists).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_quantize_ggml import _awkward_rows, _importance, ggml_quantize_chunk

from qllama.errors import UnsupportedError
from qllama.gguf.types import IQ1_M, IQ1_S, TQ1_0, TQ2_0, type_name
from qllama.qtensor import QTensor
from qllama.quantize.blocks import quantize_chunk


@pytest.mark.oracle
@pytest.mark.parametrize("type_id", [TQ1_0, TQ2_0, IQ1_M], ids=type_name)
def test_chunk_bytes_equal_ggml(type_id):
    x = _awkward_rows(200 + type_id)
    np.testing.assert_array_equal(quantize_chunk(x, type_id), ggml_quantize_chunk(type_id, x))


@pytest.mark.oracle
@pytest.mark.parametrize("type_id", [IQ1_S, IQ1_M, TQ1_0], ids=type_name)
def test_chunk_with_weights_bytes_equal_ggml(type_id):
    """With importance weights (tq1_0 ignores them, as ggml); iq1 rows also with runs of equal values
    (the sort's ties) and a block whose weights are all zero (no split fits)."""
    x = _awkward_rows(300 + type_id)
    x[7, :64] = np.round(x[7, :64] * 2) / 2  # many ties
    qw = _importance(type_id, x.shape[1])
    qw[32:64] = 0
    np.testing.assert_array_equal(quantize_chunk(x, type_id, qw), ggml_quantize_chunk(type_id, x, qw))


def test_iq1_s_needs_weights():
    with pytest.raises(UnsupportedError, match="iq1_s needs importance weights"):
        quantize_chunk(np.ones((1, 256), np.float32), IQ1_S)


@pytest.mark.parametrize("type_id", [TQ1_0, TQ2_0], ids=type_name)
def test_ternary_blocks_round_trip(type_id):
    """Values -a, 0, a (a exact in fp16) in every position of two super-blocks: d = a, and each
    value comes back exactly (every trit position of tq1_0's three packings is hit)."""
    rng = np.random.default_rng(5)
    x = (rng.integers(-1, 2, (3, 512)) * np.float32(0.375)).astype(np.float32)
    x[:, 0] = 0.375  # the max is a in every super-block
    x[:, 256] = -0.375
    q = quantize_chunk(x, type_id)
    back = QTensor.from_bytes(type_id, q, (512, 3)).dequantize()
    np.testing.assert_array_equal(back, x)
