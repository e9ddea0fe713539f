"""KV store: Triton kernel (interpreter on CPU) and the torch fallback vs a plain loop."""
import pytest
import torch

from nanoinfer.kernels.kv_store import store_kvcache, store_kvcache_torch, store_kvcache_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def expected(key, value, k_cache, v_cache, slots):
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    bs = k_cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_ref[s // bs, s % bs] = key[t]
            v_ref[s // bs, s % bs] = value[t]
    return k_ref, v_ref


def make_inputs(num_tokens, num_heads, head_dim, block_size, num_blocks, dtype, strided, device=DEV):
    if strided:  # views into a fused qkv row: [T, (Hq + 2 Hkv) * D]
        qkv = torch.randn(num_tokens, (3 * num_heads) * head_dim, dtype=dtype, device=device)
        key = qkv[:, num_heads * head_dim:2 * num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        value = qkv[:, 2 * num_heads * head_dim:].view(num_tokens, num_heads, head_dim)
    else:
        key = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
        value = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens].to(torch.int32)
    slots[::3] = -1
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("fn", [store_kvcache_triton, store_kvcache_torch, store_kvcache])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", [(2, 16, 16), (3, 24, 256), (1, 8, 16)])
def test_store(fn, strided, shape):
    torch.manual_seed(0)
    heads, dim, bs = shape
    key, value, k_cache, v_cache, slots = make_inputs(13, heads, dim, bs, 4, torch.float32, strided)
    k_ref, v_ref = expected(key, value, k_cache, v_cache, slots)
    fn(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_int64_slots_and_empty():
    key, value, k_cache, v_cache, slots = make_inputs(5, 2, 16, 16, 2, torch.float16, False)
    k_ref, v_ref = expected(key, value, k_cache, v_cache, slots)
    store_kvcache_triton(key, value, k_cache, v_cache, slots.long())
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    store_kvcache_triton(key[:0], value[:0], k_cache, v_cache, slots[:0])


@pytest.mark.cuda
@pytest.mark.parametrize("strided", [False, True])
def test_cuda_store_bf16(strided):
    torch.manual_seed(1)
    key, value, k_cache, v_cache, slots = make_inputs(3000, 8, 128, 256, 40, torch.bfloat16, strided)
    k_ref, v_ref = expected(key, value, k_cache, v_cache, slots)
    store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
