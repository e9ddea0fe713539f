"""The fused qkv epilogue kernel (interpreter on CPU, real on GPU) vs the unfused path it replaces:
rms_norm on q and k, apply_rotary, store_kvcache_torch."""
import pytest
import torch

from nanoinfer.kernels.kv_store import store_kvcache_torch
from nanoinfer.kernels.qkv_epilogue import qkv_epilogue
from nanoinfer.layers.layernorm import rms_norm
from nanoinfer.layers.rotary_embedding import RotaryEmbedding, apply_rotary

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def reference(qkv, positions, rope, q_w, k_w, eps, k_cache, v_cache, slots, heads, kv_heads, dim):
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(n, heads, dim), k.reshape(n, kv_heads, dim), v.reshape(n, kv_heads, dim)
    if q_w is not None:
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    q, k = apply_rotary(q, positions, rope.cos_sin_cache), apply_rotary(k, positions, rope.cos_sin_cache)
    if k_cache.numel():
        store_kvcache_torch(k, v, k_cache, v_cache, slots)
    return q


def run(n, heads, kv_heads, dim, block_size, dtype, norm=True, strided=False, store=True, scaling=None):
    torch.manual_seed(0)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(n, width + (24 if strided else 0), dtype=dtype, device=DEV)[:, :width]
    positions = torch.randint(0, 500, (n,), device=DEV)
    rope = RotaryEmbedding(dim, 512, 10000.0, scaling).to(DEV)
    q_w = (torch.rand(dim, device=DEV) + 0.5).to(dtype) if norm else None
    k_w = (torch.rand(dim, device=DEV) + 0.5).to(dtype) if norm else None
    num_blocks = (n + block_size - 1) // block_size + 2
    shape = (num_blocks, block_size, kv_heads, dim) if store else (0,)
    k_cache = torch.randn(shape, dtype=dtype, device=DEV)
    v_cache = torch.randn(shape, dtype=dtype, device=DEV)
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:n]
    slots[1::3] = -1  # padded rows: nothing stored
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = reference(qkv, positions, rope, q_w, k_w, 1e-6, k_ref, v_ref, slots, heads, kv_heads, dim)
    q = qkv_epilogue(qkv, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, k_cache, v_cache, slots,
                     heads, kv_heads, dim)
    # fp32 agrees to rounding; fp16/bf16 may differ by one unit where a rounding step falls differently
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)  # v is copied unchanged
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 2, 8), (3, 3, 12), (16, 8, 128)])
def test_matches_unfused(dtype, heads, kv_heads, dim):
    run(7, heads, kv_heads, dim, block_size=16, dtype=dtype)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("strided", [True, False])
def test_without_norm_and_strided_rows(norm, strided):
    run(5, 4, 2, 16, block_size=4, dtype=torch.float32, norm=norm, strided=strided)


def test_llama3_rope_and_page_size_256():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    run(9, 4, 1, 32, block_size=256, dtype=torch.float32, norm=False, scaling=scaling)


def test_empty_cache_only_computes_q():
    """The memory-profiling warm-up runs before the cache is allocated: q only, nothing stored."""
    run(3, 4, 2, 16, block_size=4, dtype=torch.float32, store=False)


def test_rejects_odd_head_dim_and_bad_width():
    x = torch.randn(2, 5 * 6, device=DEV)
    pos = torch.zeros(2, dtype=torch.int64, device=DEV)
    cs = torch.zeros(8, 6, device=DEV)
    with pytest.raises(ValueError, match="even head_dim"):
        qkv_epilogue(x[:, :25], pos, cs, None, None, 0.0, torch.empty(0), torch.empty(0), None, 3, 1, 5)
    with pytest.raises(ValueError, match="even head_dim"):
        qkv_epilogue(x, pos, cs, None, None, 0.0, torch.empty(0), torch.empty(0), None, 2, 1, 6)


def test_empty_batch():
    q = qkv_epilogue(torch.empty(0, 64, device=DEV), torch.empty(0, dtype=torch.int64, device=DEV),
                     torch.zeros(8, 16, device=DEV), None, None, 0.0, torch.empty(0), torch.empty(0), None,
                     2, 1, 16)
    assert q.shape == (0, 2, 16)
