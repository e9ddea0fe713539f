"""Attention over the paged KV cache in plain torch: the CPU backend and the reference for kernels.

One function serves plain prefill, prefill over a cached prefix, chunked prefill and decode: sequence
i owns query_lens[i] query rows, which are the last query_lens[i] of its context_lens[i] positions.
"""
import torch


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """q: [sum(query_lens), num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, width]. Returns [sum(query_lens), num_heads, head_dim]."""
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
