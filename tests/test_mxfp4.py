"""MXFP4 (ggml type 39, gpt-oss's experts): one E8M0 exponent byte + 16 bytes of e2m1 codes per 32.

- rows decode (NumPy and Numba, parallel and serial) == gguf-py's `dequantize`, bit for bit, over
  every exponent byte (0 and 1: ggml's subnormal halves; 255: 2^127);
- the float path == float64 within 1e-5;
- the int8 kernel == a NumPy transcription of ggml's AVX2 `ggml_vec_dot_mxfp4_q8_0` (two 8-lane
  accumulators over block pairs, the scalar tail block by an fma), bit for bit, and == the live
  ggml (`oracle`: libggml-cpu of llama-cpp-python through ctypes);
- a prompt's rows == decode's, bit for bit, for 1..9 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from qllama.gguf.types import MXFP4
from qllama.qtensor import INT8_TYPES, SUPPORTED_TYPES, TYPES, QTensor, quantize_activation

gq = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as GQ  # noqa: E402
from test_iquants import _fma, _hsum8, _lanes, _needs_int8, bits, ggml_matvec  # noqa: E402


def random_mxfp4(n_rows: int, ne0: int, rng, e_lo: int = 118, e_hi: int = 126) -> np.ndarray:
    """uint8 (n_rows, ne0 / 32 * 17): random codes, exponent bytes in [e_lo, e_hi]."""
    raw = rng.integers(0, 256, (n_rows, ne0 // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(e_lo, e_hi + 1, (n_rows, ne0 // 32), dtype=np.uint8)
    return raw.reshape(n_rows, -1)


def test_the_type_record():
    t = TYPES[MXFP4]
    assert (t.ggml.name, t.ggml.block_size, t.ggml.type_size, t.int8_form) == ("mxfp4", 32, 17, "q8_0")
    assert MXFP4 in SUPPORTED_TYPES and MXFP4 in INT8_TYPES


def test_dequantize_equals_gguf_bit_for_bit():
    from qllama.dequant import mxfp4_rows
    from qllama.kernels import mxfp4
    from qllama.kernels._fp16 import FP16_TO_F32

    rng = np.random.default_rng(39)
    raw = random_mxfp4(8, 32 * 40, rng, 0, 255)
    raw[0, 0::17][:4] = [0, 1, 2, 255]  # the subnormal halves, the smallest normal, the largest
    ref = gq.dequantize(raw, GQ(MXFP4))
    rows = np.arange(8, dtype=np.int64)
    np.testing.assert_array_equal(bits(mxfp4_rows.dequantize_rows(MXFP4, raw, rows)), bits(ref))
    for parallel in (True, False):
        out = np.empty(ref.shape, np.float32)
        mxfp4.dequantize_rows(MXFP4, raw, rows, FP16_TO_F32, out, parallel=parallel)
        np.testing.assert_array_equal(bits(out), bits(ref))
    q = QTensor.from_bytes(MXFP4, raw, (32 * 40, 8))
    np.testing.assert_array_equal(bits(q.dequantize([5, 2])), bits(ref[[5, 2]]))


def test_float_path_matches_float64(float_path):
    rng = np.random.default_rng(1)
    raw = random_mxfp4(40, 512, rng)
    w = gq.dequantize(raw, GQ(MXFP4)).astype(np.float64)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    q = QTensor.from_bytes(MXFP4, raw, (512, 40))
    ref = x.astype(np.float64) @ w.T
    for got in (q.matmul(x), np.stack([q.matvec(xi) for xi in x])):
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def _ggml_mxfp4(raw_row, xq, xd) -> np.float32:
    """ggml_vec_dot_mxfp4_q8_0 (AVX2): block pairs into two 8-lane accumulators with one fma of
    (dy * E8M0_HALF(e)) each, hsum_float_8 of their sum, then the scalar tail block (an fma)."""
    from qllama.dequant.mxfp4_rows import E8M0_HALF, KVALUES_MXFP4

    nb = raw_row.size // 17
    blocks = raw_row.reshape(nb, 17)
    e = E8M0_HALF[blocks[:, 0]]
    qs = blocks[:, 1:]
    q = KVALUES_MXFP4[np.concatenate([qs & 15, qs >> 4], axis=-1)].astype(np.int64)  # (nb, 32)
    p = _lanes(q * xq.reshape(nb, 32).astype(np.int64))  # (nb, 8)
    acc = [np.zeros(8, np.float32), np.zeros(8, np.float32)]
    ib = 0
    while ib + 1 < nb:
        for h in range(2):
            db = np.float32(xd[ib + h] * e[ib + h])
            acc[h] = np.array([_fma(db, np.float32(p[ib + h, l]), acc[h][l]) for l in range(8)], np.float32)
        ib += 2
    s = _hsum8(acc[0] + acc[1])
    if ib < nb:
        s = _fma(np.float32(xd[ib] * e[ib]), np.float32(p[ib].sum()), s)
    return s


@pytest.mark.parametrize("ne0", [256, 288, 32, 2880])
def test_int8_equals_ggml_vec_dot_transcription(ne0):
    """Decode and prompts (1..9 tokens) == the transcription of ggml's vec_dot, bit for bit, on the
    same q8_0 activations (288: nine blocks, ggml's odd tail; 2880: gpt-oss's width, 90 blocks)."""
    _needs_int8()
    rng = np.random.default_rng(ne0)
    raw = random_mxfp4(11, ne0, rng)
    q = QTensor.from_bytes(MXFP4, raw, (ne0, 11))
    x = rng.standard_normal((9, ne0)).astype(np.float32)
    x[0, :32] = -3.0  # a constant block: every activation -127
    act = quantize_activation(x)
    xq, xd, _ = act.quantized("q8_0")
    ref = np.array([[_ggml_mxfp4(raw[r], xq[t], xd[t]) for r in range(11)] for t in range(9)], np.float32)
    np.testing.assert_array_equal(bits(q.matmul(act)), bits(ref))
    for t in (0, 5):
        np.testing.assert_array_equal(bits(q.matvec(x[t])), bits(ref[t]))


def test_prompt_rows_equal_decode_bit_for_bit():
    _needs_int8()
    rng = np.random.default_rng(5)
    ne0 = 32 * 27  # an odd block count
    q = QTensor.from_bytes(MXFP4, random_mxfp4(20, ne0, rng), (ne0, 20))
    x = rng.standard_normal((9, ne0)).astype(np.float32)
    one = np.stack([q.matvec(xi) for xi in x])
    for n in range(1, 10):
        np.testing.assert_array_equal(bits(q.matmul(x[:n])), bits(one[:n]))


def test_int8_matches_float64_within_activation_rounding():
    _needs_int8()
    rng = np.random.default_rng(9)
    raw = random_mxfp4(64, 1024, rng)
    w = gq.dequantize(raw, GQ(MXFP4)).astype(np.float64)
    x = rng.standard_normal(1024).astype(np.float32)
    got = QTensor.from_bytes(MXFP4, raw, (1024, 64)).matvec(x)
    ref = w @ x.astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert 1e-7 < err < 3e-2


@pytest.mark.oracle
@pytest.mark.parametrize("ne0", [2880, 32 * 45])
def test_int8_equals_live_ggml_vec_dot(ne0):
    _needs_int8()
    rng = np.random.default_rng(ne0)
    raw = random_mxfp4(16, ne0, rng)
    q = QTensor.from_bytes(MXFP4, raw, (ne0, 16))
    x = rng.standard_normal((6, ne0)).astype(np.float32)
    ref = np.stack([ggml_matvec(MXFP4, raw, xi) for xi in x])
    np.testing.assert_array_equal(bits(q.matmul(x)), bits(ref))
    np.testing.assert_array_equal(bits(q.matvec(x[2])), bits(ref[2]))
