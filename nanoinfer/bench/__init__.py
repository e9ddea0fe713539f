"""Micro-benchmarks, each runnable as `python -m nanoinfer.bench.NAME` (the engine-level benchmark is
the top-level bench.py): kernels (attention, KV store), sampler, tp_step (tensor-parallel step
latency on CPU), moe (fused MoE kernel)."""
