"""tools/compare_layers.py without llama.cpp: reading a ggml tensor through its struct, and the
per-point errors against hand-computed values. (The tool against llama.cpp itself runs in
tests/test_smollm2.py, oracle.)"""

from __future__ import annotations

import numpy as np

from tools.compare_layers import GGML_F16, GGML_F32, _GgmlTensor, _tensor_array, compare, llama_names


def _tensor(buf: np.ndarray, ggml_type: int, ne, nb) -> _GgmlTensor:
    t = _GgmlTensor()
    t.type = ggml_type
    t.data = buf.ctypes.data
    for k in range(4):
        t.ne[k], t.nb[k] = ne[k], nb[k]
    return t


def test_struct_layout_matches_ggml_h():
    # ggml.h: type(4) pad(4) buffer(8) ne(32) nb(32) op(4) op_params(64) flags(4) src(80) view_src(8)
    # view_offs(8) data(8) name(64): data at 248, name at 256
    assert _GgmlTensor.data.offset == 248 and _GgmlTensor.name.offset == 256


def test_contiguous_and_permuted_views():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)  # ggml ne = (4, 3, 2)
    t = _tensor(x, GGML_F32, (4, 3, 2, 1), (4, 16, 48, 96))
    assert np.array_equal(_tensor_array(t)[0], x)
    # a permuted view (ggml_permute 0, 2, 1, 3): ne (4, 2, 3), strides swapped
    t = _tensor(x, GGML_F32, (4, 2, 3, 1), (4, 48, 16, 96))
    assert np.array_equal(_tensor_array(t)[0], x.transpose(1, 0, 2))
    h = np.array([[1.5, -2.0], [0.25, 65504.0]], dtype=np.float16)
    t = _tensor(h, GGML_F16, (2, 2, 1, 1), (2, 4, 8, 8))
    got = _tensor_array(t)[0, 0]
    assert got.dtype == np.float32 and np.array_equal(got, h.astype(np.float32))


def test_compare_relative_errors_and_f16_keys():
    names = llama_names(1)
    assert names["blk.0.ffn_act"] == ("ffn_swiglu-0", "ffn_geglu-0") and names["embed"] == ("inp_scaled", "embd")
    ours = {"blk.0.attn_norm": np.array([[3.0, 4.0]], np.float32), "blk.0.attn_k": np.array([[[1.0, 2.0]]], np.float32),
            "embed": np.array([[1.0, 1.0]], np.float32), "logits": np.array([[0.0, 2.0]], np.float32)}
    theirs = {"attn_norm-0": np.array([[3.0, 4.5]], np.float32),  # |diff| 0.5 / |(3, 4.5)|
              "Kcur-0": np.array([[1.0, 2.0 + 2**-12]], np.float32),  # rounds to 2.0 in f16: no error
              "embd": np.array([[1.0, 1.0]], np.float32), "result_output": np.array([[0.0, 1.0]], np.float32)}
    table, glob = compare(ours, theirs, 1, "f16")
    vals = table[0][1]
    assert abs(vals["attn_norm"] - 0.5 / np.hypot(3.0, 4.5)) < 1e-12
    assert vals["attn_k"] == 0.0 and vals["attn_q"] is None
    _, glob32 = compare(ours, theirs, 1, "f32", max_abs=True)
    assert dict(glob) == {"embed": 0.0, "logits": 1.0} and dict(glob32)["logits"] == 1.0
    table32, _ = compare(ours, theirs, 1, "f32", max_abs=True)
    assert table32[0][1]["attn_k"] == np.float32(2**-12)
