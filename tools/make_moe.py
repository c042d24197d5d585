"""Write small synthetic mixture-of-experts GGUF files (random weights) for tests and benchmarks.

Families qwen3moe, llama (Mixtral), olmoe, qwen2moe, granitemoe and dense granite, laid out as
llama.cpp's converter (convert_hf_to_gguf.py) writes them: the `<arch>.expert_*` keys, the router
`blk.N.ffn_gate_inp.weight` [n_embd, n_expert] kept in f32 (the converter and llama-quantize never
quantize it), the experts as one 3-D tensor per projection, expert-major:
`ffn_{gate,up}_exps` [n_embd, n_ff_exp, n_expert], `ffn_down_exps` [n_ff_exp, n_embd, n_expert],
shared experts as `ffn_*_shexp` (qwen2moe's gate `ffn_gate_inp_shexp` [n_embd]).

Usage as a script:
    python tools/make_moe.py OUT.gguf --arch qwen3moe [--n-embd 256 --n-layer 2 --n-expert 8 --n-used 2
                                                        --n-ff-exp 256 --type q4_K]
    python tools/make_moe.py OUT.gguf --preset qwen3-30b-a3b --n-layer 4 --type q4_K   # real shapes
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gguf

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.make_model import _gw_type, random_tensor, tiny_vocab, vocab_from_gguf  # noqa: E402

MOE_FAMILIES = ("qwen3moe", "llama", "olmoe", "qwen2moe", "granitemoe", "granite", "gpt-oss")
NEOX = {"qwen3moe", "olmoe", "qwen2moe", "gpt-oss"}


@dataclass
class MoeSpec:
    arch: str = "qwen3moe"
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # attention.key_length/value_length (qwen3moe writes it); None: n_embd / n_head
    n_ff: int = 128  # feed_forward_length
    n_expert: int = 8
    n_used: int = 2
    n_ff_exp: int | None = None  # expert_feed_forward_length (qwen*); None: not written
    n_ff_shexp: int = 0  # expert_shared_feed_forward_length (qwen2moe: required shared expert; granitemoe: optional)
    n_ctx: int = 256
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    tied: bool = False
    weight_type: str = "f32"  # 2-D matrices and the experts
    types: dict[str, str] = field(default_factory=dict)  # per kind: {"ffn_down_exps": "q6_K", "token_embd": ...}
    vocab: str | None = None  # copy tokenizer metadata from this GGUF; None: the tiny SPM vocabulary
    router_std: float = 1.0  # std of the router's rows (x h) : larger = sharper routing
    seed: int = 0
    # granite
    logit_scale: float = 4.0
    residual_scale: float = 0.5
    embedding_scale: float = 2.0
    attention_scale: float = 0.0  # 0: not written (1/sqrt(head_dim))
    # expert-count overrides for hostile files (written as given)
    expert_count_key: int | None = None
    expert_used_key: int | None = None
    expert_tensor_count: int | None = None  # experts in the 3-D tensors only (router keeps n_expert rows)
    direct: bool = False  # quantized weights as random packed blocks, no float copies (real shapes, speed runs)
    output_std: float | None = None  # std of output.weight (None: 1/sqrt(n_embd)); sets the logits' scale
    # gpt-oss: window of the even layers, YaRN (factor 0: none), attention sinks' std
    n_swa: int = 16
    yarn_factor: float = 32.0
    yarn_orig_ctx: int = 64
    sink_std: float = 1.0


def _zero_mean_q4_k(packed: np.ndarray) -> np.ndarray:
    """Random q4_K blocks, each with dmin = 7.5 d: a sub-block's mean d (7.5 sc - 7.5 m) is then zero
    on average (sc and m uniform), instead of a positive offset common to a whole row, whose
    rank-one component would make every token's hidden state alike (and route them alike)."""
    blocks = packed.reshape(-1, 144)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    blocks[:, 2:4].view(np.float16)[:] = (7.5 * d).astype(np.float16)
    return packed


def write_moe(path: str | Path, spec: MoeSpec) -> dict[str, np.ndarray]:
    """Write the file; return {tensor name: stored values as float32, numpy shape}."""
    arch = spec.arch
    if arch not in MOE_FAMILIES:
        raise ValueError(f"unknown MoE family {arch!r}; choose one of {MOE_FAMILIES}")
    rng = np.random.default_rng(spec.seed)
    vocab = vocab_from_gguf(spec.vocab) if spec.vocab else tiny_vocab()
    n_vocab = len(vocab["tokenizer.ggml.tokens"][0])
    d, n_layer, ne = spec.n_embd, spec.n_layer, spec.n_expert
    hd = spec.head_dim or d // spec.n_head
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd
    ff_exp = spec.n_ff_exp or (spec.n_ff if arch in ("llama", "olmoe", "granitemoe") else spec.n_ff // spec.n_used)
    moe = arch != "granite"

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    u32 = lambda k, v: w.add_uint32(f"{arch}.{k}", int(v))  # noqa: E731
    f32 = lambda k, v: w.add_float32(f"{arch}.{k}", float(v))  # noqa: E731
    u32("context_length", spec.n_ctx)
    u32("embedding_length", d)
    u32("block_count", n_layer)
    u32("feed_forward_length", spec.n_ff)
    u32("attention.head_count", spec.n_head)
    u32("attention.head_count_kv", spec.n_head_kv)
    f32("rope.freq_base", spec.rope_base)
    f32("attention.layer_norm_rms_epsilon", spec.rms_eps)
    if spec.head_dim is not None:
        u32("attention.key_length", hd)
        u32("attention.value_length", hd)
    if arch in ("llama", "granite", "granitemoe"):
        u32("rope.dimension_count", hd)
        u32("vocab_size", n_vocab)
    if moe:
        u32("expert_count", ne if spec.expert_count_key is None else spec.expert_count_key)
        u32("expert_used_count", spec.n_used if spec.expert_used_key is None else spec.expert_used_key)
    if arch == "gpt-oss":  # convert_hf_to_gguf.py GptOssModel
        u32("attention.sliding_window", spec.n_swa)
        if spec.yarn_factor:
            w.add_string(f"{arch}.rope.scaling.type", "yarn")
            f32("rope.scaling.factor", spec.yarn_factor)
            u32("rope.scaling.original_context_length", spec.yarn_orig_ctx)
    if spec.n_ff_exp is not None and arch in ("qwen3moe", "qwen2moe", "gpt-oss"):
        u32("expert_feed_forward_length", spec.n_ff_exp)
    if spec.n_ff_shexp:
        u32("expert_shared_feed_forward_length", spec.n_ff_shexp)
    if arch in ("granite", "granitemoe"):
        f32("logit_scale", spec.logit_scale)
        f32("residual_scale", spec.residual_scale)
        f32("embedding_scale", spec.embedding_scale)
        if spec.attention_scale:
            f32("attention.scale", spec.attention_scale)
    for key, entry in vocab.items():
        if len(entry) == 3:
            w.add_key_value(key, entry[0], _gw_type(entry[1]), _gw_type(entry[2]))
        else:
            w.add_key_value(key, entry[0], _gw_type(entry[1]))
    stored: dict[str, np.ndarray] = {}

    def tname(kind: str, cols: int) -> str:
        t = spec.types.get(kind, spec.weight_type)
        from qllama.gguf.types import GGML_TYPES_BY_NAME

        return t if t == "f32" or cols % GGML_TYPES_BY_NAME[t].block_size == 0 else "f32"

    def add(name: str, rows: int, cols: int, std: float, kind: str) -> None:
        # (direct blocks have a common mean offset: an embedding of them makes every token alike,
        # so every token would route to the same experts; the tiny vocabulary's are cheap to quantize)
        direct = spec.direct and kind not in ("token_embd", "output")
        data, values = random_tensor(rng, tname(kind, cols), rows, cols, std, direct=direct)
        if direct and tname(kind, cols) == "q4_K":
            data = (_zero_mean_q4_k(data[0]), data[1])
        if isinstance(data, tuple):
            w.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            w.add_tensor(name, data)
        stored[name] = values

    def add_experts(name: str, rows: int, cols: int, std: float, kind: str) -> None:
        """n_expert matrices (rows, cols) stacked expert-major: GGUF shape [cols, rows, n_expert]."""
        t = tname(kind, cols)
        if t == "mxfp4" and spec.direct:  # random codes, exponents for the wanted std (rms of the codes' values 5.85)
            qt = gguf.GGMLQuantizationType.MXFP4
            e = int(round(128 + np.log2(std / 5.85)))
            parts = []
            for _ in range(spec.expert_tensor_count or ne):
                q = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
                q[..., 0] = rng.integers(e - 1, e + 2, (rows, cols // 32), dtype=np.uint8)
                parts.append(((q.reshape(rows, -1), qt), None))
        elif t == "mxfp4":  # (gpt-oss's experts) Gaussian weights through gguf-py's quantizer
            qt = gguf.GGMLQuantizationType.MXFP4
            packed = [gguf.quants.quantize((rng.standard_normal((rows, cols)) * std).astype(np.float32), qt)
                      for _ in range(spec.expert_tensor_count or ne)]
            parts = [((q, qt), gguf.quants.dequantize(q, qt).astype(np.float32)) for q in packed]
        else:
            parts = [random_tensor(rng, t, rows, cols, std, direct=spec.direct) for _ in range(spec.expert_tensor_count or ne)]
        if spec.direct and t == "q4_K":
            parts = [((_zero_mean_q4_k(p[0][0]), p[0][1]), p[1]) for p in parts]
        if isinstance(parts[0][0], tuple):
            packed = np.stack([p[0][0] for p in parts])  # (n_expert, rows, row bytes)
            w.add_tensor(name, packed, raw_dtype=parts[0][0][1])
        else:
            w.add_tensor(name, np.stack([p[0] for p in parts]))  # (n_expert, rows, cols)
        stored[name] = None if parts[0][1] is None else np.stack([p[1] for p in parts])

    def vec(name: str, values) -> None:
        values = np.asarray(values, dtype=np.float32)
        w.add_tensor(name, values)
        stored[name] = values

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    add("token_embd.weight", n_vocab, d, 1.0, "token_embd")
    s = 1.0 / np.sqrt(d)
    for i in range(n_layer):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", norm(d))
        add(p + "attn_q.weight", q_dim, d, s, "attn_q")
        add(p + "attn_k.weight", kv_dim, d, s, "attn_k")
        add(p + "attn_v.weight", kv_dim, d, s, "attn_v")
        if arch in ("qwen2moe", "gpt-oss"):
            vec(p + "attn_q.bias", 0.2 * rng.standard_normal(q_dim))
            vec(p + "attn_k.bias", 0.2 * rng.standard_normal(kv_dim))
            vec(p + "attn_v.bias", 0.2 * rng.standard_normal(kv_dim))
        if arch == "qwen3moe":
            vec(p + "attn_q_norm.weight", norm(hd))
            vec(p + "attn_k_norm.weight", norm(hd))
        if arch == "olmoe":
            vec(p + "attn_q_norm.weight", norm(q_dim))
            vec(p + "attn_k_norm.weight", norm(kv_dim))
        add(p + "attn_output.weight", d, q_dim, 1.0 / np.sqrt(q_dim), "attn_output")
        if arch == "gpt-oss":  # output bias, sinks, and post_attention_norm as the FFN's norm
            vec(p + "attn_output.bias", 0.2 * rng.standard_normal(d))
            vec(p + "attn_sinks.weight", spec.sink_std * rng.standard_normal(spec.n_head))
            vec(p + "post_attention_norm.weight", norm(d))
        else:
            vec(p + "ffn_norm.weight", norm(d))
        if not moe:
            add(p + "ffn_gate.weight", spec.n_ff, d, s, "ffn_gate")
            add(p + "ffn_up.weight", spec.n_ff, d, s, "ffn_up")
            add(p + "ffn_down.weight", d, spec.n_ff, 1.0 / np.sqrt(spec.n_ff), "ffn_down")
            continue
        # the router: f32 always (converter and llama-quantize keep ffn_gate_inp unquantized)
        router = (rng.standard_normal((ne, d)) * spec.router_std * s).astype(np.float32)
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        stored[p + "ffn_gate_inp.weight"] = router
        if arch == "gpt-oss":  # router and expert biases (expert-major 2-D: [width, n_expert])
            vec(p + "ffn_gate_inp.bias", 0.5 * rng.standard_normal(ne))
            vec(p + "ffn_gate_exps.bias", 0.2 * rng.standard_normal((ne, ff_exp)))
            vec(p + "ffn_up_exps.bias", 0.2 * rng.standard_normal((ne, ff_exp)))
            vec(p + "ffn_down_exps.bias", 0.2 * rng.standard_normal((ne, d)))
        add_experts(p + "ffn_gate_exps.weight", ff_exp, d, s, "ffn_gate_exps")
        add_experts(p + "ffn_up_exps.weight", ff_exp, d, s, "ffn_up_exps")
        add_experts(p + "ffn_down_exps.weight", d, ff_exp, 1.0 / np.sqrt(ff_exp), "ffn_down_exps")
        if spec.n_ff_shexp:
            fs = spec.n_ff_shexp
            if arch == "qwen2moe":
                vec(p + "ffn_gate_inp_shexp.weight", rng.standard_normal(d) * s)
            add(p + "ffn_gate_shexp.weight", fs, d, s, "ffn_gate_shexp")
            add(p + "ffn_up_shexp.weight", fs, d, s, "ffn_up_shexp")
            add(p + "ffn_down_shexp.weight", d, fs, 1.0 / np.sqrt(fs), "ffn_down_shexp")
    vec("output_norm.weight", norm(d))
    if not spec.tied:
        add("output.weight", n_vocab, d, spec.output_std or 1.0 / np.sqrt(d), "output")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def moe_spec(arch: str, **kw) -> MoeSpec:
    """A MoeSpec with the family's structural defaults (as its converter writes it)."""
    defaults = {
        "qwen3moe": dict(head_dim=32, rope_base=1000000.0, n_ff_exp=64),
        "llama": dict(rms_eps=1e-5),
        "olmoe": dict(n_head_kv=4, rms_eps=1e-5),
        "qwen2moe": dict(rope_base=1000000.0, n_ff_exp=64, n_ff_shexp=128),
        "granitemoe": dict(rms_eps=1e-6, tied=True, n_ff_shexp=0),
        "granite": dict(rms_eps=1e-6, tied=True),
        "gpt-oss": dict(head_dim=16, rope_base=150000.0, rms_eps=1e-5, n_ff_exp=64, n_expert=8, n_used=4),
    }[arch]
    return MoeSpec(arch=arch, **{**defaults, **kw})


# Real shapes (config.json of each model), random weights; a few layers measure a layer's cost.
PRESETS = {
    # Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim 128, 128 experts, 8 used,
    # moe_intermediate_size 768, vocab 151936 (here the tiny vocabulary), untied
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144,
                          n_expert=128, n_used=8, n_ff_exp=768, n_ctx=4096),
    # OLMoE-1B-7B-0924: hidden 2048, 16 layers, 16 heads, 64 experts, 8 used, intermediate 1024
    "olmoe-1b-7b": dict(arch="olmoe", n_embd=2048, n_head=16, n_head_kv=16, n_ff=1024, n_expert=64, n_used=8,
                        n_ctx=4096),
    # gpt-oss-20b: hidden 2880, 24 layers, 64 heads, 8 KV heads, head_dim 64, 32 experts, 4 used,
    # intermediate 2880, window 128, YaRN factor 32 over 4096, experts in MXFP4
    "gpt-oss-20b": dict(arch="gpt-oss", n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880, n_expert=32,
                        n_used=4, n_ff_exp=2880, n_ctx=4096, n_swa=128, yarn_factor=32.0, yarn_orig_ctx=4096),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", choices=MOE_FAMILIES, default="qwen3moe")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-expert", type=int, default=8)
    ap.add_argument("--n-used", type=int, default=2)
    ap.add_argument("--n-ff-exp", type=int, default=None)
    ap.add_argument("--type", default="f32", help="type of the matrices and experts (f32, q8_0, q4_K, ...)")
    ap.add_argument("--down-type", default=None, help="type of ffn_down_exps (default --type)")
    ap.add_argument("--vocab", help="copy the tokenizer from this GGUF")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    types = {"ffn_down_exps": a.down_type} if a.down_type else {}
    if a.preset:
        kw = dict(PRESETS[a.preset])
        spec = moe_spec(kw.pop("arch"), n_layer=a.n_layer, weight_type=a.type, types=types, vocab=a.vocab,
                        seed=a.seed, direct=True, **kw)
    else:
        kw = dict(n_embd=a.n_embd, n_layer=a.n_layer, n_expert=a.n_expert, n_used=a.n_used, weight_type=a.type,
                  types=types, vocab=a.vocab, seed=a.seed)
        if a.n_ff_exp:
            kw["n_ff_exp"] = a.n_ff_exp
        spec = moe_spec(a.arch, **kw)
    write_moe(a.out, spec)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
