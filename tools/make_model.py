"""Write small synthetic Llama GGUF files (random weights) for tests and benchmarks.

Usage as a script:
    python tools/make_model.py OUT.gguf [--n-embd 64 --n-layer 2 --n-head 4 --n-head-kv 2 --n-ff 128
                                        --type q4_K --tied --rope-freqs --vocab ../shared/vocab/ggml-vocab-llama-spm.gguf]
    python tools/make_model.py OUT.gguf --preset llama-3.2-1b --mix Q4_K_M   # real shapes, random weights

Block-quantized tensors are made as random packed blocks (every bit pattern is a valid block)
whose fp16 scale fields are then rescaled to a sane weight magnitude; the exact stored values
(as gguf-py's independent dequantizer reads them) are returned, so tests can run a float64
reference forward pass on precisely the weights the runtime sees.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gguf  # writer + the oracle dequantizer (tests/tools only)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from qllama.ggml_types import GGML_TYPES_BY_NAME  # noqa: E402
from qllama.gguf import GGUFFile, ValueType  # noqa: E402

# Byte offsets of the fp16 scale fields inside one block, per type: scaling them all by c
# scales every dequantized value by c (each type is linear in these fields).
_SCALE_FIELDS = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,),
}


# Types made by quantizing Gaussian floats (realistic scale patterns); the others are random
# packed blocks, which exercise every bit pattern but have heavy-tailed sub-block scales.
_QUANTIZED_FROM_FLOATS = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K"}


@dataclass
class ModelSpec:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 128
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = False
    rope_freqs: bool = False  # write a Llama 3.1-style rope_freqs.weight
    rope_scale_linear: float | None = None
    weight_type: str = "f32"  # type of the 2-D weight matrices
    types: dict[str, str] = field(default_factory=dict)  # per-tensor overrides: {"token_embd": "q6_K", ...}
    preset: str | None = None  # a llama.cpp quantization preset ("Q4_K_M"...): per-tensor types as llama-quantize picks
    vocab: str | None = None  # copy tokenizer metadata from this GGUF; None: the tiny built-in SPM vocab
    chat_template: str | None = None  # written as tokenizer.chat_template
    seed: int = 0
    name: str = "synthetic"


def tiny_vocab() -> dict:
    """A small SentencePiece-style (llama) vocabulary: specials, 256 byte tokens, some pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    pieces = ["▁", "▁t", "he", "▁the", "▁a", "in", "er", "on", "▁o", "re", "at", "en", "▁s", "▁w", "is", "▁th"]
    pieces += [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    pieces += list(".,!?'") + ["▁The", "▁and", "▁of", "▁to", "ing", "▁is", "▁in"]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": ("llama", ValueType.STRING),
        "tokenizer.ggml.tokens": (tokens, ValueType.ARRAY, ValueType.STRING),
        "tokenizer.ggml.scores": (scores, ValueType.ARRAY, ValueType.FLOAT32),
        "tokenizer.ggml.token_type": (types, ValueType.ARRAY, ValueType.INT32),
        "tokenizer.ggml.bos_token_id": (1, ValueType.UINT32),
        "tokenizer.ggml.eos_token_id": (2, ValueType.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, ValueType.UINT32),
        "tokenizer.ggml.add_bos_token": (True, ValueType.BOOL),
    }


def vocab_from_gguf(path: str) -> dict:
    """Every tokenizer.* key of a GGUF, with its types, ready for GGUFWriter."""
    gf = GGUFFile(path)
    out = {}
    for key, value in gf.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        mt = gf.metadata_types[key]
        if mt.type == ValueType.ARRAY:
            v = value.tolist() if isinstance(value, np.ndarray) else list(value)
            out[key] = (v, ValueType.ARRAY, mt.item.type)
        else:
            out[key] = (value, mt.type)
    return out


def _gw_type(t: ValueType) -> gguf.GGUFValueType:
    return gguf.GGUFValueType(int(t))


def random_tensor(rng: np.random.Generator, type_name: str, rows: int, cols: int, std: float):
    """(data for GGUFWriter, stored values float32 (rows, cols)) for a weight of `type_name`."""
    if type_name == "f32":
        w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        return w, w
    if type_name == "f16":
        w = (rng.standard_normal((rows, cols)) * std).astype(np.float16)
        return w, w.astype(np.float32)
    if type_name == "bf16":
        w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncation is a valid bf16 value
        packed = bits.view(np.uint8).reshape(rows, cols * 2)
        return (packed, gguf.GGMLQuantizationType.BF16), (bits.astype(np.uint32) << 16).view(np.float32)
    gt = GGML_TYPES_BY_NAME[type_name]
    qtype = gguf.GGMLQuantizationType(gt.id)
    if type_name in _QUANTIZED_FROM_FLOATS:
        # realistic blocks: Gaussian weights through qllama's ggml-compatible quantizer
        from qllama.quantize import quantize_array

        packed = quantize_array((rng.standard_normal((rows, cols)) * std).astype(np.float32), gt.id)
        return (packed, qtype), gguf.quants.dequantize(packed, qtype).reshape(rows, cols).astype(np.float32)
    n_blocks = rows * cols // gt.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, gt.type_size), dtype=np.uint8)
    fields = _SCALE_FIELDS[type_name]
    for off in fields:  # start from unit-ish scales, then rescale to the wanted std
        blocks[:, off : off + 2].view(np.float16)[:] = rng.uniform(0.5, 1.5, size=(n_blocks, 1)).astype(np.float16)
    packed = blocks.reshape(rows, -1)
    values = gguf.quants.dequantize(packed, qtype).reshape(rows, cols)
    c = std / max(float(values.std()), 1e-12)
    for off in fields:
        view = blocks[:, off : off + 2].view(np.float16)
        view[:] = (view.astype(np.float32) * c).astype(np.float16)
    packed = blocks.reshape(rows, -1)
    values = gguf.quants.dequantize(packed, qtype).reshape(rows, cols).astype(np.float32)
    return (packed, qtype), values


def write_model(path: str | Path, spec: ModelSpec | None = None, **kwargs) -> dict[str, np.ndarray]:
    """Write a synthetic Llama GGUF; return {tensor name: stored values as float32, numpy shape}."""
    spec = spec or ModelSpec(**kwargs)
    rng = np.random.default_rng(spec.seed)
    vocab = vocab_from_gguf(spec.vocab) if spec.vocab else tiny_vocab()
    n_vocab = len(vocab["tokenizer.ggml.tokens"][0])
    head_dim = spec.n_embd // spec.n_head
    kv_dim = spec.n_head_kv * head_dim

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(spec.name)
    arch = "llama"
    w.add_uint32(f"{arch}.context_length", spec.n_ctx)
    w.add_uint32(f"{arch}.embedding_length", spec.n_embd)
    w.add_uint32(f"{arch}.block_count", spec.n_layer)
    w.add_uint32(f"{arch}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{arch}.attention.head_count", spec.n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", spec.n_head_kv)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.rms_eps)
    w.add_float32(f"{arch}.rope.freq_base", spec.rope_base)
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_uint32(f"{arch}.vocab_size", n_vocab)
    if spec.rope_scale_linear:
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", spec.rope_scale_linear)
    for key, entry in vocab.items():
        if len(entry) == 3:
            w.add_key_value(key, entry[0], _gw_type(entry[1]), _gw_type(entry[2]))
        else:
            w.add_key_value(key, entry[0], _gw_type(entry[1]))

    if spec.preset:
        from qllama.quantize import get_preset

        w.add_file_type(get_preset(spec.preset).ftype)
    if spec.chat_template is not None:
        w.add_string("tokenizer.chat_template", spec.chat_template)
    stored: dict[str, np.ndarray] = {}

    def add(name: str, rows: int, cols: int, std: float, kind: str) -> None:
        tname = spec.types.get(kind, spec.weight_type)
        if spec.preset:
            from qllama.ggml_types import GGML_TYPES
            from qllama.quantize import choose_tensor_type

            tid = choose_tensor_type(name, (cols, rows), spec.preset, spec.n_layer, tied_embeddings=spec.tied)
            tname = GGML_TYPES[tid].name
        if tname != "f32" and cols % GGML_TYPES_BY_NAME[tname].block_size:
            tname = "f32"  # row length not a multiple of the block: keep this one float
        data, values = random_tensor(rng, tname, rows, cols, std)
        if isinstance(data, tuple):
            w.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            w.add_tensor(name, data)
        stored[name] = values

    def add_vector(name: str, values: np.ndarray) -> None:
        values = values.astype(np.float32)
        w.add_tensor(name, values)
        stored[name] = values

    add("token_embd.weight", n_vocab, spec.n_embd, 1.0, "token_embd")
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        s = 1.0 / np.sqrt(spec.n_embd)
        add_vector(p + "attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(spec.n_embd))
        add(p + "attn_q.weight", spec.n_embd, spec.n_embd, s, "attn_q")
        add(p + "attn_k.weight", kv_dim, spec.n_embd, s, "attn_k")
        add(p + "attn_v.weight", kv_dim, spec.n_embd, s, "attn_v")
        add(p + "attn_output.weight", spec.n_embd, spec.n_embd, s, "attn_output")
        add_vector(p + "ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(spec.n_embd))
        add(p + "ffn_gate.weight", spec.n_ff, spec.n_embd, s, "ffn_gate")
        add(p + "ffn_up.weight", spec.n_ff, spec.n_embd, s, "ffn_up")
        add(p + "ffn_down.weight", spec.n_embd, spec.n_ff, 1.0 / np.sqrt(spec.n_ff), "ffn_down")
    add_vector("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(spec.n_embd))
    if not spec.tied:
        add("output.weight", n_vocab, spec.n_embd, 1.0 / np.sqrt(spec.n_embd), "output")
    if spec.rope_freqs:
        # Llama 3.1-style: high-frequency pairs untouched (1), low-frequency ones slowed down (up to 8)
        add_vector("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


PRESETS = {
    # Real shapes with random weights (DESIGN.md section 7).
    "llama-3.2-1b": dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_ctx=131072, rope_base=500000.0,
                         tied=True, rope_freqs=True, vocab="ggml-vocab-llama-bpe.gguf", name="llama-3.2-1b-random"),
    "tinyllama-1.1b": dict(n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632, n_ctx=2048,
                           vocab="ggml-vocab-llama-spm.gguf", name="tinyllama-1.1b-random"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--shared", default=str(REPO.parent / "shared"), help="where vocab/ lives (for presets)")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=2)
    ap.add_argument("--n-ff", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=128)
    ap.add_argument("--type", default="f32", help="type of the weight matrices (f32, f16, q8_0, q4_K, ...)")
    ap.add_argument("--mix", help="per-tensor types of a llama.cpp preset instead of --type (e.g. Q4_K_M)")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--rope-freqs", action="store_true")
    ap.add_argument("--vocab", help="copy the tokenizer from this GGUF")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.preset:
        kw = dict(PRESETS[a.preset])
        kw["vocab"] = str(Path(a.shared) / "vocab" / kw["vocab"])
        spec = ModelSpec(weight_type=a.type, preset=a.mix, seed=a.seed, **kw)
    else:
        spec = ModelSpec(n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_head, n_head_kv=a.n_head_kv, n_ff=a.n_ff,
                         n_ctx=a.n_ctx, weight_type=a.type, preset=a.mix, tied=a.tied, rope_freqs=a.rope_freqs, vocab=a.vocab,
                         seed=a.seed)
    write_model(a.out, spec)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
