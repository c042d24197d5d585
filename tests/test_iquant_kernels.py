"""The i-quants' batch kernels (issue 30 item 4): iq4_xs / iq4_nl / iq3_s / iq2_xxs gemms (`kernels/_x86_gemm.py`,
driven by `kernels/int8.GEMM_ROWS`) give every row the one-token row kernel's bits, and the
live ggml's `vec_dot` bits (oracle). A prompt's rows of iq4_xs / iq3_s / iq2_xxs (`matmul(prompt=True)`,
8+ tokens) take llama.cpp's prompt arithmetic instead (its ggml-cpu/tiled kernels, `_x86_gemm.SUMS`):
equal to a float64 / exact-rounding reference of it, and to the live ggml's `mul_mat` (oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from qllama.gguf.types import GGML_TYPES, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, Q2_K, Q4_K, Q5_K, Q6_K
from qllama.qtensor import QTensor, get_threads, quantize_activation, set_threads

pytest.importorskip("gguf.quants")
from test_iquants import _needs_int8, bits, ggml_products, gq, random_blocks  # noqa: E402  (tests/ is on sys.path)

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
    from qllama.kernels._x86_gemm import HALVES, L1_BLOCK_BYTES, TILE_ROWS
    from qllama.kernels._x86_gemm_iq import IQ_PACKED_BYTES
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


PROMPT_TYPES = (IQ4_XS, IQ3_S, IQ2_XXS, IQ3_XXS, Q4_K, Q5_K, Q6_K, Q2_K)
_GQ = {IQ4_XS: "IQ4_XS", IQ3_S: "IQ3_S", IQ2_XXS: "IQ2_XXS", IQ3_XXS: "IQ3_XXS", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
       Q2_K: "Q2_K"}


def _round_f32(v) -> np.float32:
    """The exact rational v rounded once to float32 (nearest, ties to even; normal range)."""
    from fractions import Fraction

    if v == 0:
        return np.float32(0.0)
    sign, v = (-1 if v < 0 else 1), abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    q = v / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    n = q.numerator // q.denominator
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return np.float32(sign * n * 2.0 ** (e - 23))


def _fma32(a, b, c) -> np.float32:
    from fractions import Fraction

    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _integer_rows(tid: int, blocks: np.ndarray, fields: tuple[float, ...]) -> np.ndarray:
    """gguf-py's decoding of blocks (n_rows, nb, bytes) with their fp16 scale fields set to
    `fields` (d = 1: scale * value as exact integers; q4_K's d = 0, dmin = 1: -min) -> int64."""
    unit = blocks.copy()
    for off, v in zip(GGML_TYPES[tid].scale_fields, fields):
        unit[..., off:off + 2] = np.array([v], np.float16).view(np.uint8)
    w = gq.dequantize(unit.reshape(blocks.shape[0], -1), getattr(gq.GGMLQuantizationType, _GQ[tid])).astype(np.float64)
    w = w * {IQ2_XXS: 8, IQ3_XXS: 4}.get(tid, 1)  # (their d = 1 rows carry 1/8 and 1/4)
    wi = w.astype(np.int64)
    assert np.array_equal(wi, w)  # exact integers
    return wi.reshape(blocks.shape[0], blocks.shape[1], 256)


def llama_prompt_reference(tid: int, raw: np.ndarray, xq: np.ndarray, xd: np.ndarray) -> np.ndarray:
    """llama.cpp's prompt arithmetic (ggml-cpu/tiled, its AVX-512 VNNI kernel as GCC builds it),
    from gguf-py's decoder: per row, token and super-block the exact integer s1 = sum of (scale *
    value) * x (the values decoded with d = 1: exact integers, times 8 for iq2_xxs, 4 for iq3_xxs)
    and for q4_K, q5_K and q2_K s2 = sum of min * x; then r = fl(fl(s1) * d) (those: r = -fl(s2) * dmin + r, fused) and out =
    fma(r, dx, out) over the super-blocks in order, from 0 (d: the fp16 d, / 8 for iq2_xxs, / 4 for iq3_xxs).
    float32 (n_tok, n_rows)."""
    t = GGML_TYPES[tid]
    n_rows, nb = raw.shape[0], raw.shape[1] // t.type_size
    blocks = raw.reshape(n_rows, nb, t.type_size)
    scales = [blocks[..., off:off + 2].copy().view(np.float16)[..., 0].astype(np.float32) for off in t.scale_fields]
    d = scales[0] * np.float32({IQ2_XXS: 0.125, IQ3_XXS: 0.25}.get(tid, 1.0))  # (n_rows, nb)
    x = xq.astype(np.int64).reshape(xq.shape[0], nb, 256)
    s1 = np.einsum("rbe,tbe->trb", _integer_rows(tid, blocks, (1.0, 0.0)), x)  # (n_tok, n_rows, nb)
    s2 = -np.einsum("rbe,tbe->trb", _integer_rows(tid, blocks, (0.0, 1.0)), x) if tid in (Q4_K, Q5_K, Q2_K) else None
    out = np.zeros((xq.shape[0], n_rows), np.float32)
    for t_ in range(xq.shape[0]):
        for r in range(n_rows):
            acc = np.float32(0.0)
            for b in range(nb):
                f = np.float32(np.float32(s1[t_, r, b]) * d[r, b])
                if not (np.isfinite(f) and np.isfinite(acc)):  # (a NaN scale: the row is NaN, checked apart)
                    acc = np.float32(np.nan)
                    continue
                if s2 is not None:
                    f = _fma32(-np.float32(s2[t_, r, b]), scales[1][r, b], f)
                acc = _fma32(f, xd[t_, b], acc)
            out[t_, r] = acc
    return out


@pytest.mark.parametrize("tid", PROMPT_TYPES)
@pytest.mark.parametrize("ne0", [2048, 256])
def test_prompt_rows_take_llama_cpps_prompt_arithmetic(tid, ne0):
    """matmul(prompt=True) (on a 512-bit ISA 8 tokens a pass, then one by one; 2048 columns: two
    ranges of super-blocks that stay in L1) == the reference, bit for bit, at 1 and 2 threads; a
    NaN scale spoils its row only; without prompt=True a batch keeps vec_dot's rounding; with a
    mask (a server step of prompt and decode rows) each row takes its own kind's."""
    from qllama.kernels._x86_gemm import TILE_ROWS

    _needs_int8()
    rng = np.random.default_rng(ne0 + tid + 1)
    n_rows = 2 * TILE_ROWS
    raw = random_blocks(tid, n_rows, ne0, rng, scale=0.03)
    at = (GGML_TYPES[tid].type_size if ne0 > 256 else 0) + GGML_TYPES[tid].scale_fields[0]
    raw[3, at:at + 2] = np.array([0x7E00], np.uint16).view(np.uint8)  # row 3: d = NaN
    q = QTensor.from_bytes(tid, raw, (ne0, n_rows))
    before = get_threads()
    try:
        for n_threads in (1, 2):
            set_threads(n_threads)
            for n_tok in (3, 8, 19):
                x = rng.standard_normal((n_tok, ne0)).astype(np.float32)
                xq, xd, _ = quantize_activation(x).quantized("q8_K")
                got = q.matmul(x, prompt=True)
                assert np.isnan(got[:, 3]).all() and np.isfinite(np.delete(got, 3, axis=1)).all()
                want = llama_prompt_reference(tid, raw, xq, xd)
                np.testing.assert_array_equal(bits(np.delete(got, 3, axis=1)), bits(np.delete(want, 3, axis=1)))
                exact = q.matmul(x)
                assert not np.array_equal(bits(exact), bits(got))  # (the two roundings differ somewhere)
                np.testing.assert_array_equal(bits(exact[-1]), bits(q.matvec(x[-1])))
                mask = np.arange(n_tok) % 3 == 1
                mixed = q.matmul(x, prompt=mask)
                np.testing.assert_array_equal(bits(mixed[mask]), bits(got[mask]))
                np.testing.assert_array_equal(bits(mixed[~mask]), bits(exact[~mask]))
    finally:
        set_threads(before)


def ggml_mul_mat(tid: int, raw: np.ndarray, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """The live ggml's mul_mat (a graph of one node on its CPU backend) of rows raw (n_rows, row
    bytes) of type tid and float32 x (n_tok, ne0) -> float32 (n_tok, n_rows)."""
    import ctypes

    from test_iquants import _ggml_cpu

    _, cpu = _ggml_cpu()
    import llama_cpp

    base = ctypes.CDLL(str(__import__("pathlib").Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))

    class Params(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    vp = ctypes.c_void_p
    for name, res, args in (("ggml_init", vp, [Params]), ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                            ("ggml_mul_mat", vp, [vp, vp, vp]), ("ggml_new_graph", vp, [vp]),
                            ("ggml_build_forward_expand", None, [vp, vp]), ("ggml_get_data", vp, [vp]), ("ggml_free", None, [vp])):
        fn = getattr(base, name)
        fn.restype, fn.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.argtypes, cpu.ggml_graph_compute_with_ctx.restype = [vp, vp, ctypes.c_int], ctypes.c_int
    n_rows, (n_tok, ne0) = raw.shape[0], x.shape
    ctx = base.ggml_init(Params(raw.nbytes + x.nbytes + 4 * n_rows * n_tok + (16 << 20), None, False))
    try:
        a = base.ggml_new_tensor_2d(ctx, tid, ne0, n_rows)
        b = base.ggml_new_tensor_2d(ctx, 0, ne0, n_tok)  # (GGML_TYPE_F32)
        xs = np.ascontiguousarray(x, np.float32)
        ctypes.memmove(base.ggml_get_data(a), np.ascontiguousarray(raw).ctypes.data, raw.nbytes)
        ctypes.memmove(base.ggml_get_data(b), xs.ctypes.data, xs.nbytes)
        c = base.ggml_mul_mat(ctx, a, b)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, c)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, n_threads) == 0
        out = np.empty((n_tok, n_rows), np.float32)
        ctypes.memmove(out.ctypes.data, base.ggml_get_data(c), out.nbytes)
        return out
    finally:
        base.ggml_free(ctx)


@pytest.mark.oracle
@pytest.mark.parametrize("tid", PROMPT_TYPES)
def test_prompt_rows_equal_live_ggml_mul_mat(tid):
    """A prompt's rows (matmul(prompt=True)) == llama.cpp's own mul_mat of the batch at 8+ tokens,
    bit for bit (its tiled kernels: 16 or fewer tokens its narrow path, more the 256 x 256
    windows). For the i-quants, decode rows (prompt=False) keep vec_dot's rounding, which the tiled
    kernels do not (so this is a real test of the prompt path), and under 8 tokens llama.cpp's
    mul_mat is its vec_dot, as qllama's decode rows."""
    from qllama.kernels._x86_gemm import TILE_ROWS

    _needs_int8()
    rng = np.random.default_rng(tid)
    ne0, n_rows = 2048, 2 * TILE_ROWS
    raw = random_blocks(tid, n_rows, ne0, rng, scale=0.03)
    q = QTensor.from_bytes(tid, raw, (ne0, n_rows))
    for n_tok in (4, 8, 13, 40):
        x = rng.standard_normal((n_tok, ne0)).astype(np.float32)
        want = ggml_mul_mat(tid, raw, x)
        if n_tok >= 8:
            np.testing.assert_array_equal(bits(q.matmul(x, prompt=True)), bits(want))
        if tid not in (Q4_K, Q5_K, Q6_K, Q2_K):  # (qllama's k-quant decode rows are not this build's vec_dot bits)
            assert (n_tok < 8) == np.array_equal(bits(q.matmul(x)), bits(want))
