"""Write each new token's K and V into the paged cache at its slot (slot -1: padded row, skipped).

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], so slot s is row s of the cache
viewed as [num_blocks * block_size, num_kv_heads * head_dim].
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                     slot_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    for start in range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping):
    """key, value: [num_tokens, num_kv_heads, head_dim], rows may be strided (views into qkv)."""
    num_tokens, num_heads, head_dim = key.shape
    row = num_heads * head_dim
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and key.stride(1) == head_dim and value.stride(1) == head_dim
    block = min(triton.next_power_of_2(row), 1024)
    _store_kv_kernel[(num_tokens,)](key, key.stride(0), value, value.stride(0), k_cache, v_cache,
                                    slot_mapping, ROW=row, BLOCK=block)


def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping):
    """The same store with index_copy_ (CPU fallback); rows with slot -1 are dropped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    row = key.shape[1] * key.shape[2]
    k_cache.view(-1, row).index_copy_(0, slot_mapping.long(), key.reshape(-1, row))
    v_cache.view(-1, row).index_copy_(0, slot_mapping.long(), value.reshape(-1, row))


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    if k_cache.is_cuda:
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping)
