"""How attention runs on this device, chosen once per engine (`select_attention_backend`) and shared
by every Attention layer (docs/architecture.md lists the backends). Every backend uses one cache
layout, [num_blocks, block_size, num_kv_heads, head_dim] per layer for K and for V, and stores
and reads an FP8 cache with the layer's k_scale and v_scale."""
import logging

import torch

from nanoinfer.kernels.kv_store import store_kvcache
from nanoinfer.kernels.qkv_epilogue import qkv_epilogue
from nanoinfer.kernels.torch_attention import paged_attention_torch
from nanoinfer.kernels.triton_attention import decode_attention, prefill_attention
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.utils.context import get_context

logger = logging.getLogger("nanoinfer")


class AttentionBackend:
    name: str
    mixed_step_graphs = False  # a step with prompt chunks may replay a CUDA graph (one launch whatever the mix)
    sorts_decode_rows = False  # decode reads ctx.decode_order, the rows longest context first

    def write_step(self, layer, qkv: torch.Tensor, positions: torch.Tensor, q_norm: RMSNorm | None,
                   k_norm: RMSNorm | None) -> torch.Tensor:
        """Returns q [N, num_heads, head_dim], normed and rotated; K and V go to the cache (not while
        it is empty: the memory-profiling warm-up runs before the cache exists)."""
        raise NotImplementedError

    def attend(self, layer, q: torch.Tensor) -> torch.Tensor:
        """q: [N, num_heads, head_dim] -> attention over the layer's cache, [N, num_heads, head_dim]."""
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_step(self, layer, qkv, positions, q_norm, k_norm):
        heads, kv_heads = layer.num_heads, layer.num_kv_heads
        shape = (qkv.shape[0], heads + 2 * kv_heads, layer.head_dim)  # (not -1: a step may have no token)
        q, k, v = qkv.view(shape).split([heads, kv_heads, kv_heads], dim=1)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = layer.rotary_emb(positions, q, k)
        if layer.k_cache.numel():
            store_kvcache(k, v, layer.k_cache, layer.v_cache, get_context().slot_mapping, layer.k_scale,
                          layer.v_scale)
        return q

    def attend(self, layer, q):
        ctx = get_context()
        query_lens = ctx.query_lens_cpu if ctx.is_prefill else [1] * q.shape[0]
        return paged_attention_torch(q, layer.k_cache, layer.v_cache, query_lens, ctx.context_lens_cpu,
                                     ctx.block_tables, layer.scale, layer.k_scale, layer.v_scale)


class FusedEpilogueBackend(AttentionBackend):
    """The CUDA backends' write_step: q/k norm, RoPE and the K/V store in one kernel."""

    def write_step(self, layer, qkv, positions, q_norm, k_norm):
        q_w, k_w, eps = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 0.0)
        return qkv_epilogue(qkv, positions, layer.rotary_emb.cos_sin_cache, q_w, k_w, eps, layer.k_cache,
                            layer.v_cache, get_context().slot_mapping, layer.num_heads, layer.num_kv_heads,
                            layer.head_dim, layer.k_scale, layer.v_scale)


class TritonAttentionBackend(FusedEpilogueBackend):
    """A mixed step (decode rows and prompt chunks) runs whole through the prefill kernel: one launch
    a layer costs far less host time than a decode + prefill split, and lets such steps replay graphs."""
    name = "triton"
    mixed_step_graphs = True
    sorts_decode_rows = True

    def attend(self, layer, q):
        ctx = get_context()
        if ctx.is_prefill:
            return prefill_attention(q, layer.k_cache, layer.v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                                     ctx.block_tables, ctx.max_seqlen_q, layer.scale, k_scale=layer.k_scale,
                                     v_scale=layer.v_scale)
        return decode_attention(q, layer.k_cache, layer.v_cache, ctx.context_lens, ctx.block_tables, layer.scale,
                                order=ctx.decode_order, k_scale=layer.k_scale, v_scale=layer.v_scale)


class FlashAttnBackend(FusedEpilogueBackend):
    """FA2 as nano-vllm calls it (varlen with a block table for steps with prompt chunks, with_kvcache
    for decode). Its paged K/V wants blocks of a multiple of 256 tokens; it cannot read an FP8 cache."""
    name = "flash_attn"

    def __init__(self, block_size: int, kv_cache_dtype: str = "auto"):
        if block_size % 256:
            raise ValueError(f"the flash_attn backend needs kvcache_block_size % 256 == 0, got {block_size}")
        if kv_cache_dtype != "auto":
            raise ValueError(f"the flash_attn backend cannot read an FP8 KV cache (kv_cache_dtype={kv_cache_dtype!r}); "
                             "use the triton backend, or kv_cache_dtype='auto'")
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # optional dependency
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def attend(self, layer, q):
        ctx = get_context()
        if ctx.is_prefill:
            return self.varlen(q, layer.k_cache, layer.v_cache, cu_seqlens_q=ctx.cu_seqlens_q,
                               cu_seqlens_k=ctx.cu_seqlens_k, max_seqlen_q=ctx.max_seqlen_q,
                               max_seqlen_k=ctx.max_seqlen_k, softmax_scale=layer.scale, causal=True,
                               block_table=ctx.block_tables)
        return self.with_kvcache(q.unsqueeze(1), layer.k_cache, layer.v_cache, cache_seqlens=ctx.context_lens,
                                 block_table=ctx.block_tables, softmax_scale=layer.scale, causal=True).squeeze(1)


def flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401  (optional dependency)
    except ImportError:
        return False
    return True


def select_attention_backend(device: str, block_size: int, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """torch on CPU; on CUDA flash_attn where importable and the cache is not FP8, else triton."""
    if device != "cuda":
        backend = TorchAttentionBackend()
    elif flash_attn_importable() and kv_cache_dtype == "auto":
        backend = FlashAttnBackend(block_size)
    else:
        if flash_attn_importable():
            logger.info("kv_cache_dtype=%r: flash-attn cannot read an FP8 KV cache; using the triton backend",
                        kv_cache_dtype)
        backend = TritonAttentionBackend()
    logger.info("attention backend: %s", backend.name)
    return backend
