"""Row dequantization in NumPy (the embedding lookup, the float tiles of the grid types) and the i-quants' lookup grids (ggml's published tables)."""
