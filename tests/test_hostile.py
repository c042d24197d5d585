"""Numerically hostile files: NaN/Inf in weights, out-of-range hyper-parameters, bad special ids.

The corpus is written by tools/make_hostile.py from the trained Shakespeare model; each case
declares the behaviour qllama promises for it (see that module's docstring).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from qllama.report.check import check_tensors
from qllama.gguf.reader import GGUFFile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_hostile  # noqa: E402

SOURCE = make_hostile.DEFAULT_SOURCE
needs_source = pytest.mark.skipif(not SOURCE.exists(), reason=f"{SOURCE} not found (../shared is absent)")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    if not SOURCE.exists():
        pytest.skip(f"{SOURCE} not found (../shared is absent)")
    return make_hostile.make_corpus(tmp_path_factory.mktemp("hostile"))


# -- the scan kernel on hand-built data -----------------------------------------------------


def test_scan_kernel_counts_and_first_on_hand_built_words():
    from qllama.kernels.scan import count_nonfinite, count_nonfinite_parallel

    words = np.zeros(10 * 4, np.uint16)  # 10 blocks of 4 words, fields at words 0 and 3
    offsets = np.array([0, 3], np.int64)
    words[2 * 4 + 3] = 0x7C00  # block 2: +Inf in its second field
    words[7 * 4 + 0] = 0xFE00  # block 7: a negative NaN in its first field
    words[5 * 4 + 1] = 0x7C00  # block 5: Inf in a word that is not a scale field: ignored
    words[8 * 4 + 0] = 0x7BFF  # the largest finite fp16: fine
    mask = np.uint16(0x7C00)
    assert count_nonfinite(words, 4, offsets, mask, 0, 10) == (2, 2)
    assert count_nonfinite(words, 4, offsets, mask, 3, 10) == (1, 7)
    assert count_nonfinite_parallel(words, 4, offsets, mask, 10) == (2, 2)
    assert count_nonfinite(words, 4, offsets, mask, 0, 2) == (0, -1)


def test_scan_float_tensors_value_by_value():
    from qllama.kernels.scan import count_nonfinite, count_nonfinite_parallel

    x = np.linspace(-3e38, 3e38, 200_001).astype(np.float32)
    x[[17, 99_000]] = [np.inf, np.nan]
    words = x.view(np.uint32)
    mask = np.uint32(0x7F800000)
    one = np.zeros(1, np.int64)
    assert count_nonfinite(words, 1, one, mask, 0, x.size) == (2, 17)
    # chunked over threads (SCAN_CHUNK = 65536 items): the first bad item is in chunk 0
    assert count_nonfinite_parallel(words, 1, one, mask, x.size) == (2, 17)
    x[17] = 1.0
    assert count_nonfinite_parallel(words, 1, one, mask, x.size) == (1, 99_000)


def test_large_tensors_take_the_parallel_scan(monkeypatch, tmp_path):
    """check_tensors must give the same answer whichever kernel a tensor's size selects."""
    import qllama.report.check as check

    if not SOURCE.exists():
        pytest.skip("needs ../shared")
    path = make_hostile.make_corpus(tmp_path, only=["f16-nan"])["f16-nan"]
    serial = check_tensors(GGUFFile(path)).findings
    monkeypatch.setattr(check, "PARALLEL_SCAN_BYTES", 0)
    assert check_tensors(GGUFFile(path)).findings == serial


# -- the corpus ----------------------------------------------------------------------------


@needs_source
def test_clean_trained_models_pass_the_check():
    for name in ("shakespeare-spm-Q4_K_M.gguf", "shakespeare-spm-f32.gguf"):
        report = check_tensors(GGUFFile(SOURCE.parent / name))
        assert report.ok and not report.unchecked
        assert report.n_bytes > 10_000_000


@pytest.mark.parametrize("name", sorted(make_hostile.CASES))
def test_check_names_exactly_the_broken_tensor(corpus, name):
    from qllama.errors import GGUFError

    case = make_hostile.CASES[name]
    if case.expect == "bad-file":  # the file does not open: nothing to scan
        with pytest.raises(GGUFError, match=case.tensor.replace(".", r"\.")):
            GGUFFile(corpus[name])
        return
    report = check_tensors(GGUFFile(corpus[name]))
    assert not report.unchecked
    assert [f.name for f in report.findings] == ([case.tensor] if case.tensor else [])
    for f in report.findings:
        if f.unit == "block":  # the first block's scale field was poked
            expected_first = 0
        else:  # the element poked, as an index into the tensor's values
            expected_first = case.poke_f32[1] if case.poke_f32 else case.poke[1] // 2
        assert (f.count, f.first) == (1, expected_first)


# -- what running each file does -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(make_hostile.CASES))
def test_each_file_ends_in_its_documented_behaviour(corpus, name):
    import warnings

    import qllama
    from qllama.errors import NonFiniteError, QllamaError, QllamaWarning

    case = make_hostile.CASES[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case.expect in ("load-error", "bad-file"):
            with pytest.raises(QllamaError) as e:
                qllama.load(corpus[name], n_ctx=64)
            if case.expect == "bad-file":
                assert f"tensor '{case.tensor}'" in str(e.value)
            else:
                assert case.key in str(e.value) and "must be" in str(e.value)
            return
        model = qllama.load(corpus[name], n_ctx=64, n_threads=1)
        if case.expect == "nonfinite":
            with pytest.raises(NonFiniteError) as e:
                model.complete("ROMEO:", max_tokens=4, temperature=0)
            assert e.value.point == case.where and e.value.layer == int(case.where.split(".")[1])
            assert f"first at {case.where}" in str(e.value)
            return
        text = model.complete("ROMEO:", max_tokens=6, temperature=0)
    assert text.strip(), "normal output expected"
    ours = [w for w in caught if issubclass(w.category, QllamaWarning)]
    if case.expect == "warn":
        assert len(ours) == 1 and case.key in str(ours[0].message)
    else:
        assert not ours


def test_nonfinite_stops_generation_after_clean_tokens(corpus):
    """A NaN that only some steps reach: the text before it streams, then the typed error."""
    import qllama
    from qllama.errors import NonFiniteError

    model = qllama.load(corpus["norm-nan"], n_ctx=64, n_threads=1)
    chunks = []
    with pytest.raises(NonFiniteError) as e:
        for chunk in model.generate("ROMEO:", max_tokens=4, temperature=0):
            chunks.append(chunk)
    assert chunks == [] and e.value.position == 0  # the prompt itself already fails


@pytest.mark.parametrize("name,needle", [("scale-nan-q4_K", "first at blk.0.attn_q"),
                                         ("eps-negative", "layer_norm_rms_epsilon = -1.0"),
                                         ("rope-base-zero", "llama.rope.freq_base = 0.0")])
def test_cli_one_error_line(corpus, name, needle):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "qllama", "run", str(corpus[name]), "ROMEO:", "-n", "4", "-t", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("name,needle", [
    ("scale-nan-iq4_xs", "tensor blk.0.attn_q.weight (iq4_xs): 1 of 256 blocks with a non-finite scale"),
    ("scale-nan-iq2_xxs", "tensor blk.0.attn_q.weight (iq2_xxs): 1 of 256 blocks with a non-finite scale"),
    ("scale-nan-iq1_m", "tensor blk.0.attn_q.weight (iq1_m): 1 of 256 blocks with a non-finite scale"),
    ("truncated-iq4_xs", "tensor 'blk.0.attn_q.weight' (34816 bytes at data offset"),
    ("row-not-block-iq4_xs", "row length 128 is not a multiple of the iq4_xs block size 256"),
    ("row-not-block-iq2_xxs", "row length 128 is not a multiple of the iq2_xxs block size 256")])
def test_cli_iquant_cases_one_error_line(corpus, name, needle):
    """The i-quant cases: `inspect --check` and `run` each end in one `error:` line and exit 1,
    with no traceback (a NaN scale: the scan names the tensor and `run` the first point it reaches;
    a broken structure: the file does not open)."""
    import subprocess

    case = make_hostile.CASES[name]
    run_needle = "first at blk.0.attn_q" if case.expect == "nonfinite" else needle
    for args, want in ((["inspect", str(corpus[name]), "--check"], needle),
                       (["run", str(corpus[name]), "ROMEO:", "-n", "4", "-t", "1"], run_needle)):
        r = subprocess.run([sys.executable, "-m", "qllama", *args], capture_output=True, text=True, timeout=600)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 1 and len(errors) == 1 and want in errors[0], (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_cli_check_tensors_and_inspect_check(corpus):
    import subprocess

    for args in (["inspect", str(corpus["f16-nan"]), "--check"],
                 ["run", str(corpus["f16-nan"]), "x", "-n", "1", "--check-tensors"]):
        r = subprocess.run([sys.executable, "-m", "qllama", *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 1, r.stderr
        assert "error: tensor blk.1.ffn_down.weight (f16): 1 of 196608 values" in r.stderr
    r = subprocess.run([sys.executable, "-m", "qllama", "inspect", str(SOURCE), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "all finite" in r.stderr


@pytest.mark.parametrize("type_name", ["iq1_m", "mxfp4"])
def test_composite_scales_are_scanned_as_gguf_py_decodes_them(tmp_path, type_name):
    """iq1_m spreads its fp16 d over four scale words and MXFP4 scales by an E8M0 byte: the check
    flags exactly the blocks that gguf-py's dequantization turns non-finite."""
    import gguf

    from qllama.gguf.types import GGML_TYPES_BY_NAME

    t = GGML_TYPES_BY_NAME[type_name]
    qtype = gguf.GGMLQuantizationType(t.id)
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(12, t.type_size), dtype=np.uint8)  # (blocks, bytes)
    if type_name == "iq1_m":
        sc = blocks[:, 48:56].view("<u2")  # d's nibbles: an ordinary 0x3C00 (1.0), then spoil two blocks
        sc &= np.uint16(0x0FFF)
        sc[:, 3] |= np.uint16(0x3000)
        sc[:, 2] |= np.uint16(0xC000)
        sc[[3, 7], 3] |= np.uint16(0x7000)  # exponent bits all set: d is Inf or NaN
        sc[[3, 7], 2] |= np.uint16(0xC000)
    else:
        blocks[:, 0] = rng.integers(100, 140, size=12)
        blocks[:, 1:] |= 0x77  # nonzero values in every nibble
        blocks[[3, 7], 0] = [254, 255]
    values = gguf.quants.dequantize(blocks.reshape(1, -1), qtype).reshape(12, -1)  # (blocks, elements)
    expected = ~np.isfinite(values).all(axis=1)
    assert expected.tolist() == [i in (3, 7) for i in range(12)]
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("w", blocks.reshape(1, -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    report = check_tensors(GGUFFile(str(tmp_path / "m.gguf")))
    assert not report.unchecked
    (f,) = report.findings
    assert (f.count, f.total, f.first) == (2, 12, 3)
