"""`qllama inspect MODEL`: what a GGUF file holds (like `ollama show` and `gguf-dump`).

Human output: a summary block, the quant mix, and the tensor table (shapes in GGUF order,
ne0 first). `--metadata` adds every key; `--json` prints one JSON document instead.
Never imports numba (only the reader, the type table and the summary), so it starts fast.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import click
import numpy as np

from ..gguf.reader import GGUFFile, MetadataType, ValueType
from ..report.summary import KV_CACHE_TOKENS, ModelSummary, summarize
from .model_ref import ModelRef
from .options import kv_cache_options

JSON_ARRAY_LIMIT = 64  # --json: arrays longer than this are summarised
JSON_HEAD = 8  # ... as their type, count and this many first items
TEXT_ARRAY_HEAD = 6  # --metadata: first items shown of a long array
TEXT_ARRAY_LIMIT = 16  # --metadata: arrays up to this long are shown whole
TEXT_STRING_LIMIT = 120  # --metadata: longer strings (chat templates) are cut


# -- formatting helpers ---------------------------------------------------------------------


def human_bytes(n: int | None) -> str:
    """1536 -> '1.50 KiB'; None -> '?'."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if n < 1024 or unit == "EiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """19794176 -> '19.79M'."""
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def show_str(s: str) -> str:
    """A metadata string made printable: invalid UTF-8 bytes as \\xNN, control characters escaped."""
    raw = s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if raw.isprintable():
        return raw
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in raw)


def quote(s: str) -> str:
    """A string for display in quotes (tokens, array items)."""
    return "'" + show_str(s).replace("'", "\\'") + "'"


def show_scalar(v: Any) -> str:
    if isinstance(v, str):
        return show_str(v)
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    if isinstance(v, (float, np.floating)):
        return f"{float(v):g}"
    return str(v)


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Aligned columns; columns in `right` are right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


# -- human output -------------------------------------------------------------------------


def _layers(v: int | list[int] | None) -> str:
    if v is None:
        return "?"
    if isinstance(v, list):
        return f"{min(v)}-{max(v)} (per layer)"
    return str(v)


def summary_lines(f: GGUFFile, s: ModelSummary) -> list[str]:
    """The summary block as `label  value` lines."""

    def opt(v: Any) -> str:
        return "?" if v is None else show_scalar(v)

    def token(i: int | None, t: str | None) -> str:
        if i is None:
            return "?"
        return f"{i} {quote(t)}" if t is not None else str(i)

    params = f"{human_count(s.n_params)} ({s.n_params:,})" if s.n_tensors else "0 (vocab only: no tensors)"
    if s.rope_freq_base is not None:
        rope = f"base {s.rope_freq_base:g}"
    else:
        rope = "base not set (llama.cpp default 10000)"
    if s.rope_dimension_count is not None:
        rope += f", {s.rope_dimension_count} dims"
    rope += f", scaling {s.rope_scaling or 'none'}"
    if s.rope_layout:
        rope += ", " + ("NeoX halves" if s.rope_layout == "neox" else "interleaved pairs")
    heads = f"{_layers(s.head_count)} / {_layers(s.head_count_kv)}"
    if s.head_dim:
        heads += f" (head dim {s.head_dim})"
    if s.kv_cache_bytes_per_1k is not None:
        kv = f"{human_bytes(s.kv_cache_bytes_per_1k)} per 1K ({KV_CACHE_TOKENS}) tokens: {s.kv_cache_formula}"
        if s.kv_cache_bytes_default_ctx is not None:
            kv += f"; {human_bytes(s.kv_cache_bytes_default_ctx)} at the default context of {s.kv_cache_default_ctx}"
    else:
        kv = "? (layers, KV heads or head size missing)"
    if s.chat_template:
        tmpl = f"present ({len(f.metadata['tokenizer.chat_template'])} chars)"
    else:
        tmpl = "none"
    if s.chat_template_names:
        tmpl += "; named: " + ", ".join(show_str(n) for n in s.chat_template_names)
    tok = s.tokenizer_model or "?"
    if s.tokenizer_pre:
        tok += f" (pre-tokenizer {show_str(s.tokenizer_pre)})"
    rows = [
        ("architecture", opt(s.architecture)),
        ("name", opt(s.name)),
        ("parameters", params),
        ("file type", opt(s.file_type) + (f" (quantization version {s.quantization_version})" if s.quantization_version is not None else "")),
        ("tensor data", f"{human_bytes(s.tensor_bytes)} in {s.n_tensors} tensors"),
        ("context length", opt(s.context_length)),
        ("embedding size", opt(s.embedding_length)),
        ("layers", opt(s.block_count)),
        ("heads / KV heads", heads),
        ("FFN size", _layers(s.feed_forward_length)),
        ("RoPE", rope),
        ("vocab size", opt(s.vocab_size)),
        ("tokenizer", show_str(tok)),
        ("BOS / EOS", f"{token(s.bos_token_id, s.bos_token)} / {token(s.eos_token_id, s.eos_token)}"),
        ("chat template", tmpl),
        ("KV cache", kv),
    ] + family_rows(s)
    w = max(len(k) for k, _ in rows)
    return [f"  {k.ljust(w)}  {v}" for k, v in rows]


def family_rows(s: ModelSummary) -> list[tuple[str, str]]:
    """What qllama runs for this architecture: attention details, window, softcaps, tensors present."""
    if not s.supported:
        return [("runs in qllama", f"no (architecture {opt_str(s.architecture)} is not supported)")]
    attn = f"scale {s.attn_scale:.6g}"
    attn += f", logit softcap {s.attn_softcap:g}" if s.attn_softcap else ", no logit softcap"
    attn += ", Q/K norm" if s.qk_norm else ""
    attn += ", Q/K/V bias" if s.qkv_bias else ""
    attn += ", fused attn_qkv" if s.fused_qkv else ""
    rows = [("attention", attn)]
    if s.sliding_window:
        layers = s.window_layers or []
        rows.append(("sliding window", f"{s.sliding_window} positions on {len(layers)} of {opt_str(s.block_count)} layers "
                                        f"({s.window_pattern}); their RoPE base {s.rope_freq_base_swa:g}"))
    else:
        rows.append(("sliding window", "none"))
    rows.append(("final softcap", f"{s.final_softcap:g}" if s.final_softcap else "none"))
    if s.expert_count:
        moe = (f"{s.expert_count} experts, {s.expert_used_count} used per token (expert FFN {s.expert_ff_length}"
               + (f", shared expert {s.shared_expert_ff_length}" if s.shared_expert_ff_length else "") + ")")
        rows.append(("experts", moe))
        share = f" ({100.0 * s.params_per_token / s.n_params:.1f}%)" if s.n_params else ""
        rows.append(("read per token", f"{human_count(s.params_per_token)} of {human_count(s.n_params)} parameters{share}, "
                                       f"{human_bytes(s.bytes_per_token)} of weights"))
    if s.rope_factors:
        rows.append(("RoPE factors", s.rope_factors))
    return rows


def opt_str(v: Any) -> str:
    return "?" if v is None else show_scalar(v)


def quant_mix_lines(s: ModelSummary) -> list[str]:
    rows = [["type", "tensors", "params", "bytes", "%", "bits/weight"]]
    for r in s.quant_mix:
        rows.append([
            r.type, str(r.n_tensors), human_count(r.n_elements), human_bytes(r.n_bytes),
            "?" if r.percent is None else f"{r.percent:.2f}",
            "?" if r.bits_per_weight is None else f"{r.bits_per_weight:.2f}",
        ])
    return _table(rows, right={1, 2, 3, 4, 5})


def tensor_lines(f: GGUFFile) -> list[str]:
    rows = [["name", "type", "shape (ne0 first)", "bytes", "offset"]]
    for t in f.tensors.values():
        rows.append([
            show_str(t.name), t.type_name, "[" + ", ".join(str(d) for d in t.shape) + "]",
            human_bytes(t.n_bytes), str(t.offset),
        ])
    return _table(rows, right={3, 4})


def _show_array(v: Any) -> str:
    n = len(v)
    items = v if n <= TEXT_ARRAY_LIMIT else v[:TEXT_ARRAY_HEAD]
    parts = []
    for x in items:
        if isinstance(x, (list, np.ndarray)):
            parts.append(_show_array(x))
        elif isinstance(x, str):
            parts.append(quote(x))
        else:
            parts.append(show_scalar(x))
    if n > TEXT_ARRAY_LIMIT:
        return "[" + ", ".join(parts) + f", ...] ({n} items)"
    return "[" + ", ".join(parts) + "]"


def metadata_lines(f: GGUFFile) -> list[str]:
    rows = []
    for k, v in f.metadata.items():
        t = str(f.metadata_types[k])
        if isinstance(v, (list, np.ndarray)):
            val = _show_array(v)
        elif isinstance(v, str):
            val = show_str(v)
            if len(val) > TEXT_STRING_LIMIT:
                val = val[:TEXT_STRING_LIMIT] + f"... ({len(v)} chars)"
        else:
            val = show_scalar(v)
        rows.append([show_str(k), t, val])
    return _table([["key", "type", "value"]] + rows, right=set()) if rows else ["  (none)"]


def render_text(f: GGUFFile, with_metadata: bool = False, kv_types: tuple[str, str] = ("f16", "f16")) -> str:
    """The human-readable report."""
    s = summarize(f, kv_types)
    head = (
        f"{show_str(f.path)}: GGUF v{f.version}, {human_bytes(f.file_size)}, "
        f"{len(f.metadata)} metadata keys, {len(f.tensors)} tensors"
    )
    out = [head, ""] + summary_lines(f, s)
    if with_metadata:
        out += ["", "metadata"] + metadata_lines(f)
    if f.tensors:
        out += ["", "quant mix"] + quant_mix_lines(s)
        out += ["", "tensors"] + tensor_lines(f)
    else:
        out += ["", "no tensors (vocab-only file)"]
    return "\n".join(out)


# -- JSON ---------------------------------------------------------------------------------


def _json_value(v: Any) -> Any:
    """Metadata value -> plain JSON: str with invalid bytes as \\xNN, no NaN, numpy -> Python."""
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        x = float(v)
        return x if math.isfinite(x) else str(x)  # JSON has no NaN/Infinity
    if isinstance(v, np.ndarray):
        return [_json_value(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(_json_value(k)): _json_value(x) for k, x in v.items()}
    return v if v is None else str(v)


def _json_metadata(v: Any, mtype: MetadataType) -> Any:
    if mtype.type != ValueType.ARRAY:
        return _json_value(v)
    if len(v) > JSON_ARRAY_LIMIT:
        head = v[:JSON_HEAD]
        return {
            "type": str(mtype),
            "count": len(v),
            "head": [_json_metadata(x, mtype.item) if mtype.item is not None else _json_value(x) for x in head],
        }
    return [_json_metadata(x, mtype.item) if mtype.item is not None else _json_value(x) for x in v]


def render_json(f: GGUFFile, kv_types: tuple[str, str] = ("f16", "f16")) -> str:
    """One JSON document: version, metadata, tensors, summary."""
    doc = {
        "path": _json_value(f.path),
        "version": f.version,
        "file_size": f.file_size,
        "alignment": f.alignment,
        "data_offset": f.data_offset,
        "metadata": {_json_value(k): _json_metadata(v, f.metadata_types[k]) for k, v in f.metadata.items()},
        "metadata_types": {_json_value(k): str(t) for k, t in f.metadata_types.items()},
        "tensors": [
            {"name": _json_value(t.name), "type": t.type_name, "shape": list(t.shape),
             "offset": t.offset, "n_bytes": t.n_bytes}
            for t in f.tensors.values()
        ],
        "summary": _json_value(summarize(f, kv_types).to_dict()),
    }
    return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False)


def _echo(text: str) -> None:
    # Whatever stdout's encoding, never fail on a character it cannot show.
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    click.echo(text.encode(enc, "backslashreplace").decode(enc))


@click.command()
@click.argument("model", type=ModelRef())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (version, metadata, tensors, summary).")
@click.option("--metadata", "with_metadata", is_flag=True, help="Also print every metadata key (long arrays summarised).")
@click.option("--check", is_flag=True,
              help="Scan every tensor for NaN and Inf (quantized blocks' scales, float values); exit 1 if any is found.")
@kv_cache_options
def command(model: str, as_json: bool, with_metadata: bool, check: bool, type_k: str = "f16", type_v: str = "f16") -> int:
    """Show what a GGUF file holds: summary, quant mix, tensors (and metadata).

    With --check, scan the tensors for non-finite numbers instead (one line per bad tensor).
    """
    with GGUFFile(model) as f:
        if check:
            from .check_report import check_json, run_check

            if as_json:
                doc = check_json(f)
                _echo(json.dumps(doc, indent=2))
                return 0 if doc["ok"] else 1
            return 0 if run_check(f) else 1
        kv = (type_k.lower(), type_v.lower())  # the KV bytes shown are for these cache types
        _echo(render_json(f, kv) if as_json else render_text(f, with_metadata, kv))
    return 0
