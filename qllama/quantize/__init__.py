"""A ggml-compatible quantizer: float rows -> ggml block bytes, and whole GGUF files -> a preset.

Three layers, each usable alone (data flows blocks -> presets -> writer):

- `blocks`: `quantize_array(x, type_id)`, float32 rows (n_rows, ne0) -> uint8 (n_rows, row_bytes)
  in ggml's block layout, byte-identical to ggml's row references (`quantize_row_*_ref`), and
  `quantize_chunk`, byte-identical to `ggml_quantize_chunk` (what llama-quantize writes; the
  k-quant and iq4 kernels are in `qllama.kernels.quantize_k`);
- `presets`: `choose_tensor_type(...)`, llama.cpp's per-tensor type mix (`llama_tensor_get_type`
  in src/llama-quant.cpp) for the presets in `PRESETS`;
- `writer`: `quantize_gguf(src, dst, preset)` and `plan_quantization`, GGUF in, GGUF out, every
  metadata key copied with its type.

Importing this package does not import numba (the k-quant kernels load on first use).
"""

from __future__ import annotations

from .blocks import FLOAT_TYPES, QUANTIZABLE_TYPES, bf16_to_f32, quantize_array, quantize_chunk, to_bf16_bits
from .presets import PRESETS, Preset, choose_tensor_type, get_preset, tensor_is_quantized, use_more_bits
from .writer import GGML_QNT_VERSION, RequantizeError, TensorPlan, plan_quantization, quantize_gguf

__all__ = [
    "FLOAT_TYPES", "QUANTIZABLE_TYPES", "bf16_to_f32", "quantize_array", "quantize_chunk", "to_bf16_bits",
    "PRESETS", "Preset", "choose_tensor_type", "get_preset", "tensor_is_quantized", "use_more_bits",
    "GGML_QNT_VERSION", "RequantizeError", "TensorPlan", "plan_quantization", "quantize_gguf",
]
