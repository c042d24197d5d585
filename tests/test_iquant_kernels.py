"""The i-quants' batch kernels (issue 30 item 4): iq4_xs / iq4_nl / iq3_s / iq2_xxs gemms (`kernels/_x86_gemm.py`,
driven by `kernels/int8.GEMM_ROWS`) give every row the one-token row kernel's bits, and the
live ggml's `vec_dot` bits (oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.gguf.types import IQ2_XXS, IQ3_S, IQ4_NL, IQ4_XS
from qllama.qtensor import QTensor, get_threads, quantize_activation, set_threads

pytest.importorskip("gguf.quants")
from test_iquants import _needs_int8, bits, ggml_products, random_blocks  # noqa: E402  (tests/ is on sys.path)

FORM = {IQ4_NL: "q8_0", IQ4_XS: "q8_K", IQ3_S: "q8_K", IQ2_XXS: "q8_K"}
BLOCK_BYTES = {IQ4_NL: 18, IQ4_XS: 136, IQ3_S: 110, IQ2_XXS: 66}
CASES = [(IQ4_XS, 4096), (IQ4_XS, 256), (IQ4_NL, 4096), (IQ4_NL, 32 * 129), (IQ4_NL, 64), (IQ3_S, 4096), (IQ3_S, 256),
         (IQ2_XXS, 4096), (IQ2_XXS, 512)]


@pytest.mark.parametrize("tid,ne0", CASES, ids=[f"{t}-{n}" for t, n in CASES])
def test_gemm_equals_the_row_kernel(tid, ne0):
    """int8.GEMM_ROWS (TILE_ROWS rows a pass; 4096 columns: 2-3 ranges of units that stay in L1; iq4_nl
    with an odd block count: ggml's tail block; iq3_s / iq2_xxs: the grid values signed and packed
    as iq4_xs) == ROWS_INT8 bit for bit at 2..33 tokens and 1 and 2 threads; a NaN scale spoils
    its row only; q.matmul takes the gemm and equals q.matvec."""
    from qllama.kernels import iquants
    from qllama.kernels._x86_gemm import HALVES, IQ_PACKED_BYTES, L1_BLOCK_BYTES, TILE_ROWS
    from qllama.kernels.int8 import _over_threads
    from qllama.qtensor import _fp16_table

    _needs_int8()
    if ne0 == 4096:
        # (iq4_nl: pairs; a 256-bit ISA's packs take half the bytes: 2 ranges there)
        assert ne0 // (64 if tid == IQ4_NL else 256) * IQ_PACKED_BYTES[tid] > HALVES * L1_BLOCK_BYTES
    rng = np.random.default_rng(ne0 + tid)
    n_rows = 3 * TILE_ROWS
    raw = random_blocks(tid, n_rows, ne0, rng, scale=0.03)
    at = BLOCK_BYTES[tid] if ne0 > 256 or tid == IQ4_NL else 0
    raw[5, at:at + 2] = np.array([0x7E00], np.uint16).view(np.uint8)  # row 5, block 1 (or 0): d = NaN
    q = QTensor.from_bytes(tid, raw, (ne0, n_rows))
    before = get_threads()
    try:
        for n_threads in (1, 2):
            set_threads(n_threads)
            for n_tok in (2, 3, 7, 33):
                x = rng.standard_normal((n_tok, ne0)).astype(np.float32)
                xq, xd, xs = quantize_activation(x).quantized(FORM[tid])
                by_rows, by_gemm = (np.empty((n_tok, n_rows), np.float32) for _ in range(2))
                _over_threads(iquants.ROWS_INT8[tid], n_rows, raw, xq, xd, xs, _fp16_table(), by_rows, n_threads)
                iquants.matmul_int8(tid, raw, xq, xd, xs, _fp16_table(), by_gemm, n_threads)
                np.testing.assert_array_equal(bits(by_gemm), bits(by_rows))
                assert np.isnan(by_gemm[:, 5]).all() and np.isfinite(np.delete(by_gemm, 5, axis=1)).all()
                ym = q.matmul(x)
                np.testing.assert_array_equal(bits(ym), bits(by_gemm))
                np.testing.assert_array_equal(bits(ym[n_tok - 1]), bits(q.matvec(x[n_tok - 1])))
    finally:
        set_threads(before)


@pytest.mark.oracle
@pytest.mark.parametrize("tid,ne0", [(IQ4_XS, 2048), (IQ4_NL, 2048), (IQ4_NL, 32 * 45), (IQ3_S, 2048), (IQ2_XXS, 2048)])
def test_gemm_equals_live_ggml_vec_dot(tid, ne0):
    """A batch through the gemm (whole groups of TILE_ROWS rows) == ggml's vec_dot, row by row."""
    from qllama.kernels._x86_gemm import TILE_ROWS

    _needs_int8()
    rng = np.random.default_rng(ne0 + 7)
    raw = random_blocks(tid, 2 * TILE_ROWS, ne0, rng, scale=0.03)
    q = QTensor.from_bytes(tid, raw, (ne0, 2 * TILE_ROWS))
    x = rng.standard_normal((5, ne0)).astype(np.float32)
    want = np.stack([ggml_products(tid, raw, xi)[0] for xi in x])  # ggml's, or its fma form of iq4_nl's tail
    np.testing.assert_array_equal(bits(q.matmul(x)), bits(want))
