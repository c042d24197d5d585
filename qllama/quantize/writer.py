"""GGUF -> GGUF: `quantize_gguf` writes a model quantized to a preset, as `plan_quantization` says.

Reads with `qllama.gguf.reader.GGUFFile`, writes with gguf-py's `GGUFWriter` (streaming, one tensor in
memory at a time), copies every metadata key with its type, sets `general.file_type` and
`general.quantization_version`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import GGUFError, OutputExistsError, QllamaError, UnsupportedError
from ..gguf.types import BF16, GGML_TYPES, type_name
from .blocks import CHUNK_ELEMENTS, FLOAT_TYPES, bf16_to_f32, quantize_chunk
from .presets import NEEDS_IMATRIX, choose_tensor_type, get_preset, needs_imatrix_message, tensor_requires_imatrix

log = logging.getLogger(__name__)

GGML_QNT_VERSION = 2  # general.quantization_version written by current ggml


@dataclass(frozen=True)
class TensorPlan:
    """What quantize_gguf does with one tensor."""

    name: str
    shape: tuple[int, ...]  # GGUF order, ne0 first
    src_type: int
    dst_type: int
    n_elements: int
    dst_bytes: int


class RequantizeError(UnsupportedError):
    """A tensor that must be converted is already quantized, and requantizing was not allowed."""


def plan_quantization(src, preset: str, allow_requantize: bool = False, has_imatrix: bool = False) -> list[TensorPlan]:
    """The per-tensor types quantize_gguf would write for `src` (a path or an open GGUFFile);
    has_imatrix: with an importance matrix (a few of llama.cpp's choices depend on it).

    Raises RequantizeError when a tensor that must be converted is already quantized, unless
    allow_requantize (then it is dequantized and quantized again: the errors add up).
    """
    from ..gguf.reader import GGUFFile

    own = not isinstance(src, GGUFFile)
    g = GGUFFile(src) if own else src
    try:
        p = get_preset(preset)
        md = g.metadata
        arch = md.get("general.architecture", "")
        n_layers = int(md.get(f"{arch}.block_count", 0) or 0)
        names = list(g.tensors)
        n_attn_v = sum(1 for n in names if any(s in n for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")))
        tied = "output.weight" not in g.tensors
        n_head = md.get(f"{arch}.attention.head_count", 0)
        n_head_kv = md.get(f"{arch}.attention.head_count_kv", n_head)
        is_70b = arch == "llama" and n_layers == 80 and _scalar(n_head) != _scalar(n_head_kv)
        n_gqa = _scalar(n_head) // max(1, _scalar(n_head_kv) or 1) if _scalar(n_head) else 1
        n_expert = int(_scalar(md.get(f"{arch}.expert_count", 0)) or 0)
        plans = []
        for t in g.tensors.values():
            dst = choose_tensor_type(
                t.name, t.shape, p.name, n_layers, current_type=t.type_id, n_attn_v=n_attn_v,
                tied_embeddings=tied, n_expert=n_expert, is_70b=is_70b, n_gqa=n_gqa, has_imatrix=has_imatrix,
            )
            if dst != t.type_id and t.type_id not in FLOAT_TYPES and not allow_requantize:
                raise RequantizeError(
                    f"tensor {t.name!r} is already quantized ({t.type_name}); requantizing to "
                    f"{type_name(dst)} would compound the error: quantize from the f32/f16/bf16 model"
                )
            n_bytes = t.n_bytes if dst == t.type_id else t.n_elements // GGML_TYPES[dst].block_size * GGML_TYPES[dst].type_size
            if n_bytes is None:
                raise UnsupportedError(f"tensor {t.name!r} has an unknown type id {t.type_id}")
            plans.append(TensorPlan(t.name, t.shape, t.type_id, dst, t.n_elements, n_bytes))
        return plans
    finally:
        if own:
            g.close()


def _scalar(v: Any) -> Any:
    """Per-layer arrays (some archs store head counts per layer): take the first value."""
    if isinstance(v, np.ndarray):
        return v.flat[0].item() if v.size else 0
    return v


def copy_metadata(writer, g, skip_keys=()) -> None:
    """Copy every metadata key of GGUFFile g to a GGUFWriter, keeping each value's GGUF type
    (but the keys the writer sets itself, and `skip_keys`)."""
    from gguf import GGUFValueType

    from ..gguf.reader import ValueType

    skip = {"general.architecture", "general.alignment", "general.file_type", "general.quantization_version",
            "split.no", "split.count", "split.tensors.count", *skip_keys}  # set by the writer / ours / not a split
    for key, value in g.metadata.items():
        if key in skip:
            continue
        mtype = g.metadata_types[key]
        vt = GGUFValueType(int(mtype.type))
        if mtype.type == ValueType.STRING:
            writer.add_key_value(key, _encode(value), vt)
        elif mtype.type == ValueType.ARRAY:
            items = _array_items(value)
            if len(items) == 0:
                # GGUFWriter cannot write an empty array; nothing reads an empty array anyway
                log.warning("quantize: metadata key %s is an empty array and is not copied", key)
                continue
            sub = GGUFValueType(int(mtype.item.type)) if mtype.item is not None else None
            writer.add_key_value(key, items, vt, sub_type=sub)
        else:
            writer.add_key_value(key, value, vt)


def _encode(s: str) -> bytes:
    # surrogateescape: the reader keeps invalid UTF-8 this way; write back the original bytes
    return s.encode("utf-8", "surrogateescape")


def _array_items(value: Any) -> list:
    """A metadata array as the list GGUFWriter packs (numpy views -> python lists, str -> bytes)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return [_encode(v) if isinstance(v, str) else _array_items(v) if isinstance(v, (list, np.ndarray)) else v for v in value]


def _tensor_as_f32_rows(g, t, r0: int, r1: int) -> np.ndarray:
    """Rows r0:r1 of a tensor as float32 (r1-r0, ne0): f16/bf16 are widened exactly, a quantized
    tensor (requantizing) is dequantized by QTensor."""
    ne0 = t.shape[0] if t.shape else 1
    if t.type_id not in FLOAT_TYPES:
        from ..qtensor import QTensor

        rows = t.n_elements // ne0  # (a 3-D expert tensor: every expert's rows, one after another)
        return QTensor.from_bytes(t.type_id, g.tensor_bytes(t.name), (ne0, rows), name=t.name).dequantize(slice(r0, r1))
    arr = g.tensor_array(t.name).reshape(-1, ne0)[r0:r1]  # zero-copy view of the mmap
    if t.type_id == BF16:
        return bf16_to_f32(arr)
    return np.ascontiguousarray(arr, dtype=np.float32)


def _quantize_tensor(g, t, pl: TensorPlan, imatrix, preset: str) -> np.ndarray:
    """One tensor's bytes (n_rows, row_bytes): each matrix (expert) with its own importance
    weights, as llama-quantize passes imatrix + i03 * n_per_row."""
    ne0 = pl.shape[0] if pl.shape else 1
    n_rows = pl.n_elements // ne0
    n_mat = pl.shape[2] if len(pl.shape) > 2 else 1
    rows_per_mat = n_rows // n_mat
    qw = imatrix.for_tensor(pl.name, ne0, n_mat) if imatrix is not None else None  # (n_mat, ne0) or None
    if qw is None and tensor_requires_imatrix(pl.name, pl.dst_type, get_preset(preset).name):
        raise QllamaError(f"the importance matrix has no entry for {pl.name}, which {preset} needs")
    data = np.empty((n_rows, GGML_TYPES[pl.dst_type].row_bytes(ne0)), np.uint8)
    step = max(1, CHUNK_ELEMENTS // max(ne0, 1))
    for m in range(n_mat):
        end = (m + 1) * rows_per_mat
        for r0 in range(m * rows_per_mat, end, step):
            r1 = min(r0 + step, end)
            data[r0:r1] = quantize_chunk(_tensor_as_f32_rows(g, t, r0, r1), pl.dst_type, None if qw is None else qw[m])
    return data


def quantize_gguf(
    src_path,
    dst_path,
    preset: str,
    progress: Callable[[int, int, str], None] | None = None,
    *,
    force: bool = False,
    allow_requantize: bool = False,
    imatrix=None,
) -> None:
    """Quantize a f32/f16/bf16 GGUF model to a llama.cpp preset (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0...).

    Writes dst_path with gguf's GGUFWriter: all metadata copied with its types, general.file_type
    set to the preset's llama_ftype and general.quantization_version to 2; the tensors in input
    order, each converted as `plan_quantization` says. progress(done, total, tensor_name) is
    called after each tensor (done/total count elements). The output appears atomically (a
    temporary file is renamed); it refuses to overwrite the input, and an existing output unless
    force=True. A quantized input is refused unless allow_requantize (see plan_quantization).
    imatrix: llama.cpp's importance matrix (a path, or an ImportanceMatrix), applied per tensor as
    llama-quantize does; a preset that needs one (Q2_K_S) is refused without it.
    """
    import gguf as gguf_py

    from ..gguf.reader import GGUFFile
    from .imatrix import ImportanceMatrix, read_imatrix

    p = get_preset(preset)
    if imatrix is not None and not isinstance(imatrix, ImportanceMatrix):
        imatrix = read_imatrix(imatrix)
    if imatrix is None and p.name in NEEDS_IMATRIX:
        raise QllamaError(needs_imatrix_message(p.name))
    src_path = os.fspath(src_path)
    dst_path = os.fspath(dst_path)
    if not os.path.exists(src_path):
        raise QllamaError(f"{src_path}: no such file")
    if os.path.exists(dst_path):
        if os.path.samefile(src_path, dst_path):
            raise QllamaError(f"{dst_path}: the output would overwrite the input")
        if not force:
            raise OutputExistsError(f"{dst_path} exists")
        if os.path.isdir(dst_path):
            raise QllamaError(f"{dst_path}: is a directory")

    with GGUFFile(src_path) as g:
        arch = g.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(f"{src_path}: no general.architecture: not a model file")
        plans = plan_quantization(g, p.name, allow_requantize=allow_requantize, has_imatrix=imatrix is not None)
        for pl in plans if imatrix is not None else ():  # a matrix of another model: refused before writing
            if pl.dst_type != pl.src_type:
                imatrix.for_tensor(pl.name, pl.shape[0], pl.shape[2] if len(pl.shape) > 2 else 1)
        total = sum(pl.n_elements for pl in plans)

        tmp_path = f"{dst_path}.tmp{os.getpid()}"
        writer = gguf_py.GGUFWriter(tmp_path, arch)
        try:
            if "general.alignment" in g.metadata:
                writer.add_custom_alignment(int(g.alignment))
            copy_metadata(writer, g)
            writer.add_quantization_version(GGML_QNT_VERSION)
            writer.add_file_type(p.ftype)
            if imatrix is not None:  # the keys llama-quantize adds
                writer.add_string("quantize.imatrix.file", imatrix.path)
                if imatrix.datasets:
                    writer.add_string("quantize.imatrix.dataset", imatrix.datasets[0])
                writer.add_int32("quantize.imatrix.entries_count", len(imatrix.weights))
                if imatrix.chunk_count > 0:
                    writer.add_int32("quantize.imatrix.chunks_count", imatrix.chunk_count)
            for pl in plans:
                # GGUFWriter wants the numpy (reversed) shape; with uint8 + raw_dtype, the byte shape
                np_shape = tuple(reversed(pl.shape)) or (1,)
                gt = GGML_TYPES[pl.dst_type]
                byte_shape = (*np_shape[:-1], np_shape[-1] // gt.block_size * gt.type_size)
                writer.add_tensor_info(pl.name, byte_shape, np.dtype(np.uint8), pl.dst_bytes,
                                       raw_dtype=gguf_py.GGMLQuantizationType(pl.dst_type))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            done = 0
            for pl in plans:
                t = g.tensors[pl.name]
                if pl.dst_type == pl.src_type:
                    data = g.tensor_bytes(pl.name)
                else:
                    data = _quantize_tensor(g, t, pl, imatrix, p.name)
                writer.write_tensor_data(data.reshape(-1))
                done += pl.n_elements
                if progress is not None:
                    progress(done, total, pl.name)
            writer.close()
            os.replace(tmp_path, dst_path)
        except BaseException:
            writer.close()
            try:
                os.unlink(tmp_path)
            except OSError:
                pass
            raise
