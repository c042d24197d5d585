"""What a GGUF file holds, in numbers a person wants: `summarize(GGUFFile) -> ModelSummary`.

Used by `qllama inspect`. Import-light (no numba: qllama.models loads its kernels lazily).
Metadata comes from an untrusted file, so every value is read defensively: a key with an
unexpected type is treated as absent rather than raising.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..gguf.types import FILE_TYPES, GGML_TYPES
from ..gguf.reader import GGUFFile

KV_CACHE_TOKENS = 1024  # "per 1K tokens of context"
KV_CACHE_ELEMENT_BYTES = 2  # the runtime's default KV cache is f16, as llama.cpp's (f32, -ctk/-ctv f32, doubles it)
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


@dataclass
class QuantMixRow:
    """The tensors of one ggml type: how many, their elements, bytes and share of all bytes."""

    type: str
    n_tensors: int
    n_elements: int
    n_bytes: int | None  # None when the type is unknown (size cannot be computed)
    percent: float | None  # of the known tensor bytes
    bits_per_weight: float | None


@dataclass
class ModelSummary:
    """The facts `qllama inspect` prints. None means "not in the file"."""

    version: int
    file_size: int
    n_metadata: int
    n_tensors: int
    architecture: str | None
    name: str | None
    n_params: int
    tensor_bytes: int  # sum over tensors of known type
    file_type: str | None
    quantization_version: int | None
    quant_mix: list[QuantMixRow]
    context_length: int | None
    embedding_length: int | None
    block_count: int | None
    head_count: int | list[int] | None  # a list when per layer
    head_count_kv: int | list[int] | None
    head_dim: int | None  # key length per head
    feed_forward_length: int | list[int] | None
    rope_freq_base: float | None
    rope_dimension_count: int | None
    rope_scaling: str | None  # e.g. "linear x4.0", "yarn x8.0 (orig. ctx 8192)", "rope_freqs.weight"
    vocab_size: int | None
    tokenizer_model: str | None
    tokenizer_pre: str | None
    bos_token_id: int | None
    bos_token: str | None
    eos_token_id: int | None
    eos_token: str | None
    chat_template: bool
    chat_template_names: list[str] = field(default_factory=list)  # tokenizer.chat_template.<name>
    kv_cache_bytes_per_token: int | None = None  # f16 K and V of the layers that keep every position
    kv_cache_bytes_per_1k: int | None = None
    kv_cache_formula: str | None = None
    # what qllama runs (from the architecture's own reader; None for an architecture it does not run)
    supported: bool = False
    rope_layout: str | None = None  # "neox" (halves) or "norm" (interleaved pairs)
    sliding_window: int | None = None  # positions a windowed layer sees
    window_layers: list[int] | None = None  # indices of the windowed layers
    window_pattern: str | None = None  # e.g. "5 local : 1 global"
    rope_freq_base_swa: float | None = None  # RoPE base of the windowed layers
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_scale: float | None = None  # multiplies q.k
    qk_norm: bool | None = None  # per-head RMSNorm on Q and K
    qkv_bias: bool | None = None  # biases on Q, K, V
    fused_qkv: bool | None = None  # one attn_qkv matrix
    rope_factors: str | None = None  # per-frequency factors: rope_freqs, or LongRoPE long/short
    kv_cache_window_bytes: int | None = None  # fixed bytes of the windowed layers' rings (window + 512 positions)
    kv_cache_default_ctx: int | None = None  # the context `run` uses by default (min(context_length, 4096))
    kv_cache_bytes_default_ctx: int | None = None  # the whole cache at that context
    # mixture of experts (models/moe.py): None for a dense model
    expert_count: int | None = None
    expert_used_count: int | None = None  # experts run per token
    expert_ff_length: int | None = None  # rows of each expert's gate/up
    shared_expert_ff_length: int | None = None  # the shared expert's (0: none)
    params_per_token: int | None = None  # parameters a decoded token reads: the rest + used/count of the experts
    bytes_per_token: int | None = None  # their bytes (what decode streams from memory per token)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(v: Any) -> int | None:
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def _float(v: Any) -> float | None:
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    return None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _int_or_layers(v: Any) -> int | list[int] | None:
    """An int, or a per-layer integer array (some architectures vary heads/FFN per layer)."""
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu" and len(v):
        vals = [int(x) for x in v]
        return vals[0] if len(set(vals)) == 1 else vals
    return _int(v)


def _sum_layers(v: int | list[int] | None, n_layer: int) -> int | None:
    """Sum of a per-layer value over the layers (no list of n_layer items: n_layer is untrusted)."""
    if v is None:
        return None
    if isinstance(v, list):
        return sum(v) if len(v) == n_layer else None
    return v * n_layer


def _kv_element_bytes(kv_types: tuple[str, str]) -> tuple[float, float]:
    """Bytes per cached K and V element of the cache types (f16 2, f32 4, q8_0 34/32, ...)."""
    from ..models.kvcache import kv_bytes_per_element

    return kv_bytes_per_element(kv_types[0]), kv_bytes_per_element(kv_types[1])


def _kv_dims_text(kv_types: tuple[str, str], head_dim: int) -> tuple[str, str]:
    """(prefix, per-head text) of the KV formula: "2 (K,V) x ", "... x 2 B (f16)" for one type."""
    bk, bv = _kv_element_bytes(kv_types)
    if kv_types[0] == kv_types[1]:
        return "2 (K,V) x ", f"{head_dim} dims x {bk:g} B ({kv_types[0]})"
    return "", f"{head_dim} dims x (K {bk:g} B ({kv_types[0]}) + V {bv:g} B ({kv_types[1]}))"


def summarize(f: GGUFFile, kv_types: tuple[str, str] = ("f16", "f16")) -> ModelSummary:
    """Compute the summary of an open GGUF file (cheap: reads metadata and tensor infos only).
    kv_types: the KV cache's (type_k, type_v) whose bytes the summary reports (the default f16)."""
    md = f.metadata
    arch = _str(md.get("general.architecture"))
    a = f"{arch}." if arch else "\0"  # "\0" matches no key

    # -- tensors: parameter count and quant mix --
    by_type: dict[int, list] = {}
    for t in f.tensors.values():
        row = by_type.setdefault(t.type_id, [0, 0, 0])
        row[0] += 1
        row[1] += t.n_elements
        row[2] += t.n_bytes or 0
    known_bytes = sum(r[2] for tid, r in by_type.items() if tid in GGML_TYPES)
    mix = []
    for tid, (n, elems, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        known = tid in GGML_TYPES
        mix.append(
            QuantMixRow(
                type=GGML_TYPES[tid].name if known else f"unknown({tid})",
                n_tensors=n,
                n_elements=elems,
                n_bytes=nbytes if known else None,
                percent=(100.0 * nbytes / known_bytes if known_bytes else 0.0) if known else None,
                bits_per_weight=(8.0 * nbytes / elems if elems else None) if known else None,
            )
        )

    ft = _int(md.get("general.file_type"))
    file_type = None if ft is None else FILE_TYPES.get(ft, f"unknown({ft})")

    # -- hyperparameters --
    n_layer = _int(md.get(f"{a}block_count"))
    n_embd = _int(md.get(f"{a}embedding_length"))
    n_head = _int_or_layers(md.get(f"{a}attention.head_count"))
    n_head_kv = _int_or_layers(md.get(f"{a}attention.head_count_kv"))
    if n_head_kv is None:
        n_head_kv = n_head  # llama.cpp's default
    key_len = _int(md.get(f"{a}attention.key_length"))
    val_len = _int(md.get(f"{a}attention.value_length"))
    head_dim = key_len
    if head_dim is None and n_embd and isinstance(n_head, int) and n_head > 0 and n_embd % n_head == 0:
        head_dim = n_embd // n_head
    if val_len is None:
        val_len = head_dim

    # -- KV cache: f16 K and V for every layer (the default cache type) --
    kv_tok = formula = None
    kv_heads_total = _sum_layers(n_head_kv, n_layer) if n_layer else None  # KV heads over all layers
    if kv_heads_total is not None and head_dim and val_len:
        bk, bv = _kv_element_bytes(kv_types)
        kv_tok = round(kv_heads_total * (head_dim * bk + val_len * bv))
        if isinstance(n_head_kv, int) and head_dim == val_len:
            pre, dims = _kv_dims_text(kv_types, head_dim)
            formula = f"{pre}{n_layer} layers x {n_head_kv} KV heads x {dims} = {kv_tok} B/token"
        else:
            formula = (f"sum over layers of KV heads x (key {head_dim} x {bk:g} B ({kv_types[0]}) + "
                       f"value {val_len} x {bv:g} B ({kv_types[1]}))")

    # -- RoPE --
    scaling = None
    stype = _str(md.get(f"{a}rope.scaling.type"))
    sfactor = _float(md.get(f"{a}rope.scaling.factor"))
    if sfactor is None:
        lin = _float(md.get(f"{a}rope.scale_linear"))  # the older key
        if lin is not None:
            stype, sfactor = stype or "linear", lin
    if stype and stype != "none":
        scaling = stype + (f" x{sfactor:g}" if sfactor is not None else "")
        orig = _int(md.get(f"{a}rope.scaling.original_context_length"))
        if orig:
            scaling += f" (orig. ctx {orig})"
    if "rope_freqs.weight" in f.tensors:  # Llama 3.1-style per-frequency factors
        scaling = f"{scaling}, rope_freqs.weight" if scaling else "rope_freqs.weight (per-frequency factors)"

    # -- tokenizer --
    tokens = md.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else None
    vocab = _int(md.get(f"{a}vocab_size"))
    if vocab is None and tokens is not None:
        vocab = len(tokens)

    def tok(key: str) -> tuple[int | None, str | None]:
        i = _int(md.get(key))
        if i is None or tokens is None or not 0 <= i < len(tokens) or not isinstance(tokens[i], str):
            return i, None
        return i, tokens[i]

    bos_id, bos = tok("tokenizer.ggml.bos_token_id")
    eos_id, eos = tok("tokenizer.ggml.eos_token_id")
    prefix = CHAT_TEMPLATE_KEY + "."
    names = sorted(k[len(prefix):] for k, v in md.items() if k.startswith(prefix) and isinstance(v, str))

    summary = ModelSummary(
        version=f.version,
        file_size=f.file_size,
        n_metadata=len(md),
        n_tensors=len(f.tensors),
        architecture=arch,
        name=_str(md.get("general.name")),
        n_params=sum(t.n_elements for t in f.tensors.values()),
        tensor_bytes=known_bytes,
        file_type=file_type,
        quantization_version=_int(md.get("general.quantization_version")),
        quant_mix=mix,
        context_length=_int(md.get(f"{a}context_length")),
        embedding_length=n_embd,
        block_count=n_layer,
        head_count=n_head,
        head_count_kv=n_head_kv,
        head_dim=head_dim,
        feed_forward_length=_int_or_layers(md.get(f"{a}feed_forward_length")),
        rope_freq_base=_float(md.get(f"{a}rope.freq_base")),
        rope_dimension_count=_int(md.get(f"{a}rope.dimension_count")),
        rope_scaling=scaling,
        vocab_size=vocab,
        tokenizer_model=_str(md.get("tokenizer.ggml.model")),
        tokenizer_pre=_str(md.get("tokenizer.ggml.pre")),
        bos_token_id=bos_id,
        bos_token=bos,
        eos_token_id=eos_id,
        eos_token=eos,
        chat_template=isinstance(md.get(CHAT_TEMPLATE_KEY), str),
        chat_template_names=names,
        kv_cache_bytes_per_token=kv_tok,
        kv_cache_bytes_per_1k=None if kv_tok is None else kv_tok * KV_CACHE_TOKENS,
        kv_cache_formula=formula,
    )
    _family_fields(f, summary, kv_types)
    return summary


def _family_fields(f: GGUFFile, s: ModelSummary, kv_types: tuple[str, str] = ("f16", "f16")) -> None:
    """The fields of an architecture qllama runs, read as the runtime reads them (qllama.models,
    which imports no Numba until a forward pass), and the KV cache as the runtime allocates it:
    windowed layers hold a ring of window + SWA_BATCH positions, not the whole context."""
    from ..models import read_args
    from ..models.kvcache import SWA_BATCH

    try:
        a = read_args(f.metadata)
    except Exception:  # an unsupported or damaged file: the generic fields above are all we say
        return
    t = f.tensors
    s.supported = True
    s.head_dim = a.head_dim
    s.rope_layout = "neox" if a.rope_neox else "norm"
    s.attn_scale = a.attn_scale
    s.attn_softcap = a.attn_softcap or None
    s.final_softcap = a.final_softcap or None
    s.qk_norm = "blk.0.attn_q_norm.weight" in t
    s.qkv_bias = "blk.0.attn_q.bias" in t or "blk.0.attn_qkv.bias" in t
    s.fused_qkv = "blk.0.attn_qkv.weight" in t
    if a.n_expert:  # a decoded token reads its k experts' slices of the ffn_*_exps tensors and all the rest
        s.expert_count, s.expert_used_count = a.n_expert, a.n_expert_used
        s.expert_ff_length, s.shared_expert_ff_length = a.n_ff_exp, a.n_ff_shexp
        exp = [x for name, x in t.items() if name.endswith("_exps.weight")]
        rest = [x for name, x in t.items() if not name.endswith("_exps.weight")]
        frac = a.n_expert_used / a.n_expert
        s.params_per_token = round(sum(x.n_elements for x in rest) + frac * sum(x.n_elements for x in exp))
        s.bytes_per_token = round(sum(x.n_bytes or 0 for x in rest) + frac * sum(x.n_bytes or 0 for x in exp))
    if "rope_freqs.weight" in t:
        s.rope_factors = "rope_freqs.weight"
    elif "rope_factors_long.weight" in t:
        s.rope_factors = (f"LongRoPE: rope_factors_long when n_ctx > {a.n_ctx_orig}, else rope_factors_short"
                          + (f"; cos/sin x {a.rope_attn_factor:g}" if a.rope_attn_factor != 1.0 else ""))
    windowed = [il for il in range(a.n_layer) if a.is_swa(il)]
    if windowed:
        s.sliding_window = a.n_swa
        s.window_layers = windowed
        s.rope_freq_base_swa = a.rope_freq_base_swa
        local = len(windowed)
        period = next((p for p in range(2, a.n_layer + 1) if all(a.is_swa(i) == (i % p < p - 1) for i in range(a.n_layer))), None)
        s.window_pattern = f"{period - 1} local : 1 global" if period else f"{local} of {a.n_layer} layers local"
    bk, bv = _kv_element_bytes(kv_types)
    per_pos = round(a.n_head_kv * a.head_dim * (bk + bv))  # K and V of one layer, one position
    n_global = a.n_layer - len(windowed)
    ring = a.n_swa + SWA_BATCH
    s.kv_cache_bytes_per_token = n_global * per_pos
    s.kv_cache_bytes_per_1k = s.kv_cache_bytes_per_token * KV_CACHE_TOKENS
    ctx = a.default_n_ctx()
    s.kv_cache_default_ctx = ctx
    s.kv_cache_bytes_default_ctx = n_global * ctx * per_pos + len(windowed) * min(ctx, ring) * per_pos
    pre, dims = _kv_dims_text(kv_types, a.head_dim)
    dims = f"{a.n_head_kv} KV heads x {dims}"
    if windowed:
        s.kv_cache_window_bytes = len(windowed) * ring * per_pos
        s.kv_cache_formula = (f"{pre}{n_global} global layers x {dims} = {s.kv_cache_bytes_per_token} B/token; "
                              f"the {len(windowed)} windowed layers hold {a.n_swa} + {SWA_BATCH} positions each "
                              f"({s.kv_cache_window_bytes} B at any longer context)")
    else:
        s.kv_cache_formula = f"{pre}{a.n_layer} layers x {dims} = {s.kv_cache_bytes_per_token} B/token"
