"""Numerical health of a GGUF's tensors: which hold NaN or Inf, and where.

Quantized blocks store integers plus fp16 scale fields (see `GGMLType.scale_fields`); only
those fields can be non-finite, so a block is bad when one of them is. f32, f16 and bf16
tensors are checked value by value. The scan reads the packed bytes in place (see
`kernels/scan.py`): it needs no dequantization and no extra memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gguf.types import BF16, F16, F32, GGML_TYPES, IQ1_M, MXFP4
from ..gguf.reader import GGUFFile

# per element type: (integer view, mask of the exponent bits)
_ELEMENT_LAYOUT = {
    F32: (np.uint32, 0x7F800000),
    F16: (np.uint16, 0x7C00),
    BF16: (np.uint16, 0x7F80),
}
_FP16_EXPONENT = 0x7C00
PARALLEL_SCAN_BYTES = 32 << 20  # smaller tensors scan on this thread: waking the pool costs more


@dataclass(frozen=True)
class TensorFinding:
    """A tensor with non-finite numbers: `count` of its `total` blocks (or values) are bad."""

    name: str
    type_name: str
    unit: str  # "block" (quantized: a scale field is bad) or "value" (float tensors)
    count: int
    total: int
    first: int  # index of the first bad block / value

    def describe(self) -> str:
        what = "with a non-finite scale" if self.unit == "block" else "non-finite (NaN or Inf)"
        return (f"tensor {self.name} ({self.type_name}): {self.count} of {self.total} {self.unit}s {what}, "
                f"first at {self.unit} {self.first}")


@dataclass(frozen=True)
class CheckReport:
    findings: list[TensorFinding]
    unchecked: list[str]  # tensors of a type whose layout the scan does not know
    n_tensors: int
    n_bytes: int  # bytes scanned

    @property
    def ok(self) -> bool:
        return not self.findings


def _iq1_m_bad(blocks: np.ndarray) -> np.ndarray:
    """iq1_m keeps its fp16 d in the top nibbles of its four scale words (bytes 48..55), as ggml
    reassembles it: (blocks,) bool, True where d is NaN or Inf."""
    sc = np.ascontiguousarray(blocks[:, 48:56]).view("<u2").astype(np.uint32)  # (blocks, 4)
    d = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    return (d & _FP16_EXPONENT) == _FP16_EXPONENT


def _mxfp4_bad(blocks: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 exponent byte: from 254 on, ggml's half-scale times e2m1's largest values
    overflows float32 (as gguf-py's and ggml's dequantization do): (blocks,) bool."""
    return blocks[:, 0] >= 254


# types whose scale is not one fp16 field: a NumPy test per block
_COMPOSITE_SCALES = {IQ1_M: _iq1_m_bad, MXFP4: _mxfp4_bad}


def scan_tensor(gf: GGUFFile, name: str) -> TensorFinding | None:
    """Scan one tensor; None when it is finite. Raises KeyError for a type the scan does not know."""
    from ..kernels.scan import count_nonfinite, count_nonfinite_parallel

    info = gf.tensors[name]
    raw = gf.tensor_bytes(name)  # uint8 view into the mmap
    if info.type_id in _COMPOSITE_SCALES:
        size = GGML_TYPES[info.type_id].type_size
        bad = _COMPOSITE_SCALES[info.type_id](raw.reshape(-1)[: raw.size // size * size].reshape(-1, size))
        count = int(bad.sum())
        if count == 0:
            return None
        return TensorFinding(name, info.type_name, "block", count, int(bad.size), int(np.argmax(bad)))
    if info.type_id in _ELEMENT_LAYOUT:
        dtype, mask = _ELEMENT_LAYOUT[info.type_id]
        words = raw.view(dtype)  # one word per value
        stride, offsets, unit = 1, np.zeros(1, np.int64), "value"
    else:
        t = GGML_TYPES.get(info.type_id)
        if t is None or not t.scale_fields:
            raise KeyError(info.type_name)
        # every listed block layout has an even size and fp16 fields at even offsets
        words, mask = raw.view(np.uint16), _FP16_EXPONENT
        stride, offsets, unit = t.type_size // 2, np.array(t.scale_fields, np.int64) // 2, "block"
    n_items = words.shape[0] // stride
    mask = words.dtype.type(mask)
    if raw.nbytes >= PARALLEL_SCAN_BYTES:
        count, first = count_nonfinite_parallel(words, stride, offsets, mask, n_items)
    else:
        count, first = count_nonfinite(words, stride, offsets, mask, 0, n_items)
    if count == 0:
        return None
    return TensorFinding(name, info.type_name, unit, int(count), int(n_items), int(first))


def check_tensors(gf: GGUFFile) -> CheckReport:
    """Scan every tensor of an open GGUF file for NaN and Inf."""
    findings, unchecked, n_bytes = [], [], 0
    for name, info in gf.tensors.items():
        try:
            finding = scan_tensor(gf, name)
        except KeyError:
            unchecked.append(name)
            continue
        n_bytes += info.n_bytes or 0
        if finding is not None:
            findings.append(finding)
    return CheckReport(findings, unchecked, len(gf.tensors), n_bytes)
