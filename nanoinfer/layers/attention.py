"""Paged attention layer: from the fused qkv projection's output to the attention output, over this
layer's K/V cache; the work is the shared backend's (layers/attention_backend.py).

k_scale / v_scale (vLLM's names): with kv_cache_dtype="fp8" the cache stores K / k_scale and
V / v_scale in e4m3. Float32 scalars, the same on every rank, 1.0 unless the checkpoint has them;
other caches ignore them."""
import math

import torch
from torch import nn

from nanoinfer.layers.attention_backend import AttentionBackend
from nanoinfer.layers.rotary_embedding import RotaryEmbedding


def load_kv_scale(param: nn.Parameter, loaded: torch.Tensor):
    """A per-tensor scale: one positive, finite value (shape [] or [1], as checkpoints store it)."""
    if loaded.numel() != 1:
        raise ValueError(f"a KV cache scale is one value (shape [] or [1]), found shape {list(loaded.shape)}")
    value = float(loaded.reshape(()).float())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a KV cache scale must be positive and finite, got {value}")
    param.data.fill_(value)


def _kv_scale() -> nn.Parameter:
    param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
    param.weight_loader = load_kv_scale
    param.optional_in_checkpoint = True  # utils/loader.py: absent -> keeps its default, 1.0
    return param


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rotary: RotaryEmbedding,
                 *, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.rotary_emb = rotary
        self.backend = backend
        self.k_scale, self.v_scale = _kv_scale(), _kv_scale()
        self.k_cache = self.v_cache = torch.tensor([])  # bound by the model runner

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> torch.Tensor:
        """qkv: [N, (num_heads + 2 * num_kv_heads) * head_dim] -> [N, num_heads * head_dim]. q_norm,
        k_norm: the per-head RMSNorms (Qwen3), owned by the caller under the checkpoint's names."""
        q = self.backend.write_step(self, qkv, positions, q_norm, k_norm)
        if not self.k_cache.numel():
            # The memory-profiling warm-up runs before the cache exists; its output is discarded.
            return torch.zeros_like(q).reshape(q.shape[0], -1)
        return self.backend.attend(self, q).reshape(q.shape[0], self.num_heads * self.head_dim)
