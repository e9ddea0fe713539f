"""Everything between the fused qkv projection and attention, in one kernel per layer (CUDA):
per-head RMSNorm of q and k (Qwen3; skipped for models without it), RoPE (neox style) on q and k,
q written out, k and v stored into the paged cache at their slots (slot -1: padded row, skipped).
An FP8 cache stores k and v divided by the layer's k_scale / v_scale and rounded to e4m3, in
registers (kernels/kv_store.py `to_cache`).

Unfused, this is 5 kernels per layer (two norms, two RoPEs, the KV store), each mostly launch
latency at decode batch sizes. The arithmetic and its roundings follow the unfused
path (layers/layernorm.py rms_norm, layers/rotary_embedding.py apply_rotary), which stays the CPU
path and the reference for tests.
"""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.kv_store import is_fp8_cache, scale_or_unit, to_cache
from nanoinfer.kernels.pdl import pdl_options


@triton.jit
def _norm_rope(x1, x2, w_ptr, offs, d_mask, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
               DTYPE: tl.constexpr):
    """x1, x2: [heads, HALF] float32 halves of each head. Returns the rotated halves, float32."""
    if HAS_NORM:
        ms = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
        r = tl.rsqrt(ms + eps)[:, None]
        w1 = tl.load(w_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HEAD_DIM // 2 + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        # weight * normed.to(dtype), rounded to dtype: as rms_norm does it
        x1 = (w1 * (x1 * r).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * r).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _qkv_epilogue_kernel(qkv_ptr, stride_t, pos_ptr, cos_sin_ptr, stride_cs, qw_ptr, kw_ptr, eps,
                         q_ptr, stride_qt, k_cache_ptr, v_cache_ptr, slot_ptr, cache_stride_s, cache_stride_h,
                         k_scale_ptr, v_scale_ptr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         H_PAD: tl.constexpr, KH_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                         D_PAD: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr, KV_FP8: tl.constexpr,
                         PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if PDL:  # (kernels/pdl.py) the qkv rows come from the kernel before
        tl.extra.cuda.gdc_wait()
    DTYPE = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_PAD)
    d_mask = offs < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=d_mask, other=0.0)[None, :]
    row = qkv_ptr + t * stride_t

    heads = tl.arange(0, H_PAD)
    mask = (heads[:, None] < NUM_HEADS) & d_mask[None, :]
    src = row + heads[:, None] * HEAD_DIM + offs[None, :]
    q1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    q1, q2 = _norm_rope(q1, q2, qw_ptr, offs, d_mask, cos, sin, eps, HEAD_DIM, HAS_NORM, DTYPE)
    dst = q_ptr + t * stride_qt + heads[:, None] * HEAD_DIM + offs[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(dst, q1.to(DTYPE), mask=mask)
    tl.store(dst + HALF, q2.to(DTYPE), mask=mask)

    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            kv_heads = tl.arange(0, KH_PAD)
            k_mask = (kv_heads[:, None] < NUM_KV_HEADS) & d_mask[None, :]
            k_src = row + NUM_HEADS * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + offs[None, :]
            k1 = tl.load(k_src, mask=k_mask, other=0.0).to(tl.float32)
            k2 = tl.load(k_src + HALF, mask=k_mask, other=0.0).to(tl.float32)
            k1, k2 = _norm_rope(k1, k2, kw_ptr, offs, d_mask, cos, sin, eps, HEAD_DIM, HAS_NORM, DTYPE)
            cache = slot * cache_stride_s + kv_heads[:, None] * cache_stride_h + offs[None, :]
            out_ty = k_cache_ptr.dtype.element_ty
            # k rounded to the model's dtype first, as the unfused path stores it
            tl.store(k_cache_ptr + cache, to_cache(k1.to(DTYPE), k_scale_ptr, out_ty, KV_FP8), mask=k_mask)
            tl.store(k_cache_ptr + cache + HALF, to_cache(k2.to(DTYPE), k_scale_ptr, out_ty, KV_FP8), mask=k_mask)

            offs_d = tl.arange(0, D_PAD)
            v_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
            v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=v_mask, other=0.0)
            tl.store(v_cache_ptr + slot * cache_stride_s + kv_heads[:, None] * cache_stride_h + offs_d[None, :],
                     to_cache(v, v_scale_ptr, out_ty, KV_FP8), mask=v_mask)


def qkv_epilogue(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor | None,
                 num_heads: int, num_kv_heads: int, head_dim: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [N, (num_heads + 2 * num_kv_heads) * head_dim], rows may be strided. Returns q
    [N, num_heads, head_dim] normed and rotated; k and v go to the cache (not when it is empty:
    the memory-profiling warm-up runs before the cache exists). k_scale, v_scale: float32 scalar
    tensors, read for an FP8 cache only (None: 1.0)."""
    n = qkv.shape[0]
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    if head_dim % 2 or qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv_epilogue needs an even head_dim and a [N, (heads + 2 kv heads) * head_dim] "
                         f"input with contiguous rows, got head_dim={head_dim}, qkv {tuple(qkv.shape)}")
    store = k_cache.numel() > 0
    if store:
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        assert k_cache.stride(1) == num_kv_heads * head_dim and slot_mapping is not None
        assert k_cache.dtype == v_cache.dtype
    has_norm = q_norm_weight is not None
    h_pad, kh_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    _qkv_epilogue_kernel[(n,)](
        qkv, qkv.stride(0), positions, cos_sin_cache, cos_sin_cache.stride(0),
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv, eps,
        q, q.stride(0), k_cache if store else qkv, v_cache if store else qkv,
        slot_mapping if store else positions, k_cache.stride(1) if store else 0,
        k_cache.stride(2) if store else 0, scale_or_unit(k_scale, qkv.device), scale_or_unit(v_scale, qkv.device),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=h_pad, KH_PAD=kh_pad,
        HALF_PAD=triton.next_power_of_2(head_dim // 2), D_PAD=triton.next_power_of_2(head_dim),
        HAS_NORM=has_norm, STORE=store, KV_FP8=store and is_fp8_cache(k_cache),
        num_warps=4 if h_pad * head_dim >= 2048 else 2, **pdl_options(qkv.device))
    return q
