"""The torch paged attention (CPU backend, and the kernels' reference) against dense causal SDPA on
the same K/V laid out contiguously."""
import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels.kv_store import store_kvcache_torch
from nanoinfer.kernels.torch_attention import paged_attention_torch


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_matches_dense(num_heads, num_kv_heads, block_size):
    torch.manual_seed(num_heads * 10 + block_size)
    head_dim, num_blocks = 16, 40
    context_lens = [1, 17, 50, 33]
    query_lens = [1, 17, 9, 1]  # plain prefill, a prefill over a cached prefix, and decodes
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks)
    width = max((c + block_size - 1) // block_size for c in context_lens)
    tables, used = [], 0
    full_k, full_v = [], []
    for c in context_lens:
        n = (c + block_size - 1) // block_size
        row = perm[used:used + n].tolist()
        used += n
        tables.append(row + [-1] * (width - n))
        k = torch.randn(c, num_kv_heads, head_dim)
        v = torch.randn(c, num_kv_heads, head_dim)
        slots = torch.tensor([row[p // block_size] * block_size + p % block_size for p in range(c)])
        store_kvcache_torch(k, v, k_cache, v_cache, slots)
        full_k.append(k)
        full_v.append(v)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    scale = head_dim ** -0.5
    out = paged_attention_torch(q, k_cache, v_cache, query_lens, context_lens, block_tables, scale)
    start = 0
    group = num_heads // num_kv_heads
    for ql, c, k, v in zip(query_lens, context_lens, full_k, full_v):
        qi = q[start:start + ql].transpose(0, 1)                       # [H, ql, D]
        ki = k.repeat_interleave(group, 1).transpose(0, 1)              # [H, c, D]
        vi = v.repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(c)[None, :] <= torch.arange(c - ql, c)[:, None]
        ref = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[start:start + ql], ref, atol=1e-5, rtol=1e-5)
        start += ql


def test_store_skips_padded_rows():
    k_cache = torch.zeros(2, 16, 1, 4)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 4)
    store_kvcache_torch(k, k * 2, k_cache, v_cache, torch.tensor([5, -1, 17]))
    assert k_cache.view(-1, 4)[[5, 17]].eq(1).all() and k_cache.sum() == 8
    assert v_cache.view(-1, 4)[[5, 17]].eq(2).all()
