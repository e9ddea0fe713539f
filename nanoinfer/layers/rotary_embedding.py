"""Rotary position embedding (neox style, as Qwen and Llama use), with a precomputed cos/sin cache.
RoPE types: "default", and "llama3" (Llama 3.1+ frequency scaling)."""
import math

import torch
from torch import nn


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; rotated in float32, returned in x's dtype."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}: 'default' and 'llama3' are implemented")
    # Llama 3: long wavelengths slowed down by `factor`, short ones kept, a smooth blend between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rotary(q, positions, self.cos_sin_cache), apply_rotary(k, positions, self.cos_sin_cache)
