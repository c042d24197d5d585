"""`qllama tokenize`: output format, options, stdin, errors, and no numba import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, shared_path


def qllama(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "qllama", "tokenize", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def spm() -> str:
    return str(shared_path("vocab", "ggml-vocab-llama-spm.gguf"))


@pytest.fixture(scope="module")
def llama3() -> str:
    return str(shared_path("vocab", "ggml-vocab-llama-bpe.gguf"))


def test_pieces(spm):
    r = qllama(spm, "Hello world\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["     1 -> '<s>'", " 15043 -> ' Hello'", "  3186 -> ' world'", "    13 -> '\\n'"]


def test_ids_no_bos_parse_special(llama3):
    assert qllama(llama3, "--ids", "Hello<|eot_id|>").stdout == "[128000, 9906, 27, 91, 68, 354, 851, 91, 29]\n"
    r = qllama(llama3, "--ids", "--no-bos", "--parse-special", "Hello<|eot_id|>")
    assert r.stdout == "[9906, 128009]\n"


def test_stdin(spm):
    assert qllama(spm, "--ids", "--no-bos", stdin="Hello").stdout == "[15043]\n"
    assert qllama(spm, "--ids", "-", stdin="Hello").stdout == "[1, 15043]\n"


def _write_gguf(path, **kv) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in kv.items():
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_errors(tmp_path):
    bert = _write_gguf(tmp_path / "bert.gguf", **{"tokenizer.ggml.model": "bert",
                                                  "tokenizer.ggml.tokens": ["[PAD]", "a"]})
    r = qllama(bert, "hi")
    assert r.returncode == 1 and r.stderr.startswith("error:") and "bert" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    none = _write_gguf(tmp_path / "none.gguf")
    r = qllama(none, "hi")
    assert r.returncode == 1 and "error:" in r.stderr and "no tokenizer" in r.stderr
    r = qllama(str(tmp_path / "missing.gguf"), "hi")
    assert r.returncode in (1, 2) and r.stderr.startswith("error:")


def test_does_not_import_numba(spm):
    code = ("import sys; from qllama.cli import main\n"
            f"try:\n    main(['tokenize', {spm!r}, 'hi'])\nexcept SystemExit:\n    pass\n"
            "print('NUMBA' if 'numba' in sys.modules else 'CLEAN')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.strip().splitlines()[-1] == "CLEAN", r.stdout + r.stderr
