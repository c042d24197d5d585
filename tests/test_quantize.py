"""Tests of the qllama.quantize package and `qllama quantize`.

Oracles: gguf-py's reference quantizers (q8_0/q4_0/q4_1/q5_0/q5_1/bf16: bytes must be equal) and
its independent dequantizers (k-quant round trips); llama.cpp's own Q4_K_M quantization of the
shared trained model (q4_K/q6_K bytes must be equal, and its per-tensor type mix); hand-computed
values (use_more_bits, fallbacks, nearest_int, fp16 rounding); live llama.cpp through
llama-cpp-python when installed (marked oracle).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest

from qllama import quantize as qz
from qllama.kernels import quantize_k
from qllama.quantize import blocks as qblocks
from qllama.errors import GGUFError, QllamaError, UnsupportedError
from qllama.gguf.types import BF16, F16, F32, GGML_TYPES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from qllama.gguf.reader import GGUFFile, ValueType
from qllama.quantize import choose_tensor_type, plan_quantization, quantize_array, quantize_gguf, use_more_bits
from tools.compare_quantizer import perplexity as llama_cpp_perplexity

SHARED = Path(__file__).resolve().parents[2] / "shared"
F32_MODEL = SHARED / "models" / "shakespeare-spm-f32.gguf"
Q4KM_MODEL = SHARED / "models" / "shakespeare-spm-Q4_K_M.gguf"
VAL_TEXT = SHARED / "models" / "shakespeare-val.txt"


def _need(p: Path) -> Path:
    if not p.exists():
        pytest.skip(f"{p} is absent (the read-only ../shared folder is not beside this checkout)")
    return p


def _gt(type_id: int) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(type_id)


def _rows(seed: int, n_rows: int, ne0: int, scale: float = 0.02) -> np.ndarray:
    """Gaussian rows with the awkward cases mixed in: a zero block, a constant block, an
    all-negative block, exact halves (rounding ties) and an outlier."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_rows, ne0)) * scale).astype(np.float32)  # (n_rows, ne0)
    x[0, :32] = 0
    if n_rows > 1:
        x[1, :32] = 0.25
        x[1, 32:64] = -np.abs(x[1, 32:64]) - 0.01
    if n_rows > 2:
        x[2, :32] = np.arange(-16, 16, dtype=np.float32) * 0.5  # ties for q8_0's roundf
        x[2, 40] = 3.0
    return x


def _dequant(q: np.ndarray, type_id: int, shape) -> np.ndarray:
    return gguf.quants.dequantize(q, _gt(type_id)).reshape(shape).astype(np.float64)


def _rel_rmse(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2)))


# ---------------------------------------------------------------------------------------------
# block quantizers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("type_id", [Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, BF16])
def test_legacy_bytes_equal_gguf_py_reference(type_id):
    x = _rows(1, 16, 512)
    x[5, 7] = -0.0
    mine = quantize_array(x, type_id)
    ref = gguf.quants.quantize(x, _gt(type_id)).view(np.uint8).reshape(mine.shape)
    assert mine.dtype == np.uint8 and mine.shape == (16, GGML_TYPES[type_id].row_bytes(512))
    np.testing.assert_array_equal(mine, ref)


def test_float_types():
    x = _rows(2, 3, 64)
    x[0, 0] = 70000.0  # f16 overflow -> inf, as ggml
    np.testing.assert_array_equal(quantize_array(x, F32).view(np.float32), x)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(quantize_array(x, F16).view(np.float16), x.astype(np.float16))
    # bf16: round to nearest even, by hand
    b = quantize_array(np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.0]], np.float32), BF16).view(np.uint16)
    np.testing.assert_array_equal(b, [[0x3F80, 0x3F82, 0xC000]])
    np.testing.assert_array_equal(qz.bf16_to_f32(np.array([0x3F82], np.uint16)), [1.015625])


@pytest.mark.parametrize(
    "type_id, max_rel_rmse",
    # ~5% above the relative RMSE this quantizer (bytes equal to llama.cpp's) gets on gaussian data:
    # q4_K 0.0714, q5_K 0.0364, q6_K 0.0178
    [(Q4_K, 0.075), (Q5_K, 0.0385), (Q6_K, 0.0187)],
)
def test_kquant_round_trip(type_id, max_rel_rmse):
    x = _rows(3, 24, 512)
    q = quantize_array(x, type_id)
    assert q.shape == (24, GGML_TYPES[type_id].row_bytes(512))
    y = _dequant(q, type_id, x.shape)
    np.testing.assert_array_equal(y[0, :32], 0)  # a zero sub-block decodes to exact zeros
    assert np.abs(y[1, :32] - 0.25).max() < 0.25 * 0.02  # a constant sub-block is kept
    assert _rel_rmse(x[3:], y[3:]) < max_rel_rmse
    # more bits, less error (the same data)
    if type_id != Q6_K:
        better = Q5_K if type_id == Q4_K else Q6_K
        assert _rel_rmse(x, _dequant(quantize_array(x, better), better, x.shape)) < _rel_rmse(x, y)


def test_kquant_all_zero_and_tiny_rows():
    x = np.zeros((2, 256), np.float32)
    x[1] = 1e-30  # below GROUP_MAX_EPS for q6_K: an all-zero block
    for t in (Q4_K, Q5_K, Q6_K):
        y = _dequant(quantize_array(x, t), t, x.shape)
        assert np.abs(y).max() < 1e-20


def test_kquant_threads_do_not_change_bytes(monkeypatch):
    x = _rows(5, 16, 512)  # 32 super-blocks
    serial = {t: quantize_array(x, t) for t in (Q4_K, Q5_K, Q6_K)}
    monkeypatch.setattr(qblocks, "_MIN_BLOCKS_PER_THREAD", 4)
    monkeypatch.setattr(qblocks.os, "cpu_count", lambda: 3)  # uneven slices
    for t, ref in serial.items():
        np.testing.assert_array_equal(quantize_array(x, t), ref)


def test_kquant_bytes_equal_llama_cpp():
    """q4_K and q6_K tensors that llama.cpp's llama-quantize wrote for the shared model: same bytes."""
    src, ref = GGUFFile(_need(F32_MODEL)), GGUFFile(_need(Q4KM_MODEL))
    for name in ("blk.3.attn_v.weight", "blk.2.ffn_down.weight", "blk.0.attn_q.weight", "blk.1.ffn_up.weight"):
        t = ref.tensors[name]
        x = src.tensor_array(name).reshape(-1, t.shape[0])  # (rows, ne0)
        mine = quantize_array(x, t.type_id)
        np.testing.assert_array_equal(mine.reshape(-1), ref.tensor_bytes(name), err_msg=name)


def test_helpers_match_ggml_rounding():
    nearest = quantize_k.nearest_int.py_func  # the plain-Python body runs the same float32 arithmetic
    vals = [0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -3.51, 4194303.0]
    assert [nearest(np.float32(v)) for v in vals] == [0, 2, 2, 0, -2, 3, -4, 4194303]
    rng = np.random.default_rng(4)
    f = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-9, 5, 2000),
        np.array([6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 65504, 65519.9, 65520, -1e9, 0.0, -0.0], np.float32),
    ]).astype(np.float32)
    mine = np.array([quantize_k.fp16_round(v) for v in f], np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(mine, f.astype(np.float16).astype(np.float32))


def test_quantize_array_rejects_bad_input():
    with pytest.raises(QllamaError, match="multiple"):
        quantize_array(np.zeros((2, 100), np.float32), Q4_K)
    with pytest.raises(UnsupportedError):
        quantize_array(np.zeros((2, 256), np.float32), 16)  # iq2_xxs: no quantizer
    with pytest.raises(QllamaError, match="NaN"):
        quantize_array(np.full((1, 256), np.nan, np.float32), Q4_K)
    with pytest.raises(QllamaError):
        quantize_array(np.zeros((2, 2, 256), np.float32), Q8_0)
    assert quantize_array(np.zeros(64, np.float64), Q8_0).shape == (1, 68)  # 1-D: one row, f64 ok


# ---------------------------------------------------------------------------------------------
# llama.cpp's per-tensor mix
# ---------------------------------------------------------------------------------------------

def test_use_more_bits_hand_computed():
    # 32 layers: first/last 4 and every third from layer 6
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]


def test_choose_tensor_type_rules():
    c = choose_tensor_type
    assert c("output.weight", (4096, 32000), "Q4_K_M", 32) == Q6_K
    assert c("output.weight", (4096, 32000), "Q8_0", 32) == Q8_0
    assert c("output.weight", (4096, 32000), "Q4_0", 32) == Q6_K
    assert c("output.weight", (4544, 32000), "Q4_K_M", 32) == Q8_0  # ne0 % 256
    assert c("token_embd.weight", (4096, 32000), "Q4_K_M", 32) == Q4_K
    assert c("token_embd.weight", (4096, 32000), "Q4_K_M", 32, tied_embeddings=True) == Q6_K
    assert c("token_embd.weight", (4096, 32000), "Q5_K_M", 32) == Q5_K
    assert c("blk.6.attn_v.weight", (4096, 4096), "Q4_K_M", 32) == Q6_K
    assert c("blk.7.attn_v.weight", (4096, 4096), "Q4_K_M", 32) == Q4_K
    assert c("blk.11.attn_v.weight", (8192, 1024), "Q4_K_M", 80, is_70b=True) == Q5_K
    assert c("blk.31.ffn_down.weight", (11008, 4096), "Q5_K_M", 32) == Q6_K
    assert c("blk.31.ffn_down.weight", (11008, 4096), "Q4_K_M", 32) == Q6_K
    assert c("blk.31.ffn_down.weight", (10976, 4096), "Q4_K_M", 32) == Q8_0  # q6_K, 10976 % 256 -> q8_0
    assert c("blk.30.ffn_down.weight", (11008, 4096), "Q5_K_M", 32) == Q6_K
    assert c("blk.5.ffn_down.weight", (10976, 4096), "Q4_K_M", 32) == Q5_0  # q4_K fallback
    assert c("blk.5.ffn_down.weight", (10976, 4096), "Q5_K_M", 32) == Q5_1  # q5_K fallback
    assert c("blk.5.ffn_down.weight", (10976, 4096), "Q6_K", 32) == Q8_0
    assert c("blk.5.ffn_down.weight", (10976, 4096), "Q4_0", 32) == Q4_0  # no mix for legacy presets
    assert c("blk.0.attn_v.weight", (4096, 4096), "Q4_0", 32) == Q4_0
    assert c("blk.0.attn_k.weight", (4096, 1024), "Q4_K_M", 32, n_expert=8) == Q8_0
    assert c("blk.0.attn_norm.weight", (4096,), "Q4_K_M", 32) == F32  # 1-D: unchanged
    assert c("blk.0.attn_norm.weight", (4096,), "Q4_K_M", 32, current_type=F16) == F16
    assert c("rope_freqs.weight", (64,), "Q8_0", 32) == F32
    assert c("blk.0.ffn_gate_inp.weight", (4096, 8), "Q4_K_M", 32) == F32
    assert c("blk.0.attn_q.weight", (4096, 4096), "F16", 32) == F16
    assert c("blk.0.attn_q.weight", (40, 4096), "Q4_0", 32) == F16  # not even a multiple of 32
    assert c("blk.0.attn_q.weight", (4096, 4096), "q4_k_m", 32) == Q4_K  # case-insensitive
    with pytest.raises(QllamaError, match="unknown quantization type"):
        c("blk.0.attn_q.weight", (4096, 4096), "Q3_K_XL", 32)


def test_choose_tensor_type_rules_of_the_low_bit_presets():
    """llama_tensor_get_type's rules for Q2_K, Q3_K_S/M/L, IQ4_NL, IQ4_XS, IQ3_S and IQ3_M, by hand."""
    from qllama.gguf.types import IQ3_S, IQ4_NL, IQ4_XS, Q2_K, Q3_K

    c = choose_tensor_type
    assert c("blk.0.attn_q.weight", (4096, 4096), "Q2_K", 32) == Q2_K
    assert c("blk.0.attn_v.weight", (4096, 1024), "Q2_K", 32) == Q3_K
    assert c("blk.0.attn_v.weight", (4096, 1024), "Q2_K", 32, n_gqa=4) == Q4_K
    assert c("blk.9.ffn_down.weight", (11008, 4096), "Q2_K", 32) == Q3_K
    assert c("blk.9.attn_output.weight", (4096, 4096), "Q2_K", 32) == Q3_K
    assert c("blk.9.attn_output.weight", (4096, 4096), "Q2_K", 32, n_expert=8) == Q5_K
    assert c("blk.9.ffn_down.weight", (10976, 4096), "Q2_K", 32) == Q4_0  # q3_K cannot hold 10976: q4_0
    assert c("blk.9.attn_v.weight", (4096, 4096), "Q3_K_S", 32) == Q3_K
    assert c("blk.9.attn_v.weight", (8192, 1024), "Q3_K_S", 80, is_70b=True) == Q5_K
    assert [c(f"blk.{i}.attn_v.weight", (4096, 4096), "Q3_K_M", 32) for i in (0, 1, 2)] == [Q5_K, Q5_K, Q4_K]
    assert [c(f"blk.{i}.ffn_down.weight", (11008, 4096), "Q3_K_M", 32) for i in (1, 2)] == [Q5_K, Q4_K]  # 32 // 16
    assert c("blk.5.attn_output.weight", (4096, 4096), "Q3_K_M", 32) == Q4_K
    assert c("blk.5.ffn_up.weight", (4096, 11008), "Q3_K_M", 32) == Q3_K
    assert c("blk.5.attn_v.weight", (4096, 4096), "Q3_K_L", 32) == Q5_K
    assert c("blk.5.ffn_down.weight", (11008, 4096), "Q3_K_L", 32) == Q5_K
    assert c("blk.5.attn_output.weight", (4096, 4096), "Q3_K_L", 32) == Q5_K
    assert c("output.weight", (4096, 32000), "IQ4_NL", 32) == Q6_K
    assert c("output.weight", (4544, 32000), "IQ4_NL", 32) == Q8_0  # q6_K's 256 does not divide 4544
    assert c("output.weight", (4544, 32000), "IQ4_XS", 32) == Q8_0
    assert c("token_embd.weight", (4544, 32000), "IQ4_XS", 32) == IQ4_NL
    assert c("blk.0.attn_v.weight", (4096, 1024), "IQ4_XS", 32) == IQ4_XS
    assert c("blk.0.attn_v.weight", (4096, 1024), "IQ4_XS", 32, n_gqa=8) == Q5_K
    assert [c(f"blk.{i}.ffn_down.weight", (11008, 4096), "IQ4_NL", 32) for i in (3, 4)] == [Q5_K, IQ4_NL]
    assert c("blk.3.ffn_down.weight", (11008, 4096), "IQ4_NL", 32, has_imatrix=True) == IQ4_NL
    assert c("blk.3.ffn_down.weight", (11008, 4096), "Q4_0", 32, has_imatrix=True) == Q4_1
    assert c("blk.3.attn_q.weight", (4096, 4096), "IQ3_S", 32) == IQ3_S
    assert c("blk.3.attn_v.weight", (4096, 1024), "IQ3_S", 32) == IQ3_S
    assert c("blk.3.attn_v.weight", (4096, 1024), "IQ3_S", 32, n_gqa=4) == Q4_K
    assert c("blk.3.attn_v.weight", (4096, 1024), "IQ3_M", 32) == Q4_K
    assert [c(f"blk.{i}.ffn_down.weight", (11008, 4096), "IQ3_M", 32) for i in (3, 4)] == [Q4_K, IQ3_S]
    assert c("blk.9.attn_output.weight", (4096, 4096), "IQ3_M", 32) == Q4_K
    assert c("blk.9.attn_output.weight", (4096, 4096), "IQ3_S", 32) == IQ3_S
    assert c("blk.9.attn_output.weight", (4096, 4096), "IQ3_S", 32, n_expert=8) == Q5_K
    assert c("blk.9.ffn_down.weight", (10976, 4096), "IQ3_S", 32) == IQ4_NL  # iq3_s cannot hold 10976


def test_mix_equals_llama_cpp_q4_k_m():
    ref = GGUFFile(_need(Q4KM_MODEL))
    plans = {p.name: p.dst_type for p in plan_quantization(_need(F32_MODEL), "Q4_K_M")}
    assert plans == {name: t.type_id for name, t in ref.tensors.items()}


# ---------------------------------------------------------------------------------------------
# GGUF -> GGUF
# ---------------------------------------------------------------------------------------------

N_EMBD, N_FF, N_LAYER, N_VOCAB = 256, 288, 4, 40  # n_ff % 256 != 0: exercises the fallbacks


def _write_model(path: Path, wtype: int = F32, alignment: int | None = None, tied: bool = False,
                 nested: bool = True, n_layer: int = N_LAYER, n_head_kv: int | None = None) -> dict[str, np.ndarray]:
    """A tiny Llama-shaped GGUF with every kind of metadata value; returns the f32 weights.

    nested: include nested arrays (valid GGUF, but llama.cpp's reader rejects them); n_head_kv: of
    the 4 heads, how many K/V heads (default: 4, no key written).
    """
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    V = gguf.GGUFValueType
    w.add_key_value("general.name", "tiny", V.STRING)
    w.add_key_value("llama.context_length", 128, V.UINT32)
    w.add_key_value("llama.block_count", n_layer, V.UINT32)
    w.add_key_value("llama.embedding_length", N_EMBD, V.UINT32)
    w.add_key_value("llama.feed_forward_length", N_FF, V.UINT32)
    w.add_key_value("llama.attention.head_count", 4, V.UINT32)
    if n_head_kv is not None:
        w.add_key_value("llama.attention.head_count_kv", n_head_kv, V.UINT32)
    w.add_key_value("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32)
    w.add_key_value("general.file_type", 0, V.UINT32)
    w.add_key_value("test.u8", 200, V.UINT8)
    w.add_key_value("test.i8", -5, V.INT8)
    w.add_key_value("test.u16", 60000, V.UINT16)
    w.add_key_value("test.i16", -30000, V.INT16)
    w.add_key_value("test.i32", -7, V.INT32)
    w.add_key_value("test.u64", 2**63 + 5, V.UINT64)
    w.add_key_value("test.i64", -(2**40), V.INT64)
    w.add_key_value("test.f64", 0.1, V.FLOAT64)
    w.add_key_value("test.bool", True, V.BOOL)
    w.add_key_value("test.empty_string", "", V.STRING)
    w.add_key_value("test.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("test.u64s", [1, 2**64 - 1], V.ARRAY, sub_type=V.UINT64)
    if nested:
        w.add_key_value("test.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
        w.add_key_value("test.nested_str", [["a", "bc"], ["ü"]], V.ARRAY, sub_type=V.ARRAY)
    tokens = [f"t{i}".encode() for i in range(N_VOCAB - 1)] + [b"\xff\xfe"]  # one invalid UTF-8 token
    w.add_key_value("tokenizer.ggml.tokens", tokens, V.ARRAY, sub_type=V.STRING)
    w.add_key_value("tokenizer.ggml.scores", [float(-i) / 3 for i in range(N_VOCAB)], V.ARRAY, sub_type=V.FLOAT32)
    weights: dict[str, np.ndarray] = {}

    def add(name: str, shape_np: tuple[int, ...], std: float = 0.02) -> None:
        x = (rng.standard_normal(shape_np) * std).astype(np.float32)
        if len(shape_np) == 1:
            x = 1 + x
        if wtype == F16 and len(shape_np) > 1:
            x = x.astype(np.float16)
            w.add_tensor(name, x)
        elif wtype == BF16 and len(shape_np) > 1:
            bits = qz.to_bf16_bits(x)
            x = qz.bf16_to_f32(bits)
            w.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, x)
        weights[name] = x.astype(np.float32)

    add("token_embd.weight", (N_VOCAB, N_EMBD))
    add("output_norm.weight", (N_EMBD,))
    if not tied:
        add("output.weight", (N_VOCAB, N_EMBD))
    n_kv = N_EMBD * (n_head_kv or 4) // 4  # K/V rows
    for i in range(n_layer):
        add(f"blk.{i}.attn_norm.weight", (N_EMBD,))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(f"blk.{i}.{n}.weight", (n_kv if n in ("attn_k", "attn_v") else N_EMBD, N_EMBD))
        add(f"blk.{i}.ffn_gate.weight", (N_FF, N_EMBD))
        add(f"blk.{i}.ffn_up.weight", (N_FF, N_EMBD))
        add(f"blk.{i}.ffn_down.weight", (N_EMBD, N_FF))
        add(f"blk.{i}.ffn_norm.weight", (N_EMBD,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


# expected types for the tiny model (4 layers: use_more_bits -> layers 2, 3; ffn_down ne0 = 288)
def _expected_type(name: str, preset: str, tied: bool = False) -> int:
    if name.endswith("norm.weight"):
        return F32
    kq = {"Q4_K_M": Q4_K, "Q5_K_M": Q5_K, "Q6_K": Q6_K, "Q8_0": Q8_0, "Q4_0": Q4_0}[preset]
    fallback = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q8_0 if preset == "Q8_0" else Q6_K
    more = preset in ("Q4_K_M", "Q5_K_M") and name.startswith(("blk.2.", "blk.3."))
    if "attn_v" in name and more:
        return Q6_K
    if "ffn_down" in name:
        t = Q6_K if more else kq
        return fallback.get(t, t)
    return kq


@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0"])
def test_quantize_gguf_presets(tmp_path, preset):
    src, dst = tmp_path / "in.gguf", tmp_path / "out.gguf"
    weights = _write_model(src)
    calls = []
    quantize_gguf(src, dst, preset, progress=lambda d, n, name: calls.append((d, n, name)))
    assert calls[-1][0] == calls[-1][1] == sum(x.size for x in weights.values())
    assert [c[2] for c in calls] == list(weights)
    a, b = GGUFFile(src), GGUFFile(dst)
    assert b.metadata["general.file_type"] == qz.PRESETS[preset].ftype
    assert b.metadata["general.quantization_version"] == 2
    assert list(b.tensors) == list(a.tensors)
    for name, x in weights.items():
        t = b.tensors[name]
        assert t.shape == a.tensors[name].shape
        assert t.type_id == _expected_type(name, preset), name
        y = _dequant(b.tensor_bytes(name), t.type_id, x.shape)
        # each tensor is exactly quantize_array of the source (itself checked against references)
        np.testing.assert_array_equal(b.tensor_bytes(name), quantize_array(x.reshape(-1, x.shape[-1]), t.type_id).reshape(-1))
        assert _rel_rmse(x, y) < 0.1, name  # q4_0 on gaussian data: 0.087
    # gguf-py's reader accepts the file too
    r = gguf.GGUFReader(str(dst))
    assert len(r.tensors) == len(weights)


def test_quantize_gguf_copies_metadata_with_types(tmp_path):
    src, dst = tmp_path / "in.gguf", tmp_path / "out.gguf"
    _write_model(src, alignment=64)
    quantize_gguf(src, dst, "Q8_0")
    a, b = GGUFFile(src), GGUFFile(dst)
    assert b.alignment == 64 and all(t.offset % 64 == 0 for t in b.tensors.values())
    for key, va in a.metadata.items():
        if key == "general.file_type":
            continue
        vb = b.metadata[key]
        if key == "test.nested":  # GGUFWriter can only write nested int arrays as int32
            assert [v.tolist() for v in vb] == [[1, 2], [3]]
            continue
        assert b.metadata_types[key] == a.metadata_types[key], key
        if isinstance(va, np.ndarray):
            np.testing.assert_array_equal(vb, va)
        else:
            assert vb == va, key
    assert b.metadata["tokenizer.ggml.tokens"][-1].encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert b.metadata_types["test.u64"].type == ValueType.UINT64


@pytest.mark.parametrize("wtype", [F16, BF16])
def test_quantize_gguf_half_inputs(tmp_path, wtype):
    src, dst = tmp_path / "in.gguf", tmp_path / "out.gguf"
    weights = _write_model(src, wtype=wtype, tied=True)
    quantize_gguf(src, dst, "Q4_K_M")
    b = GGUFFile(dst)
    assert b.tensors["token_embd.weight"].type_id == Q6_K  # tied: gets the output's type
    name = "blk.0.attn_q.weight"
    x = weights[name]  # the exact values the half-precision file holds
    np.testing.assert_array_equal(b.tensor_bytes(name), quantize_array(x, Q4_K).reshape(-1))


def test_quantize_gguf_refusals(tmp_path):
    from qllama.errors import OutputExistsError

    src = tmp_path / "in.gguf"
    _write_model(src)
    with pytest.raises(QllamaError, match="overwrite the input"):
        quantize_gguf(src, src, "Q4_0", force=True)
    (tmp_path / "exists.gguf").write_bytes(b"x")
    with pytest.raises(OutputExistsError, match="exists") as e:  # the CLI adds the --force hint
        quantize_gguf(src, tmp_path / "exists.gguf", "Q4_0")
    assert "--" not in str(e.value)
    quantize_gguf(src, tmp_path / "exists.gguf", "Q4_0", force=True)
    assert GGUFFile(tmp_path / "exists.gguf").metadata["general.file_type"] == 2
    with pytest.raises(QllamaError, match="no such file"):
        quantize_gguf(tmp_path / "missing.gguf", tmp_path / "o.gguf", "Q4_0")
    (tmp_path / "text.gguf").write_text("hello world, not a model")
    with pytest.raises(GGUFError, match="not a GGUF"):
        quantize_gguf(tmp_path / "text.gguf", tmp_path / "o.gguf", "Q4_0")
    with pytest.raises(QllamaError, match="unknown quantization type"):
        quantize_gguf(src, tmp_path / "o.gguf", "Q9_9")
    # an already-quantized input: refused (requantizing is lossy), no output left behind
    q = tmp_path / "q.gguf"
    quantize_gguf(src, q, "Q8_0")
    with pytest.raises(UnsupportedError, match="already quantized"):
        quantize_gguf(q, tmp_path / "o.gguf", "Q4_K_M")
    assert not any(p.name.startswith("o.gguf") for p in tmp_path.iterdir())


def test_cli(tmp_path, capsys):
    from qllama.cli import main

    src, dst = tmp_path / "in.gguf", tmp_path / "out.gguf"
    _write_model(src)
    main(["quantize", str(src), str(dst), "q4_k_m"])
    assert GGUFFile(dst).metadata["general.file_type"] == 15
    err = capsys.readouterr().err
    assert "quantizing to Q4_K_M" in err and "wrote" in err
    for args, msg in [
        ([str(src), str(dst), "Q4_K_M"], "exists (use --force"),
        ([str(src), str(src), "Q4_K_M", "--force"], "overwrite the input"),
        ([str(src), str(tmp_path / "x.gguf"), "Q7"], "unknown quantization type"),
        ([str(tmp_path / "nope.gguf"), str(tmp_path / "x.gguf"), "Q4_0"], "no such file"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["quantize", *args])
        assert e.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error:") and msg in err and err.count("\n") == 1
    main(["quantize", str(src), str(tmp_path / "x.gguf"), "Q4_K_M", "--dry-run"])
    out = capsys.readouterr().out
    assert "blk.3.attn_v.weight" in out and "q6_K" in out and not (tmp_path / "x.gguf").exists()


@pytest.mark.slow
def test_whole_shared_model_equals_llama_cpp_q4_k_m(tmp_path):
    """Every tensor of our Q4_K_M file is byte-identical to llama.cpp's; same metadata."""
    dst = tmp_path / "q4km.gguf"
    quantize_gguf(_need(F32_MODEL), dst, "Q4_K_M")
    a, b = GGUFFile(dst), GGUFFile(_need(Q4KM_MODEL))
    assert list(a.metadata) == list(b.metadata)
    for name, t in b.tensors.items():
        assert a.tensors[name].type_id == t.type_id
        np.testing.assert_array_equal(a.tensor_bytes(name), b.tensor_bytes(name), err_msg=name)


# ---------------------------------------------------------------------------------------------
# live llama.cpp (llama-cpp-python)
# ---------------------------------------------------------------------------------------------

def _llama_quantize(llama_cpp, src: Path, dst: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, "llama_model_quantize failed"


@pytest.mark.oracle
@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0"])
def test_oracle_tiny_model_like_llama_cpp(tmp_path, preset):
    """The tiny model (ffn_down ne0 = 288 -> the q5_0/q5_1/q8_0 fallbacks; tied embeddings):
    llama.cpp picks the same types; legacy blocks are byte-identical, k-quant RMSE within 1%."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src, ours, theirs = tmp_path / "in.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    weights = _write_model(src, nested=False, tied=True)  # llama.cpp rejects nested arrays
    quantize_gguf(src, ours, preset)
    _llama_quantize(llama_cpp, src, theirs, qz.PRESETS[preset].ftype)
    a, b = GGUFFile(ours), GGUFFile(theirs)
    assert b.tensors["token_embd.weight"].type_id == (Q8_0 if preset == "Q8_0" else Q6_K)
    for name, t in b.tensors.items():
        assert a.tensors[name].type_id == t.type_id, name
        if t.type_id in (Q8_0, Q4_0, Q5_0, Q5_1, F32):
            np.testing.assert_array_equal(a.tensor_bytes(name), b.tensor_bytes(name), err_msg=name)
        else:
            x = weights[name]
            ea = _rel_rmse(x, _dequant(a.tensor_bytes(name), t.type_id, x.shape))
            eb = _rel_rmse(x, _dequant(b.tensor_bytes(name), t.type_id, x.shape))
            assert ea <= eb * 1.01, (name, ea, eb)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0"])
def test_oracle_same_types_and_rmse_as_llama_cpp(tmp_path, preset):
    llama_cpp = pytest.importorskip("llama_cpp")
    src = _need(F32_MODEL)
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize_gguf(src, ours, preset)
    _llama_quantize(llama_cpp, src, theirs, qz.PRESETS[preset].ftype)
    f, a, b = GGUFFile(src), GGUFFile(ours), GGUFFile(theirs)
    assert a.metadata["general.file_type"] == b.metadata["general.file_type"]
    for name, t in b.tensors.items():
        assert a.tensors[name].type_id == t.type_id, name
        if t.type_id == F32:
            continue
        x = f.tensor_array(name).astype(np.float64)
        ea = _rel_rmse(x, _dequant(a.tensor_bytes(name), t.type_id, x.shape))
        eb = _rel_rmse(x, _dequant(b.tensor_bytes(name), t.type_id, x.shape))
        assert ea <= eb * 1.01, (name, ea, eb)


@pytest.mark.oracle
@pytest.mark.slow
def test_oracle_llama_cpp_loads_our_file_and_perplexity_within_2pct(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    src = _need(F32_MODEL)
    text = _need(VAL_TEXT).read_text(encoding="utf-8")
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize_gguf(src, ours, "Q4_K_M")
    _llama_quantize(llama_cpp, src, theirs, qz.PRESETS["Q4_K_M"].ftype)
    ppl_ours = llama_cpp_perplexity(ours, text)
    ppl_theirs = llama_cpp_perplexity(theirs, text)
    assert abs(ppl_ours / ppl_theirs - 1) < 0.02, (ppl_ours, ppl_theirs)
