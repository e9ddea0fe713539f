"""Paged attention layer: from the fused qkv projection's output to the attention output, over this
layer's K/V cache. The work is the backend's (layers/attention_backend.py), chosen once per engine
and shared by every layer; the layer holds what is its own: head counts, RoPE, and the cache."""
import torch
from torch import nn

from nanoinfer.layers.attention_backend import AttentionBackend
from nanoinfer.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rotary: RotaryEmbedding,
                 *, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.rotary_emb = rotary
        self.backend = backend
        self.k_cache = self.v_cache = torch.tensor([])  # bound by the model runner

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> torch.Tensor:
        """qkv: [N, (num_heads + 2 * num_kv_heads) * head_dim]. q_norm, k_norm: the per-head RMSNorms
        of q and k (Qwen3), owned by the caller, under the names the checkpoint gives them.
        Stores the step's K/V in the cache, then attends. Returns [N, num_heads * head_dim]."""
        q = self.backend.write_step(self, qkv, positions, q_norm, k_norm)
        if not self.k_cache.numel():
            # The memory-profiling warm-up runs before the cache exists; its output is discarded.
            return torch.zeros_like(q).reshape(q.shape[0], -1)
        return self.backend.attend(self, q).reshape(q.shape[0], self.num_heads * self.head_dim)
