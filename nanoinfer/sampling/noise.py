"""Seeded rows' noise: a counter-based hash of (seed, step, token id) instead of torch's generator.

A seeded request then gets the same tokens whatever else is in the batch, wherever it sits in it, on
CPU and GPU alike. The step is the number of tokens the request generated so far: the host mixes
(seed, step) into two 32-bit keys per row (seed_keys, in the plan), the device hashes them with each
token id into Exp(1) noise (hashed_exponential).
"""
import torch

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seed_keys(seed: int, step: int) -> list[int]:
    """Two 32-bit keys from (seed, step), mixed by splitmix64 on the host. `seed` is an int64
    (SamplingParams checks it): `& _M64` maps that range one-to-one onto 64 bits (two's complement),
    so distinct seeds never share keys."""
    h = _splitmix64(_splitmix64(seed & _M64) ^ step)
    return [h & _M32, h >> 32]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 tensors holding values < 2**32; every product stays below
    2**63 (multipliers < 2**31), so there is no signed overflow on any backend."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 16)


def hashed_exponential(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] Exp(1) noise determined by the per-row keys [S, 2] alone (counter-based)."""
    idx = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32((_mix32(idx[None, :] ^ keys[:, :1]) + keys[:, 1:]) & _M32)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(u)
