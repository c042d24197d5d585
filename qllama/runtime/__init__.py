"""The process around the model: kernel warm-up, the compile pool, memory checks, the adaptive thread count."""
