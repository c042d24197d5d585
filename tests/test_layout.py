"""The package's layout rules (README "How it is built"): no import cycle between modules, even
through imports inside functions, and few modules at the top level."""

from __future__ import annotations

from tools.import_cycles import ROOT, cycles, edges, modules


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(edges(modules())) == []


def test_function_level_imports_count(tmp_path):
    pkg = tmp_path / "qllama"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    graph = edges(modules(pkg))
    assert graph["qllama.b"] == {"qllama.a"} and graph["qllama.c"] == set()
    assert cycles(graph) == [["qllama.a", "qllama.b"]]


def test_few_modules_at_the_top_level():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 8, top


def test_one_record_per_tensor_type_and_the_sets_derive_from_it():
    """Every per-type set comes from qtensor.TYPES, and the kernels' own tables agree with the records."""
    from qllama.gguf.types import GGML_TYPES
    from qllama.kernels import int8
    from qllama.qtensor import ACTIVATION_FORMS, FUSED_TYPES, GEMM_TYPES, INT8_TYPES, SUPPORTED_TYPES, TYPES

    assert SUPPORTED_TYPES == set(TYPES)
    for tid, rec in TYPES.items():
        assert rec.ggml is GGML_TYPES[tid]  # block size and bytes from the one table
        assert rec.int8_form is None or rec.int8_form in ACTIVATION_FORMS
        assert not rec.fused or tid in INT8_TYPES  # the fused kernels are int8 kernels
    assert GEMM_TYPES == set(int8.GEMM_TYPES)  # a record's gemm flag <=> the kernel packs that type
    assert FUSED_TYPES >= GEMM_TYPES
    assert all(int8._BLOCK_BYTES[t] == GGML_TYPES[t].type_size for t in int8._BLOCK_BYTES)
