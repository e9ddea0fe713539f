"""Write each new token's K and V into the paged cache at its slot (slot -1: padded row, skipped).

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], so slot s is row s of the cache
viewed as [num_blocks * block_size, num_kv_heads * head_dim]. One program per token, with one 2-D
[heads, head_dim] load and store for K and one for V; key and value may have any token and head
stride (views into a fused qkv) as long as head_dim is contiguous. (The CUDA attention backends
store K/V in kernels/qkv_epilogue.py instead, fused with the q/k norms and RoPE.)
"""
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(key_ptr, key_stride_t, key_stride_h, value_ptr, value_stride_t, value_stride_h,
                     k_cache_ptr, v_cache_ptr, slot_ptr, cache_stride_s, cache_stride_h,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                     D_PAD: tl.constexpr):
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping):
    """key, value: [num_tokens, num_kv_heads, head_dim], last dim contiguous; rows and heads may be
    strided (views into a fused qkv). slot_mapping: [num_tokens] int32/int64, -1 = skip."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(1) == num_heads * head_dim
    h_pad, d_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](key, key.stride(0), key.stride(1), value, value.stride(0),
                                    value.stride(1), k_cache, v_cache, slot_mapping,
                                    k_cache.stride(1), k_cache.stride(2), NUM_HEADS=num_heads,
                                    HEAD_DIM=head_dim, H_PAD=h_pad, D_PAD=d_pad,
                                    num_warps=4 if h_pad * d_pad >= 1024 else 1)


def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping):
    """The same store with index_copy_ (CPU fallback); rows with slot -1 are dropped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    row = key.shape[1] * key.shape[2]
    k_cache.view(-1, row).index_copy_(0, slot_mapping.long(), key.reshape(-1, row).to(k_cache.dtype))
    v_cache.view(-1, row).index_copy_(0, slot_mapping.long(), value.reshape(-1, row).to(v_cache.dtype))


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    if k_cache.is_cuda:
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping)
