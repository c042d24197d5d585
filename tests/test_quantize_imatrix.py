"""`qllama quantize --imatrix`: reading llama.cpp's importance matrix, and the error lines.

The GGUF files here are written with gguf-py directly in the layout of llama.cpp's tools/imatrix
(`W.in_sum2` f32 (ne0, n_mat), `W.counts` f32 (1, n_mat), imatrix.* keys), the legacy .dat with
struct; the expected weights are computed by hand (sums / counts). Byte equality with ggml given a
matrix is in tests/test_quantize_ggml.py (oracle).
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from qllama.errors import QllamaError
from qllama.quantize.imatrix import ImatrixError, read_imatrix

from test_quantize import _write_model


def _llama_cpp_imatrix(path, entries: dict, *, keys: bool = True, dtype=np.float32) -> None:
    """entries: name -> (sums (n_mat, ne0), counts (n_mat,)); None for either leaves it out."""
    w = gguf.GGUFWriter(str(path), arch="")
    if keys:
        w.add_string("general.type", "imatrix")
        w.add_array("imatrix.datasets", ["wiki.train.raw"])
        w.add_uint32("imatrix.chunk_count", 3)
        w.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, counts) in entries.items():
        if sums is not None:
            w.add_tensor(f"{name}.in_sum2", np.asarray(sums, dtype))
        if counts is not None:
            w.add_tensor(f"{name}.counts", np.asarray(counts, dtype).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_reads_llama_cpp_gguf_layout(tmp_path):
    p = tmp_path / "imatrix.gguf"
    _llama_cpp_imatrix(p, {
        "blk.0.attn_q.weight": ([[2.0, 4.0, 6.0]], [2.0]),
        "blk.0.ffn_down_exps.weight": ([[3.0, 6.0], [1.0, 1.0]], [3.0, 0.0]),  # expert 1 never reached: ones
    })
    m = read_imatrix(p)
    assert m.datasets == ["wiki.train.raw"] and m.chunk_count == 3 and m.path == str(p)
    np.testing.assert_array_equal(m.weights["blk.0.attn_q.weight"], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(m.for_tensor("blk.0.ffn_down_exps.weight", 2, 2), [[1.0, 2.0], [1.0, 1.0]])
    assert m.weights["blk.0.attn_q.weight"].dtype == np.float32
    assert m.for_tensor("blk.9.attn_q.weight", 3, 1) is None  # no entry: quantized without weights
    assert m.for_tensor("token_embd.weight", 3, 1) is None
    with pytest.raises(ImatrixError, match="3 values for blk.0.attn_q.weight, which has 4 columns"):
        m.for_tensor("blk.0.attn_q.weight", 4, 1)
    # float32 division, as llama.cpp: 1/3 rounded once
    _llama_cpp_imatrix(p, {"w": ([[1.0]], [3.0])})
    assert read_imatrix(p).weights["w"][0] == np.float32(1) / np.float32(3)


def test_reads_legacy_dat(tmp_path):
    def entry(name: bytes, ncall: int, vals) -> bytes:
        return struct.pack("<i", len(name)) + name + struct.pack("<ii", ncall, len(vals)) + struct.pack(f"<{len(vals)}f", *vals)

    p = tmp_path / "imatrix.dat"
    body = struct.pack("<i", 2) + entry(b"blk.0.attn_k.weight", 4, [4.0, 8.0]) + entry(b"output.weight", 0, [5.0])
    p.write_bytes(body + struct.pack("<ii", 10, 5) + b"calib")
    m = read_imatrix(p)
    np.testing.assert_array_equal(m.weights["blk.0.attn_k.weight"], [1.0, 2.0])
    np.testing.assert_array_equal(m.weights["output.weight"], [5.0])  # ncall 0: the sums as they are
    assert m.chunk_count == 10 and m.datasets == ["calib"]
    p.write_bytes(body)  # the older files end after the entries
    assert read_imatrix(p).chunk_count == 0


@pytest.mark.parametrize("case, message", [
    ("text", "not an importance matrix"),
    ("truncated", "not an importance matrix"),
    ("no_keys", "no imatrix.datasets key"),
    ("no_counts", "mismatched sums and counts for blk.0.attn_q.weight"),
    ("nan", "holds NaN or Inf"),
    ("f16", "not f32"),
    ("missing", "cannot read the importance matrix"),
    ("empty", "no entries"),
])
def test_bad_files_are_one_error(tmp_path, case, message):
    p = tmp_path / "bad.gguf"
    good = {"blk.0.attn_q.weight": ([[1.0, 2.0]], [1.0])}
    if case == "text":
        p.write_text("not a matrix at all\n")
    elif case == "truncated":
        p.write_bytes(struct.pack("<ii", 3, 50) + b"blk")
    elif case == "no_keys":
        _llama_cpp_imatrix(p, good, keys=False)
    elif case == "no_counts":
        _llama_cpp_imatrix(p, {"blk.0.attn_q.weight": ([[1.0, 2.0]], None)})
    elif case == "nan":
        _llama_cpp_imatrix(p, {"blk.0.attn_q.weight": ([[1.0, np.nan]], [1.0])})
    elif case == "f16":
        _llama_cpp_imatrix(p, good, dtype=np.float16)
    elif case == "empty":
        _llama_cpp_imatrix(p, {})
    with pytest.raises(ImatrixError, match=message) as e:
        read_imatrix(p)
    assert "\n" not in str(e.value)


def test_cli_error_lines(tmp_path, capsys):
    from qllama.cli import main

    src = tmp_path / "in.gguf"
    _write_model(src, nested=False)
    (tmp_path / "bad.dat").write_bytes(b"\x01\x00")
    wrong = tmp_path / "wrong.gguf"
    _llama_cpp_imatrix(wrong, {"blk.0.attn_q.weight": ([[1.0] * 7], [1.0])})  # 7 columns for 256
    for args, msg in [
        (["Q2_K_S"], "Q2_K_S needs an importance matrix: give one with --imatrix FILE (make one with llama.cpp: llama-imatrix"),
        (["IQ2_XXS"], "IQ2_XXS needs an importance matrix: give one with --imatrix FILE"),
        (["IQ3_XS"], "IQ3_XS needs an importance matrix: give one with --imatrix FILE"),
        (["IQ1_M"], "IQ1_M needs an importance matrix: give one with --imatrix FILE"),
        (["Q4_K_M", "--imatrix", str(tmp_path / "bad.dat")], "not an importance matrix"),
        (["Q4_K_M", "--imatrix", str(tmp_path / "none.gguf")], "cannot read the importance matrix"),
        (["Q4_K_M", "--imatrix", str(wrong)], "it was made for another model"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["quantize", str(src), str(tmp_path / "out.gguf"), *args])
        assert e.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error:") and msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.gguf").exists()


def test_cli_with_imatrix_changes_the_weights_and_records_it(tmp_path, capsys):
    from qllama.cli import main
    from qllama.gguf.reader import GGUFFile

    src = tmp_path / "in.gguf"
    weights = _write_model(src, nested=False)
    m = tmp_path / "imatrix.gguf"
    _llama_cpp_imatrix(m, {"blk.0.attn_q.weight": (np.linspace(0.1, 9, 256)[None, :], [1.0])})
    main(["quantize", str(src), str(tmp_path / "plain.gguf"), "Q4_K_M"])
    main(["quantize", str(src), str(tmp_path / "w.gguf"), "Q4_K_M", "--imatrix", str(m)])
    capsys.readouterr()
    a, b = GGUFFile(tmp_path / "plain.gguf"), GGUFFile(tmp_path / "w.gguf")
    assert b.metadata["quantize.imatrix.file"] == str(m)
    assert b.metadata["quantize.imatrix.dataset"] == "wiki.train.raw"
    assert b.metadata["quantize.imatrix.entries_count"] == 1 and b.metadata["quantize.imatrix.chunks_count"] == 3
    assert "quantize.imatrix.file" not in a.metadata
    assert bytes(a.tensor_bytes("blk.0.attn_q.weight")) != bytes(b.tensor_bytes("blk.0.attn_q.weight"))
    assert bytes(a.tensor_bytes("blk.0.attn_k.weight")) == bytes(b.tensor_bytes("blk.0.attn_k.weight"))  # no entry
    assert len(weights) == len(b.tensors)
    with pytest.raises(QllamaError, match="needs an importance matrix"):
        from qllama.quantize import quantize_gguf

        quantize_gguf(src, tmp_path / "x.gguf", "Q2_K_S")
