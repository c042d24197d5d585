"""`qllama inspect` and the model summary: content, JSON shape, vocab-only files, hostile files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from qllama.cli.inspect_cmd import command as inspect_command
from qllama.cli.inspect_cmd import human_bytes, human_count
from qllama.gguf.types import F16, F32, Q4_K, Q6_K, Q8_0
from qllama.gguf.reader import GGUFFile, ValueType
from qllama.report.summary import summarize

from test_gguf import make_gguf  # noqa: E402  (tests/ is on sys.path)

VT = ValueType
REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared"


def shared(rel: str) -> Path:
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"{p} is absent (the read-only ../shared folder is not beside this checkout)")
    return p


def run(*args: str) -> "click.testing.Result":  # noqa: F821
    return CliRunner().invoke(inspect_command, list(args), catch_exceptions=False)


def run_subprocess(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "qllama", *args], capture_output=True, text=True, env=env, timeout=120)


# A synthetic GQA llama with chat templates, an unknown tensor type and awkward strings.
SYNTH_KVS = [
    ("general.architecture", VT.STRING, "llama"), ("general.name", VT.STRING, "synth"),
    ("general.file_type", VT.UINT32, 15),
    ("llama.context_length", VT.UINT32, 4096), ("llama.embedding_length", VT.UINT32, 512),
    ("llama.block_count", VT.UINT32, 3), ("llama.feed_forward_length", VT.UINT32, 1536),
    ("llama.attention.head_count", VT.UINT32, 8), ("llama.attention.head_count_kv", VT.UINT32, 2),
    ("llama.rope.freq_base", VT.FLOAT32, 500000.0),
    ("llama.rope.scaling.type", VT.STRING, "linear"), ("llama.rope.scaling.factor", VT.FLOAT32, 4.0),
    ("tokenizer.ggml.model", VT.STRING, "gpt2"), ("tokenizer.ggml.pre", VT.STRING, "llama-bpe"),
    ("tokenizer.ggml.tokens", VT.ARRAY, (VT.STRING, ["<s>", "</s>", "a\nb", b"\xff\xfe"] + [f"t{i}" for i in range(96)])),
    ("tokenizer.ggml.scores", VT.ARRAY, (VT.FLOAT32, [float("nan"), float("inf")] + [0.5] * 98)),
    ("tokenizer.ggml.bos_token_id", VT.UINT32, 0), ("tokenizer.ggml.eos_token_id", VT.UINT32, 3),
    ("tokenizer.chat_template", VT.STRING, "{% for m in messages %}{{ m.content }}{% endfor %}"),
    ("tokenizer.chat_template.tool_use", VT.STRING, "{{ tools }}"),
    ("tokenizer.chat_template.rag", VT.STRING, "{{ documents }}"),
    ("odd.string", VT.STRING, b"bad\xc3 utf8 \x1b[31m"),
    ("odd.nested", VT.ARRAY, (VT.ARRAY, [(VT.INT32, list(range(70))), (VT.INT32, [1])])),
    ("odd.nan", VT.FLOAT64, float("nan")),
]
SYNTH_TENSORS = [
    ("token_embd.weight", (512, 100), Q4_K, None), ("output_norm.weight", (512,), F32, None),
    ("blk.0.attn_q.weight", (512, 512), Q8_0, None), ("output.weight", (512, 100), Q6_K, None),
    ("rope_freqs.weight", (32,), F16, None), ("mystery.weight", (64, 2), 99, None),
]


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("inspect") / "synth.gguf"
    p.write_bytes(make_gguf(SYNTH_KVS, SYNTH_TENSORS))
    return p


# ---------------------------------------------------------------------------------------


def test_human_formatting() -> None:
    assert human_bytes(None) == "?" and human_bytes(1023) == "1023 B" and human_bytes(1536) == "1.50 KiB"
    assert human_bytes(8 * 2**20) == "8.00 MiB" and human_bytes(3 * 2**40) == "3.00 TiB"
    assert human_count(19_794_176) == "19.79M" and human_count(999) == "999" and human_count(1_230_000_000) == "1.23B"


def test_summary_of_synthetic_model(synth: Path) -> None:
    s = summarize(GGUFFile(synth))
    assert (s.architecture, s.name, s.file_type) == ("llama", "synth", "MOSTLY_Q4_K_M")
    assert s.n_params == 512 * 100 * 2 + 512 + 512 * 512 + 32 + 128
    assert (s.block_count, s.head_count, s.head_count_kv, s.head_dim) == (3, 8, 2, 64)
    assert s.rope_scaling == "linear x4, rope_freqs.weight"
    assert s.vocab_size == 100 and s.bos_token == "<s>" and s.eos_token_id == 3
    assert s.chat_template and s.chat_template_names == ["rag", "tool_use"]
    # f16 K and V (the default cache): 2 * n_layer * n_head_kv * head_dim * 2 bytes per token
    assert s.kv_cache_bytes_per_token == 2 * 3 * 2 * 64 * 2
    assert s.kv_cache_bytes_per_1k == 2 * 3 * 2 * 64 * 2 * 1024
    mix = {r.type: r for r in s.quant_mix}
    assert mix["q4_K"].n_bytes == 100 * 2 * 144 and mix["q6_K"].n_bytes == 100 * 2 * 210
    assert mix["q8_0"].n_bytes == 512 * 16 * 34 and mix["f32"].n_bytes == 2048
    assert mix["unknown(99)"].n_bytes is None and mix["unknown(99)"].percent is None
    known = sum(r.n_bytes for r in s.quant_mix if r.n_bytes is not None)
    assert s.tensor_bytes == known
    assert abs(sum(r.percent for r in s.quant_mix if r.percent is not None) - 100) < 1e-9
    assert mix["q4_K"].bits_per_weight == 4.5 and mix["q6_K"].bits_per_weight == 6.5625


def test_summary_per_layer_heads_and_defaults() -> None:
    kvs = [("general.architecture", VT.STRING, "openelm"), ("openelm.block_count", VT.UINT32, 2),
           ("openelm.embedding_length", VT.UINT32, 64),
           ("openelm.attention.head_count", VT.ARRAY, (VT.INT32, [4, 8])),
           ("openelm.attention.head_count_kv", VT.ARRAY, (VT.INT32, [1, 2])),
           ("openelm.attention.key_length", VT.UINT32, 16), ("openelm.attention.value_length", VT.UINT32, 16)]
    s = summarize(GGUFFile.from_bytes(make_gguf(kvs)))
    assert s.head_count == [4, 8] and s.head_count_kv == [1, 2] and s.head_dim == 16
    assert s.kv_cache_bytes_per_token == (1 + 2) * (16 + 16) * 2
    # head_count_kv absent: equals head_count; wrong-typed values are ignored, not fatal
    kvs = [("general.architecture", VT.STRING, "llama"), ("llama.block_count", VT.STRING, "two"),
           ("llama.embedding_length", VT.UINT32, 64), ("llama.attention.head_count", VT.UINT32, 4)]
    s = summarize(GGUFFile.from_bytes(make_gguf(kvs)))
    assert s.head_count_kv == 4 and s.block_count is None and s.kv_cache_bytes_per_1k is None


def test_inspect_text_on_trained_model() -> None:
    p = shared("models/shakespeare-spm-Q4_K_M.gguf")
    r = run(str(p))
    assert r.exit_code == 0, r.output
    out = r.output
    f = GGUFFile(p)
    n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    for want in ("architecture      llama", f"({n_params:,})", "MOSTLY_Q4_K_M", "heads / KV heads  8 / 8 (head dim 32)",
                 "context length    256", "FFN size          768", "vocab size        32000", "1 '<s>' / 2 '</s>'",
                 "chat template     none", "KV cache          4.00 MiB per 1K (1024) tokens", "quant mix", "tensors"):
        assert want in out, want
    lines = out.splitlines()
    for t in f.tensors.values():  # every tensor: name, type, shape ne0 first, offset
        row = next(line for line in lines if line.split() and line.split()[0] == t.name)
        assert t.type_name in row and "[" + ", ".join(map(str, t.shape)) + "]" in row and row.endswith(str(t.offset))
    assert any(line.split()[:2] == ["q4_K", "25"] for line in lines if line.split())


def test_inspect_json_document(synth: Path) -> None:
    r = run(str(synth), "--json")
    assert r.exit_code == 0
    doc = json.loads(r.output)  # one document
    assert {"version", "metadata", "tensors", "summary"} <= set(doc)
    assert doc["version"] == 3
    md = doc["metadata"]
    tokens = md["tokenizer.ggml.tokens"]
    assert tokens["type"] == "array[string]" and tokens["count"] == 100 and tokens["head"][:3] == ["<s>", "</s>", "a\nb"]
    assert tokens["head"][3] == "\\xff\\xfe"  # invalid UTF-8 shown as \xNN, never a lone surrogate
    assert md["tokenizer.ggml.scores"]["head"][:2] == ["nan", "inf"]  # JSON has no NaN
    assert md["odd.nan"] == "nan" and md["odd.string"].startswith("bad\\xc3")
    assert md["odd.nested"][0]["count"] == 70 and md["odd.nested"][1] == [1]  # summarised per array
    assert md["general.file_type"] == 15 and md["llama.rope.freq_base"] == 500000.0
    t = {x["name"]: x for x in doc["tensors"]}
    assert t["token_embd.weight"] == {"name": "token_embd.weight", "type": "q4_K", "shape": [512, 100],
                                      "offset": 0, "n_bytes": 28800}
    assert t["mystery.weight"]["type"] == "unknown(99)" and t["mystery.weight"]["n_bytes"] is None
    assert doc["summary"]["kv_cache_bytes_per_1k"] == 2 * 3 * 2 * 64 * 2 * 1024
    assert doc["summary"]["chat_template_names"] == ["rag", "tool_use"]
    r.output.encode("utf-8")  # strict: no surrogates anywhere


def test_inspect_text_unknown_type_and_odd_strings(synth: Path) -> None:
    r = run(str(synth), "--metadata")
    assert r.exit_code == 0
    out = r.output
    row = next(line for line in out.splitlines() if "mystery.weight" in line)
    assert "unknown(99)" in row and " ? " in row
    assert "unknown(99)" in out.split("quant mix")[1]
    assert "chat template     present (50 chars); named: rag, tool_use" in out
    assert "linear x4, rope_freqs.weight" in out
    assert "bad\\xc3 utf8 \\x1b[31m" in out  # escapes, no raw control characters
    assert "\x1b" not in out
    for key, _, _ in SYNTH_KVS:
        assert key in out
    assert "(100 items)" in out
    assert "0 '<s>' / 3 '\\xff\\xfe'" in out and "'a\\nb'" in out  # tokens quoted, escaped


def test_inspect_vocab_only_file() -> None:
    p = shared("vocab/ggml-vocab-llama-bpe.gguf")
    r = run(str(p))
    assert r.exit_code == 0
    assert "0 (vocab only: no tensors)" in r.output and "no tensors (vocab-only file)" in r.output
    assert "128.00 MiB per 1K (1024) tokens" in r.output  # 2 * 32 layers * 8 KV heads * 128 * 2 B (f16)
    assert "128000 '<|begin_of_text|>' / 128001 '<|end_of_text|>'" in r.output
    doc = json.loads(run(str(p), "--json").output)
    assert doc["tensors"] == [] and doc["metadata"]["tokenizer.ggml.merges"]["count"] == 280147


@pytest.mark.parametrize("rel", ["vocab/ggml-vocab-gpt-2.gguf", "vocab/ggml-vocab-llama-spm.gguf",
                                 "models/shakespeare-spm-f32.gguf"])
def test_inspect_all_modes_on_shared_files(rel: str) -> None:
    p = shared(rel)
    for args in ((), ("--metadata",), ("--json",)):
        r = run(str(p), *args)
        assert r.exit_code == 0, r.output
    json.loads(r.output)


HOSTILE = {
    "truncated": lambda good: good[: len(good) // 2],
    "bad magic": lambda good: b"GGML" + good[4:],
    "version 1": lambda good: good[:4] + b"\x01\x00\x00\x00" + good[8:],
    "overlap": lambda good: make_gguf([], [("a", (16,), F32, 0), ("b", (16,), F32, 32)], data=bytes(96)),
    "overflow": lambda good: make_gguf([], [("w", (2**42 + 1, 2**22), F32, 0)], data=bytes(64)),
    "utf8 key": lambda good: make_gguf([(b"k\xff", VT.UINT8, 1)]),
    "huge array": lambda good: make_gguf([("a", VT.ARRAY, (VT.UINT8, [1]))])[:-9] + b"\x00" * 7 + b"\x80\x01",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_inspect_hostile_file_one_error_line(kind: str, synth: Path, tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(HOSTILE[kind](synth.read_bytes()))
    r = run_subprocess("inspect", str(p))
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(p) in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_inspect_missing_file_and_directory(tmp_path: Path) -> None:
    for target, msg in ((tmp_path / "nope.gguf", "no such file"), (tmp_path, "is a directory")):
        r = run_subprocess("inspect", str(target))
        assert r.returncode == 1 and r.stderr.startswith("error: ") and msg in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_inspect_never_imports_numba(synth: Path) -> None:
    code = (
        "import sys\n"
        "from qllama.cli import main\n"
        f"sys.argv = ['qllama', 'inspect', {str(synth)!r}, '--json']\n"
        "try:\n    main()\n"
        "finally:\n"
        "    bad = sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite', 'torch'))\n"
        "    print('HEAVY', bad, file=sys.stderr)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stderr
    json.loads(r.stdout)


# -- each family's own fields, as qllama runs it -------------------------------------------


@pytest.fixture(scope="module")
def family_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tools.make_model import ModelSpec, family_spec, write_model

    root = tmp_path_factory.mktemp("families")
    small = dict(n_embd=64, n_ff=128, n_head=4)
    specs = {
        "llama": ModelSpec(n_layer=2, n_head_kv=2, **small),
        "qwen2": family_spec("qwen2", n_layer=2, n_head_kv=2, **small),
        "qwen3": family_spec("qwen3", n_layer=2, n_head_kv=2, head_dim=32, **small),
        "gemma2": family_spec("gemma2", n_layer=4, n_head_kv=2, head_dim=32, sliding_window=64, **small),
        "gemma3": family_spec("gemma3", n_layer=12, n_head_kv=1, head_dim=32, sliding_window=512, n_ctx=32768, **small),
        "phi3": family_spec("phi3", n_layer=2, n_head_kv=4, n_ctx=1024, rope_orig_ctx=256, **small),
    }
    out = {}
    for name, spec in specs.items():
        out[name] = root / f"{name}.gguf"
        write_model(out[name], spec)
    return out


def test_family_fields(family_files: dict[str, Path]) -> None:
    s = {name: summarize(GGUFFile(p)) for name, p in family_files.items()}
    assert all(x.supported for x in s.values())
    assert [s[n].rope_layout for n in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")] == ["norm"] + ["neox"] * 5
    assert s["qwen2"].qkv_bias and not s["qwen3"].qkv_bias and not s["llama"].qkv_bias
    assert s["qwen3"].qk_norm and s["gemma3"].qk_norm and not s["gemma2"].qk_norm
    assert s["qwen3"].head_dim == 32 and s["qwen3"].attn_scale == pytest.approx(32 ** -0.5)  # 4 x 32 != n_embd 64
    assert (s["gemma2"].attn_softcap, s["gemma2"].final_softcap) == (50.0, 30.0)  # the file's (llama.cpp's defaults)
    assert s["gemma3"].attn_softcap is None and s["gemma3"].final_softcap is None
    assert s["gemma2"].window_layers == [0, 2] and s["gemma2"].window_pattern == "1 local : 1 global"
    assert s["phi3"].fused_qkv and s["phi3"].sliding_window is None  # llama.cpp ignores Phi's window
    assert s["phi3"].rope_factors.startswith("LongRoPE: rope_factors_long when n_ctx > 256")
    g3 = s["gemma3"]
    assert (g3.sliding_window, g3.window_layers, g3.window_pattern) == (512, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10], "5 local : 1 global")
    assert g3.rope_freq_base_swa == 10000.0
    # KV cache: only the 2 global layers grow with the context; the 10 windowed ones hold 512 + 512 positions
    per_pos = 2 * 1 * 32 * 2  # f16 K and V
    assert g3.kv_cache_bytes_per_token == 2 * per_pos and g3.kv_cache_bytes_per_1k == 2 * per_pos * 1024
    assert g3.kv_cache_window_bytes == 10 * 1024 * per_pos
    assert g3.kv_cache_default_ctx == 4096 and g3.kv_cache_bytes_default_ctx == (2 * 4096 + 10 * 1024) * per_pos
    assert g3.kv_cache_bytes_default_ctx < 12 * 4096 * per_pos / 2  # vs every layer holding every position


def test_family_fields_in_text_output(family_files: dict[str, Path]) -> None:
    out = run(str(family_files["gemma3"])).output
    assert "NeoX halves" in out
    assert "sliding window    512 positions on 10 of 12 layers (5 local : 1 global); their RoPE base 10000" in out
    assert "attention         scale 0.176777, no logit softcap, Q/K norm" in out
    out = run(str(family_files["gemma2"])).output
    assert "logit softcap 50" in out and "final softcap     30" in out
    assert "interleaved pairs" in run(str(family_files["llama"])).output
    assert "fused attn_qkv" in run(str(family_files["phi3"])).output


def test_unsupported_architecture_says_so(tmp_path: Path) -> None:
    kvs = [("general.architecture", VT.STRING, "mamba"), ("mamba.block_count", VT.UINT32, 2)]
    p = tmp_path / "mamba.gguf"
    p.write_bytes(make_gguf(kvs))
    assert "runs in qllama    no (architecture mamba is not supported)" in run(str(p)).output
