"""Write small synthetic GGUF files (random weights) for tests and benchmarks.

Families: llama, qwen2, qwen3, gemma2, gemma3, phi3, each laid out as llama.cpp's converter
(convert_hf_to_gguf.py) writes it: the same tensor names and shapes, the same `<arch>.*` keys
(and only those the converter writes: e.g. no rope.dimension_count for qwen/gemma, no
rope.freq_base for gemma2), norm weights stored with Gemma's +1 already added, Phi-3's fused
attn_qkv and gate|up ffn_up, its rope_factors_long/short and rope.scaling.attn_factor.

Usage as a script:
    python tools/make_model.py OUT.gguf [--n-embd 64 --n-layer 2 --n-head 4 --n-head-kv 2 --n-ff 128
                                        --type q4_K --tied --rope-freqs --vocab ../shared/vocab/ggml-vocab-llama-spm.gguf]
    python tools/make_model.py OUT.gguf --preset llama-3.2-1b --mix Q4_K_M   # real shapes, random weights
    python tools/make_model.py OUT.gguf --arch gemma3 --vocab ../shared/vocab/ggml-vocab-llama-spm.gguf
    python tools/make_model.py OUT.gguf --preset qwen2.5-0.5b --mix Q4_K_M     # also: gemma3-1b

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

from qllama.gguf.types import GGML_TYPES_BY_NAME  # noqa: E402
from qllama.gguf.reader import GGUFFile, ValueType  # noqa: E402

# Byte offsets of the fp16 scale fields inside one block, per type: scaling them all by c
# scales every dequantized value by c (each type is linear in these fields).
_SCALE_FIELDS = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,),
    "iq4_nl": (0,), "iq4_xs": (0,), "iq3_s": (0,), "iq2_xxs": (0,),
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
    # --- other families (see family_spec() for each family's defaults) ---
    arch: str = "llama"  # general.architecture
    head_dim: int | None = None  # written as attention.key_length/value_length; None: n_embd // n_head, no key
    rope_dims: int | None = None  # phi3: rope.dimension_count (partial rotary, Phi-4-mini); None: head_dim
    qkv_bias: bool = False  # qwen2: attn_q/k/v.bias
    qk_norm: bool = False  # qwen3, gemma3: attn_q_norm/attn_k_norm (head_dim)
    sliding_window: int | None = None  # attention.sliding_window (gemma2/3, phi3: 0 = none)
    swa_pattern: int | None = None  # attention.sliding_window_pattern (converters never write it)
    attn_softcap: float | None = None  # attn_logit_softcapping (gemma2)
    final_softcap: float | None = None  # final_logit_softcapping (gemma2; gemma3 when set)
    rope_base_swa: float | None = None  # rope.freq_base_swa (gemma3's local layers)
    rope_orig_ctx: int | None = None  # phi3: rope.scaling.original_context_length
    longrope: bool = False  # phi3: rope_factors_long/short + rope.scaling.attn_factor
    embd_std: float | None = None  # std of token_embd (None: 1.0 as for llama)
    output_std: float | None = None  # std of output.weight (None: 1/sqrt(n_embd)); sets the logits' scale
    vocab_pad: int | None = None  # pad the vocabulary to this many tokens with [PAD{i}] (unused) tokens
    direct_blocks: bool = False  # quantized weights as random packed blocks, no float copies (8B shapes)


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


def random_tensor(rng: np.random.Generator, type_name: str, rows: int, cols: int, std: float, direct: bool = False):
    """(data for GGUFWriter, stored values float32 (rows, cols)) for a weight of `type_name`.

    direct: a quantized weight is written as random packed blocks whose scales are calibrated on
    a few rows, and no values are returned (None): the shapes of 8B models, which neither fit
    float32 copies in memory nor need them (speed runs)."""
    if direct and type_name in _SCALE_FIELDS:
        return _direct_blocks(rng, type_name, rows, cols, std), None
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


def _direct_blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int, std: float):
    """Random packed blocks (rows, bytes per row) of a quantized type, scaled so that a sample
    of rows dequantizes to about `std` (each type is linear in its fp16 scale fields)."""
    gt = GGML_TYPES_BY_NAME[type_name]
    qtype = gguf.GGMLQuantizationType(gt.id)
    per_row = cols // gt.block_size
    blocks = rng.integers(0, 256, size=(rows * per_row, gt.type_size), dtype=np.uint8)  # (blocks, bytes)
    fields = _SCALE_FIELDS[type_name]
    sample = min(rows, 8) * per_row
    for off in fields:
        blocks[:sample, off : off + 2].view(np.float16)[:] = np.float16(1.0)
    values = gguf.quants.dequantize(blocks[:sample].reshape(min(rows, 8), -1), qtype)
    scale = np.float16(std / max(float(values.std()), 1e-12))
    for off in fields:
        blocks[:, off : off + 2].view(np.float16)[:] = scale * rng.uniform(0.5, 1.5, size=(len(blocks), 1)).astype(np.float16)
    return blocks.reshape(rows, -1), qtype


def write_model(path: str | Path, spec: ModelSpec | None = None, **kwargs) -> dict[str, np.ndarray]:
    """Write a synthetic GGUF; return {tensor name: stored values as float32, numpy shape}."""
    spec = spec or ModelSpec(**kwargs)
    if spec.arch != "llama":
        return write_family(path, spec)
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
        tname = spec.types.get(name.removesuffix(".weight"), spec.types.get(kind, spec.weight_type))  # (a tensor, or a kind)
        if spec.preset:
            from qllama.gguf.types import GGML_TYPES
            from qllama.quantize import choose_tensor_type

            tid = choose_tensor_type(name, (cols, rows), spec.preset, spec.n_layer, tied_embeddings=spec.tied)
            tname = GGML_TYPES[tid].name
        if tname != "f32" and cols % GGML_TYPES_BY_NAME[tname].block_size:
            tname = "f32"  # row length not a multiple of the block: keep this one float
        data, values = random_tensor(rng, tname, rows, cols, std, direct=spec.direct_blocks)
        if isinstance(data, tuple):
            w.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            w.add_tensor(name, data)
        if values is not None:
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
        add("output.weight", n_vocab, spec.n_embd, spec.output_std or 1.0 / np.sqrt(spec.n_embd), "output")
    if spec.rope_freqs:
        # Llama 3.1-style: high-frequency pairs untouched (1), low-frequency ones slowed down (up to 8)
        add_vector("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


# =============================================================================================
# Other families, as llama.cpp's converter lays them out
# =============================================================================================

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")

# Chat templates: Qwen's and Phi-3.5's as published (../shared/templates); Gemma's is short
# enough to state here (the shape of Gemma 2/3's published template, system folded into the
# first user turn).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
CHATML_TEMPLATE = (  # used when ../shared/templates is absent
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PHI3_TEMPLATE = (  # used when ../shared/templates is absent
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def family_spec(arch: str, **kw) -> ModelSpec:
    """A ModelSpec with the family's real structural defaults (the small sizes of ModelSpec)."""
    defaults: dict = {
        "llama": {},
        "qwen2": dict(qkv_bias=True, rope_base=1000000.0, rms_eps=1e-6, tied=True),
        "qwen3": dict(qk_norm=True, head_dim=32, rope_base=1000000.0, rms_eps=1e-6, tied=True),
        "gemma2": dict(head_dim=16, rms_eps=1e-6, tied=True, sliding_window=4096, attn_softcap=50.0,
                       final_softcap=30.0),
        "gemma3": dict(qk_norm=True, head_dim=32, rope_base=1000000.0, rope_base_swa=10000.0, rms_eps=1e-6,
                       tied=True, sliding_window=512),
        "phi3": dict(n_head_kv=4, tied=False, sliding_window=0, rope_orig_ctx=4096, n_ctx=131072, longrope=True),
    }[arch]
    merged = {**defaults, **kw}
    if merged.get("tied") and "embd_std" not in merged:
        # the embedding is also the output: keep the logits at a trained model's scale (std ~2)
        merged["embd_std"] = 2.0 / np.sqrt(merged.get("n_embd", ModelSpec.n_embd))
    return ModelSpec(arch=arch, **merged)


def _spm_with_extra(vocab: dict, extra: list[str], pad_to: int | None = None) -> dict:
    """Append control tokens (and [PAD] unused ones) to an SPM-style vocabulary dict."""
    v = dict(vocab)
    tokens = list(v["tokenizer.ggml.tokens"][0])
    types = list(v["tokenizer.ggml.token_type"][0])
    scores = list(v["tokenizer.ggml.scores"][0]) if "tokenizer.ggml.scores" in v else None
    for t in extra:
        tokens.append(t)
        types.append(3)  # CONTROL, as the converter marks special added tokens
        if scores is not None:
            scores.append(-1000.0)
    if pad_to:
        for i in range(len(tokens), pad_to):
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
            if scores is not None:
                scores.append(-10000.0)
    v["tokenizer.ggml.tokens"] = (tokens, ValueType.ARRAY, ValueType.STRING)
    v["tokenizer.ggml.token_type"] = (types, ValueType.ARRAY, ValueType.INT32)
    if scores is not None:
        v["tokenizer.ggml.scores"] = (scores, ValueType.ARRAY, ValueType.FLOAT32)
    return v


def family_vocab(arch: str, base: dict, pad_to: int | None = None) -> dict:
    """The family's tokenizer metadata, built on a real vocabulary (`base`, from vocab_from_gguf).

    qwen*: a GPT-2 BPE vocab with pre-tokenizer `qwen2`, ChatML specials, no BOS, EOS <|im_end|>.
    gemma*: an SPM vocab without the space prefix, <start_of_turn>/<end_of_turn>, EOT <end_of_turn>.
    phi3: an SPM vocab with Phi-3's added tokens at 32000... (<|endoftext|> EOS, <|end|> EOT).
    """
    is_bpe = base["tokenizer.ggml.model"][0] == "gpt2"
    n = len(base["tokenizer.ggml.tokens"][0])
    if arch in ("qwen2", "qwen3"):
        extra = ["<|im_start|>", "<|im_end|>"]
        v = _spm_with_extra(base, extra, pad_to)
        tokens = v["tokenizer.ggml.tokens"][0]
        if is_bpe:
            v["tokenizer.ggml.pre"] = ("qwen2", ValueType.STRING)
            eot = tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else n - 1
            v["tokenizer.ggml.bos_token_id"] = (eot, ValueType.UINT32)
            v["tokenizer.ggml.padding_token_id"] = (eot, ValueType.UINT32)
        v["tokenizer.ggml.eos_token_id"] = (n + 1, ValueType.UINT32)
        v["tokenizer.ggml.add_bos_token"] = (False, ValueType.BOOL)
        return v
    if arch in ("gemma2", "gemma3"):
        v = _spm_with_extra(base, ["<start_of_turn>", "<end_of_turn>"], pad_to)
        if not is_bpe:
            v["tokenizer.ggml.add_space_prefix"] = (False, ValueType.BOOL)
        v["tokenizer.ggml.add_bos_token"] = (True, ValueType.BOOL)
        v["tokenizer.ggml.eot_token_id"] = (n + 1, ValueType.UINT32)
        return v
    if arch == "phi3":
        extra = ["<|endoftext|>", "<|assistant|>"] + [f"<|placeholder{i}|>" for i in range(1, 5)]
        extra += ["<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
        v = _spm_with_extra(base, extra, pad_to if pad_to else n + 64)
        v["tokenizer.ggml.eos_token_id"] = (n, ValueType.UINT32)  # <|endoftext|>
        v["tokenizer.ggml.eot_token_id"] = (n + 7, ValueType.UINT32)  # <|end|>
        v["tokenizer.ggml.padding_token_id"] = (n, ValueType.UINT32)
        v["tokenizer.ggml.add_bos_token"] = (False, ValueType.BOOL)
        return v
    return _spm_with_extra(base, [], pad_to)


def family_template(arch: str, shared: str | Path | None = None) -> str:
    """The chat template a converted model of this family carries."""
    tdir = Path(shared) / "templates" if shared else None
    if arch in ("gemma2", "gemma3"):
        return GEMMA_TEMPLATE
    names = {"qwen2": "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen3": "Qwen-Qwen2.5-7B-Instruct.jinja",
             "phi3": "microsoft-Phi-3.5-mini-instruct.jinja", "llama": "meta-llama-Llama-3.1-8B-Instruct.jinja"}
    if tdir is not None and (tdir / names[arch]).is_file():
        return (tdir / names[arch]).read_text()
    return PHI3_TEMPLATE if arch == "phi3" else CHATML_TEMPLATE


def longrope_factors(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Phi-3-like LongRoPE factors for n frequency pairs: (long, short), both >= 1."""
    x = np.linspace(0.0, 1.0, n)
    long = 1.0 + 15.0 * x**2  # high-frequency pairs ~1, low-frequency ones slowed down up to 16x
    short = 1.0 + 0.5 * x**3
    return long.astype(np.float32), short.astype(np.float32)


def write_family(path: str | Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    """write_model for the non-llama families (keys and tensors as llama.cpp's converter writes)."""
    arch = spec.arch
    if arch not in FAMILIES:
        raise ValueError(f"unknown family {arch!r}; choose one of {FAMILIES}")
    rng = np.random.default_rng(spec.seed)
    base = vocab_from_gguf(spec.vocab) if spec.vocab else tiny_vocab()
    vocab = family_vocab(arch, base, spec.vocab_pad)
    n_vocab = len(vocab["tokenizer.ggml.tokens"][0])
    n_embd, n_ff, n_layer = spec.n_embd, spec.n_ff, spec.n_layer
    hd = spec.head_dim or n_embd // spec.n_head
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd
    rope_dims = spec.rope_dims or hd
    gemma = arch in ("gemma2", "gemma3")
    tied = True if arch == "gemma2" else spec.tied  # gemma2 never has output.weight

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(spec.name)
    u32 = lambda k, v: w.add_uint32(f"{arch}.{k}", int(v))  # noqa: E731
    f32 = lambda k, v: w.add_float32(f"{arch}.{k}", float(v))  # noqa: E731
    u32("context_length", spec.n_ctx)
    u32("embedding_length", n_embd)
    u32("block_count", n_layer)
    u32("feed_forward_length", n_ff)
    u32("attention.head_count", spec.n_head)
    u32("attention.head_count_kv", spec.n_head_kv)
    f32("attention.layer_norm_rms_epsilon", spec.rms_eps)
    if spec.head_dim is not None:
        u32("attention.key_length", hd)
        u32("attention.value_length", hd)
    if arch == "gemma2":
        if spec.rope_base != 10000.0:
            raise ValueError("gemma2 files carry no rope.freq_base (llama.cpp's default 10000 applies)")
    else:
        f32("rope.freq_base", spec.rope_base)
    if arch == "gemma3" and spec.rope_base_swa is not None:
        f32("rope.freq_base_swa", spec.rope_base_swa)
    if arch == "phi3":
        u32("rope.dimension_count", rope_dims)
        u32("rope.scaling.original_context_length", spec.rope_orig_ctx or spec.n_ctx)
    if spec.rope_scale_linear:
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        f32("rope.scaling.factor", spec.rope_scale_linear)
    if gemma or arch == "phi3":
        if spec.sliding_window is not None:
            u32("attention.sliding_window", spec.sliding_window)
    if spec.swa_pattern is not None:
        u32("attention.sliding_window_pattern", spec.swa_pattern)
    if arch == "gemma2":
        f32("attn_logit_softcapping", spec.attn_softcap if spec.attn_softcap is not None else 50.0)
        f32("final_logit_softcapping", spec.final_softcap if spec.final_softcap is not None else 30.0)
    elif arch == "gemma3" and spec.final_softcap:
        f32("final_logit_softcapping", spec.final_softcap)
    long_f = short_f = None
    if arch == "phi3" and spec.longrope:
        orig = spec.rope_orig_ctx or spec.n_ctx
        scale = spec.n_ctx / orig
        attn_factor = float(np.sqrt(1 + np.log(scale) / np.log(orig))) if scale > 1.0 else 1.0
        f32("rope.scaling.attn_factor", attn_factor)
        long_f, short_f = longrope_factors(rope_dims // 2)
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
            from qllama.gguf.types import GGML_TYPES
            from qllama.quantize import choose_tensor_type

            tid = choose_tensor_type(name, (cols, rows), spec.preset, n_layer, tied_embeddings=tied)
            tname = GGML_TYPES[tid].name
        if tname != "f32" and cols % GGML_TYPES_BY_NAME[tname].block_size:
            tname = "f32"
        data, values = random_tensor(rng, tname, rows, cols, std)
        if isinstance(data, tuple):
            w.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            w.add_tensor(name, data)
        stored[name] = values

    def add_vector(name: str, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float32)
        w.add_tensor(name, values)
        stored[name] = values

    def norm(n: int) -> np.ndarray:  # gemma's converter stores 1 + w: the stored value is the multiplier
        return 1.0 + 0.1 * rng.standard_normal(n)

    add("token_embd.weight", n_vocab, n_embd, spec.embd_std or 1.0, "token_embd")
    s = 1.0 / np.sqrt(n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        add_vector(p + "attn_norm.weight", norm(n_embd))
        if arch == "phi3":  # fused Q|K|V rows
            add(p + "attn_qkv.weight", q_dim + 2 * kv_dim, n_embd, s, "attn_qkv")
        else:
            add(p + "attn_q.weight", q_dim, n_embd, s, "attn_q")
            add(p + "attn_k.weight", kv_dim, n_embd, s, "attn_k")
            add(p + "attn_v.weight", kv_dim, n_embd, s, "attn_v")
        if spec.qkv_bias:
            add_vector(p + "attn_q.bias", 0.2 * rng.standard_normal(q_dim))
            add_vector(p + "attn_k.bias", 0.2 * rng.standard_normal(kv_dim))
            add_vector(p + "attn_v.bias", 0.2 * rng.standard_normal(kv_dim))
        if spec.qk_norm:
            add_vector(p + "attn_q_norm.weight", norm(hd))
            add_vector(p + "attn_k_norm.weight", norm(hd))
        add(p + "attn_output.weight", n_embd, q_dim, 1.0 / np.sqrt(q_dim), "attn_output")
        if gemma:
            add_vector(p + "post_attention_norm.weight", norm(n_embd))
        add_vector(p + "ffn_norm.weight", norm(n_embd))
        if arch == "phi3":  # fused gate|up rows: gate first (HF Phi3MLP chunks gate, up)
            add(p + "ffn_up.weight", 2 * n_ff, n_embd, s, "ffn_up")
        else:
            add(p + "ffn_gate.weight", n_ff, n_embd, s, "ffn_gate")
            add(p + "ffn_up.weight", n_ff, n_embd, s, "ffn_up")
        add(p + "ffn_down.weight", n_embd, n_ff, 1.0 / np.sqrt(n_ff), "ffn_down")
        if gemma:
            add_vector(p + "post_ffw_norm.weight", norm(n_embd))
    add_vector("output_norm.weight", norm(n_embd))
    if not tied:
        add("output.weight", n_vocab, n_embd, spec.output_std or 1.0 / np.sqrt(n_embd), "output")
    if long_f is not None:
        add_vector("rope_factors_long.weight", long_f)
        add_vector("rope_factors_short.weight", short_f)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


PRESETS = {
    # Real shapes with random weights (DESIGN.md section 7).
    # Llama 3.1 8B config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336,
    # vocab 128256, untied output, rope_theta 500000 with Llama 3.1 rope factors. Quantized weights
    # go in as random blocks (`direct_blocks`): the file is ~4.9 GB in Q4_K_M.
    "llama-3.1-8b": dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, n_ctx=131072, rope_base=500000.0,
                         rope_freqs=True, vocab="ggml-vocab-llama-bpe.gguf", name="llama-3.1-8b-random",
                         direct_blocks=True),
    "llama-3.2-1b": dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_ctx=131072, rope_base=500000.0,
                         tied=True, rope_freqs=True, vocab="ggml-vocab-llama-bpe.gguf", name="llama-3.2-1b-random"),
    "tinyllama-1.1b": dict(n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632, n_ctx=2048,
                           vocab="ggml-vocab-llama-spm.gguf", name="tinyllama-1.1b-random"),
    # Qwen2.5-0.5B(-Instruct) config.json: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
    # 4864, vocab 151936, tie_word_embeddings, rope_theta 1e6, rms_norm_eps 1e-6, Q/K/V biases.
    "qwen2.5-0.5b": dict(arch="qwen2", n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864, n_ctx=32768,
                         vocab="ggml-vocab-gpt-2.gguf", vocab_pad=151936, name="qwen2.5-0.5b-random"),
    # Gemma 3 1B(-it) config.json: hidden 1152, 26 layers, 4 heads, 1 KV head, head_dim 256,
    # intermediate 6912, vocab 262144, sliding_window 512 (5 local : 1 global), rope_theta 1e6,
    # rope_local_base_freq 1e4, no rope scaling, no softcapping, query_pre_attn_scalar 256.
    "gemma3-1b": dict(arch="gemma3", n_embd=1152, n_layer=26, n_head=4, n_head_kv=1, head_dim=256, n_ff=6912,
                      n_ctx=32768, sliding_window=512, vocab="ggml-vocab-llama-spm.gguf", vocab_pad=262144,
                      name="gemma3-1b-random"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--arch", choices=FAMILIES, default="llama", help="model family (with its structural defaults)")
    ap.add_argument("--shared", default=str(REPO.parent / "shared"), help="where vocab/ and templates/ live")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=None, help="default 2 (phi3: 4)")
    ap.add_argument("--head-dim", type=int, default=None, help="attention.key_length (qwen3/gemma: family default)")
    ap.add_argument("--n-ff", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=None, help="context_length (default 128; phi3: 131072)")
    ap.add_argument("--window", type=int, default=None, help="attention.sliding_window (gemma2/3, phi3)")
    ap.add_argument("--type", default="f32", help="type of the weight matrices (f32, f16, q8_0, q4_K, ...)")
    ap.add_argument("--mix", help="per-tensor types of a llama.cpp preset instead of --type (e.g. Q4_K_M)")
    ap.add_argument("--tied", action="store_true", help="llama: no output.weight (the families have their own default)")
    ap.add_argument("--rope-freqs", action="store_true")
    ap.add_argument("--vocab", help="copy the tokenizer from this GGUF")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.preset:
        kw = dict(PRESETS[a.preset])
        kw["vocab"] = str(Path(a.shared) / "vocab" / kw["vocab"])
        arch = kw.pop("arch", "llama")
        if arch == "llama":
            spec = ModelSpec(weight_type=a.type, preset=a.mix, seed=a.seed, **kw)
        else:
            spec = family_spec(arch, weight_type=a.type, preset=a.mix, seed=a.seed,
                               chat_template=family_template(arch, a.shared), **kw)
    elif a.arch == "llama":
        spec = ModelSpec(n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_head,
                         n_head_kv=2 if a.n_head_kv is None else a.n_head_kv, n_ff=a.n_ff,
                         n_ctx=a.n_ctx or 128, weight_type=a.type, preset=a.mix, tied=a.tied, rope_freqs=a.rope_freqs,
                         vocab=a.vocab, seed=a.seed)
    else:
        kw = dict(n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_head, n_ff=a.n_ff, weight_type=a.type, preset=a.mix,
                  vocab=a.vocab, seed=a.seed, chat_template=family_template(a.arch, a.shared))
        for key, val in (("n_head_kv", a.n_head_kv), ("head_dim", a.head_dim), ("n_ctx", a.n_ctx),
                         ("sliding_window", a.window)):
            if val is not None:
                kw[key] = val
        if a.tied:
            kw["tied"] = True
        spec = family_spec(a.arch, **kw)
    write_model(a.out, spec)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
