"""Reading GGUF files: the header, metadata, tensor views (`reader`) and the table of ggml tensor types (`types`)."""
