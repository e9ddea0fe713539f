"""Micro-benchmarks, each runnable as `python -m nanoinfer.bench.NAME` (the engine-level benchmark is
the top-level bench.py, which nothing in the package imports): kernels (attention, KV store), gemv,
sampler, tp_step (tensor-parallel step latency on CPU), moe (fused MoE kernel), allreduce, decode_step.
random_model makes the weightless checkpoints of real models' shapes that they and bench.py load."""
