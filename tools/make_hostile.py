"""A corpus of numerically hostile GGUF files, made from a trained model.

Each file is the trained Shakespeare model (`../shared/models/shakespeare-spm-Q4_K_M.gguf`, or
the bundled demo copy) with one thing broken: a NaN or Inf in a scale field of a quantized
block (one file per quantized type and field, the i-quants and ternary types included), a NaN
in an f32, f16 or bf16 tensor or a norm vector, an out-of-range hyper-parameter, or a
special-token id outside the vocabulary. The structure of these files is valid; only the numbers
are wrong. A few more break the structure of an i-quant tensor: its data cut short at the end of
the file, or a row length that is not a multiple of its block.

`CASES` lists every file with the behaviour qllama promises for it (`expect`):
- "load-error":  `qllama.load` / `qllama run` fail with one `error:` line naming `key` and its value;
- "nonfinite":   generation stops with one `error:` line naming where the first non-finite value
                 appeared (`where`, e.g. "blk.0.attn_q"); `inspect --check` names `tensor`;
- "warn":        a warning names `key`, the value is ignored as llama.cpp ignores it, text is normal;
- "runs":        normal, finite output (llama.cpp gives normal output too);
- "bad-file":    opening the file (`qllama run`, `inspect --check`) fails with one `error:` line
                 naming `tensor`.

Usage: python tools/make_hostile.py OUT_DIR [--source MODEL.gguf] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = HERE.parent.parent / "shared" / "models" / "shakespeare-spm-Q4_K_M.gguf"

F16_NAN, F16_INF = 0x7E00, 0x7C00
TARGET = "blk.0.attn_q.weight"  # the matrix whose first block is broken (256 x 256 in the source)
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K")
IQUANT_TYPES = ("iq4_nl", "iq4_xs", "iq2_xxs", "iq3_s", "iq1_s", "tq2_0")  # a NaN d each (one fp16 field)
# types written as random blocks with a small finite scale (qllama has no quantizer for them here;
# every bit pattern of their blocks is valid, so the layer's output is noise, but finite)
RANDOM_BLOCK_TYPES = ("q2_K", "q3_K", "iq2_xxs", "iq3_s", "iq1_s", "iq1_m", "tq2_0")
IQ1_M_SCALES = 48  # byte offset of iq1_m's four scale words, whose top nibbles hold its fp16 d


@dataclass(frozen=True)
class Case:
    name: str
    expect: str  # "load-error" | "nonfinite" | "warn" | "runs"
    tensor: str | None = None  # the tensor `inspect --check` must name
    where: str | None = None  # the layer.operation a non-finite error must name
    key: str | None = None  # the metadata key an error or warning must name
    kv: dict = field(default_factory=dict)  # metadata overrides: key -> (value, gguf value type name)
    retype: tuple[str, str] | None = None  # (tensor, ggml type): re-encode a tensor in this type
    poke: tuple[str, int, int | tuple[int, ...]] | None = None  # (tensor, byte offset, uint16 value(s)) after retype
    poke_f32: tuple[str, int, float] | None = None  # (tensor, element index, value) for f32 tensors
    shape: tuple[str, tuple[int, int]] | None = None  # (tensor, (rows, ne0)) declared instead of its own
    truncate: tuple[str, int] | None = None  # (tensor written last, bytes cut off the end of the file)


def _scale_cases() -> list[Case]:
    from qllama.gguf.types import GGML_TYPES_BY_NAME

    cases = []
    for tname in QUANT_TYPES + IQUANT_TYPES:
        fields = GGML_TYPES_BY_NAME[tname].scale_fields
        for bits, label in ((F16_NAN, "nan"), (F16_INF, "inf"))[: 1 if tname in IQUANT_TYPES else 2]:
            cases.append(Case(f"scale-{label}-{tname}", "nonfinite", tensor=TARGET, where="blk.0.attn_q",
                              retype=(TARGET, tname), poke=(TARGET, fields[0], bits)))
        if len(fields) > 1:  # the min / dmin field too
            cases.append(Case(f"min-nan-{tname}", "nonfinite", tensor=TARGET, where="blk.0.attn_q",
                              retype=(TARGET, tname), poke=(TARGET, fields[1], F16_NAN)))
    return cases


def _iquant_structure_cases() -> list[Case]:
    """iq1_m's d (spread over four scale words), and i-quant tensors whose structure is broken."""
    # words 2 and 3 of block 0 carry d's nibbles 2 and 3: 0xE and 0x7 make d 0x7E00, a NaN
    return [Case("scale-nan-iq1_m", "nonfinite", tensor=TARGET, where="blk.0.attn_q", retype=(TARGET, "iq1_m"),
                 poke=(TARGET, IQ1_M_SCALES + 4, (0xE000, 0x7000))),
            Case("truncated-iq4_xs", "bad-file", tensor=TARGET, retype=(TARGET, "iq4_xs"), truncate=(TARGET, 1000)),
            # 256 x 256 iq4_xs bytes declared as 512 rows of 128: not a multiple of its 256-block
            Case("row-not-block-iq4_xs", "bad-file", tensor=TARGET, retype=(TARGET, "iq4_xs"),
                 shape=(TARGET, (512, 128))),
            Case("row-not-block-iq2_xxs", "bad-file", tensor=TARGET, retype=(TARGET, "iq2_xxs"),
                 shape=(TARGET, (512, 128)))]


def all_cases() -> list[Case]:
    down = "blk.1.ffn_down.weight"
    return _scale_cases() + _iquant_structure_cases() + [
        Case("norm-nan", "nonfinite", tensor="blk.0.attn_norm.weight", where="blk.0.attn_norm",
             poke_f32=("blk.0.attn_norm.weight", 7, math.nan)),
        Case("f32-nan", "nonfinite", tensor=down, where="blk.1.ffn_out", retype=(down, "f32"),
             poke_f32=(down, 1000, math.nan)),
        Case("f16-nan", "nonfinite", tensor=down, where="blk.1.ffn_out", retype=(down, "f16"),
             poke=(down, 2 * 1000, F16_NAN)),
        Case("bf16-inf", "nonfinite", tensor=down, where="blk.1.ffn_out", retype=(down, "bf16"),
             poke=(down, 2 * 1000, 0x7F80)),
        Case("eps-negative", "load-error", key="llama.attention.layer_norm_rms_epsilon",
             kv={"llama.attention.layer_norm_rms_epsilon": (-1.0, "FLOAT32")}),
        Case("eps-nan", "load-error", key="llama.attention.layer_norm_rms_epsilon",
             kv={"llama.attention.layer_norm_rms_epsilon": (math.nan, "FLOAT32")}),
        Case("rope-base-zero", "load-error", key="llama.rope.freq_base",
             kv={"llama.rope.freq_base": (0.0, "FLOAT32")}),
        Case("rope-scale-negative", "load-error", key="llama.rope.scaling.factor",
             kv={"llama.rope.scaling.type": ("linear", "STRING"), "llama.rope.scaling.factor": (-2.0, "FLOAT32")}),
        # llama.cpp reads a factor of 0 as "no scaling": so does qllama
        Case("rope-scale-zero", "runs",
             kv={"llama.rope.scaling.type": ("linear", "STRING"), "llama.rope.scaling.factor": (0.0, "FLOAT32")}),
        # positions / 1e30 are ~0 everywhere: odd text, but finite, and llama.cpp accepts it too
        Case("rope-scale-huge", "runs",
             kv={"llama.rope.scaling.type": ("linear", "STRING"), "llama.rope.scaling.factor": (1e30, "FLOAT32")}),
        Case("bos-out-of-vocab", "warn", key="tokenizer.ggml.bos_token_id",
             kv={"tokenizer.ggml.bos_token_id": (99999, "UINT32")}),
        Case("eos-out-of-vocab", "warn", key="tokenizer.ggml.eos_token_id",
             kv={"tokenizer.ggml.eos_token_id": (1 << 31, "UINT32")}),
    ]


CASES = {c.name: c for c in all_cases()}


# -- writing --------------------------------------------------------------------------------


def _encode_tensor(values: np.ndarray, tname: str, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """float32 (rows, ne0) -> the array GGUFWriter takes for ggml type `tname`, and that type name."""
    from qllama.gguf.types import GGML_TYPES_BY_NAME

    if tname == "f32":
        return values.astype(np.float32), tname
    if tname == "f16":
        return values.astype(np.float16), tname
    if tname == "bf16":
        return _bf16_bits(values), tname
    if tname in RANDOM_BLOCK_TYPES:
        t = GGML_TYPES_BY_NAME[tname]
        n_blocks = values.size // t.block_size
        raw = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
        small = np.float16(1e-3)
        for off in t.scale_fields:
            raw[:, off : off + 2] = np.frombuffer(small.tobytes(), np.uint8)
        if tname == "iq1_m":  # d's four nibbles go into the top nibbles of the four scale words
            words = raw[:, IQ1_M_SCALES : IQ1_M_SCALES + 8].view("<u2")  # (blocks, 4)
            d = int(small.view(np.uint16))
            for k in range(4):
                words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        return raw.reshape(values.shape[0], -1), tname
    from qllama.quantize import quantize_array

    return quantize_array(values, GGML_TYPES_BY_NAME[tname].id), tname


def _tensor_values(gf, name: str) -> np.ndarray:
    """A tensor of the source as float32 (rows, ne0), through gguf-py's independent dequantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    info = gf.tensors[name]
    raw = gf.tensor_bytes(name)
    vals = dequantize(raw, GGMLQuantizationType(info.type_id))
    return np.asarray(vals, dtype=np.float32).reshape(-1, info.shape[0])


def write_case(case: Case, source: Path, out: Path) -> Path:
    """Write one hostile file; returns its path (OUT/<name>.gguf)."""
    import gguf

    from qllama.gguf.reader import GGUFFile
    from qllama.quantize.writer import copy_metadata

    dst = out / f"{case.name}.gguf"
    tmp = dst.with_suffix(".gguf.part")
    rng = np.random.default_rng(0)
    gf = GGUFFile(source)
    writer = gguf.GGUFWriter(str(tmp), gf.metadata["general.architecture"])
    copy_metadata(writer, gf, skip_keys=case.kv)
    for key, (value, vtype) in case.kv.items():
        writer.add_key_value(key, value, gguf.GGUFValueType[vtype])

    names = list(gf.tensors)
    if case.truncate:  # the tensor to cut short goes last
        names.remove(case.truncate[0])
        names.append(case.truncate[0])
    for name in names:
        info = gf.tensors[name]
        if case.retype and name == case.retype[0]:
            arr, tname = _encode_tensor(_tensor_values(gf, name), case.retype[1], rng)
        elif info.type_name in ("f32", "f16"):
            arr, tname = np.array(gf.tensor_array(name)), info.type_name
        else:
            arr, tname = np.array(gf.tensor_bytes(name)).reshape(info.shape[-1] if len(info.shape) > 1 else 1, -1), info.type_name
        if case.poke and name == case.poke[0]:
            arr = np.ascontiguousarray(arr)
            words = np.array(case.poke[2], "<u2").reshape(-1)
            arr.view(np.uint8).reshape(-1)[case.poke[1] : case.poke[1] + words.nbytes] = words.view(np.uint8)
        if case.poke_f32 and name == case.poke_f32[0]:
            arr = np.array(arr, dtype=np.float32)
            arr.reshape(-1)[case.poke_f32[1]] = case.poke_f32[2]
        qtype = gguf.GGMLQuantizationType[tname.upper()]
        if tname in ("f32", "f16"):
            writer.add_tensor(name, arr)
        elif case.shape and name == case.shape[0]:
            # a non-uint8 view makes GGUFWriter take the declared element shape as it is
            writer.add_tensor(name, np.ascontiguousarray(arr).view(np.uint16), raw_shape=case.shape[1], raw_dtype=qtype)
        else:
            writer.add_tensor(name, arr, raw_dtype=qtype)
    gf.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if case.truncate:
        os.truncate(tmp, tmp.stat().st_size - case.truncate[1])
    os.replace(tmp, dst)  # never leave a half-written file under the final name
    return dst


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as uint16 rows for GGUFWriter's raw bf16."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def make_corpus(out: Path, source: Path = DEFAULT_SOURCE, only: list[str] | None = None) -> dict[str, Path]:
    """Write every case (or `only` these) into `out`; returns {case name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    names = only or list(CASES)
    return {n: write_case(CASES[n], source, out) for n in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    ap.add_argument("--only", nargs="*", choices=sorted(CASES))
    args = ap.parse_args(argv)
    if not args.source.exists():
        print(f"error: {args.source}: no such file", file=sys.stderr)
        return 1
    for name, path in make_corpus(args.out, args.source, args.only).items():
        c = CASES[name]
        print(f"{path}  expect={c.expect}  {c.tensor or c.key or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
