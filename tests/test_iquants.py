"""The i-quants (issue 30): iq4_nl and iq4_xs end to end; the grid and ternary types' decoders.

- dequantisation (NumPy rows and the Numba decoders) == gguf-py's `gguf.quants.dequantize`, bit
  for bit, on random blocks (every bit pattern of an iq4 block is valid; the grid types' indices
  are drawn within their grids);
- the int8 kernels == a NumPy transcription of ggml's AVX2 `ggml_vec_dot_iq4_nl_q8_0` /
  `ggml_vec_dot_iq4_xs_q8_K` (`_ggml_*` below), bit for bit, and == the live ggml (`oracle`:
  libggml-cpu of llama-cpp-python called through ctypes);
- prompts (2..9 tokens: 4-token tiles and tails) == decode bit for bit;
- a tiny model in iq4_xs / iq4_nl runs and matches a float64 forward of its stored weights.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from qllama.gguf import types as gt
from qllama.gguf.types import GGML_TYPES, IQ4_NL, IQ4_XS
from qllama.qtensor import QTensor, int8_activations, quantize_activation

gq = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as GQ  # noqa: E402

IQ4 = (IQ4_NL, IQ4_XS)
FORM = {IQ4_NL: "q8_0", IQ4_XS: "q8_K"}


def random_blocks(tid: int, n_rows: int, ne0: int, rng, scale: float = 0.05) -> np.ndarray:
    """uint8 (n_rows, row bytes) of random blocks with finite fp16 scales d."""
    t = GGML_TYPES[tid]
    raw = rng.integers(0, 256, (n_rows, ne0 // t.block_size, t.type_size), dtype=np.uint8)
    for off in t.scale_fields:
        raw[..., off:off + 2] = rng.uniform(-scale, scale, (n_rows, raw.shape[1], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n_rows, -1)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# -- dequantisation --------------------------------------------------------------------------


@pytest.mark.parametrize("tid", IQ4)
def test_dequantize_equals_gguf_bit_for_bit(tid):
    from qllama.dequant import iq_rows as dequantize_iq_np
    from qllama.kernels import iquants
    from qllama.kernels._fp16 import FP16_TO_F32

    rng = np.random.default_rng(tid)
    raw = random_blocks(tid, 7, 1024, rng, scale=60000.0)  # (the full fp16 range)
    raw[0, :2] = np.array([0x7C00], np.uint16).view(np.uint8)  # an Inf scale: Inf/NaN as gguf-py
    ref = gq.dequantize(raw, GQ(tid))  # (7, 1024)
    rows = np.arange(7, dtype=np.int64)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(bits(dequantize_iq_np.dequantize_rows(tid, raw, rows)), bits(ref))
    for parallel in (True, False):
        out = np.empty((7, 1024), np.float32)
        iquants.dequantize_rows(tid, raw, rows, FP16_TO_F32, out, parallel=parallel)
        np.testing.assert_array_equal(bits(out), bits(ref))
    q = QTensor.from_bytes(tid, raw, (1024, 7))
    np.testing.assert_array_equal(bits(q.dequantize([3, 1])), bits(ref[[3, 1]]))


@pytest.mark.parametrize("tid", IQ4)
def test_float_path_matches_float64(tid, float_path):
    rng = np.random.default_rng(1)
    raw = random_blocks(tid, 40, 512, rng)
    w = gq.dequantize(raw, GQ(tid)).astype(np.float64)  # (40, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    q = QTensor.from_bytes(tid, raw, (512, 40))
    ref = x.astype(np.float64) @ w.T
    for got in (q.matmul(x), np.stack([q.matvec(xi) for xi in x])):
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


GRID_TYPES = (gt.IQ3_S, gt.IQ3_XXS, gt.IQ2_XXS, gt.IQ2_XS, gt.IQ2_S, gt.IQ1_S, gt.IQ1_M, gt.TQ1_0, gt.TQ2_0)


@pytest.mark.parametrize("tid", GRID_TYPES, ids=lambda t: GGML_TYPES[t].name)
def test_grid_types_dequantize_equal_gguf(tid):
    """Random bytes are valid blocks of every grid type (each grid has 2^bits entries; ternary
    bytes decode by ggml's formula, wrapping products included); iq1_m's fp16 d is spread over its
    scales, so random blocks include NaN / Inf / subnormal d: NaN where gguf-py has NaN."""
    from qllama.dequant import iq_rows as dequantize_iq_np

    rng = np.random.default_rng(100 + tid)
    raw = random_blocks(tid, 9, 1024, rng, scale=2.0)
    with np.errstate(all="ignore"):
        ref = gq.dequantize(raw, GQ(tid))  # (9, 1024)
        got = QTensor.from_bytes(tid, raw, (1024, 9)).dequantize()
        got2 = dequantize_iq_np.dequantize_rows(tid, raw, np.array([8, 0, 8]))
    for a, b in ((got, ref), (got2, ref[[8, 0, 8]])):
        nan = np.isnan(b)
        assert np.array_equal(np.isnan(a), nan)
        np.testing.assert_array_equal(bits(a)[~nan], bits(b)[~nan])


@pytest.mark.parametrize("tid", GRID_TYPES, ids=lambda t: GGML_TYPES[t].name)
def test_grid_types_matvec_matmul_match_float64(tid, float_path):
    rng = np.random.default_rng(200 + tid)
    raw = random_blocks(tid, 24, 512, rng)
    if tid == gt.IQ1_M:  # its d lives in the scales' top nibbles: set d = 0.01 in every block
        blocks = raw.reshape(24, 2, 56)
        dbits = int(np.array([0.01], np.float16).view(np.uint16)[0])
        for k in range(4):
            sc = blocks[..., 48 + 2 * k: 50 + 2 * k].copy().view("<u2")
            sc[:] = (sc & 0x0FFF) | (((dbits >> (4 * k)) & 15) << 12)
            blocks[..., 48 + 2 * k: 50 + 2 * k] = sc.view(np.uint8)
        raw = blocks.reshape(24, -1)
    w = gq.dequantize(raw, GQ(tid)).astype(np.float64)  # (24, 512)
    q = QTensor.from_bytes(tid, raw, (512, 24))
    x = rng.standard_normal((5, 512)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T
    assert np.isfinite(ref).all()
    for got in (q.matmul(x), np.stack([q.matvec(xi) for xi in x])):
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


GRID_INT8 = (gt.IQ3_S, gt.IQ3_XXS, gt.IQ2_XXS, gt.IQ2_XS, gt.IQ2_S, gt.IQ1_S, gt.IQ1_M, gt.TQ1_0, gt.TQ2_0)


def grid_matrix(tid: int, n_rows: int, ne0: int, rng) -> np.ndarray:
    """Random blocks of a grid type with a finite d of 0.01 .. 0.03 (iq1_m: written into the scales' top nibbles)."""
    raw = random_blocks(tid, n_rows, ne0, rng, scale=0.03)
    if tid == gt.IQ1_M:
        blocks = raw.reshape(n_rows, -1, 56)
        d = rng.uniform(0.01, 0.03, blocks.shape[:2]).astype(np.float16).view(np.uint16).astype(np.int64)
        for k in range(4):
            sc = blocks[..., 48 + 2 * k: 50 + 2 * k].copy().view("<u2")[..., 0].astype(np.int64)
            sc = (sc & 0x0FFF) | (((d >> (4 * k)) & 15) << 12)
            blocks[..., 48 + 2 * k: 50 + 2 * k] = sc.astype("<u2")[..., None].view(np.uint8)
        raw = blocks.reshape(n_rows, -1)
    return raw


@pytest.mark.parametrize("tid", GRID_INT8, ids=lambda t: GGML_TYPES[t].name)
def test_grid_int8_prompt_equals_decode_and_float64(tid):
    """The grid types' int8 kernels: rows of a 1..6-token batch == the one-token rows bit for bit;
    within the activations' rounding of the float64 product (exactness against ggml: the oracle test)."""
    _needs_int8()
    rng = np.random.default_rng(300 + tid)
    for n_rows in (48, 13):  # (48: the batch kernel, `_x86_gemm`, in passes of 16 or 8 rows; 13: the row kernels)
        raw = grid_matrix(tid, n_rows, 512, rng)
        q = QTensor.from_bytes(tid, raw, (512, n_rows))
        x = rng.standard_normal((6, 512)).astype(np.float32)
        one = np.stack([q.matvec(xi) for xi in x])
        for n in (1, 2, 6):
            np.testing.assert_array_equal(bits(q.matmul(x[:n])), bits(one[:n]))
    ref = x.astype(np.float64) @ gq.dequantize(raw, GQ(tid)).astype(np.float64).T
    assert 1e-7 < np.abs(one - ref).max() / np.abs(ref).max() < 5e-2


@pytest.mark.oracle
@pytest.mark.parametrize("tid", GRID_INT8, ids=lambda t: GGML_TYPES[t].name)
def test_grid_int8_equals_live_ggml_vec_dot(tid):
    _needs_int8()
    rng = np.random.default_rng(400 + tid)
    raw = grid_matrix(tid, 8, 1024, rng)
    q = QTensor.from_bytes(tid, raw, (1024, 8))
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    ref = np.stack([ggml_matvec(tid, raw, xi) for xi in x])
    np.testing.assert_array_equal(bits(q.matmul(x)), bits(ref))
    np.testing.assert_array_equal(bits(q.matvec(x[1])), bits(ref[1]))


def test_every_isa_gives_the_same_bits(tmp_path):
    """iq4_nl / iq4_xs decode and prompt rows in a process of another ISA (avx2, or avx512-vnni
    emulated where this one is avx2) equal this process's bit for bit."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from qllama.kernels._x86 import ISA

    _needs_int8()
    other = "avx2" if ISA != "avx2" else "avx512-vnni"
    code = (
        "import sys, numpy as np; sys.path.insert(0, 'tests')\n"
        "from test_iquants import isa_probe; np.savez(sys.argv[1], **isa_probe())\n"
    )
    env = {**os.environ, "QLLAMA_ISA": other, "QLLAMA_ISA_EMULATE": "1"}
    out = tmp_path / "other.npz"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    mine, theirs = isa_probe(), np.load(out)
    assert str(theirs["isa"]) == other and sorted(theirs.files) == sorted(mine)
    for k in mine:
        if k != "isa":
            np.testing.assert_array_equal(bits(theirs[k]), bits(mine[k]), err_msg=k)


def isa_probe() -> dict:
    """Fixed random iq4 matrices times 1, 3, 4 and 9 tokens (the 4-token intrinsic and its tails)."""
    from qllama.kernels._x86 import ISA

    rng = np.random.default_rng(7)
    res = {"isa": np.array(ISA)}
    for tid, ne0 in ((IQ4_NL, 32 * 45), (IQ4_NL, 512), (IQ4_XS, 1024)):
        q = QTensor.from_bytes(tid, random_blocks(tid, 24, ne0, rng), (ne0, 24))
        for n in (1, 3, 4, 9):
            x = rng.standard_normal((n, ne0)).astype(np.float32)
            x[0, :64] = -3.0
            res[f"{tid}/{ne0}/{n}"] = q.matmul(x) if n > 1 else q.matvec(x[0])
    return res


# -- int8 products: ggml's vec_dot in NumPy ---------------------------------------------------


def _fma(a, b, c):
    """float32 a * b + c rounded once (the exact product and sum in float64, then one rounding:
    exact but for double-rounding ties, which these tests' values do not hit)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _hsum8(v: np.ndarray) -> np.float32:
    """ggml's hsum_float_8, float32 throughout."""
    v = v.astype(np.float32)
    v = v[:4] + v[4:]
    v = v[:2] + v[2:]
    return np.float32(v[0] + v[1])


def _lanes(p: np.ndarray) -> np.ndarray:
    """(..., 32) int products -> (..., 8) int lane sums of 4 (pmaddubsw pairs, pmaddwd by 1)."""
    return p.reshape(*p.shape[:-1], 8, 4).sum(-1)


def _ggml_iq4_nl(raw_row, xq, xd) -> np.float32:
    """ggml_vec_dot_iq4_nl_q8_0 (AVX2): blocks in pairs into two 8-lane accumulators, then the
    scalar tail block with `sumf += d * sumi` (an fma)."""
    from qllama.dequant import iq_rows as dn

    nb = raw_row.size // 18
    blocks = raw_row.reshape(nb, 18)
    d = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
    q = dn._nibble_values(blocks[:, 2:]).astype(np.int64)  # (nb, 32)
    p = _lanes(q * xq.reshape(nb, 32).astype(np.int64))  # (nb, 8)
    acc = [np.zeros(8, np.float32), np.zeros(8, np.float32)]
    ib = 0
    while ib + 1 < nb:
        for h in range(2):
            db = np.float32(xd[ib + h] * d[ib + h])
            acc[h] = np.array([_fma(db, np.float32(p[ib + h, l]), acc[h][l]) for l in range(8)], np.float32)
        ib += 2
    s = _hsum8(acc[0] + acc[1])
    if ib < nb:
        s = _fma(np.float32(xd[ib] * d[ib]), np.float32(p[ib].sum()), s)
    return s


def _ggml_iq4_xs(raw_row, xq, xd) -> np.float32:
    """ggml_vec_dot_iq4_xs_q8_K (AVX2): per super-block the int32 lanes of sum_j ls_j * pairs,
    one fma of d * dx into 8 lanes; hsum_float_8 at the end."""
    from qllama.dequant import iq_rows as dn

    nb = raw_row.size // 136
    blocks = raw_row.reshape(nb, 136)
    acc = np.zeros(8, np.float32)
    for b in range(nb):
        blk = blocks[b]
        d = blk[:2].copy().view(np.float16)[0].astype(np.float32)
        sh = int(blk[2]) | (int(blk[3]) << 8)
        isum = np.zeros(8, np.int64)
        for j in range(8):
            ls = ((int(blk[4 + j // 2]) >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4)
            q = dn._nibble_values(blk[8 + 16 * j: 24 + 16 * j]).astype(np.int64)
            isum += (ls - 32) * _lanes(q * xq[256 * b + 32 * j: 256 * b + 32 * j + 32].astype(np.int64))
        db = np.float32(d * xd[b])
        acc = np.array([_fma(db, np.float32(isum[l]), acc[l]) for l in range(8)], np.float32)
    return _hsum8(acc)


def _needs_int8():
    if not int8_activations():
        pytest.skip("no int8-activation kernels on this host (needs AVX2)")


@pytest.mark.parametrize("tid,ne0", [(IQ4_NL, 256), (IQ4_NL, 288), (IQ4_NL, 32), (IQ4_XS, 512), (IQ4_XS, 256)])
def test_int8_equals_ggml_vec_dot_transcription(tid, ne0):
    """Decode (one token) and prompts (1..9 tokens) equal the NumPy transcription of ggml's
    vec_dot bit for bit, on the same q8 activations. (288: nine blocks, ggml's odd tail.)"""
    _needs_int8()
    rng = np.random.default_rng(ne0 + tid)
    raw = random_blocks(tid, 11, ne0, rng)
    q = QTensor.from_bytes(tid, raw, (ne0, 11))
    ggml = _ggml_iq4_nl if tid == IQ4_NL else _ggml_iq4_xs
    x = rng.standard_normal((9, ne0)).astype(np.float32)
    x[0, :32] = -3.0  # a constant block: every activation -127
    act = quantize_activation(x)
    xq, xd, _ = act.quantized(FORM[tid])
    ref = np.array([[ggml(raw[r], xq[t], xd[t]) for r in range(11)] for t in range(9)], np.float32)  # (9, 11)
    np.testing.assert_array_equal(bits(q.matmul(act)), bits(ref))
    for t in (0, 5):
        np.testing.assert_array_equal(bits(q.matvec(x[t])), bits(ref[t]))


@pytest.mark.parametrize("tid", IQ4)
def test_prompt_rows_equal_decode_bit_for_bit(tid):
    _needs_int8()
    rng = np.random.default_rng(5)
    ne0 = 32 * 27 if tid == IQ4_NL else 768  # (iq4_nl: an odd block count)
    for n_rows in (20, 48):  # (48: the batch kernel, `_x86_gemm`, in passes of 16 or 8 rows)
        raw = random_blocks(tid, n_rows, ne0, rng)
        q = QTensor.from_bytes(tid, raw, (ne0, n_rows))
        x = rng.standard_normal((9, ne0)).astype(np.float32)
        one = np.stack([q.matvec(xi) for xi in x])
        for n in range(1, 10):
            np.testing.assert_array_equal(bits(q.matmul(x[:n])), bits(one[:n]))


@pytest.mark.parametrize("tid", IQ4)
def test_int8_matches_float64_within_activation_rounding(tid):
    _needs_int8()
    rng = np.random.default_rng(9)
    raw = random_blocks(tid, 64, 1024, rng)
    w = gq.dequantize(raw, GQ(tid)).astype(np.float64)
    x = rng.standard_normal(1024).astype(np.float32)
    got = QTensor.from_bytes(tid, raw, (1024, 64)).matvec(x)
    ref = w @ x.astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert 1e-7 < err < 3e-2


# -- the live ggml ----------------------------------------------------------------------------


def _ggml_cpu():
    """(libggml-cpu of llama-cpp-python, its type-traits accessor) or skip."""
    import ctypes
    import os

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    ctypes.CDLL(os.path.join(lib, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    if not cpu.ggml_cpu_has_avx2():
        pytest.skip("this ggml build has no AVX2 vec_dot")

    class Traits(ctypes.Structure):
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]

    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    return ctypes, cpu


def _ggml_rows(tid: int, raw: np.ndarray, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ggml's vec_dot of the first n elements of every row with x in ggml's own activation form
    (from_float) -> float32 (n_rows,), that activation's bytes)."""
    ctypes, cpu = _ggml_cpu()
    tr = cpu.ggml_get_type_traits_cpu(tid).contents
    vt = cpu.ggml_get_type_traits_cpu(tr.vec_dot_type).contents
    yq = np.zeros(x.size // 256 * 292 + x.size // 32 * 34, np.uint8)  # room for q8_K or q8_0
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(vt.from_float)(x.ctypes.data, yq.ctypes.data, x.size)
    vec_dot = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(tr.vec_dot)
    out, s = np.zeros(raw.shape[0], np.float32), np.zeros(1, np.float32)
    for r in range(raw.shape[0]):
        row = np.ascontiguousarray(raw[r])
        vec_dot(n, s.ctypes.data, 0, row.ctypes.data, 0, yq.ctypes.data, 0, 1)
        out[r] = s[0]
    return out, yq


def ggml_matvec(tid: int, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Row by row with ggml's own from_float (the activation form) and vec_dot -> float32 (n_rows,)."""
    return _ggml_rows(tid, raw, x, x.size)[0]


def ggml_products(tid: int, raw: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(what qllama must give, what this llama.cpp build gives), float32 (n_rows,) each.

    Equal, except for an iq4_nl row of an odd block count: ggml sums the pairs of blocks with
    vector fmas, then adds the last block in scalar C, `sumf += d * sumi`, which one build of
    llama.cpp compiles to an fma and another to a product and a sum (seen on a Zen 5 host). qllama
    takes the fma form. So there the expected value is fma(d, sumi, S) with S ggml's own sum of
    the pairs (its vec_dot over the row less the last block), and ggml's value must be that or
    S + fl(d * sumi): both exact, bit for bit."""
    ref, yq = _ggml_rows(tid, raw, x, x.size)
    nb = x.size // 32
    if tid != IQ4_NL or nb % 2 == 0:
        return ref, ref
    pairs, _ = _ggml_rows(tid, raw, x, x.size - 32)  # S: the pairs alone, in the same order
    yb = yq[:nb * 34].reshape(nb, 34)[-1]  # the last q8_0 block: fp16 d, 32 int8
    xq = yb[2:].view(np.int8).astype(np.int64)
    want = np.empty_like(ref)
    for r in range(raw.shape[0]):
        wb = np.ascontiguousarray(raw[r]).reshape(nb, 18)[-1]  # the last iq4_nl block: fp16 d, 16 bytes of nibbles
        w = np.asarray(gq.IQ4_NL.kvalues, np.int64)  # (gguf-py's copy of ggml's table)
        w = w[np.concatenate([wb[2:] & 15, wb[2:] >> 4])]
        sumi = int(w @ xq)
        d = np.float32(wb[:2].view(np.float16)[0]) * np.float32(yb[:2].view(np.float16)[0])  # as ggml: x.d * y.d
        fused = np.float32(np.longdouble(d) * sumi + np.longdouble(pairs[r]))  # one rounding (exact in 64 bits)
        split = np.float32(pairs[r] + np.float32(d * np.float32(sumi)))
        assert bits(ref[r])[0] in (bits(fused)[0], bits(split)[0]), r
        want[r] = fused
    return want, ref


@pytest.mark.oracle
@pytest.mark.parametrize("tid,ne0", [(IQ4_NL, 2048), (IQ4_NL, 32 * 45), (IQ4_XS, 2048)])
def test_int8_equals_live_ggml_vec_dot(tid, ne0):
    _needs_int8()
    rng = np.random.default_rng(ne0)
    raw = random_blocks(tid, 16, ne0, rng)
    q = QTensor.from_bytes(tid, raw, (ne0, 16))
    x = rng.standard_normal((6, ne0)).astype(np.float32)
    want = np.stack([ggml_products(tid, raw, xi)[0] for xi in x])  # ggml's, or its fma form of iq4_nl's tail
    np.testing.assert_array_equal(bits(q.matmul(x)), bits(want))
    np.testing.assert_array_equal(bits(q.matvec(x[2])), bits(want[2]))


# -- a tiny model -------------------------------------------------------------------------------


@pytest.mark.parametrize("wtype", ["iq4_xs", "iq4_nl"])
def test_tiny_model_matches_float64_reference(tmp_path, wtype, int8_mode):
    from qllama.gguf.reader import GGUFFile
    from qllama.models import build_model, read_args
    from test_model import reference_logits, rel_err
    from tools.make_model import ModelSpec, write_model

    spec = ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, weight_type=wtype, seed=3,
                     types={"token_embd": wtype, "output": "q8_0"})
    path = tmp_path / f"{wtype}.gguf"
    stored = write_model(path, spec)
    gf = GGUFFile(path)
    model = build_model(gf, read_args(gf.metadata), n_ctx=64)
    model.kv_types = ("f32", "f32")
    assert {gf.tensors["blk.0.attn_q.weight"].type_id, gf.tensors["token_embd.weight"].type_id} == {GGML_TYPES_BY(wtype)}
    tokens = np.random.default_rng(0).integers(0, model.args.n_vocab, size=9).tolist()
    ref = reference_logits(stored, model.args, tokens)
    for on, tol in ((False, 1e-4), (True, 3e-2)):
        int8_mode(on)
        full = model.forward(tokens, model.new_cache(), all_logits=True)
        assert rel_err(full, ref) <= tol, (on, rel_err(full, ref))
        cache = model.new_cache()
        steps = np.concatenate([model.forward([t], cache, all_logits=True) for t in tokens])
        np.testing.assert_allclose(steps, full, rtol=0, atol=1e-4 * np.abs(full).max())


def test_a_prompts_rows_take_the_prompt_arithmetic_and_decode_rows_keep_decodes(tmp_path, int8_mode):
    """Model.forward(prompt=True) rounds an iq4_xs prompt as llama.cpp's prompt kernels (not as
    decode: the logits differ, by what flipping some activations' int8 rounding makes of a last-bit
    difference, within the int8 path's 3e-2 of test_tiny_model...); in one round of a prompt and a
    decode step (a server step, forward_many with a flag per segment) the prompt's rows equal the
    prompt run alone and the decode row equals the one-token step run alone, bit for bit."""
    from qllama.gguf.reader import GGUFFile
    from qllama.models import build_model, read_args
    from test_model import rel_err
    from tools.make_model import ModelSpec, write_model

    int8_mode(True)
    spec = ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, weight_type="iq4_xs", seed=5,
                     types={"token_embd": "iq4_xs", "output": "iq4_xs"})
    path = tmp_path / "iq4_xs.gguf"
    write_model(path, spec)
    gf = GGUFFile(path)
    model = build_model(gf, read_args(gf.metadata), n_ctx=64)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.args.n_vocab, size=12).tolist()
    other = rng.integers(0, model.args.n_vocab, size=5).tolist()
    as_prompt = model.forward(prompt, model.new_cache(), all_logits=True, prompt=True)
    as_steps = model.forward(prompt, model.new_cache(), all_logits=True)
    assert not np.array_equal(bits(as_prompt), bits(as_steps))
    assert rel_err(as_prompt, as_steps) <= 3e-2

    def decoded():  # a cache holding `other` from one-token steps
        cache = model.new_cache()
        for t in other[:-1]:
            model.forward([t], cache)
        return cache

    alone = model.forward([other[-1]], decoded())
    together = model.forward_many([(prompt, model.new_cache()), ([other[-1]], decoded())], all_logits=True,
                                  prompt=[True, False])
    np.testing.assert_array_equal(bits(together[0]), bits(as_prompt))
    np.testing.assert_array_equal(bits(together[1]), bits(alone))
    last = model.forward_many([(prompt, model.new_cache()), ([other[-1]], decoded())], prompt=[True, False])  # (last rows)
    np.testing.assert_array_equal(bits(last[0]), bits(as_prompt[-1:]))
    np.testing.assert_array_equal(bits(last[1]), bits(alone))


def GGML_TYPES_BY(name: str) -> int:
    from qllama.gguf.types import type_by_name

    return type_by_name(name).id


# -- files llama.cpp made (oracle: llama-cpp-python quantizes the trained model) -----------------

# preset -> (llama_ftype, the i-quant type its file holds); measured on the trained model (n_ctx 128,
# 15 chunks, f16 caches): perplexity IQ4_NL +0.095%, IQ4_XS +0.034%, IQ3_S +0.107%, IQ3_M +0.016%,
# TQ1_0 and TQ2_0 -0.017% against llama.cpp; argmax equal at every clear position (margin >= 0.15)
# and 32 greedy tokens equal for all six (397 s on the shared 2 cores). The presets that need an
# importance matrix (IQ3_XXS, IQ2_*, IQ1_*, Q2_K_S): tests/test_iquants_oracle.py.
ORACLE_FTYPES = {"IQ4_NL": (25, IQ4_NL), "IQ4_XS": (30, IQ4_XS), "IQ3_S": (26, gt.IQ3_S), "IQ3_M": (27, gt.IQ3_S),
                 "TQ1_0": (36, gt.TQ1_0), "TQ2_0": (37, gt.TQ2_0)}
ORACLE_PPL_TOL = 5e-3


def llama_cpp_quantize(src, dst, ftype: int, imatrix: dict | None = None, kv: dict | None = None) -> None:
    """llama.cpp's `llama_model_quantize` writes `dst` from `src` as llama file type `ftype`
    (tools/llama_quantize.py; skips without llama-cpp-python)."""
    from tools.llama_quantize import quantize

    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the [oracle] extra) is not installed")
    quantize(src, dst, ftype, imatrix=imatrix, kv=kv)


@pytest.fixture(scope="module")
def llama_cpp_files(tmp_path_factory):
    from conftest import shared_path

    src = shared_path("models", "shakespeare-spm-f32.gguf")
    root = tmp_path_factory.mktemp("iq-oracle")

    @functools.cache
    def get(name: str):
        path = root / f"shakespeare-{name}.gguf"
        llama_cpp_quantize(src, path, ORACLE_FTYPES[name][0])
        return path

    return get


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("name", list(ORACLE_FTYPES))
def test_llama_cpp_files_match_llama_cpp(llama_cpp_files, name, tmp_path):
    """A file llama.cpp quantized: its tensors decode as gguf-py's; perplexity within 0.5% of
    llama.cpp's (llama-perplexity's protocol, f16 caches both); teacher-forced argmax equal at every
    clear position; greedy text equal up to a near-tie."""
    compare_with_llama_cpp(llama_cpp_files(name), name, ORACLE_FTYPES[name][1], tmp_path)


def compare_with_llama_cpp(path, name: str, tid: int, tmp_path, cli_text: bool = True) -> dict:
    """The oracle comparison of one llama.cpp-made file (see the test above); `tid` is the type the
    preset is about (at least one tensor must have it). Every quantized type in the file decodes as
    gguf-py's. cli_text False: the greedy tokens are compared as ids from the API, not as the text
    `qllama run` prints (a byte-level synthetic vocabulary prints invalid UTF-8). Returns the
    measured figures."""
    import json
    import subprocess
    import sys

    import qllama
    from conftest import REPO
    from qllama.gguf.reader import GGUFFile
    from test_families_oracle import MARGIN, LlamaCpp, _margins, _text, first_departure

    gf = GGUFFile(path)
    by_type: dict[int, list[str]] = {}
    for n, info in gf.tensors.items():
        if info.type_id not in (gt.F32, gt.F16):
            by_type.setdefault(info.type_id, []).append(n)
    assert tid in by_type, f"no {GGML_TYPES[tid].name} tensor in llama.cpp's {name} file"
    for t, names in by_type.items():
        for tname in names[:2]:
            q = QTensor.from_gguf(gf, tname)
            np.testing.assert_array_equal(bits(q.dequantize(np.arange(0, q.n_rows, 7))),
                                          bits(gq.dequantize(q.raw[::7], GQ(t))))
    types = sorted(GGML_TYPES[t].name for t in by_type)
    lc = LlamaCpp(path, 128)
    text = _text()
    want = lc.perplexity(text, 128, chunks=15)
    (tmp_path / "text.txt").write_text(text)
    out = subprocess.run([sys.executable, "-m", "qllama", "perplexity", str(path), str(tmp_path / "text.txt"), "-c", "128",
                          "--chunks", "15", "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["ppl"]
    print(f"\nPPL {name} ({', '.join(types)}): qllama {got:.4f} llama.cpp {want:.4f} ({(got / want - 1) * 100:+.3f}%)")
    assert abs(got / want - 1) <= ORACLE_PPL_TOL

    model = qllama.load(path, n_ctx=256)
    lc = LlamaCpp(path, 256)
    ids = lc.tokenize(text)[:200]
    lw = lc.logits(ids)
    agree = np.argmax(model.logits(ids), axis=1) == np.argmax(lw, axis=1)
    sure = _margins(lw) >= 0.15
    print(f"ARGMAX {name}: agrees at {int((agree & sure).sum())}/{int(sure.sum())} clear positions, {int(agree.sum())}/200 overall")
    assert agree[sure].all(), np.flatnonzero(sure & ~agree).tolist()

    prompt = "ROMEO: But soft, what light"
    toks, margins = lc.greedy(lc.tokenize(prompt), 32)
    if cli_text:
        out = subprocess.run([sys.executable, "-m", "qllama", "run", str(path), prompt, "--raw", "--temp", "0", "-n",
                              "32", "-c", "256"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        j = first_departure(lc, toks, margins, out.stdout)
    else:
        ours = [t for c in model.stream(prompt, max_tokens=len(toks), temperature=0) for t in c.token_ids]
        j = next((k for k, (x, y) in enumerate(zip(ours, toks)) if x != y), None)
    print(f"GREEDY {name}: " + (f"all {len(toks)} tokens equal" if j is None else f"departs at {j}, margin {margins[j]:.3f}"))
    assert j is None or margins[j] < MARGIN
    return {"types": types, "ppl": (got, want), "argmax": (int((agree & sure).sum()), int(sure.sum())), "greedy": j}


@pytest.mark.parametrize("wtype", ["iq4_xs", "iq4_nl"])
def test_inspect_names_the_types_and_check_finds_a_nan_scale(tmp_path, wtype):
    """`qllama inspect` names the i-quant types; `--check` finds a NaN in a block's fp16 d (the
    scale fields of gguf/types.py) and names the tensor."""
    import subprocess
    import sys

    from conftest import REPO
    from qllama.gguf.reader import GGUFFile
    from tools.make_model import ModelSpec, write_model

    path = tmp_path / f"{wtype}.gguf"
    write_model(path, ModelSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=1, weight_type=wtype, seed=5))
    r = subprocess.run([sys.executable, "-m", "qllama", "inspect", str(path)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and wtype in r.stdout, r.stderr
    gf = GGUFFile(path)
    t = GGML_TYPES[gf.tensors["blk.0.ffn_up.weight"].type_id]
    data = bytearray(path.read_bytes())
    at = bytes(data).find(gf.tensor_bytes("blk.0.ffn_up.weight").tobytes()[:4096])
    del gf
    f = at + 5 * t.type_size + t.scale_fields[0]  # block 5's d
    data[f:f + 2] = np.array([0x7E00], np.uint16).tobytes()  # NaN
    path.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "qllama", "inspect", str(path), "--check"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "blk.0.ffn_up.weight" in r.stderr + r.stdout, (r.stdout, r.stderr)
