"""Numba kernels: one file per family.

- `_fp16.py`   fp16 -> f32 lookup table (Numba has no float16 on the CPU)
- `floats.py`  f32 / f16 / bf16 mat-vec and mat-mat
- `legacy.py`  q4_0, q4_1, q5_0, q5_1, q8_0: bit-exact block decoders, block dots of the float mat-vec
- `kquants.py` q2_K .. q6_K: the same
- `block_matvec.py` the float mat-vec of every block type (one loop, the type's block dot inlined)
- `dequantize.py` row dequantization of every block type (one kernel, the type a parameter)
- `act_quant.py` activation quantizers (q8_K, q8_0, q8_1) for the int8 path
- `int8.py`    the int8-activation mat-mat kernels
               (which serve mat-vec too), for every quantized type
- `_x86.py`    the x86 intrinsics (pmaddubsw / pmaddwd; vpdpbusd / vpdpwssd on VNNI) used by
               `int8.py` and `fused.py`, and the choice of ISA (`ISA`, QLLAMA_ISA)
- `_x86_gemm.py` the q4_K, q6_K, q4_0 and q8_0 batch kernels (8 rows per pass; 16 on AVX-512)
- `quantize_k.py` the k-quant block quantizers (q4_K, q5_K, q6_K) of `qllama.quantize`
- `quantize_iq1.py` the tq1_0, tq2_0, iq1_s and iq1_m quantizers (loaded only by `qllama quantize`)
- `quantize_iq2.py` the iq3_xxs, iq2_xxs, iq2_xs and iq2_s grid-search quantizers (also only by `qllama quantize`)
- `layer_ops.py` the non-matmul parts of a transformer layer (norms, RoPE, attention, FFN gates)
- `scan.py`    scans of packed data for non-finite floats (`qllama inspect --check`)
- `fused.py`   decode kernels for steps of 1-9 tokens: a layer's Q|K|V, gate|up, GLU and ffn_down in few calls
- `jit.py`     `kernel`, the one decorator every kernel is compiled with (cache=True,
               error_model="numpy": float arithmetic never raises; LLVM level 1), and
               `call_address`: a kernel calling another compiled kernel by address, so that a
               long body compiles once rather than again inside each caller

Kernels take validated input (shapes, dtypes, sizes are checked in `qllama.qtensor`) and run
with `boundscheck=False`. Importing this package compiles nothing (Numba compiles lazily).
"""
