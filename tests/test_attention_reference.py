"""The torch paged attention (CPU backend, and the kernels' reference) against dense causal SDPA on
the same K/V laid out contiguously, and its batched groups against the plain per-sequence loop."""
import random

import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels import torch_attention
from nanoinfer.kernels.kv_store import store_kvcache_torch
from nanoinfer.kernels.torch_attention import paged_attention_torch


def _paged_attention_loop(q, k_cache, v_cache, query_lens, context_lens, block_tables, scale):
    """The former implementation, one sequence at a time: the reference for the batched one."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        blocks = block_tables[i, :(ctx_len + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        qi = q[start:start + q_len].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qi, k) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        future = torch.arange(ctx_len, device=q.device)[None, :] > q_pos[:, None]
        scores.masked_fill_(future, float("-inf"))
        o = torch.einsum("hgqk,khd->qhgd", scores.softmax(-1), v)
        out[start:start + q_len] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
        start += q_len
    return out


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


def _random_batch(rng: random.Random, num_heads, num_kv_heads, block_size, dtype, head_dim=8):
    """Mixed step: decodes (query 1), plain prefills, prefills over a cached prefix; contexts mostly not
    a multiple of the block size. Unused cache slots hold NaN and table padding holds garbage ids,
    which attention must never read."""
    query_lens, context_lens = [], []
    for _ in range(rng.randint(1, 12)):
        ctx = rng.randint(1, 90)
        kind = rng.random()
        q_len = 1 if kind < 0.4 else ctx if kind < 0.7 else rng.randint(1, ctx)
        query_lens.append(q_len)
        context_lens.append(ctx)
    num_blocks = sum((c + block_size - 1) // block_size for c in context_lens) + 3
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks).tolist()
    width = max((c + block_size - 1) // block_size for c in context_lens) + 1
    tables = []
    for c in context_lens:
        n = (c + block_size - 1) // block_size
        row, perm = perm[:n], perm[n:]
        tables.append(row + [rng.choice([-1, 10 ** 6]) for _ in range(width - n)])
        slots = torch.tensor([row[p // block_size] * block_size + p % block_size for p in range(c)])
        store_kvcache_torch(torch.randn(c, num_kv_heads, head_dim, dtype=dtype),
                            torch.randn(c, num_kv_heads, head_dim, dtype=dtype), k_cache, v_cache, slots)
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype)
    return q, k_cache, v_cache, query_lens, context_lens, torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize("num_kv_heads, group", [(2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("limits", ["default", "waste_only", "one_per_group"])
def test_batched_matches_loop(monkeypatch, num_kv_heads, group, block_size, limits):
    # Small shapes all fit one group by default; the other limits split them into several groups.
    if limits == "waste_only":
        monkeypatch.setattr(torch_attention, "_SMALL_GROUP_ELEMS", 0)
    elif limits == "one_per_group":
        monkeypatch.setattr(torch_attention, "_MAX_GROUP_ELEMS", 1)
    rng = random.Random(f"{num_kv_heads}-{group}-{block_size}-{limits}")
    torch.manual_seed(rng.randint(0, 2 ** 31))
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(4):
            q, k_cache, v_cache, query_lens, context_lens, tables = _random_batch(
                rng, num_kv_heads * group, num_kv_heads, block_size, dtype)
            scale = rng.uniform(0.1, 1.0)
            out = paged_attention_torch(q, k_cache, v_cache, query_lens, context_lens, tables, scale)
            ref = _paged_attention_loop(q, k_cache, v_cache, query_lens, context_lens, tables, scale)
            assert out.dtype == dtype and not out.isnan().any()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_groups_bound_padding():
    # One 8k prompt chunk and 200 decodes: the chunk is alone, and no group pads its work more than
    # twice (or past the small-group allowance), nor past the memory cap unless it is one sequence.
    rng = random.Random(0)
    query_lens = [8192] + [1] * 200 + [rng.randint(1, 300) for _ in range(30)]
    context_lens = [8192] + [rng.randint(1, 8192) for _ in range(200)] + [rng.randint(300, 4000) for _ in range(30)]
    num_heads, kv_row = 32, 8 * 128
    groups = torch_attention._group(query_lens, context_lens, num_heads, kv_row)
    assert sorted(i for g in groups for i in g) == list(range(len(query_lens)))
    assert [0] in groups
    assert len(groups) < 60
    cost = lambda q, c: c * (q * num_heads + 2 * kv_row)  # noqa: E731
    for g in groups:
        padded = len(g) * cost(max(query_lens[i] for i in g), max(context_lens[i] for i in g))
        actual = sum(cost(query_lens[i], context_lens[i]) for i in g)
        assert len(g) == 1 or padded <= min(torch_attention._MAX_GROUP_ELEMS,
                                            max(2 * actual, torch_attention._SMALL_GROUP_ELEMS))
