"""Benchmarks: `qllama bench` (runner) and the per-operation profile."""
