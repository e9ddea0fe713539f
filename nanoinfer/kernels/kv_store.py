"""Write each new token's K and V into the paged cache at its slot (slot -1: padded row, skipped).

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], so slot s is row s of the cache
viewed as [num_blocks * block_size, num_kv_heads * head_dim]. One program per token, with one 2-D
[heads, head_dim] load and store for K and one for V; key and value may have any token and head
stride (views into a fused qkv) as long as head_dim is contiguous. (The CUDA attention backends
store K/V in kernels/qkv_epilogue.py instead, fused with the q/k norms and RoPE.)

FP8 cache (kv_cache_dtype="fp8", a float8_e4m3fn cache): a value x is stored as x / scale rounded
to the nearest e4m3 value (ties to even), saturated to +-448, and read back as fp8 * scale, with
one float32 scale per layer for K and one for V (vLLM's k_scale / v_scale). Every path rounds the
same way (kernels/fp8_round.py): `quantize_kv` in torch, `to_cache` in Triton.
"""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.fp8_round import FP8_E4M3_DTYPE, div_rn, e4m3_rounded, to_e4m3

FP8_KV_DTYPE = FP8_E4M3_DTYPE


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn holding x / scale (float32, correctly rounded), rounded to
    nearest even, saturated."""
    return to_e4m3(div_rn(x, scale))


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def scale_or_unit(scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The float32 scale tensor a kernel reads; None -> 1.0 (vLLM's default), one cached tensor per
    device so that a CUDA graph captured with it keeps a valid address."""
    if scale is not None:
        return scale
    device = torch.device(device)
    if device not in _UNIT_SCALES:
        _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT_SCALES[device]


@triton.jit
def to_cache(x, scale_ptr, out_ty: tl.constexpr, KV_FP8: tl.constexpr):
    """A K or V value, in the model's dtype, as the cache stores it."""
    if KV_FP8:
        y = e4m3_rounded(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))).to(out_ty)
    else:
        y = x.to(out_ty)
    return y


@triton.jit
def _store_kv_kernel(key_ptr, key_stride_t, key_stride_h, value_ptr, value_stride_t, value_stride_h,
                     k_cache_ptr, v_cache_ptr, slot_ptr, cache_stride_s, cache_stride_h, k_scale_ptr, v_scale_ptr,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                     D_PAD: tl.constexpr, KV_FP8: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t = token.to(tl.int64)
    k = tl.load(key_ptr + t * key_stride_t + offs_h[:, None] * key_stride_h + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * value_stride_t + offs_h[:, None] * value_stride_h + offs_d[None, :],
                mask=mask)
    dst = slot * cache_stride_s + offs_h[:, None] * cache_stride_h + offs_d[None, :]
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale_ptr, k_cache_ptr.dtype.element_ty, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale_ptr, v_cache_ptr.dtype.element_ty, KV_FP8), mask=mask)


def store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """key, value: [num_tokens, num_kv_heads, head_dim], last dim contiguous; rows and heads may be
    strided (views into a fused qkv). slot_mapping: [num_tokens] int32/int64, -1 = skip.
    k_scale, v_scale: float32 scalar tensors, read for an FP8 cache only (None: 1.0)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(1) == num_heads * head_dim
    assert k_cache.dtype == v_cache.dtype
    h_pad, d_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](key, key.stride(0), key.stride(1), value, value.stride(0),
                                    value.stride(1), k_cache, v_cache, slot_mapping,
                                    k_cache.stride(1), k_cache.stride(2), scale_or_unit(k_scale, key.device),
                                    scale_or_unit(v_scale, key.device), NUM_HEADS=num_heads,
                                    HEAD_DIM=head_dim, H_PAD=h_pad, D_PAD=d_pad, KV_FP8=is_fp8_cache(k_cache),
                                    num_warps=4 if h_pad * d_pad >= 1024 else 1)


def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """The same store with index_copy_ (CPU fallback); rows with slot -1 are dropped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    row = key.shape[1] * key.shape[2]
    slots = slot_mapping.long()
    if is_fp8_cache(k_cache):
        # index_copy_ has no float8 kernel on CPU: copy the bytes
        key = quantize_kv(key, 1.0 if k_scale is None else k_scale).view(torch.uint8)
        value = quantize_kv(value, 1.0 if v_scale is None else v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, row).index_copy_(0, slots, key.reshape(-1, row).to(k_cache.dtype))
    v_cache.view(-1, row).index_copy_(0, slots, value.reshape(-1, row).to(v_cache.dtype))


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    if k_cache.is_cuda:
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
