"""llama.cpp's own quantizer, from Python: `llama_model_quantize` (the library call behind
llama-quantize) through llama-cpp-python (the [oracle] extra). Used by the oracle tests and by
tools/bench_iquants.py to make files exactly as llama.cpp makes them.

    from tools.llama_quantize import quantize, FTYPES
    quantize("f16.gguf", "iq4_xs.gguf", FTYPES["IQ4_XS"])
"""

from __future__ import annotations

import ctypes

import numpy as np

# llama.cpp's `llama_ftype` numbers of the presets the tools ask for (include/llama.h)
FTYPES = {"Q4_K_M": 15, "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25,
          "IQ3_XS": 22, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29, "IQ4_XS": 30, "IQ1_M": 31}


def quantize(src, dst, ftype: int, imatrix: dict | None = None, kv: dict | None = None, nthread: int = 2) -> None:
    """Write `dst` from `src` as llama file type `ftype`. imatrix: {tensor name: float32 (ne0,)
    importance}, passed as its `llama_model_imatrix_data` array, as llama-quantize passes the
    matrix it read; kv: {key: int | str} metadata overrides (llama-quantize's `quantize.imatrix.*`
    keys). Raises ImportError without llama-cpp-python, RuntimeError when llama.cpp refuses."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = nthread
    keep = []  # ctypes buffers alive until the call returns
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()  # a null name ends it
        for e, (name, values) in zip(entries, sorted(imatrix.items())):
            v = np.ascontiguousarray(values, np.float32)
            keep.append(v)
            e.name, e.data, e.size = name.encode(), v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), v.size
        params.imatrix = entries
        keep.append(entries)
    if kv:
        over = (llama_cpp.llama_model_kv_override * (len(kv) + 1))()  # an empty key ends it
        for o, (key, value) in zip(over, kv.items()):
            o.key = key.encode()
            if isinstance(value, str):
                o.tag, o.value.val_str = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()[:127]
            else:
                o.tag, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, int(value)
        params.kv_overrides = over
        keep.append(over)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {rc}")
