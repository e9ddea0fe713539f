"""Attention over the paged KV cache in plain torch: the CPU backend and the reference for kernels.

One function serves plain prefill, prefill over a cached prefix, chunked prefill, decode and mixed
steps: sequence i owns query_lens[i] query rows, which are the last query_lens[i] of its
context_lens[i] positions.

Sequences are batched: each group of similar sequences is padded to its longest query and context,
gathered from the cache with one index and computed with one masked SDPA call in float32. A group
grows only while padding at most doubles its work (or the work is tiny) and stays under
_MAX_GROUP_ELEMS, so one long prompt chunk never pads many decode rows to its size.
tests/test_attention_reference.py checks this against the plain per-sequence loop.

An FP8 cache (float8_e4m3fn) is dequantized as it is gathered: fp8 -> float32 * k_scale (v_scale).
"""
import torch
import torch.nn.functional as F

_SMALL_GROUP_ELEMS = 1 << 20  # below this, padding waste costs less than another group's overhead
_MAX_GROUP_ELEMS = 1 << 27    # float32 elements of scores + K/V per group (512 MB)


def _group(query_lens: list[int], context_lens: list[int], num_heads: int, kv_row: int) -> list[list[int]]:
    """Greedy groups over sequences sorted by (query, context) length, longest first."""
    def cost(q, c):  # float32 elements: scores [q, c] per head (if SDPA materialises them), K and V
        return c * (q * num_heads + 2 * kv_row)

    order = sorted((i for i, q in enumerate(query_lens) if q), key=lambda i: (query_lens[i], context_lens[i]),
                   reverse=True)
    groups, group_q, group_c, work = [], 0, 0, 0  # the last group's longest query, context; its work
    for i in order:
        q, c = query_lens[i], context_lens[i]
        if groups:
            max_q, max_c = max(q, group_q), max(c, group_c)
            padded, actual = (len(groups[-1]) + 1) * cost(max_q, max_c), work + cost(q, c)
            if padded <= min(_MAX_GROUP_ELEMS, max(2 * actual, _SMALL_GROUP_ELEMS)):
                groups[-1].append(i)
                group_q, group_c, work = max_q, max_c, actual
                continue
        groups.append([i])
        group_q, group_c, work = q, c, cost(q, c)
    return groups


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor,
                          scale: float, k_scale: torch.Tensor | float | None = None,
                          v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """q: [sum(query_lens), num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, width]. Returns [sum(query_lens), num_heads, head_dim],
    computed in float32, in q's dtype. GQA: query head h reads KV head h // (num_heads // num_kv_heads).
    k_scale, v_scale: the FP8 cache's scales (float32 scalars; None: 1.0), unused for other caches."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    dev = q.device
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    out = torch.empty_like(q)
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    for seqs in _group(query_lens, context_lens, num_heads, num_kv_heads * head_dim):
        b = len(seqs)
        qn = torch.tensor([query_lens[i] for i in seqs], device=dev)
        cn = torch.tensor([context_lens[i] for i in seqs], device=dev)
        max_q, max_c = int(qn.max()), int(cn.max())
        # Padding rows and keys repeat a sequence's last query row and its key 0, so every index is
        # valid (never a garbage table entry or an unwritten, maybe NaN, slot) and no row is all masked.
        j = torch.minimum(torch.arange(max_q, device=dev)[None, :], qn[:, None] - 1)      # [B, Q]
        rows = torch.tensor([starts[i] for i in seqs], device=dev)[:, None] + j
        q_pos = (cn - qn)[:, None] + j                                                    # [B, Q]
        key = torch.arange(max_c, device=dev)[None, :]
        k_pos = torch.where(key < cn[:, None], key, 0)                                    # [B, C]
        tables = block_tables[torch.tensor(seqs, device=block_tables.device)].to(dev).long()
        slots = tables.gather(1, k_pos // block_size) * block_size + k_pos % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float().transpose(1, 2)       # [B, Hkv, C, D]
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float().transpose(1, 2)
        if fp8:
            if k_scale is not None:
                k = k * k_scale
            if v_scale is not None:
                v = v * v_scale
        # GQA: a KV head's query heads become more query rows, [B, Hkv, G * Q, D].
        qg = q[rows].float().view(b, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        allowed = key[:, None, :] <= q_pos[:, :, None]  # causal; also excludes keys past the context
        allowed = allowed[:, None, None].expand(b, 1, group, max_q, max_c).reshape(b, 1, group * max_q, max_c)
        o = F.scaled_dot_product_attention(qg.reshape(b, num_kv_heads, group * max_q, head_dim), k, v,
                                           attn_mask=allowed, scale=scale)
        o = o.view(b, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)       # [B, Q, Hkv, G, D]
        valid = torch.arange(max_q, device=dev)[None, :] < qn[:, None]
        out[rows[valid]] = o[valid].reshape(-1, num_heads, head_dim).to(q.dtype)
    return out
