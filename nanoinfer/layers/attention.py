"""Paged attention layer: store the step's new K/V in the cache, then attend over the cache.

The backend is chosen once at start-up (`select_backend`) and shared by every layer; all backends use
one cache layout, [num_blocks, block_size, num_kv_heads, head_dim] per layer for K and for V.
"""
import logging

import torch
from torch import nn

from nanoinfer.kernels.kv_store import store_kvcache
from nanoinfer.kernels.torch_attention import paged_attention_torch
from nanoinfer.utils.context import get_context

logger = logging.getLogger("nanoinfer")

_BACKEND = "torch"


def select_backend(device: str, block_size: int) -> str:
    """'flash_attn' on CUDA when importable, else 'triton' on CUDA; 'torch' on CPU."""
    global _BACKEND
    if device != "cuda":
        _BACKEND = "torch"
    else:
        try:
            import flash_attn  # noqa: F401
            _BACKEND = "flash_attn"
        except ImportError:
            _BACKEND = "triton"
        if _BACKEND == "flash_attn" and block_size % 256:
            raise ValueError(f"the flash_attn backend needs kvcache_block_size % 256 == 0, got {block_size}")
    logger.info("attention backend: %s", _BACKEND)
    return _BACKEND


def get_backend() -> str:
    return _BACKEND


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])  # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """q: [N, num_heads, head_dim]; k, v: [N, num_kv_heads, head_dim], or None when the step's K/V
        are already in the cache (kernels/qkv_epilogue.py). Returns [N, num_heads * head_dim]."""
        ctx = get_context()
        if not self.k_cache.numel():
            # The memory-profiling warm-up runs before the cache exists; its output is discarded.
            return torch.zeros_like(q).reshape(q.shape[0], -1)
        if k is not None:
            store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if _BACKEND == "torch":
            query_lens = ctx.query_lens_cpu if ctx.is_prefill else [1] * q.shape[0]
            o = paged_attention_torch(q, self.k_cache, self.v_cache, query_lens, ctx.context_lens_cpu,
                                      ctx.block_tables, self.scale)
        elif _BACKEND == "triton":
            # A mixed step (decode rows and prompt chunks) runs whole through the prefill kernel:
            # measured on the H200, one launch beat a decode-kernel + prefill-kernel split by ~7 ms
            # of host time per step (28 layers), for a negligible device cost.
            from nanoinfer.kernels.triton_attention import decode_attention, prefill_attention
            if ctx.is_prefill:
                o = prefill_attention(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                                      ctx.block_tables, ctx.max_seqlen_q, self.scale)
            else:
                o = decode_attention(q, self.k_cache, self.v_cache, ctx.context_lens, ctx.block_tables, self.scale,
                                     order=ctx.decode_order)
        else:
            o = self._flash_attn(q, ctx)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _flash_attn(self, q, ctx):
        # Thin FA2 wrapper as nano-vllm uses it; flash-attn is not installed where we test.
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        if ctx.is_prefill:
            return flash_attn_varlen_func(q, self.k_cache, self.v_cache, cu_seqlens_q=ctx.cu_seqlens_q,
                                          cu_seqlens_k=ctx.cu_seqlens_k, max_seqlen_q=ctx.max_seqlen_q,
                                          max_seqlen_k=ctx.max_seqlen_k, softmax_scale=self.scale,
                                          causal=True, block_table=ctx.block_tables)
        return flash_attn_with_kvcache(q.unsqueeze(1), self.k_cache, self.v_cache,
                                       cache_seqlens=ctx.context_lens, block_table=ctx.block_tables,
                                       softmax_scale=self.scale, causal=True).squeeze(1)
