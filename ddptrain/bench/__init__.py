"""Benchmarks: each module runs as ``python -m ddptrain.bench.<name>``."""
