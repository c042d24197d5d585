"""The GGUF reader against gguf-py's GGUFReader (the oracle) and against hand-built hostile files.

`make_gguf` builds GGUF images byte by byte (so that it can also build *invalid* ones);
`test_gguf_fuzz.py` imports it.
"""

from __future__ import annotations

import os
import re
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qllama.errors import GGUFError
from qllama.gguf.types import BF16, F16, F32, GGML_TYPES, Q4_K, Q6_K, Q8_0
from qllama.gguf.reader import (
    GGUFFile, MetadataType, ValueType, _Cursor, _read_string_array, _read_string_array_loop, _scan_starts, _walk_starts,
)

SHARED = Path(__file__).resolve().parents[2] / "shared"
VT = ValueType

# ---------------------------------------------------------------------------------------
# a byte-level GGUF builder
# ---------------------------------------------------------------------------------------

_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
        VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


def enc_str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_value(vtype: int, value: Any) -> bytes:
    """A value without its type tag. Arrays are given as (item_type, items)."""
    if vtype == VT.STRING:
        return enc_str(value)
    if vtype == VT.ARRAY:
        itype, items = value
        return struct.pack("<IQ", itype, len(items)) + b"".join(enc_value(itype, x) for x in items)
    return struct.pack(_FMT[vtype], value)


def tensor_nbytes(shape: tuple[int, ...], type_id: int) -> int:
    t = GGML_TYPES[type_id]
    return int(np.prod(shape, dtype=object)) // t.block_size * t.type_size if shape else t.type_size


def make_gguf(
    kvs: list[tuple[str | bytes, int, Any]] = (),
    tensors: list[tuple[str | bytes, tuple[int, ...], int, int | None]] = (),
    data: bytes | None = None,
    *,
    version: int = 3,
    magic: bytes = b"GGUF",
    alignment: int = 32,
    n_kv: int | None = None,
    n_tensors: int | None = None,
) -> bytes:
    """A GGUF image. tensors: (name, shape ne0-first, type_id, offset or None for "next aligned").

    `data` defaults to deterministic bytes of the right total size; n_kv / n_tensors override
    the header counts (to build lying headers). `alignment` is only used for layout: add a
    `general.alignment` kv yourself to change the file's alignment.
    """
    out = bytearray(magic + struct.pack("<I", version))
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    for key, vtype, value in kvs:
        out += enc_str(key) + struct.pack("<I", vtype) + enc_value(vtype, value)
    end = 0
    for name, shape, type_id, offset in tensors:
        if offset is None:
            offset = -(-end // alignment) * alignment
        end = max(end, offset + (tensor_nbytes(shape, type_id) if type_id in GGML_TYPES else 0))
        out += enc_str(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", type_id, offset)
    if tensors or data:
        out += bytes(-len(out) % alignment)
        if data is None:
            data = (np.arange(end, dtype=np.uint32) * 2654435761 >> 13).astype(np.uint8).tobytes()
        out += data
    return bytes(out)


def write(tmp_path: Path, blob: bytes, name: str = "t.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(blob)
    return p


def parse(blob: bytes) -> GGUFFile:
    return GGUFFile.from_bytes(blob)


# A small valid file with every value type, a nested array, invalid UTF-8 in a value, and tensors.
ALL_TYPES_KVS = [
    ("general.architecture", VT.STRING, "llama"),
    ("u8", VT.UINT8, 255), ("i8", VT.INT8, -128), ("u16", VT.UINT16, 65535), ("i16", VT.INT16, -32768),
    ("u32", VT.UINT32, 2**32 - 1), ("i32", VT.INT32, -(2**31)), ("f32", VT.FLOAT32, 1.5),
    ("b", VT.BOOL, 1), ("u64", VT.UINT64, 2**64 - 1), ("i64", VT.INT64, -(2**63)), ("f64", VT.FLOAT64, -0.25),
    ("s", VT.STRING, "héllo ✓"),
    ("s.bad", VT.STRING, b"ok\xff\xfe\xc3"),
    ("a.u8", VT.ARRAY, (VT.UINT8, [1, 2, 3])), ("a.i64", VT.ARRAY, (VT.INT64, [-1, 2**62])),
    ("a.f32", VT.ARRAY, (VT.FLOAT32, [0.5, -2.0])), ("a.bool", VT.ARRAY, (VT.BOOL, [1, 0, 1])),
    ("a.empty", VT.ARRAY, (VT.INT32, [])),
    ("a.str", VT.ARRAY, (VT.STRING, ["a", "", "ü", b"\x80x"])),
    ("a.nested", VT.ARRAY, (VT.ARRAY, [(VT.UINT16, [1, 2]), (VT.UINT16, [3])])),
    ("a.nested.str", VT.ARRAY, (VT.ARRAY, [(VT.STRING, ["x", "yz"])])),
]
ALL_TYPES_TENSORS = [
    ("tok", (8, 3), F32, None), ("half", (4,), F16, None), ("bf", (2, 2), BF16, None),
    ("q8", (64, 2), Q8_0, None), ("q4k", (256,), Q4_K, None), ("q6k", (256, 1, 1, 2), Q6_K, None),
]


def all_types_file() -> bytes:
    return make_gguf(ALL_TYPES_KVS, ALL_TYPES_TENSORS)


# ---------------------------------------------------------------------------------------
# oracle comparison
# ---------------------------------------------------------------------------------------


def _type_chain(mt: MetadataType | None) -> list[int]:
    chain = []
    while mt is not None:
        chain.append(int(mt.type))
        mt = mt.item
    return chain


def _flatten(v: Any) -> list:
    if isinstance(v, list):
        return [x for item in v for x in _flatten(item)]
    if isinstance(v, np.ndarray):
        return list(v)
    return [v]


def assert_same_as_oracle(path: Path) -> None:
    """Every key, type and value; every tensor's name, type, shape, offset and bytes."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    f = GGUFFile(path)
    assert f.alignment == r.alignment
    assert f.data_offset == r.data_offset or not f.tensors  # gguf-py pads the same way
    assert f.version == int(r.fields["GGUF.version"].parts[0][0])
    fields = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(f.metadata)
    for key, fld in fields.items():
        ours, mt = f.metadata[key], f.metadata_types[key]
        chain = _type_chain(mt)
        oracle_types = [int(t) for t in fld.types]
        assert chain[: len(oracle_types)] == oracle_types, key  # gguf-py omits the item type of []
        leaf = chain[-1]
        vals = _flatten(ours)
        parts = [fld.parts[i] for i in fld.data]
        if leaf == VT.STRING:
            assert [v.encode("utf-8", "surrogateescape") for v in vals] == [p.tobytes() for p in parts], key
        else:
            want = np.concatenate(parts) if parts else np.array([])
            got = np.asarray(vals, dtype=want.dtype) if vals else np.array([])
            assert len(got) == len(want), key
            if leaf == VT.BOOL:
                assert got.astype(bool).tolist() == want.astype(bool).tolist(), key
            else:
                assert got.tobytes() == want.tobytes(), key
                if isinstance(ours, np.ndarray) and parts:
                    assert ours.dtype == want.dtype, key

    assert [t.name for t in r.tensors] == list(f.tensors)
    for rt in r.tensors:
        t = f.tensors[rt.name]
        assert t.type_id == int(rt.tensor_type)
        assert list(t.shape) == [int(d) for d in rt.shape]
        assert t.n_elements == rt.n_elements
        assert t.n_bytes == rt.n_bytes
        assert f.data_offset + t.offset == rt.data_offset
        ours_b = f.tensor_bytes(rt.name)
        assert np.array_equal(ours_b, np.asarray(rt.data).reshape(-1).view(np.uint8))
    f.close()


def _shared_files() -> list:
    slow = {"ggml-vocab-llama-bpe.gguf", "ggml-vocab-falcon.gguf", "ggml-vocab-starcoder.gguf"}
    names = [
        "vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-gpt-2.gguf", "vocab/ggml-vocab-falcon.gguf",
        "vocab/ggml-vocab-starcoder.gguf", "vocab/ggml-vocab-llama-bpe.gguf",
        "models/shakespeare-spm-Q4_K_M.gguf", "models/shakespeare-spm-f32.gguf",
    ]
    return [pytest.param(n, marks=pytest.mark.slow) if n.split("/")[1] in slow else n for n in names]


@pytest.mark.parametrize("rel", _shared_files())
def test_shared_files_match_oracle(rel: str) -> None:
    # gguf-py's reader takes seconds per vocab (13+ s on llama-bpe): the biggest are `slow`.
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"{p} is absent (the read-only ../shared folder is not beside this checkout)")
    assert_same_as_oracle(p)


def test_all_value_types_match_oracle(tmp_path: Path) -> None:
    assert_same_as_oracle(write(tmp_path, all_types_file()))


def test_all_value_types_values(tmp_path: Path) -> None:
    f = GGUFFile(write(tmp_path, all_types_file()))
    md, ty = f.metadata, f.metadata_types
    assert f.version == 3 and f.alignment == 32
    assert (md["u8"], md["i8"], md["u16"], md["i16"]) == (255, -128, 65535, -32768)
    assert (md["u32"], md["i32"], md["u64"], md["i64"]) == (2**32 - 1, -(2**31), 2**64 - 1, -(2**63))
    assert (md["f32"], md["f64"], md["b"]) == (1.5, -0.25, True)
    assert md["s"] == "héllo ✓"
    assert md["s.bad"].encode("utf-8", "surrogateescape") == b"ok\xff\xfe\xc3"  # reversible
    assert md["a.u8"].tolist() == [1, 2, 3] and md["a.u8"].dtype == np.uint8
    assert md["a.i64"].tolist() == [-1, 2**62]
    assert md["a.bool"].tolist() == [True, False, True]
    assert md["a.empty"].size == 0
    assert md["a.str"][:3] == ["a", "", "ü"] and md["a.str"][3].encode("utf-8", "surrogateescape") == b"\x80x"
    assert [x.tolist() for x in md["a.nested"]] == [[1, 2], [3]]
    assert md["a.nested.str"] == [["x", "yz"]]
    assert str(ty["a.nested"]) == "array[array[uint16]]"
    assert str(ty["a.str"]) == "array[string]" and str(ty["u64"]) == "uint64"
    assert not md["a.u8"].flags.writeable  # views into the read-only map
    assert f.get("missing", 7) == 7
    # tensors: shapes ne0 first, typed views with the numpy shape reversed
    t = f.tensors["tok"]
    assert t.shape == (8, 3) and t.type_name == "f32" and t.n_bytes == 96 and t.offset == 0
    assert f.tensor_array("tok").shape == (3, 8)
    assert f.tensors["q6k"].n_bytes == 2 * 210 and f.tensors["q8"].n_bytes == 4 * 34
    assert f.tensor_array("bf").dtype == np.uint16
    raw = f.tensor_bytes("q4k")
    assert raw.size == 144 and not raw.flags.writeable and not raw.flags.owndata
    with pytest.raises(GGUFError, match="block type"):
        f.tensor_array("q4k")
    with pytest.raises(GGUFError, match="no tensor named"):
        f.tensor_bytes("nope")
    f.close()


def test_typed_views_hold_the_written_values(tmp_path: Path) -> None:
    import gguf

    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((3, 5)).astype(np.float32)
    a16 = rng.standard_normal((2, 4)).astype(np.float16)
    i32 = rng.integers(-1000, 1000, (7,), dtype=np.int32)
    p = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_custom_alignment(64)
    for name, arr in (("a32", a32), ("a16", a16), ("i32", i32)):
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(p)
    assert f.alignment == 64 and f.data_offset % 64 == 0
    assert f.tensors["a32"].shape == (5, 3)  # ne0 first
    np.testing.assert_array_equal(f.tensor_array("a32"), a32)
    np.testing.assert_array_equal(f.tensor_array("a16"), a16)
    np.testing.assert_array_equal(f.tensor_array("i32"), i32)
    assert all(f.tensors[n].offset % 64 == 0 for n in f.tensors)
    assert_same_as_oracle(p)


def test_synthetic_model_matches_oracle(tmp_path: Path) -> None:
    make_model = pytest.importorskip("tools.make_model")
    p = tmp_path / "m.gguf"
    make_model.write_model(p, make_model.ModelSpec(weight_type="q4_K", n_embd=256, n_ff=256, types={"token_embd": "q6_K"}))
    assert_same_as_oracle(p)


def test_version_2_is_read(tmp_path: Path) -> None:
    blob = bytearray(all_types_file())
    blob[4:8] = struct.pack("<I", 2)
    f = GGUFFile(write(tmp_path, bytes(blob)))
    assert f.version == 2 and f.metadata["u32"] == 2**32 - 1
    assert_same_as_oracle(tmp_path / "t.gguf")


def test_unknown_tensor_type_is_kept(tmp_path: Path) -> None:
    blob = make_gguf([], [("a", (4,), F32, 0), ("w", (10, 3), 200, 32)], data=bytes(64))
    f = GGUFFile(write(tmp_path, blob))
    t = f.tensors["w"]
    assert t.type_name == "unknown(200)" and t.n_bytes is None and t.n_elements == 30
    with pytest.raises(GGUFError, match="unknown"):
        f.tensor_bytes("w")


def test_vocab_only_file_without_tensors() -> None:
    f = parse(make_gguf([("general.architecture", VT.STRING, "llama")]))
    assert f.tensors == {} and f.metadata == {"general.architecture": "llama"}


def test_custom_alignment_and_padding() -> None:
    kvs = [("general.alignment", VT.UINT32, 256)]
    f = parse(make_gguf(kvs, [("a", (4,), F32, 0), ("b", (4,), F32, 256)], alignment=256))
    assert f.alignment == 256 and f.data_offset % 256 == 0 and f.tensors["b"].offset == 256


# ---------------------------------------------------------------------------------------
# string arrays: the vectorised path equals the plain loop
# ---------------------------------------------------------------------------------------


def _strings_blob(items: list[bytes]) -> bytes:
    return b"".join(enc_str(x) for x in items)


def _both_paths(items: list[bytes]) -> tuple[list[str], list[str]]:
    blob = _strings_blob(items) + b"tail"
    c1, c2 = _Cursor(blob, 0, len(blob)), _Cursor(blob, 0, len(blob))
    fast = _read_string_array(c1, len(items), "k")
    slow = _read_string_array_loop(c2, len(items), "k")
    assert c1.pos == c2.pos == len(blob) - 4
    return fast, slow


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=12), min_size=64, max_size=300))
def test_string_array_fast_path_equals_loop(items: list[bytes]) -> None:
    fast, slow = _both_paths(items)
    assert fast == slow
    assert [s.encode("utf-8", "surrogateescape") for s in fast] == items


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=6).map(str.encode),
                          st.sampled_from([b"", b"\x00", b"\x00\x00abc", b"x" * 255, b"y" * 256, b"z" * 300])),
                min_size=64, max_size=200))
def test_string_starts_scan_equals_walk(items: list[bytes]) -> None:
    blob = _strings_blob(items) + bytes(16)
    walked = _walk_starts(_Cursor(blob, 0, len(blob)), len(items), "k")
    scanned = _scan_starts(blob, 0, len(blob), len(items))
    if scanned is not None:  # None: the scan declined (e.g. NULs or empty strings) and the walk decides
        assert np.array_equal(scanned[0], walked[0]) and scanned[1] == walked[1]
    assert _both_paths(items)[0] == [x.decode("utf-8", "surrogateescape") for x in items]


def test_string_starts_scan_is_used_on_vocab_like_arrays() -> None:
    # The fast path must really run on ordinary vocabularies, including strings >= 256 bytes.
    items = [f"tok{i}".encode() for i in range(500)] + [b"w" * 300, "Ġ".encode() * 200, b"\xff\xfe"]
    blob = _strings_blob(items) + bytes(8)
    scanned = _scan_starts(blob, 0, len(blob), len(items))
    assert scanned is not None
    assert np.array_equal(scanned[0], _walk_starts(_Cursor(blob, 0, len(blob)), len(items), "k")[0])
    # a string of 64 KiB or more, a truncated array: declined, the walk decides
    big = _strings_blob(items[:100] + [b"q" * 70000])
    assert _scan_starts(big, 0, len(big), 101) is None
    assert _both_paths(items[:100] + [b"q" * 70000])[0][-1] == "q" * 70000
    assert _scan_starts(blob[:-20], 0, len(blob) - 20, len(items)) is None


def test_string_array_separator_fallbacks() -> None:
    # NUL in a string forces another separator; every ASCII byte present forces the loop.
    with_nul = [b"a\x00b", b"\xe2\x82", b"\xac"] * 30
    fast, slow = _both_paths(with_nul)
    assert fast == slow and fast[0] == "a\x00b"
    every_ascii = [bytes([b]) for b in range(128)] + [b"\xff", b"\xc3\xa9"]
    fast, slow = _both_paths(every_ascii)
    assert fast == slow and fast[-1] == "é"


def test_string_array_truncated_is_an_error() -> None:
    blob = _strings_blob([b"abc"] * 100)
    for cut in (len(blob) - 1, len(blob) - 3, len(blob) - 5, 9):
        for fn in (_read_string_array, _read_string_array_loop):
            with pytest.raises(GGUFError, match="string .* runs past the end"):
                fn(_Cursor(blob[:cut], 0, cut), 100, "k")


# ---------------------------------------------------------------------------------------
# hostile files: one test per named error class
# ---------------------------------------------------------------------------------------

GOOD_KVS = [("general.architecture", VT.STRING, "llama"), ("a.u32", VT.ARRAY, (VT.UINT32, [1, 2, 3]))]


def _error(blob: bytes) -> str:
    with pytest.raises(GGUFError) as e:
        parse(blob)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("<bytes>: ")
    return msg


def test_truncated_at_every_byte() -> None:
    blob = all_types_file()
    for cut in range(len(blob)):
        msg = _error(blob[:cut]) if cut else None
        if cut >= 24:
            assert "truncated" in msg or "past the end" in msg, (cut, msg)


def test_bad_magic() -> None:
    assert "not a GGUF file" in _error(make_gguf(GOOD_KVS, magic=b"GGML"))
    assert "not a GGUF file" in _error(b"GG")


def test_version_1_and_unknown_versions() -> None:
    assert "version 1 is obsolete" in _error(make_gguf(GOOD_KVS, version=1))
    assert "unsupported GGUF version 4" in _error(make_gguf(GOOD_KVS, version=4))
    assert "unsupported GGUF version" in _error(make_gguf(GOOD_KVS, version=0))


def test_big_endian_rejected() -> None:
    blob = bytearray(make_gguf(GOOD_KVS))
    blob[4:8] = struct.pack(">I", 3)
    assert "big-endian" in _error(bytes(blob))


def test_counts_beyond_file() -> None:
    assert "cannot fit" in _error(make_gguf(GOOD_KVS, n_kv=2**64 - 1))
    assert "cannot fit" in _error(make_gguf(GOOD_KVS, n_tensors=2**40))


def test_string_length_beyond_file() -> None:
    blob = make_gguf([("k", VT.STRING, "value")])
    i = blob.index(b"value") - 8
    for n in (6, 2**40, 2**63, 2**64 - 1):
        bad = blob[:i] + struct.pack("<Q", n) + blob[i + 8 :]
        assert "needs" in _error(bad) and "'k'" in _error(bad)
    key_at = blob.index(b"k") - 8
    assert "metadata key" in _error(blob[:key_at] + struct.pack("<Q", 2**63) + blob[key_at + 8 :])


def test_array_count_beyond_file_tiny_file() -> None:
    # llama.cpp PR 27188: gguf-py 0.19 hangs with unbounded memory on a ~43-byte file whose
    # array length is 2**63; here: one such file per element type, each under 50 bytes.
    for itype in (VT.UINT8, VT.STRING, VT.ARRAY, VT.FLOAT64):
        blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + enc_str("a") + struct.pack("<IIQ", VT.ARRAY, itype, 2**63)
        tracemalloc.start()
        try:
            assert "array" in _error(blob)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20


def test_nested_array_counts_are_checked() -> None:
    inner = struct.pack("<IQ", VT.UINT32, 2**62)
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + enc_str("n") + struct.pack("<IIQ", VT.ARRAY, VT.ARRAY, 1) + inner
    assert "array of 4611686018427387904 uint32" in _error(blob)
    deep = (VT.ARRAY, [(VT.ARRAY, [(VT.ARRAY, [(VT.ARRAY, [(VT.ARRAY, [(VT.ARRAY, [(VT.ARRAY, [(VT.ARRAY, [(VT.UINT8, [1])])])])])])])])])
    assert "nested deeper" in _error(make_gguf([("d", VT.ARRAY, deep)]))


def test_unknown_value_type() -> None:
    blob = bytearray(make_gguf([("k", VT.UINT32, 5)]))
    i = blob.index(b"k") + 1
    blob[i : i + 4] = struct.pack("<I", 13)
    assert "unknown metadata value type 13" in _error(bytes(blob))
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + enc_str("k") + struct.pack("<IIQ", VT.ARRAY, 99, 1) + bytes(8)
    assert "unknown metadata value type 99" in _error(blob)


def test_dims_whose_product_overflows() -> None:
    # llama.cpp PR 18674: dims like 2**42+1 wrap a 64-bit byte size to a small number.
    for shape in ((2**42 + 1, 2**22, 2**0), (2**32, 2**32), (2**21, 2**21, 2**21 + 1), (1, 2**63)):
        msg = _error(make_gguf([], [("w", shape, F32, 0)], data=bytes(64)))
        assert "'w'" in msg and ("overflow" in msg or "out of range" in msg), msg
    # Large but representable: caught as extending past the end of the file.
    assert "past the end" in _error(make_gguf([], [("w", (2**20, 2**20), F32, 0)], data=bytes(64)))


def test_too_many_dims() -> None:
    assert "5 dimensions" in _error(make_gguf([], [("w", (1, 1, 1, 1, 1), F32, 0)], data=bytes(32)))
    blob = make_gguf([], [("w", (1,), F32, 0)], data=bytes(32))
    i = blob.index(b"w") + 1
    bad = blob[:i] + struct.pack("<I", 2**32 - 1) + blob[i + 4 :]
    assert "4294967295 dimensions" in _error(bad)


def test_offsets_outside_file() -> None:
    for off in (64, 2**40, 2**63 - 32, 2**64 - 32):
        msg = _error(make_gguf([], [("w", (8,), F32, off)], data=bytes(64)))
        assert "past the end" in msg or "out of range" in msg
    # unknown type: its size is unknown, but its start must be inside the data
    assert "past the end" in _error(make_gguf([], [("u", (8,), 250, 4096)], data=bytes(64)))
    # data section itself beyond the file
    blob = make_gguf([], [("w", (8,), F32, 0)], data=bytes(32))
    assert "truncated" in _error(blob[: blob.index(b"w") + 30])


def test_misaligned_offset() -> None:
    assert "not a multiple of the alignment 32" in _error(make_gguf([], [("w", (8,), F32, 4)], data=bytes(64)))


def test_bad_alignment_values() -> None:
    assert "not a power of two" in _error(make_gguf([("general.alignment", VT.UINT32, 24)]))
    assert "not a power of two" in _error(make_gguf([("general.alignment", VT.UINT32, 0)]))
    assert "must be a uint32" in _error(make_gguf([("general.alignment", VT.UINT64, 32)]))


def test_overlapping_tensors() -> None:
    msg = _error(make_gguf([], [("a", (16,), F32, 0), ("b", (16,), F32, 32)], data=bytes(96)))
    assert "'a'" in msg and "'b'" in msg and "overlap" in msg
    # the order in the file does not matter
    assert "overlap" in _error(make_gguf([], [("b", (8,), F32, 64), ("a", (32,), F32, 0)], data=bytes(128)))
    # touching is fine; an empty tensor overlaps nothing
    parse(make_gguf([], [("a", (8,), F32, 0), ("b", (8,), F32, 32), ("e", (0,), F32, 32)], data=bytes(64)))


def test_duplicate_tensor_names_and_keys() -> None:
    assert "duplicate tensor name 'a'" in _error(make_gguf([], [("a", (8,), F32, 0), ("a", (8,), F32, 32)], data=bytes(64)))
    assert "duplicate metadata key 'k'" in _error(make_gguf([("k", VT.UINT8, 1), ("k", VT.UINT8, 2)]))


def test_invalid_utf8_in_keys_and_names() -> None:
    assert "invalid UTF-8 in metadata key" in _error(make_gguf([(b"bad\xffkey", VT.UINT8, 1)]))
    assert "invalid UTF-8 in name of tensor #0" in _error(make_gguf([], [(b"w\xc3", (8,), F32, 0)], data=bytes(32)))


def test_row_not_a_multiple_of_the_block() -> None:
    assert "not a multiple of the q4_K block size 256" in _error(make_gguf([], [("w", (100, 2), Q4_K, 0)], data=bytes(512)))


def test_file_system_errors(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="is a directory"):
        GGUFFile(tmp_path)
    with pytest.raises(GGUFError, match="empty file"):
        GGUFFile(write(tmp_path, b""))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match="not a regular file"):  # and does not block
        GGUFFile(fifo)


def test_error_closes_the_map(tmp_path: Path) -> None:
    p = write(tmp_path, make_gguf(GOOD_KVS, version=9))
    with pytest.raises(GGUFError, match=str(p)):
        GGUFFile(p)


def test_no_allocation_proportional_to_lying_counts() -> None:
    # Every count at its maximum, each in a tiny file: peak memory stays small.
    blobs = [
        make_gguf(GOOD_KVS, n_kv=2**63),
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + enc_str("a") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 2**40) + bytes(64),
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + enc_str("a") + struct.pack("<IIQ", VT.ARRAY, VT.INT64, 2**61 - 1) + bytes(64),
        b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + enc_str("t") + struct.pack("<I", 4) + struct.pack("<QQQQ", 2**16, 2**16, 2**16, 2**14) + struct.pack("<IQ", F32, 0),
    ]
    tracemalloc.start()
    try:
        for b in blobs:
            with pytest.raises(GGUFError):
                parse(b)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_closed_file_gives_an_error() -> None:
    f = parse(make_gguf([], [("a", (8,), F32, 0)], data=bytes(32)))
    f.close()
    with pytest.raises(GGUFError, match="closed"):
        f.tensor_bytes("a")


def test_error_messages_stay_short() -> None:
    msg = _error(make_gguf([("k" * 100_000, VT.UINT8, 1), ("k" * 100_000, VT.UINT8, 1)]))
    assert "duplicate metadata key" in msg and len(msg) < 200


# ---------------------------------------------------------------------------------------
# split models (gguf-split's <prefix>-0000i-of-0000n.gguf shards)
# ---------------------------------------------------------------------------------------


def split_gguf(src: Path, dst_dir: Path, stem: str, max_tensors: int) -> list[Path]:
    """Re-write `src` as shards of at most `max_tensors` tensors with gguf-py's own splitting writer."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(dst_dir / f"{stem}.gguf"), arch, split_max_tensors=max_tensors)
    for key, fld in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        vt = fld.types[0]
        if vt == GGUFValueType.ARRAY:
            items = fld.contents()
            if not items:
                continue
            w.add_key_value(key, items, vt, sub_type=fld.types[-1])
        else:
            w.add_key_value(key, fld.contents(), vt)
    for t in r.tensors:
        qt = GGMLQuantizationType(int(t.tensor_type))
        data = np.asarray(t.data)
        if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(t.name, data, raw_shape=list(reversed([int(d) for d in t.shape])), raw_dtype=qt)
        else:
            w.add_tensor(t.name, data.view(np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(dst_dir.glob(f"{stem}-*-of-*.gguf"))


def _shard(no: int, count: int, tensors: list, n_total: int | None = None, extra: list = ()) -> bytes:
    kvs = [("split.no", VT.UINT16, no), ("split.count", VT.UINT16, count)]
    if n_total is not None:
        kvs.append(("split.tensors.count", VT.INT32, n_total))
    return make_gguf(list(extra) + kvs, tensors)


def _write_shards(tmp_path: Path, blobs: list[bytes], stem: str = "m") -> Path:
    for i, b in enumerate(blobs):
        (tmp_path / f"{stem}-{i + 1:05d}-of-{len(blobs):05d}.gguf").write_bytes(b)
    return tmp_path / f"{stem}-00001-of-{len(blobs):05d}.gguf"


def test_split_model_opens_as_one_file(tmp_path: Path) -> None:
    """Three hand-built shards: tensors map into the right shard, bytes equal each shard's own view."""
    first = _write_shards(tmp_path, [
        _shard(0, 3, [("a", (8, 3), F32, None)], 4, extra=[("general.architecture", VT.STRING, "llama")]),
        _shard(1, 3, [("b", (64, 2), Q8_0, None), ("c", (4,), F16, None)]),
        _shard(2, 3, [("d", (256,), Q4_K, None)]),
    ])
    with GGUFFile(first) as f:
        assert list(f.tensors) == ["a", "b", "c", "d"]
        assert [f.tensors[n].shard for n in "abcd"] == [0, 1, 1, 2]
        assert f.metadata["general.architecture"] == "llama"
        assert len(f.paths) == 3 and f.paths[0] == str(first)
        assert f.file_size == sum(os.path.getsize(p) for p in f.paths)
        for name, shard_path in [("a", f.paths[0]), ("b", f.paths[1]), ("c", f.paths[1]), ("d", f.paths[2])]:
            with GGUFFile(shard_path, _shard=True) as one:
                assert f.tensor_bytes(name).tobytes() == one.tensor_bytes(name).tobytes()
                assert f.tensor_bytes(name).tobytes() != bytes(f.tensors[name].n_bytes)  # not all zero
        np.testing.assert_array_equal(f.tensor_array("c"), GGUFFile(f.paths[1], _shard=True).tensor_array("c"))
        assert "3 shards" in repr(f)


def test_split_model_from_gguf_writer_matches_the_unsplit_model(tmp_path: Path) -> None:
    """gguf-py's splitting writer (what gguf-split and convert_hf_to_gguf produce) reads back tensor for tensor."""
    make_model = pytest.importorskip("tools.make_model")
    src = tmp_path / "whole.gguf"
    make_model.write_model(src, make_model.ModelSpec(weight_type="q4_K", n_embd=256, n_ff=256))
    shards = split_gguf(src, tmp_path, "m", max_tensors=4)
    assert len(shards) >= 3
    whole, split = GGUFFile(src), GGUFFile(shards[0])
    assert list(split.tensors) == list(whole.tensors)
    assert max(t.shard for t in split.tensors.values()) == len(shards) - 1
    for name in whole.tensors:
        assert split.tensor_bytes(name).tobytes() == whole.tensor_bytes(name).tobytes(), name
    assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")}.keys() == whole.metadata.keys()


def test_split_shard_errors(tmp_path: Path) -> None:
    t = [("a", (4,), F32, None)]
    # opening a later shard points at the first one
    (tmp_path / "x").mkdir()
    later = _write_shards(tmp_path / "x", [_shard(0, 2, t, 2), _shard(1, 2, [("b", (4,), F32, None)])])
    with pytest.raises(GGUFError, match=r"shard 2 of 2 of a split model; open the first shard \(.*m-00001-of-00002.gguf\)"):
        GGUFFile(str(later).replace("00001-of", "00002-of"))
    # a missing shard
    (tmp_path / "y").mkdir()
    first = _write_shards(tmp_path / "y", [_shard(0, 2, t, 2), _shard(1, 2, [("b", (4,), F32, None)])])
    os.remove(str(first).replace("00001-of", "00002-of"))
    with pytest.raises(GGUFError, match="m-00002-of-00002.gguf: no such file"):
        GGUFFile(first)
    # a shard with the wrong number, a duplicated tensor, a wrong total
    cases = [
        ([_shard(0, 2, t, 2), _shard(0, 2, [("b", (4,), F32, None)])], "split.no 0 and split.count 2, expected 1 and 2"),
        ([_shard(0, 2, t, 2), _shard(1, 3, [("b", (4,), F32, None)])], "expected 1 and 2"),
        ([_shard(0, 2, t, 2), _shard(1, 2, t)], "tensor 'a' is also in an earlier shard"),
        ([_shard(0, 2, t, 5), _shard(1, 2, [("b", (4,), F32, None)])], "split.tensors.count is 5 but the 2 shards hold 2"),
        ([_shard(0, 2, t, 2), make_gguf([("split.no", VT.UINT16, 1), ("split.count", VT.UINT16, 2)],
                                         [("b", (4,), F32, 64)], data=bytes(32))],
         "extends past the end of the file"),  # each shard gets the single-file validation
        ([_shard(0, 2, t, 2), b"GGUF\x01\x00\x00\x00"], "version 1 is obsolete"),
    ]
    for i, (blobs, msg) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        with pytest.raises(GGUFError, match=re.escape(msg)):
            GGUFFile(_write_shards(d, blobs))
    # a first shard whose name does not follow the pattern; split.count of the wrong type
    p = write(tmp_path, _shard(0, 2, t, 2), "model.gguf")
    with pytest.raises(GGUFError, match="does not end in -00001-of-00002.gguf"):
        GGUFFile(p)
    p = write(tmp_path, make_gguf([("split.count", VT.STRING, "2")], t), "s.gguf")
    with pytest.raises(GGUFError, match="split.count must be an integer, not string"):
        GGUFFile(p)
    # split.count 1 (what gguf-split writes for a model it did not split) is a plain file
    p = write(tmp_path, _shard(0, 1, t, 1), "one.gguf")
    assert list(GGUFFile(p).tensors) == ["a"]


def test_split_model_closes_every_shard(tmp_path: Path) -> None:
    first = _write_shards(tmp_path, [_shard(0, 2, [("a", (4,), F32, None)], 2), _shard(1, 2, [("b", (4,), F32, None)])])
    f = GGUFFile(first)
    shard = f._files[1]
    f.close()
    assert shard._mm is None
    with pytest.raises(GGUFError, match="closed"):
        f.tensor_bytes("b")
