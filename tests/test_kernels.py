"""Kernels and QTensor against independent oracles.

- dequantization: gguf-py's NumPy dequantizers (`gguf.quants.dequantize`), bit for bit, on random
  blocks (random bytes with sane fp16 scales for k-quants, gguf-py's quantizers for legacy types),
  extreme scales, all-zero blocks, NaN/Inf in the fp16 fields, and on the tensors llama.cpp
  quantized in ../shared/models/*Q4_K_M.gguf;
- mat-vec / mat-mat: a float64 NumPy `dequantize(W) @ x`. Error measure everywhere:
  rel = max|y - ref| / max|ref| (norm-wise). Float paths: rel <= 1e-5. int8-activation paths
  (x rounded to 8 bits per block, as llama.cpp does): rel <= INT8_TOL on matrices with many
  rows; with a single row, where y may cancel to nearly 0, the error is measured against the
  scale of the sum instead: max|y - ref| / max(|W| @ |x|) <= INT8_SCALED_TOL.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf import quants as gq

from qllama.gguf import types as gt
from qllama.errors import QllamaError, UnsupportedError
from qllama.qtensor import (
    INT8_TYPES,
    SUPPORTED_TYPES,
    QTensor,
    get_threads,
    int8_activations,
    quantize_activation,
    set_int8_activations,
    set_threads,
)

SHARED = Path(__file__).parents[2] / "shared"
FLOAT_TOL = 1e-5
INT8_TOL = 3e-2  # measured 2e-3 .. 1.3e-2 on random data (q6_K's per-16 scales are the worst)
INT8_SCALED_TOL = 2e-3  # measured <= 7e-4

K_TYPES = [gt.Q2_K, gt.Q3_K, gt.Q4_K, gt.Q5_K, gt.Q6_K]
LEGACY_TYPES = [gt.Q4_0, gt.Q4_1, gt.Q5_0, gt.Q5_1, gt.Q8_0]
FLOAT_TYPES = [gt.F32, gt.F16, gt.BF16]
IQ4_TYPES = [gt.IQ4_NL, gt.IQ4_XS]  # every bit pattern a valid block (more in test_iquants.py)
ALL_TYPES = K_TYPES + LEGACY_TYPES + FLOAT_TYPES + IQ4_TYPES
# the grid i-quants' int8 kernels are tested in test_iquants.py (random blocks need their own care)
INT8_TESTED = sorted(INT8_TYPES - {gt.IQ3_S, gt.IQ3_XXS, gt.IQ2_XXS, gt.IQ2_XS, gt.IQ2_S, gt.IQ1_S, gt.IQ1_M, gt.TQ1_0, gt.TQ2_0, gt.MXFP4})  # (mxfp4: test_mxfp4.py)
# byte offsets of the fp16 fields (d, dmin / m) inside one block
FP16_FIELDS = {
    gt.Q2_K: (80, 82), gt.Q3_K: (108,), gt.Q4_K: (0, 2), gt.Q5_K: (0, 2), gt.Q6_K: (208,),
    gt.Q4_0: (0,), gt.Q4_1: (0, 2), gt.Q5_0: (0,), gt.Q5_1: (0, 2), gt.Q8_0: (0,),
    gt.IQ4_NL: (0,), gt.IQ4_XS: (0,),
}


def tname(t: int) -> str:
    return gt.type_name(t)


def random_matrix(tid: int, ne0: int, ne1: int, rng: np.random.Generator) -> np.ndarray:
    """Packed bytes (ne1, row_bytes) of a random matrix of type tid."""
    t = gt.GGML_TYPES[tid]
    if tid in K_TYPES or tid in IQ4_TYPES:  # random bytes are valid blocks; give them small finite scales
        nb = ne0 // t.block_size
        raw = rng.integers(0, 256, (ne1, nb, t.type_size), dtype=np.uint8)
        for f in FP16_FIELDS[tid]:
            raw[:, :, f : f + 2] = rng.uniform(-0.02, 0.02, (ne1, nb, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(ne1, -1)
    w = rng.standard_normal((ne1, ne0)).astype(np.float32)
    if tid == gt.F32:
        return w.view(np.uint8)
    return np.ascontiguousarray(gq.quantize(w, GQ(tid))).reshape(ne1, -1).view(np.uint8)


def oracle(tid: int, raw: np.ndarray, ne0: int) -> np.ndarray:
    """gguf-py's dequantization, float32 (ne1, ne0)."""
    if tid == gt.F32:
        return raw.view(np.float32).reshape(-1, ne0)
    if tid == gt.F16:
        return raw.view(np.float16).astype(np.float32).reshape(-1, ne0)
    return gq.dequantize(raw, GQ(tid)).reshape(-1, ne0)


def assert_bits_equal(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal bit for bit, except that any NaN matches any NaN (payloads may differ)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype == np.float32
    gn, rn = np.isnan(got), np.isnan(ref)
    assert np.array_equal(gn, rn), f"NaN positions differ: {np.argwhere(gn != rn)[:5]}"
    bad = (got.view(np.uint32) != ref.view(np.uint32)) & ~gn
    assert not bad.any(), f"{bad.sum()} values differ, first at {np.argwhere(bad)[0]}: {got[bad][:3]} vs {ref[bad][:3]}"


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def scaled_err(y: np.ndarray, ref: np.ndarray, w64: np.ndarray, x: np.ndarray) -> float:
    """max|y - ref| / max(|W| @ |x|): the error relative to the magnitude of the terms summed."""
    return float(np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(x.astype(np.float64)) @ np.abs(w64).T))


# -- dequantization ---------------------------------------------------------------------------


@pytest.mark.parametrize("tid", ALL_TYPES, ids=tname)
def test_dequantize_random_matches_gguf(tid):
    rng = np.random.default_rng(tid)
    ne0 = 512
    raw = random_matrix(tid, ne0, 5, rng)
    q = QTensor.from_bytes(tid, raw, (ne0, 5))
    ref = oracle(tid, raw, ne0)
    assert_bits_equal(q.dequantize(), ref)
    assert_bits_equal(q.dequantize(slice(1, 4)), ref[1:4])
    assert_bits_equal(q.dequantize(np.array([4, 0, 4])), ref[[4, 0, 4]])
    assert_bits_equal(q.row(3), ref[3])


def _special_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n fp16 bit patterns: zeros, extremes, subnormals, Inf, NaN, and random ones."""
    special = np.array([0x0000, 0x8000, 0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x0400,
                        0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x3C00], dtype=np.uint16)
    return np.where(rng.random(n) < 0.5, rng.choice(special, n), rng.integers(0, 1 << 16, n)).astype(np.uint16)


@pytest.mark.parametrize("tid", K_TYPES + LEGACY_TYPES, ids=tname)
def test_dequantize_special_blocks(tid):
    """Extreme scales, all-zero blocks and NaN/Inf fp16 fields: equal to gguf-py, no crash."""
    rng = np.random.default_rng(100 + tid)
    t = gt.GGML_TYPES[tid]
    ne0, ne1 = 4 * t.block_size, 16
    raw = random_matrix(tid, ne0, ne1, rng).reshape(ne1, 4, t.type_size).copy()
    for f in FP16_FIELDS[tid]:
        raw[:, :, f : f + 2] = _special_fp16(rng, ne1 * 4).reshape(ne1, 4, 1).view(np.uint8)
    f = FP16_FIELDS[tid][0]
    raw[1, 0, f : f + 2] = np.array([0x7C00], np.uint16).view(np.uint8)  # +Inf scale
    raw[2, 1, f : f + 2] = np.array([0x7E00], np.uint16).view(np.uint8)  # NaN scale
    raw[0] = 0  # an all-zero row of blocks
    raw = raw.reshape(ne1, -1)
    q = QTensor.from_bytes(tid, raw, (ne0, ne1))
    with np.errstate(all="ignore"):
        ref = oracle(tid, raw, ne0)
    assert np.isnan(ref).any() and np.isinf(ref).any()  # the test really covers them
    assert_bits_equal(q.dequantize(), ref)


@pytest.mark.parametrize("tid", K_TYPES + LEGACY_TYPES, ids=tname)
def test_numpy_row_decoders_equal_the_kernels(tid):
    """The embedding lookup's NumPy decoders (qllama/dequant/rows.py) and the Numba row kernels
    (serial and parallel, used by the float mat-mat) give the same bits, special blocks included."""
    from qllama.dequant import rows as dequantize_np
    from qllama.kernels.dequantize import dequantize_rows
    from qllama.qtensor import _fp16_table

    if tid not in dequantize_np.DECODERS:
        pytest.skip(f"{tname(tid)} keeps the Numba decoder for the lookup")
    rng = np.random.default_rng(150 + tid)
    t = gt.GGML_TYPES[tid]
    ne0, ne1 = 3 * t.block_size, 12
    raw = random_matrix(tid, ne0, ne1, rng).reshape(ne1, 3, t.type_size).copy()
    for f in FP16_FIELDS[tid]:  # half the rows with special scales (zero, subnormal, Inf, NaN, ...)
        raw[::2, :, f : f + 2] = _special_fp16(rng, (ne1 // 2) * 3).reshape(ne1 // 2, 3, 1).view(np.uint8)
    raw = raw.reshape(ne1, -1)
    rows = np.array([3, 0, 11, 3, 6], np.int64)
    got = dequantize_np.dequantize_rows(tid, raw, rows)
    for parallel in (False, True):
        ref = np.empty((rows.size, ne0), np.float32)
        dequantize_rows(tid, raw, rows, _fp16_table(), ref, parallel=parallel)
        assert_bits_equal(got, ref)


@pytest.mark.parametrize("tid", [gt.F16, gt.BF16], ids=tname)
def test_dequantize_all_half_bit_patterns(tid):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    q = QTensor.from_bytes(tid, bits.view(np.uint8), (256, 256))
    ref = oracle(tid, bits.view(np.uint8), 256)
    assert_bits_equal(q.dequantize(), ref)


def test_f16_conversion_in_products_all_bit_patterns():
    """The f16 mat-vec/mat-mat convert fp16 with bit arithmetic, not the table: check every pattern."""
    w = np.zeros((1 << 16, 32), np.uint16)  # row r = [pattern r, 0, 0, ...]
    w[:, 0] = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    q = QTensor.from_bytes(gt.F16, w.view(np.uint8), (32, 1 << 16))
    ref = w[:, 0].view(np.float16).astype(np.float32)
    e0 = np.zeros(32, np.float32)
    e0[0] = 1.0
    with np.errstate(all="ignore"):
        for y in (q.matvec(e0), q.matmul(np.stack([e0, e0]))[1]):
            assert np.array_equal(y, ref, equal_nan=True)


# -- mat-vec / mat-mat against float64 ---------------------------------------------------------


@pytest.mark.parametrize("tid", K_TYPES + LEGACY_TYPES + FLOAT_TYPES, ids=tname)  # (iq4: test_iquants.py)
def test_float_paths_match_float64(tid, float_path):
    rng = np.random.default_rng(200 + tid)
    ne0 = 512 if tid in K_TYPES else 96
    for ne1 in (1, 13):  # one row; a row count not divisible by the threads or row chunks
        raw = random_matrix(tid, ne0, ne1, rng)
        q = QTensor.from_bytes(tid, raw, (ne0, ne1))
        w64 = oracle(tid, raw, ne0).astype(np.float64)
        x = rng.standard_normal(ne0).astype(np.float32)
        assert rel_err(q.matvec(x), w64 @ x) <= FLOAT_TOL
        for n_tok in (1, 2, 7, 64):
            xs = rng.standard_normal((n_tok, ne0)).astype(np.float32)
            y = q.matmul(xs)
            assert y.shape == (n_tok, ne1)
            assert rel_err(y, xs.astype(np.float64) @ w64.T) <= FLOAT_TOL


@pytest.mark.parametrize("tid", sorted(set(INT8_TESTED) - set(IQ4_TYPES)), ids=tname)  # (iq4: test_iquants.py, == ggml)
def test_int8_paths_match_float64(tid):
    if tid not in int8_activations():
        pytest.skip("no AVX2: the int8-activation kernels are not used on this host")
    rng = np.random.default_rng(300 + tid)
    ne0 = 512
    for ne1 in (1, 37):
        raw = random_matrix(tid, ne0, ne1, rng)
        q = QTensor.from_bytes(tid, raw, (ne0, ne1))
        w64 = oracle(tid, raw, ne0).astype(np.float64)
        x = rng.standard_normal(ne0).astype(np.float32)
        y = q.matvec(x)
        assert scaled_err(y, w64 @ x, w64, x) <= INT8_SCALED_TOL
        if ne1 > 1:
            assert rel_err(y, w64 @ x) <= INT8_TOL
        for n_tok in (1, 2, 7, 64):
            xs = rng.standard_normal((n_tok, ne0)).astype(np.float32)
            ym = q.matmul(xs)
            ref = xs.astype(np.float64) @ w64.T
            assert scaled_err(ym, ref, w64, xs) <= INT8_SCALED_TOL
            if ne1 > 1:
                assert rel_err(ym, ref) <= INT8_TOL
            # prefill and decode run the same arithmetic: token t of matmul == matvec of x[t]
            assert np.array_equal(ym[n_tok - 1], q.matvec(xs[n_tok - 1]))


def _int8_reference(tid: int, w64: np.ndarray, x: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """float64 W @ x~, where x~ is x rounded to 8 bits as ggml's AVX2 quantizers do (NumPy, independent).

    q8_0 / q8_1 (32-element types): d = amax/127 kept as fp16, q = round-half-even(x * 127/amax);
    q4_1 and q5_1 take their min term from q8_1's s = fp16(d * sum q), not from fp16(d) * sum q.
    """
    bs = 256 if tid in K_TYPES or tid == gt.IQ4_XS else 32  # q8_K or q8_0/q8_1 activations
    xb = x.astype(np.float64).reshape(-1, bs)
    if bs == 32:
        x32 = x.reshape(-1, 32).astype(np.float32)
        amax = np.abs(x32).max(1)
        d = amax / np.float32(127)
        inv = (np.float32(127) / np.where(amax == 0, np.float32(1), amax)).astype(np.float32)
        q = np.rint(x32 * inv[:, None]).astype(np.float64)
        d16 = d.astype(np.float16).astype(np.float64)
        y = w64 @ (q * d16[:, None]).reshape(-1)
        if tid in (gt.Q4_1, gt.Q5_1):
            s = (d * q.sum(1).astype(np.float32)).astype(np.float16).astype(np.float64)
            nb = x.size // 32
            m = raw.reshape(raw.shape[0], nb, -1)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
            y += m @ (s - d16 * q.sum(1))
        return y
    vmax = np.take_along_axis(xb, np.abs(xb).argmax(1)[:, None], 1)
    iscale = (-127 / vmax).astype(np.float32)
    q = np.minimum(127, np.rint((iscale * x.reshape(-1, bs)).astype(np.float32)))
    d = 1 / iscale.astype(np.float64)
    return w64 @ (q * d).reshape(-1)


@pytest.mark.parametrize("tid", INT8_TESTED, ids=tname)
def test_int8_equals_rounded_activation_product(tid):
    """Apart from x's rounding, the int8 kernels are exact: compare with W @ round8(x) in float64."""
    if tid not in int8_activations():
        pytest.skip("no AVX2")
    rng = np.random.default_rng(400 + tid)
    raw = random_matrix(tid, 1024, 9, rng)
    q = QTensor.from_bytes(tid, raw, (1024, 9))
    x = rng.standard_normal(1024).astype(np.float32)
    ref = _int8_reference(tid, oracle(tid, raw, 1024).astype(np.float64), x, raw)
    assert rel_err(q.matvec(x), ref) <= 1e-5


@pytest.mark.parametrize("tid", INT8_TESTED, ids=tname)
def test_int8_batches_of_1_to_9_tokens(tid):
    """Every batch size 1..9 (4-token intrinsic calls plus 0-3 one-token ones) on 21 rows (not a
    multiple of the threads' row chunks), at 1 and 2 threads: each token's row equals W @ round8(x_t)
    in float64 (independent NumPy reference) and the one-token mat-vec of x_t bit for bit (prompt
    lookup relies on it). Legacy types use 5 blocks per row (an odd count, as 896 = 28 blocks is not
    a multiple of 256)."""
    if tid not in int8_activations():
        pytest.skip("no AVX2")
    rng = np.random.default_rng(700 + tid)
    ne0 = 512 if tid in K_TYPES or tid == gt.IQ4_XS else 160
    raw = random_matrix(tid, ne0, 21, rng)
    q = QTensor.from_bytes(tid, raw, (ne0, 21))
    w64 = oracle(tid, raw, ne0).astype(np.float64)
    before = get_threads()
    try:
        for n_threads in (1, 2):
            set_threads(n_threads)
            for n_tok in range(1, 10):
                xs = rng.standard_normal((n_tok, ne0)).astype(np.float32)
                ym = q.matmul(xs)
                for t in range(n_tok):
                    assert np.array_equal(ym[t], q.matvec(xs[t])), (n_threads, n_tok, t)
                    assert rel_err(ym[t], _int8_reference(tid, w64, xs[t], raw)) <= 1e-5, (n_threads, n_tok, t)
    finally:
        set_threads(before)


# int8.GEMM_TYPES: block bytes, offset of d, activation form
GEMMS = {gt.Q4_K: (144, 0, "q8_K"), gt.Q6_K: (210, 208, "q8_K"), gt.Q4_0: (18, 0, "q8_0"), gt.Q5_0: (22, 0, "q8_0"),
         gt.Q8_0: (34, 0, "q8_0")}


@pytest.mark.parametrize("tid,n_rows", [(t, n) for t in GEMMS for n in (48, 80)],
                         ids=[f"{tname(t)}-{n}" for t in GEMMS for n in (48, 80)])
def test_gemm_equals_the_row_kernel(tid, n_rows):
    """The batch kernels (TILE_ROWS = 8 or 16 rows per pass, rows in the vector lanes, blocks in
    ranges that stay in L1: kernels/_x86_gemm.py) give
    each row the one-token row kernel's value bit for bit, for every batch size they take
    (GEMM_MIN_TOKENS and up) at 1 and 2 threads, and W @ round8(x) in float64 within 1e-5; a
    NaN scale in one block spoils that row only, in both kernels alike."""
    from qllama.kernels import int8
    from qllama.qtensor import GEMM_MIN_TOKENS, _fp16_table

    if tid not in int8_activations():
        pytest.skip("no AVX2")
    block_bytes, d_at, form = GEMMS[tid]
    assert set(GEMMS) == set(int8.GEMM_TYPES)
    rng = np.random.default_rng(900 + n_rows + tid)
    ne0 = 4096  # 16 or 128 blocks per row: 2 or 3 ranges of blocks (int8.gemm's L1_BLOCK_BYTES)
    assert ne0 // (256 if form == "q8_K" else 32) * int8.PACKED_BYTES[tid] > int8.L1_BLOCK_BYTES
    raw = random_matrix(tid, ne0, n_rows, rng)
    at = block_bytes + d_at  # row 5, block 1: d = NaN
    raw.reshape(n_rows, -1)[5, at:at + 2] = np.array([0x7E00], np.uint16).view(np.uint8)
    if tid == gt.Q8_0:  # row 3: every quant -128 (|w| = 128, the largest pair sums)
        raw.reshape(n_rows, -1, 34)[3, :, 2:] = 0x80
    q = QTensor.from_bytes(tid, raw, (ne0, n_rows))
    w64 = oracle(tid, raw, ne0).astype(np.float64)
    ok = np.arange(n_rows) != 5
    before = get_threads()
    try:
        for n_threads in (1, 2):
            set_threads(n_threads)
            for n_tok in (GEMM_MIN_TOKENS, 3, 4, 7, 33):
                xs = rng.standard_normal((n_tok, ne0)).astype(np.float32)
                xq, xd, xsum = quantize_activation(xs).quantized(form)
                by_rows = np.empty((n_tok, n_rows), np.float32)
                by_gemm = np.empty((n_tok, n_rows), np.float32)
                int8.matmul_rows(tid, q.raw, xq, xd, xsum, _fp16_table(), by_rows, n_threads)
                int8.gemm(tid, q.raw, xq, xd, xsum, _fp16_table(), by_gemm, n_threads)
                assert np.array_equal(by_gemm, by_rows, equal_nan=True), (n_threads, n_tok)
                ym = q.matmul(xs)  # the dispatch picks the gemm here
                assert np.array_equal(ym, by_gemm, equal_nan=True)
                assert np.isnan(ym[:, 5]).all() and np.isfinite(ym[:, ok]).all()
                for t in range(n_tok):
                    assert np.array_equal(ym[t], q.matvec(xs[t]), equal_nan=True), (n_threads, n_tok, t)
                    ref = _int8_reference(tid, w64[ok], xs[t], raw)
                    assert rel_err(ym[t, ok], ref) <= 1e-5, (n_threads, n_tok, t)
    finally:
        set_threads(before)


def test_gemm_takes_whole_tiles_only():
    """A matrix whose rows are not a multiple of TILE_ROWS takes the row kernel for a batch (and
    int8.gemm itself refuses it rather than leave rows unwritten)."""
    from qllama.kernels import int8
    from qllama.qtensor import _fp16_table

    if gt.Q4_K not in int8_activations():
        pytest.skip("no AVX2")
    rng = np.random.default_rng(77)
    n_rows = 2 * int8.TILE_ROWS + 4
    q = QTensor.from_bytes(gt.Q4_K, random_matrix(gt.Q4_K, 512, n_rows, rng), (512, n_rows))
    xs = rng.standard_normal((5, 512)).astype(np.float32)
    xq, xd, xsum = quantize_activation(xs).quantized("q8_K")
    out = np.full((5, n_rows), np.nan, np.float32)
    with pytest.raises(ValueError, match=f"multiple of {int8.TILE_ROWS} rows"):
        int8.gemm(gt.Q4_K, q.raw, xq, xd, xsum, _fp16_table(), out, 1)
    int8.matmul_rows(gt.Q4_K, q.raw, xq, xd, xsum, _fp16_table(), out, 1)
    assert np.array_equal(q.matmul(xs), out)


def _q8_k_numpy(x):
    """ggml's quantize_row_q8_K in NumPy, float32 step for step: (quants, d) per 256-element block."""
    xb = x.reshape(-1, 256)
    q = np.zeros(xb.shape, np.int8)
    d = np.zeros(len(xb), np.float32)
    for i, blk in enumerate(xb):
        a = np.abs(blk)
        if not np.isfinite(blk).all():
            d[i] = np.nan
            continue
        if a.max() == 0:
            continue
        vmax = blk[int(np.argmax(a))]  # the first of the largest magnitude
        with np.errstate(over="ignore", invalid="ignore"):
            iscale = np.float32(-127.0) / vmax
            r = np.rint(iscale * blk)
        q[i] = np.where(np.isnan(r), 0, np.clip(r, -127, 127)).astype(np.int8)
        with np.errstate(divide="ignore"):
            d[i] = np.float32(1.0) / iscale
    return q.reshape(x.shape), d.reshape(x.shape[0], -1)


@pytest.mark.parametrize("n_tok", [1, 3, 9])
def test_q8_k_quants_and_scales_bit_for_bit(n_tok):
    """The q8_K quantizer (vector code) against a float32 NumPy rendition of ggml's: the quants and
    d bit for bit, on the calling thread (<= 4 tokens) and over the threads. Blocks where the rule's
    details decide: +a before -a and -a before +a (the first of the largest magnitude sets the sign),
    halves (round to even), a tiny denormal maximum (iscale overflows), NaN, Inf, all zero."""
    rng = np.random.default_rng(32)
    x = (rng.standard_normal((n_tok, 2048)) * rng.choice([1e-3, 1.0, 50.0], (n_tok, 2048))).astype(np.float32)
    x[0, 10], x[0, 200] = 9.0, -9.0  # block 0: +9 first
    x[0, 256 + 3], x[0, 256 + 100] = -9.0, 9.0  # block 1: -9 first
    x[0, 512:768] = np.arange(256, dtype=np.float32) - 127.5  # |x| 127.5 at both ends: halves everywhere
    x[0, 768:1024] = 0.0
    x[0, 800] = np.float32(1e-39)  # a denormal maximum: -127 / vmax overflows to -inf
    x[0, 801] = np.float32(-5e-40)
    x[0, 1024 + 7] = np.nan
    x[0, 1280 + 255] = -np.inf
    x[0, 1536:1792] = 0.0
    xq, xd, xs = quantize_activation(x).quantized("q8_K")
    q_ref, d_ref = _q8_k_numpy(x)
    np.testing.assert_array_equal(xq, q_ref)
    np.testing.assert_array_equal(xd.view(np.int32), d_ref.view(np.int32))
    b16 = xq.astype(np.int64).reshape(n_tok, -1, 16, 16).sum(-1)
    np.testing.assert_array_equal(xs.reshape(n_tok, -1, 16)[..., :8], b16[..., 0::2] + b16[..., 1::2])


@pytest.mark.parametrize("form", ["q8_0", "q8_1"])
def test_q8_0_and_q8_1_bit_for_bit(form):
    """The 32-element activation forms (vector code) against NumPy, step for step: d = fp16(amax /
    127), q = round-half-even(x * (127 / amax)), the sum of q (q8_0) or fp16(d * sum) (q8_1); a
    block with NaN or Inf: d NaN, quants 0; an all-zero block; halves; 1 to 9 tokens."""
    rng = np.random.default_rng(33)
    for n_tok in (1, 5, 9):
        x = (rng.standard_normal((n_tok, 320)) * rng.choice([1e-3, 1.0, 60.0], (n_tok, 320))).astype(np.float32)
        x[0, 32:64] = np.arange(32, dtype=np.float32) - 15.5  # halves
        x[0, 64:96] = 0.0
        x[0, 96 + 5] = np.nan
        x[0, 128 + 31] = np.inf
        x[0, 160 + 2] = np.float32(1e-39)  # a denormal block
        x[0, 161:192] = 0.0
        xq, xd, xs = quantize_activation(x).quantized(form)
        xb = x.reshape(-1, 32)
        finite = np.isfinite(xb).all(1)
        amax = np.where(finite[:, None], np.abs(xb), 0).max(1).astype(np.float32)
        d = np.where(finite, amax / np.float32(127), np.float32(np.nan)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            idv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
            r = np.rint(np.where(finite[:, None], xb, 0) * idv[:, None])
        q = np.clip(np.nan_to_num(r, nan=0.0), -127, 127).astype(np.int8)
        np.testing.assert_array_equal(xq.reshape(-1, 32), q)
        d16 = d.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(xd.reshape(-1), d16)
        s = q.astype(np.int64).sum(1)
        if form == "q8_0":
            np.testing.assert_array_equal(xs.reshape(-1), s)
        else:
            np.testing.assert_array_equal(xs.reshape(-1), (d * s.astype(np.float32)).astype(np.float16).astype(np.float32))


def test_q8_k_sum_slots():
    """q8_K's 16 sum slots per block (act_quant.Q8K_SUMS), against sums of the quants in NumPy:
    slots 0-7 the sums of 32 (b_2l + b_2l+1), slots 8-15 the int16 pairs (b_l low, b_l+8 high),
    and `bsum16` reads b_k back; extreme blocks (every quant +-127: |b| = 2032) and a zero block."""
    from qllama.kernels.act_quant import bsum16

    rng = np.random.default_rng(31)
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    x[0, :256] = -7.0  # every quant -127 (d < 0: the largest magnitude is negative)
    x[1, 256:512] = 0.0  # a zero block
    x[2, 512:528] = 3.0  # one 16-element run at the block's maximum
    xq, _, xs = quantize_activation(x).quantized("q8_K")
    b16 = xq.astype(np.int64).reshape(3, 4, 16, 16).sum(-1)  # (tokens, blocks, 16 sums)
    assert np.abs(b16).max() == 16 * 127
    slots = xs.reshape(3, 4, 16).astype(np.int64)
    np.testing.assert_array_equal(slots[..., :8], b16[..., 0::2] + b16[..., 1::2])
    halves = slots[..., 8:].astype(np.int32).view(np.int16).reshape(3, 4, 8, 2)  # (low, high) of each slot
    np.testing.assert_array_equal(halves[..., 0], b16[..., :8])
    np.testing.assert_array_equal(halves[..., 1], b16[..., 8:])
    for t in range(3):
        for b in range(4):
            assert [bsum16(xs[t], b, k) for k in range(16)] == list(b16[t, b])


def test_activation_reuse():
    rng = np.random.default_rng(5)
    a = QTensor.from_bytes(gt.Q4_K, random_matrix(gt.Q4_K, 256, 6, rng), (256, 6))
    b = QTensor.from_bytes(gt.Q8_0, random_matrix(gt.Q8_0, 256, 3, rng), (256, 3))
    c = QTensor.from_bytes(gt.Q5_0, random_matrix(gt.Q5_0, 256, 4, rng), (256, 4))
    x = rng.standard_normal(256).astype(np.float32)
    act = quantize_activation(x)
    for m in (a, b, c):
        assert np.array_equal(m.matvec(act), m.matvec(x))
    xs = rng.standard_normal((3, 256)).astype(np.float32)
    act = quantize_activation(xs)
    for m in (a, b, c):
        assert np.array_equal(m.matmul(act), m.matmul(xs))


def test_out_parameter_and_noncontiguous_input():
    rng = np.random.default_rng(6)
    q = QTensor.from_bytes(gt.Q6_K, random_matrix(gt.Q6_K, 256, 5, rng), (256, 5))
    x2 = rng.standard_normal((256, 2)).astype(np.float32)
    out = np.empty(5, np.float32)
    assert q.matvec(x2[:, 0], out=out) is out
    assert np.array_equal(out, q.matvec(np.ascontiguousarray(x2[:, 0])))
    out2 = np.empty((2, 5), np.float32)
    assert q.matmul(x2.T, out=out2) is out2


def test_nan_propagates_through_matvec(float_path):
    rng = np.random.default_rng(7)
    for tid in (gt.Q4_K, gt.Q8_0, gt.Q4_0):
        raw = random_matrix(tid, 256, 3, rng).copy()
        raw[1, FP16_FIELDS[tid][0] : FP16_FIELDS[tid][0] + 2] = np.array([0x7E00], np.uint16).view(np.uint8)
        q = QTensor.from_bytes(tid, raw, (256, 3))
        x = rng.standard_normal(256).astype(np.float32)
        for path in (False, True):
            set_int8_activations(path)
            y = q.matvec(x)
            assert np.isnan(y[1]) and np.isfinite(y[[0, 2]]).all(), (tname(tid), path)
        x[5] = np.nan
        assert np.isnan(q.matvec(x)).all()


def test_int8_activations_extreme_values():
    """Tiny (subnormal), huge and zero activation blocks stay finite and accurate."""
    rng = np.random.default_rng(10)
    for tid in (gt.Q4_K, gt.Q8_0, gt.Q4_0):
        raw = random_matrix(tid, 512, 5, rng)
        q = QTensor.from_bytes(tid, raw, (512, 5))
        w64 = oracle(tid, raw, 512).astype(np.float64)
        x = rng.standard_normal(512).astype(np.float32)
        x[:256] *= np.float32(1e-41)  # subnormal block(s): the inverse scale overflows
        x[256:288] = 0
        x[300] = np.float32(1e30)
        y = q.matvec(x)
        assert np.isfinite(y).all()
        assert rel_err(y, w64 @ x.astype(np.float64)) <= INT8_TOL


# -- threads ----------------------------------------------------------------------------------


def test_results_identical_at_1_and_2_threads():
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba was started with a single thread")
    rng = np.random.default_rng(8)
    before = get_threads()
    try:
        for tid in (gt.Q4_K, gt.Q5_K, gt.Q6_K, gt.Q8_0, gt.Q4_0, gt.Q4_1, gt.Q5_0, gt.Q5_1, gt.Q3_K, gt.F16):
            raw = random_matrix(tid, 256, 37, rng)
            q = QTensor.from_bytes(tid, raw, (256, 37))
            x = rng.standard_normal((7, 256)).astype(np.float32)
            res = []
            for n in (1, 2):
                set_threads(n)
                assert get_threads() == n
                per = []
                for int8 in (True, False):
                    set_int8_activations(int8)
                    per += [q.matvec(x[0]), q.matmul(x), q.dequantize()]
                res.append(per)
            for a, b in zip(*res):
                assert np.array_equal(a, b, equal_nan=True)
    finally:
        set_int8_activations(True)
        set_threads(before)


def test_set_threads_validates():
    with pytest.raises(ValueError):
        set_threads(0)
    before = get_threads()
    set_threads(None)  # physical cores
    assert get_threads() >= 1
    set_threads(before)


# -- validation -------------------------------------------------------------------------------


def test_supported_types():
    assert {tname(t) for t in SUPPORTED_TYPES} == {
        "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K",
        "iq4_nl", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0",
        "mxfp4"}


def test_from_bytes_validates():
    raw = np.zeros(144 * 2, np.uint8)
    with pytest.raises(UnsupportedError, match="q4_0_4_4, which qllama cannot run yet"):
        QTensor.from_bytes(31, raw, (256, 2))  # (repacked q4_0: never in files since 2024)
    with pytest.raises(QllamaError, match="needs 288"):
        QTensor.from_bytes(gt.Q4_K, raw[:-1], (256, 2))
    with pytest.raises(QllamaError, match="multiple of the q4_K block size"):
        QTensor.from_bytes(gt.Q4_K, raw, (128, 4))
    with pytest.raises(QllamaError):
        QTensor.from_bytes(gt.Q4_K, raw, (256, 0))
    assert QTensor.from_bytes(gt.Q4_K, raw.tobytes(), (256, 2)).nbytes == 288
    q = QTensor.from_bytes(gt.Q4_K, raw, (256, 2))
    assert q.nbytes == 288 and q.n_cols == 256 and q.n_rows == 2 and q.shape == (256, 2)
    assert not q.raw.flags.writeable


def test_operations_validate_input():
    q = QTensor.from_bytes(gt.Q8_0, np.zeros(34 * 8 * 3, np.uint8), (256, 3))
    with pytest.raises(ValueError, match="shape"):
        q.matvec(np.zeros(255, np.float32))
    with pytest.raises(ValueError, match="float32"):
        q.matvec(np.zeros(256, np.float64))
    with pytest.raises(ValueError, match="shape"):
        q.matmul(np.zeros(256, np.float32))
    with pytest.raises(ValueError, match="out"):
        q.matvec(np.zeros(256, np.float32), out=np.zeros(4, np.float32))
    with pytest.raises(IndexError):
        q.dequantize(np.array([0, 3]))
    with pytest.raises(IndexError):
        q.row(-4)
    assert q.matmul(np.zeros((0, 256), np.float32)).shape == (0, 3)
    assert q.dequantize(np.array([], np.int64)).shape == (0, 256)


def test_from_gguf_rejects_unsupported_type(tmp_path):
    from gguf import GGUFWriter

    from qllama.gguf.reader import GGUFFile

    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("ok.weight", np.zeros((2, 34), np.uint8), raw_shape=(2, 34), raw_dtype=GQ.Q8_0)
    w.add_tensor("iq.weight", np.zeros((2, 18), np.uint8), raw_shape=(2, 18), raw_dtype=GQ.Q1_0)  # (a type qllama lacks)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFFile(path)
    q = QTensor.from_gguf(gf, "ok.weight")
    assert q.shape == (32, 2) and q.type_id == gt.Q8_0
    with pytest.raises(UnsupportedError, match="tensor iq.weight has type q1_0, which qllama cannot run yet"):
        QTensor.from_gguf(gf, "iq.weight")


# -- tensors quantized by llama.cpp ------------------------------------------------------------


def _q4km_path() -> Path:
    paths = sorted((SHARED / "models").glob("*Q4_K_M.gguf")) if SHARED.is_dir() else []
    if not paths:
        pytest.skip(f"no *Q4_K_M.gguf under {SHARED / 'models'}")
    return paths[0]


def test_llama_cpp_tensors_dequantize_bit_exact():
    from qllama.gguf.reader import GGUFFile

    gf = GGUFFile(_q4km_path())
    seen = set()
    for name, info in gf.tensors.items():
        if info.type_id not in (gt.Q4_K, gt.Q6_K, gt.Q8_0, gt.Q5_0):
            continue
        q = QTensor.from_gguf(gf, name)
        ref = gq.dequantize(gf.tensor_bytes(name).reshape(q.n_rows, -1), GQ(info.type_id))
        assert_bits_equal(q.dequantize(), ref)
        seen.add(info.type_id)
    assert {gt.Q4_K, gt.Q6_K} <= seen


def test_llama_cpp_tensors_matvec():
    from qllama.gguf.reader import GGUFFile

    gf = GGUFFile(_q4km_path())
    rng = np.random.default_rng(9)
    done = set()
    for name, info in gf.tensors.items():
        if info.type_id in done or info.type_id not in (gt.Q4_K, gt.Q6_K) or len(info.shape) != 2:
            continue
        done.add(info.type_id)
        q = QTensor.from_gguf(gf, name)
        w64 = q.dequantize().astype(np.float64)
        xs = rng.standard_normal((3, q.n_cols)).astype(np.float32)
        ref = xs.astype(np.float64) @ w64.T
        for int8, tol in ((False, FLOAT_TOL), (True, INT8_TOL)):
            set_int8_activations(int8)
            try:
                assert rel_err(q.matvec(xs[0]), ref[0]) <= tol
                assert rel_err(q.matmul(xs), ref) <= tol
            finally:
                set_int8_activations(True)


# -- numerically hostile blocks (issue 17): no exception, the damage stays in its row ----------------

_NAN16, _INF16, _NEG_INF16 = 0x7E00, 0x7C00, 0xFC00
_HOSTILE = [(tid, f, bits) for tid in (gt.Q4_K, gt.Q6_K, gt.Q8_0, gt.Q4_0, gt.Q5_0, gt.Q5_1)
            for f in range(len(FP16_FIELDS[tid])) for bits in (_NAN16, _INF16, _NEG_INF16)]


@pytest.mark.parametrize("tid, field, bits", _HOSTILE,
                         ids=[f"{tname(t)}-field{f}-{b:#06x}" for t, f, b in _HOSTILE])
def test_nonfinite_scale_stays_in_its_row(tid, field, bits):
    """One block of row 2 gets a NaN / +-Inf fp16 scale. Dequantize equals gguf-py bit for bit;
    mat-vec and mat-mat on the float and int8 paths raise nothing, give a non-finite row 2, and
    every other row exactly as for the undamaged matrix (which matches float64)."""
    rng = np.random.default_rng(500 + tid + 7 * field + bits % 97)
    t = gt.GGML_TYPES[tid]
    ne0, ne1, row, block = 2 * 256, 10, 2, 1
    clean = random_matrix(tid, ne0, ne1, rng)
    bad = clean.copy()
    at = block * t.type_size + FP16_FIELDS[tid][field]
    bad[row, at : at + 2] = np.array([bits], np.uint16).view(np.uint8)
    qc = QTensor.from_bytes(tid, clean, (ne0, ne1))
    qb = QTensor.from_bytes(tid, bad, (ne0, ne1))
    others = [r for r in range(ne1) if r != row]

    with np.errstate(all="ignore"):
        ref = oracle(tid, bad, ne0)  # gguf-py
    assert_bits_equal(qb.dequantize(), ref)
    assert not np.isfinite(ref[row, block * t.block_size : (block + 1) * t.block_size]).all()
    assert np.isfinite(ref[others]).all() and np.isfinite(np.delete(ref[row], np.s_[block * t.block_size : (block + 1) * t.block_size])).all()

    w64 = oracle(tid, clean, ne0).astype(np.float64)[others]
    x = rng.standard_normal(ne0).astype(np.float32)
    xs = rng.standard_normal((5, ne0)).astype(np.float32)  # 5 tokens: the 4-token and 1-token int8 kernels
    try:
        for int8, tol in ((False, FLOAT_TOL), (True, INT8_TOL)):
            set_int8_activations(int8)
            y, ym = qb.matvec(x), qb.matmul(xs)
            assert not np.isfinite(y[row]) and not np.isfinite(ym[:, row]).any(), int8
            assert np.array_equal(y[others], qc.matvec(x)[others]), int8
            assert np.array_equal(ym[:, others], qc.matmul(xs)[:, others]), int8
            assert rel_err(y[others], w64 @ x) <= tol and rel_err(ym[:, others], xs.astype(np.float64) @ w64.T) <= tol
    finally:
        set_int8_activations(True)


@pytest.mark.parametrize("bits", [_NAN16, _INF16, _NEG_INF16], ids=hex)
def test_nonfinite_f16_weight_stays_in_its_row(bits):
    rng = np.random.default_rng(600 + bits % 89)
    ne0, ne1, row = 96, 5, 3
    w = rng.standard_normal((ne1, ne0)).astype(np.float16)
    bad = w.copy()
    bad.view(np.uint16)[row, 17] = bits
    qc = QTensor.from_bytes(gt.F16, w.view(np.uint8), (ne0, ne1))
    qb = QTensor.from_bytes(gt.F16, bad.view(np.uint8), (ne0, ne1))
    others = [r for r in range(ne1) if r != row]
    assert_bits_equal(qb.dequantize(), bad.astype(np.float32))
    x = rng.standard_normal(ne0).astype(np.float32)
    xs = rng.standard_normal((3, ne0)).astype(np.float32)
    y, ym = qb.matvec(x), qb.matmul(xs)
    assert not np.isfinite(y[row]) and not np.isfinite(ym[:, row]).any()
    assert np.array_equal(y[others], qc.matvec(x)[others])
    assert np.array_equal(ym[:, others], qc.matmul(xs)[:, others])
    w64 = w.astype(np.float64)[others]
    assert rel_err(y[others], w64 @ x) <= FLOAT_TOL and rel_err(ym[:, others], xs.astype(np.float64) @ w64.T) <= FLOAT_TOL
